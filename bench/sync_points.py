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
import time
import warnings
from pathlib import Path

import torch

from pagedinfer.engine.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagedinfer.engine.llm import LLM
from pagedinfer.engine.sampling_params import SamplingParams

TEXT = (
    "The town council met on Monday evening to discuss the new budget for the coming year. Most of "
    "the money will go to the schools, the roads and the public library."
)
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
    llm = LLM(config)
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": f"Repeat this text: {TEXT}"}])
    prompts = [prompt] * args.batch
    results = {"device": torch.cuda.get_device_name(), "batch": args.batch, "max_tokens": args.max_tokens}
    for name, (temperature, seed, spec) in CASES.items():
        results[name] = run_case(llm, prompts, temperature, seed, spec, args.max_tokens)
        r = results[name]
        print(f"== {name}: {r['sync_calls']} synchronizing calls, {r['seconds'] * 1e3:.1f} ms", flush=True)
        for site, n in list(r["sites"].items())[:8]:
            print(f"   {n:5d}  {site}")
    (args.out / "sync_points.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
