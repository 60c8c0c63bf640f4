"""One decode step of one Llama-3-8B decoder layer on the GPU: pre-fusion elementwise ops vs fused.

Old path: the layer code before the fused kernels (torch ops for add + RMSNorm, rotary and
SiLU * up: fused_reference.py, plus the separate Triton KV-cache write). New path: the fused
Triton kernels (kernels/fused_ops.py) as the model runs them now. Timed from CUDA-graph replay
(decode runs from graphs in the engine), REPS calls per graph, median over trials, bf16, random
weights, batch x context with shuffled block tables. Rows: each fused op alone, the whole
elementwise chain of a layer (2 x add+norm, rotary+write, SiLU * up), the whole layer (GEMMs and
attention included), and the greedy sampling tail of a step: before, compute_logits' .float() +
Sampler.process's clone + argmax; now .float() + argmax ("greedy_tail"), and argmax on the bf16
GEMM output once the runner calls compute_logits(upcast=False) for plain greedy batches
("greedy_tail_no_upcast").

    python bench/decode_layer.py --out OUT [--batches 1,256] [--context 544]
    python bench/decode_layer.py --out OUT --smoke   # CPU, Triton interpreter, tiny shapes, eager

Writes OUT/decode_layer.json and OUT/decode_layer_summary.txt; prints a table. Needs CUDA (or
--smoke, which checks the script end to end on the CPU; its times mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

from pagedinfer.engine.config import ModelConfig
from pagedinfer.engine.models.layers.rotary import RotaryEmbedding
from pagedinfer.engine.models.llama import LlamaDecoderLayer
from pagedinfer.engine.models.shapes import LLAMA3_8B
from pagedinfer.engine.worker.attn_metadata import AttentionMetadata
from pagedinfer.kernels import fused_ops, linear_ops, ops
from pagedinfer.kernels import fused_reference as ref

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import graph_us  # noqa: E402  (bench/ is not a package)

# Both sides use torch's GEMM: this bench compares the elementwise chain (bench/gemv.py has the GEMMs).
linear_ops.GEMV_ENABLED = False

SMOKE = dataclasses.replace(
    LLAMA3_8B, vocab_size=512, hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=16
)
BLOCK_SIZE, REPS, TRIALS = 16, 20, 15


def time_us(fn) -> float:
    """Median microseconds per fn() call: one CUDA graph holds REPS calls, replayed TRIALS times."""
    if not torch.cuda.is_available():  # --smoke: one eager call, only to exercise the code
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    return graph_us(fn, REPS, TRIALS)


def make_layer(mc: ModelConfig, device: str, dtype: torch.dtype) -> LlamaDecoderLayer:
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(mc).to(device=device, dtype=dtype).requires_grad_(False)
    for name, p in layer.named_parameters():
        p.normal_(1.0, 0.1) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)
    return layer.eval()


def make_step(mc: ModelConfig, batch: int, context: int, like: torch.Tensor) -> dict:
    """Decode inputs: hidden/residual [B, hidden], rope, caches, metadata (position = context)."""
    dev, dtype = like.device, like.dtype
    blocks_per_seq = -(-(context + 1) // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 1
    cache_shape = (num_blocks, BLOCK_SIZE, mc.num_kv_heads, mc.head_dim)
    caches = tuple(torch.randn(cache_shape, device=dev, dtype=dtype) for _ in range(2))
    tables = torch.randperm(num_blocks - 1, device=dev)[: batch * blocks_per_seq]
    tables = tables.view(batch, blocks_per_seq).to(torch.int32)  # [B, MB]
    positions = torch.full((batch,), context, dtype=torch.int64, device=dev)
    slots = tables[:, context // BLOCK_SIZE].long() * BLOCK_SIZE + context % BLOCK_SIZE  # [B]
    md = AttentionMetadata(
        slot_mapping=slots,
        positions=positions,
        block_tables=tables,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev),
        seq_lens=torch.full((batch,), context + 1, dtype=torch.int32, device=dev),
        logits_indices=torch.arange(batch, device=dev),
        max_query_len=1,
        max_seq_len=context + 1,
        is_pure_decode=True,
        backend="triton",
    )
    rope = RotaryEmbedding(mc.head_dim, mc.rope_theta, mc.rope_scaling, dev)(positions)
    hidden, residual = (torch.randn(batch, mc.hidden_size, device=dev, dtype=dtype) for _ in range(2))
    return {"hidden": hidden, "residual": residual, "rope": rope, "caches": caches, "md": md}


def old_rotary_write(attn, qkv, rope, caches, md) -> torch.Tensor:
    """The pre-fusion attention front: torch rotary over q and k, then the Triton cache write."""
    num_tokens = qkv.shape[0]
    qk, v = qkv.split([attn.q_size + attn.kv_size, attn.kv_size], dim=-1)
    qk = ref.apply_rotary(qk.view(num_tokens, attn.num_heads + attn.num_kv_heads, attn.head_dim), *rope)
    q, k = qk.split([attn.num_heads, attn.num_kv_heads], dim=1)  # [T, H, D], [T, KVH, D]
    v = v.view(num_tokens, attn.num_kv_heads, attn.head_dim)
    ops.write_kv_cache(k, v, *caches, md.slot_mapping, backend="triton")
    return q


def old_layer(layer, hidden, residual, rope, caches, md):
    """LlamaDecoderLayer.forward before fusion (same modules and weights)."""
    eps = layer.input_layernorm.eps
    hidden, residual = ref.add_rms_norm(hidden, residual, layer.input_layernorm.weight, eps)
    attn = layer.self_attn
    q = old_rotary_write(attn, attn.qkv_proj(hidden), rope, caches, md)
    out = attn._attend(q, *caches, md)  # [T, H, D]
    hidden = attn.o_proj(out.reshape(hidden.shape[0], attn.q_size))
    hidden, residual = ref.add_rms_norm(hidden, residual, layer.post_attention_layernorm.weight, eps)
    return layer.mlp.down_proj(ref.silu_mul(layer.mlp.gate_up_proj(hidden))), residual


def variants(layer, step: dict, vocab: int) -> dict:
    """name -> (old fn, new fn); each fn runs one layer's (or one step's) share of the work."""
    mc_attn, w, eps = layer.self_attn, layer.input_layernorm.weight, layer.input_layernorm.eps
    x, res, rope, caches, md = step["hidden"], step["residual"], step["rope"], step["caches"], step["md"]
    batch = x.shape[0]
    qkv = torch.randn(batch, mc_attn.qkv_proj.out_features, device=x.device, dtype=x.dtype)
    gate_up = torch.randn(batch, layer.mlp.gate_up_proj.out_features, device=x.device, dtype=x.dtype)
    logits = torch.randn(batch, vocab, device=x.device, dtype=x.dtype)

    def old_chain():
        ref.add_rms_norm(x, res, w, eps)
        old_rotary_write(mc_attn, qkv, rope, caches, md)
        ref.add_rms_norm(x, res, w, eps)
        ref.silu_mul(gate_up)

    def new_chain():
        fused_ops.add_rms_norm(x, res, w, eps, "triton")
        fused_ops.rotary_cache_write(qkv, *rope, *caches, md.slot_mapping, "triton")
        fused_ops.add_rms_norm(x, res, w, eps, "triton")
        fused_ops.silu_mul(gate_up, "triton")

    return {
        "add_rms_norm": (lambda: ref.add_rms_norm(x, res, w, eps), lambda: fused_ops.add_rms_norm(x, res, w, eps, "triton")),
        "rotary_cache_write": (
            lambda: old_rotary_write(mc_attn, qkv, rope, caches, md),
            lambda: fused_ops.rotary_cache_write(qkv, *rope, *caches, md.slot_mapping, "triton"),
        ),
        "silu_mul": (lambda: ref.silu_mul(gate_up), lambda: fused_ops.silu_mul(gate_up, "triton")),
        "elementwise_chain": (old_chain, new_chain),
        "layer": (lambda: old_layer(layer, x, res, rope, caches, md), lambda: layer(x, res, rope, caches, md)),
        "greedy_tail": (lambda: logits.float().clone().argmax(-1), lambda: logits.float().argmax(-1)),
        "greedy_tail_no_upcast": (lambda: logits.float().clone().argmax(-1), lambda: logits.argmax(-1)),
    }  # fmt: skip


def check_layer(layer, step: dict) -> float:
    """Relative difference of the fused layer's output vs the old one (bf16 rounding flips only)."""
    args = (step["hidden"], step["residual"], step["rope"], step["caches"], step["md"])
    old, new = old_layer(layer, *args)[0].float(), layer(*args)[0].float()
    return float((old - new).norm() / old.norm())


