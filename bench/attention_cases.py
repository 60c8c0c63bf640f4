"""Inputs, variants, tile sweeps and the plot for bench/attention.py (CUDA only)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import common  # bench/ is on sys.path (bench/attention.py puts it there)
import torch
import torch.nn.functional as F

from pagedinfer.kernels import ops
from pagedinfer.kernels.decode_attention import DecodeConfig, SplitMerge
from pagedinfer.kernels.decode_attention import paged_decode_attention as triton_decode
from pagedinfer.kernels.extend_attention import ExtendConfig
from pagedinfer.kernels.extend_attention import paged_extend_attention as triton_extend

BLOCK_SIZE = 16
DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Heads:
    """Attention head layout of one model."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int


LLAMA = Heads("llama3-8b", 32, 8, 128)
SMOLLM2 = Heads("smollm2-135m", 9, 3, 64)
# Small-grid decode sweep: (block_n, warps, stages, maxnreg) tiles x split merges (x split counts
# in tune_decode). Stages change nothing (Triton does not pipeline this loop); a register cap or 2
# warps give 4 resident programs an SM instead of 2 (NOTES.md v4, run 7: no gain at batch 1).
DECODE_TILES = ((64, 4, 3, None), (64, 4, 3, 128), (32, 4, 3, 128), (64, 2, 3, None), (32, 2, 3, None))
DECODE_SWEEP = [
    DecodeConfig(n, w, s, merge, maxnreg=maxnreg)
    for (n, w, s, maxnreg), merge in itertools.product(DECODE_TILES, SplitMerge)
]
EXTEND_SWEEP = [
    ExtendConfig(m, n, w, s)
    for m, n, w, s in [
        (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 32, 4, 4), (64, 64, 4, 3),
        (128, 64, 8, 4), (128, 128, 8, 2), (64, 128, 4, 3), (128, 64, 8, 2), (64, 64, 4, 4),
    ]
]  # fmt: skip


