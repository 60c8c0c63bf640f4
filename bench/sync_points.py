"""Where the engine's host thread waits for the GPU: torch's sync debug mode over whole requests.

An async engine step must not wait for the device outside `collect()` (its event wait): a
synchronizing op on the launch path (a pageable copy, `.item()`, `nonzero`, a host read of a
device tensor) makes the host wait for the step in flight, and the next step starts only after
it, so the device idles while the host plans. This runs one engine (SmolLM2 GGUF, bf16, n-gram
proposer) over greedy and seeded-sampled requests, with and without speculation, and counts the
synchronizing torch calls torch reports, by the Python line that made them.

    python3 -P bench/sync_points.py --model /path/smollm2.gguf --out OUT   (CUDA only)
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from editing_tasks import tasks  # noqa: E402  (bench/ is not a package)

from pagedinfer.engine.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagedinfer.engine.llm import LLM
from pagedinfer.engine.sampling_params import SamplingParams

CASES = {  # name: (temperature, seed, use_speculation)
    "greedy_plain": (0.0, None, False),
    "sampled_plain": (0.7, 11, False),
    "greedy_ngram": (0.0, None, True),
    "sampled_ngram": (0.7, 11, True),
}


def run_case(
    llm: LLM, prompts: list[list[int]], temperature: float, seed, use_speculation: bool, max_tokens: int
):
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        ignore_eos=True,
        use_speculation=use_speculation,
    )
    llm.generate(prompt_token_ids=prompts, sampling_params=params)  # warm-up (compiles, allocates)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        start = time.perf_counter()
        try:
            llm.generate(prompt_token_ids=prompts, sampling_params=params)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        seconds = time.perf_counter() - start
    sites = collections.Counter(
        f"{Path(w.filename).name}:{w.lineno}: {str(w.message).splitlines()[0][:90]}"
        for w in caught
        if "synchroniz" in str(w.message)
    )
    return {"seconds": seconds, "sync_calls": sum(sites.values()), "sites": dict(sites.most_common())}


def host_costs_while_busy(vocab: int = 49152) -> dict:
    """Host ms a call of the sampled launch's pieces, with the device idle and with ~0.1 s of work
    queued ahead: a call that waits for the device costs the queue's length when busy."""
    from pagedinfer.engine.core.scheduler_output import SamplingRow
    from pagedinfer.engine.sample.metadata import SamplingMetadataBuilder
    from pagedinfer.engine.sample.rng import hash_uniform, hash_uniform_reference
    from pagedinfer.engine.sample.sampler import Sampler

    dev = torch.device("cuda")
    params = SamplingParams(temperature=0.7, seed=3)
    rows = [SamplingRow(0, params, 3, 5, [1, 2], [3])]
    builder = SamplingMetadataBuilder(vocab, dev)
    meta = builder.build(rows)
    logits = torch.randn(1, vocab, device=dev)
    sampler = Sampler()
    a = torch.randn(4096, 4096, device=dev)
    pieces = {
        "pinned_copy": lambda: (
            torch.tensor([1, 2, 3], dtype=torch.int64).pin_memory().to(dev, non_blocking=True)
        ),
        "metadata_build": lambda: builder.build(rows),
        "hash_uniform": lambda: hash_uniform(meta.seeds, meta.positions, vocab),  # the kernel
        "hash_uniform_torch_ops": lambda: hash_uniform_reference(meta.seeds, meta.positions, vocab),
        "sampler_draw": lambda: sampler.draw(sampler.process(logits, meta), meta),
    }
    out = {}
    for name, fn in pieces.items():
        for _ in range(3):
            fn()  # warm-up
        torch.cuda.synchronize()
        times = {}
        for state in ("idle", "busy"):
            if state == "busy":
                for _ in range(40):  # ~0.1 s of queued fp32 matmuls
                    a @ a
            start = time.perf_counter()
            for _ in range(10):
                fn()
            times[state] = (time.perf_counter() - start) / 10 * 1e3
            torch.cuda.synchronize()
        out[name] = times
        print(
            f"   host ms a call, {name}: idle {times['idle']:.3f}, device busy {times['busy']:.3f}",
            flush=True,
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin://smollm2-135m")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sync_points.py needs a CUDA device (the sync debug mode is CUDA's)")
    args.out.mkdir(parents=True, exist_ok=True)
    config = EngineConfig(
        model=args.model,
        cache=CacheConfig(block_size=16, num_blocks=512),
        scheduler=SchedulerConfig(max_model_len=1024, max_num_seqs=16),
        device=DeviceConfig(device="cuda", dtype="bfloat16"),
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=3),
    )
    results_host = host_costs_while_busy()
    llm = LLM(config)
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": tasks(1)[0]}])  # the n-gram bench's
    prompts = [prompt] * args.batch
    results = {"device": torch.cuda.get_device_name(), "batch": args.batch, "max_tokens": args.max_tokens}
    results["host_ms_while_busy"] = results_host
    for name, (temperature, seed, spec) in CASES.items():
        results[name] = run_case(llm, prompts, temperature, seed, spec, args.max_tokens)
        r = results[name]
        print(f"== {name}: {r['sync_calls']} synchronizing calls, {r['seconds'] * 1e3:.1f} ms", flush=True)
        for site, n in list(r["sites"].items())[:8]:
            print(f"   {n:5d}  {site}")
    (args.out / "sync_points.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