def run_batch(layer, mc: ModelConfig, batch: int, context: int) -> dict:
    step = make_step(mc, batch, context, layer.input_layernorm.weight)
    row: dict = {"batch": batch, "context": context, "layer_rel_diff": check_layer(layer, step)}
    for name, (old, new) in variants(layer, step, mc.vocab_size).items():
        old_us, new_us = time_us(old), time_us(new)
        row[name] = {
            "old_us": old_us,
            "fused_us": new_us,
            "saved_us": old_us - new_us,
            "ratio": old_us / new_us,
        }
    per_layer = row["layer"]["saved_us"]
    row["predicted_step_saving_ms"] = (per_layer * mc.num_layers + row["greedy_tail"]["saved_us"]) / 1e3
    del step
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def summary(rows: list[dict], num_layers: int) -> str:
    lines = [f"{'batch':>5} {'variant':<24} {'old us':>9} {'fused us':>9} {'saved us':>9} {'old/fused':>9}"]
    for row in rows:
        for name, v in row.items():
            if isinstance(v, dict):
                lines.append(
                    f"{row['batch']:>5} {name:<24} {v['old_us']:>9.1f} {v['fused_us']:>9.1f} "
                    f"{v['saved_us']:>9.1f} {v['ratio']:>9.2f}"
                )
        lines.append(
            f"{row['batch']:>5} layer rel diff old vs fused {row['layer_rel_diff']:.2e}; "
            f"x{num_layers} layers + sampling: {row['predicted_step_saving_ms']:.2f} ms saved per step"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", default="1,256")
    parser.add_argument(
        "--context", type=int, default=544, help="tokens cached per sequence (throughput run: ~544)"
    )
    parser.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes")
    args = parser.parse_args(argv)
    mc, device, dtype = LLAMA3_8B, "cuda", torch.bfloat16
    if args.smoke:  # the interpreter must be on before triton is first imported (lazily, at launch)
        os.environ["TRITON_INTERPRET"] = "1"
        # fp32: the interpreter's bf16 arithmetic is broken (ENVIRONMENT.md)
        mc, device, dtype, args.batches, args.context = SMOKE, "cpu", torch.float32, "1,3", 20
    elif not torch.cuda.is_available():
        print("decode_layer: needs a CUDA GPU (or --smoke); nothing measured")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    layer = make_layer(mc, device, dtype)
    with torch.inference_mode():
        rows = [run_batch(layer, mc, int(b), args.context) for b in args.batches.split(",")]
    text = summary(rows, mc.num_layers)
    print(text)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)"
    result = {
        "device": name,
        "dtype": str(dtype),
        "config": dataclasses.asdict(mc),
        "reps": REPS,
        "rows": rows,
    }
    (args.out / "decode_layer.json").write_text(json.dumps(result, indent=1))
    (args.out / "decode_layer_summary.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