def _paged_cache(num_seqs: int, seq_len: int, heads: Heads) -> dict:
    """Random bf16 paged caches holding num_seqs x seq_len tokens behind shuffled block tables."""
    blocks_per_seq = -(-seq_len // BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, heads.num_kv_heads, heads.head_dim)
    tables = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(num_seqs, blocks_per_seq)
    return {
        "key_cache": torch.randn(shape, device="cuda", dtype=DTYPE),
        "value_cache": torch.randn(shape, device="cuda", dtype=DTYPE),
        "block_tables": tables,
        "scale": heads.head_dim**-0.5,
        "heads": heads,
    }


def _contiguous(cache: torch.Tensor, tables: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The same tokens as a contiguous [B, KVH, seq_len, D] tensor (SDPA's layout)."""
    b = tables.shape[0]
    dense = cache[tables.long()].view(b, -1, *cache.shape[2:])[:, :seq_len]
    return dense.transpose(1, 2).contiguous()


def decode_inputs(batch: int, context: int, heads: Heads = LLAMA) -> dict:
    x = _paged_cache(batch, context, heads)
    x["query"] = torch.randn(batch, heads.num_heads, heads.head_dim, device="cuda", dtype=DTYPE)
    x["context_lens"] = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    x["context"] = context
    return x


def ours_variant_decode(x: dict, **changes):
    """Our kernel with default tiles and splits but some DecodeConfig fields changed."""
    from dataclasses import replace

    from pagedinfer.kernels.decode_attention import default_config

    return ours_decode(x, replace(default_config(x["heads"].head_dim, x["query"].device), **changes))


def ours_decode(x: dict, config: DecodeConfig | None = None, num_splits: int | None = None):
    """Our kernel as the engine's eager step calls it: told the longest context (SDPA gets it too,
    as its tensors' length)."""
    args = (x["query"], x["key_cache"], x["value_cache"], x["block_tables"], x["context_lens"], x["scale"])
    if config is None and num_splits is None:
        return lambda: ops.paged_decode_attention(*args, max_context_len=x["context"])
    return lambda: triton_decode(*args, num_splits=num_splits, config=config)


def decode_splits(x: dict) -> int:
    """The split-K factor our default call takes for these inputs."""
    from pagedinfer.kernels.decode_attention import default_num_splits

    batch, kv_heads = x["block_tables"].shape[0], x["key_cache"].shape[2]
    return default_num_splits(batch, kv_heads, x["context"], x["query"].device)


def ours_unbounded_decode(x: dict):
    """Our kernel sized from the block table alone (the engine's CUDA-graph step, max_model_len wide)."""
    args = (x["query"], x["key_cache"], x["value_cache"], x["block_tables"], x["context_lens"], x["scale"])
    return lambda: ops.paged_decode_attention(*args)


def _sdpa_decode_fn(q, k, v, scale, backend, form):
    """q [B, H, D]; k/v [B, KVH, L, D]. 'grouped' runs each KV head's query group as G query rows."""
    from torch.nn.attention import sdpa_kernel

    b, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads

    def fn():
        with sdpa_kernel([backend]):
            if form == "grouped":
                out = F.scaled_dot_product_attention(
                    q.view(b, num_kv_heads, group, head_dim), k, v, scale=scale
                )
            else:
                out = F.scaled_dot_product_attention(
                    q.view(b, num_heads, 1, head_dim), k, v, scale=scale, enable_gqa=True
                )
        return out.reshape(b, num_heads, head_dim)

    return fn


def _backends():
    from torch.nn.attention import SDPBackend

    return {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }


def decode_kv_bytes(batch: int, context: int, heads: Heads = LLAMA) -> int:
    return 2 * batch * context * heads.num_kv_heads * heads.head_dim * torch.finfo(DTYPE).bits // 8


def pick_sdpa_decode(x: dict, timer) -> str:
    """Fastest SDPA 'backend/form' on a contiguous copy of the cache (eager timing)."""
    k = _contiguous(x["key_cache"], x["block_tables"], x["context"])
    v = _contiguous(x["value_cache"], x["block_tables"], x["context"])
    best_ms, best_name = float("inf"), "efficient/grouped"
    for (name, backend), form in itertools.product(_backends().items(), ("grouped", "gqa")):
        fn = _sdpa_decode_fn(x["query"], k, v, x["scale"], backend, form)
        try:
            fn()
        except RuntimeError:
            continue
        ms = timer(fn)
        if ms < best_ms:
            best_ms, best_name = ms, f"{name}/{form}"
    return best_name


def sdpa_decode(x: dict, sdpa_name: str):
    """torch SDPA on a contiguous [B, KVH, L, D] copy of x's cache (the copy is made here, once)."""
    backend_name, form = sdpa_name.split("/")
    k = _contiguous(x["key_cache"], x["block_tables"], x["context"])
    v = _contiguous(x["value_cache"], x["block_tables"], x["context"])
    return _sdpa_decode_fn(x["query"], k, v, x["scale"], _backends()[backend_name], form)


def gather_decode(x: dict, sdpa_name: str):
    """Naive paged baseline: gather each sequence's blocks into a padded copy, then SDPA."""
    backend_name, form = sdpa_name.split("/")
    tables = x["block_tables"].long()
    b, context = tables.shape[0], x["context"]
    kv_shape = x["key_cache"].shape[2:]

    def fn():
        k = x["key_cache"][tables].view(b, -1, *kv_shape)[:, :context].transpose(1, 2)
        v = x["value_cache"][tables].view(b, -1, *kv_shape)[:, :context].transpose(1, 2)
        return _sdpa_decode_fn(x["query"], k, v, x["scale"], _backends()[backend_name], form)()

    return fn


def load_cuda_variant():
    """The optional raw-CUDA decode library, or None where it cannot be built."""
    from pagedinfer.kernels import cuda_decode as mod

    return mod.load_extension()


def cuda_supported(heads: Heads) -> bool:
    from pagedinfer.kernels import cuda_decode as mod

    return mod.supports(heads.num_heads, heads.num_kv_heads, heads.head_dim, DTYPE)


def cuda_decode(x: dict, lib):
    from pagedinfer.kernels import cuda_decode as mod

    args = (x["query"], x["key_cache"], x["value_cache"], x["block_tables"], x["context_lens"], x["scale"])
    return lambda: mod.paged_decode_attention(lib, *args)


def tune_decode(sets: list[dict], timer, kv_bytes: int) -> list[dict]:
    """Every DECODE_SWEEP config (tile x merge) x a few split counts; timer takes one fn per input set."""
    from pagedinfer.kernels.decode_attention import MAX_SPLITS, default_num_splits

    x = sets[0]
    base = default_num_splits(x["query"].shape[0], x["heads"].num_kv_heads, x["context"], x["query"].device)
    splits_options = sorted({max(1, base // k) for k in (8, 4, 2, 1)} | {min(MAX_SPLITS, base * 2)})
    rows = []
    for config, splits in itertools.product(DECODE_SWEEP, splits_options):
        if splits == 1 and config.merge is not SplitMerge.KERNEL:
            continue  # nothing to merge: the same kernel as KERNEL
        try:
            ms = timer([ours_decode(s, config, splits) for s in sets])
        except Exception as e:  # noqa: BLE001 - a config the compiler rejects (e.g. shared memory)
            rows.append({"config": _config_dict(config), "num_splits": splits, "error": str(e)[:120]})
            continue
        rows.append(
            {"config": _config_dict(config), "num_splits": splits, "ms": ms, "gbps": kv_bytes / ms / 1e6}
        )
    return rows


def _config_dict(config) -> dict:
    return {k: v.value if isinstance(v, SplitMerge) else v for k, v in vars(config).items()}


def extend_inputs(batch: int, new: int, seq_len: int, heads: Heads = LLAMA, width: int | None = None) -> dict:
    """batch x new query tokens, the last of seq_len each; block tables `width` tokens wide (default
    seq_len; wider as in the engine's CUDA graphs)."""
    x = _paged_cache(batch, width or seq_len, heads)
    x["query"] = torch.randn(batch * new, heads.num_heads, heads.head_dim, device="cuda", dtype=DTYPE)
    x["query_start_loc"] = torch.arange(0, batch * new + 1, new, dtype=torch.int32, device="cuda")
    x["seq_lens"] = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    x["new"], x["seq_len"] = new, seq_len
    return x


def extend_flops(batch: int, new: int, seq_len: int, heads: Heads = LLAMA) -> float:
    """QK^T and PV over the causally visible keys only: 4 * H * D per (query, key) pair."""
    pairs = new * (seq_len - new) + new * (new + 1) // 2
    return 4.0 * batch * heads.num_heads * heads.head_dim * pairs


def extend_args(x: dict) -> tuple:
    """The tensors of an extend call (query, caches, tables, query_start_loc, seq_lens), in order."""
    return tuple(
        x[k] for k in ("query", "key_cache", "value_cache", "block_tables", "query_start_loc", "seq_lens")
    )


def ours_extend(x: dict, config: ExtendConfig | None = None):
    args = extend_args(x)
    if config is None:
        return lambda: ops.paged_extend_attention(*args, x["scale"], max_query_len=x["new"])
    return lambda: triton_extend(*args, x["scale"], max_query_len=x["new"], config=config)


def sdpa_prefill_variants(x: dict) -> dict:
    """SDPA causal (bottom-right aligned when new < seq_len) per backend, on contiguous tensors."""
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    b, new, seq_len = x["block_tables"].shape[0], x["new"], x["seq_len"]
    num_heads, head_dim = x["heads"].num_heads, x["heads"].head_dim
    q = x["query"].view(b, new, num_heads, head_dim).transpose(1, 2).contiguous()
    k = _contiguous(x["key_cache"], x["block_tables"], seq_len)
    v = _contiguous(x["value_cache"], x["block_tables"], seq_len)
    group = num_heads // x["heads"].num_kv_heads
    k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    mask = {"is_causal": True} if new == seq_len else {"attn_mask": causal_lower_right(new, seq_len)}

    def make(backend, kk, vv, gqa):
        def fn():
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(q, kk, vv, scale=x["scale"], enable_gqa=gqa, **mask)
            return out.transpose(1, 2).reshape(b * new, num_heads, head_dim)

        return fn

    variants = {}
    for name, backend in _backends().items():
        for kk, vv, gqa in ((k, v, True), (k_rep, v_rep, False)):
            fn = make(backend, kk, vv, gqa)
            try:
                fn()
            except RuntimeError:
                continue
            variants[f"sdpa_{name}"] = fn
            break
    return variants


def tune_extend(x: dict, timer, flops: float) -> list[dict]:
    rows = []
    for config in EXTEND_SWEEP:
        try:
            ms = timer(ours_extend(x, config))
        except Exception as e:  # noqa: BLE001 - a config the compiler rejects (e.g. shared memory)
            rows.append({"config": vars(config), "error": str(e)[:120]})
            continue
        rows.append({"config": vars(config), "ms": ms, "tflops": flops / ms / 1e9})
    return rows


def plot(result: dict, path: Path) -> None:
    drawn = common.subplots(path, 1, 2, figsize=(15, 5), gridspec_kw={"width_ratios": [2, 1]})
    if drawn is None:
        return
    fig, (ax1, ax2) = drawn
    names = ["triton", "unbounded", "fused", "pdl", "cuda", "sdpa", "gather"]
    rows = [r for r in result["decode"] if r.get("model", LLAMA.name) == LLAMA.name]
    width = 0.12
    for i, name in enumerate(names):
        xs = [j + i * width for j, r in enumerate(rows) if "gbps" in r.get(name, {})]
        ys = [r[name]["gbps"] for r in rows if "gbps" in r.get(name, {})]
        if ys:
            ax1.bar(xs, ys, width, label=name)
    ax1.axhline(result["copy_gbps"], color="k", ls="--", lw=1, label="d2d copy bw")
    ax1.set_xticks([j + (len(names) - 1) / 2 * width for j in range(len(rows))])
    ax1.set_xticklabels([f"{r['batch']}x{r['context']}" for r in rows], rotation=45)
    ax1.set_ylabel("KV GB/s")
    ax1.set_title(f"paged decode, 32q/8kv d128 bf16 ({result['device']})")
    ax1.legend()
    prows = [r for r in result["prefill"] if r.get("model", LLAMA.name) == LLAMA.name]
    pnames = ["triton", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient"]
    for i, name in enumerate(pnames):
        xs = [j + i * width for j, r in enumerate(prows) if "tflops" in r.get(name, {})]
        ys = [r[name]["tflops"] for r in prows if "tflops" in r.get(name, {})]
        if ys:
            ax2.bar(xs, ys, width, label=name)
    ax2.set_xticks([j + (len(pnames) - 1) / 2 * width for j in range(len(prows))])
    ax2.set_xticklabels([f"{r['batch']}x{r['new_tokens']}/{r['seq_len']}" for r in prows], rotation=45)
    ax2.set_ylabel("TFLOP/s")
    ax2.set_title("prefill / extend (causal)")
    ax2.legend()
    common.save(fig, path, dpi=120)
