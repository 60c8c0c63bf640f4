"""Where a speculative step's GPU time goes, against a plain decode step: torch.profiler kernel
tables per step for bench/speculative.py's workloads (n-gram on SmolLM2, the 8B-shaped pair).

The same prompts run twice through the same engine: speculation off (plain decode steps) and on
(K drafts verified per step), each profiled over the whole generation after a warm-up, kernels
summed by name and divided by the run's step count. The formula of issue 6 charges a verification
step as one plain step; the difference of the two tables is what it does not count.

    python -P bench/profile_spec.py --device cuda --out OUT --workloads ngram,pair --model X.gguf --k 4
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative import set_speculation  # noqa: E402  (bench/ is not a package)
from speculative_workloads import pair_workload, smollm2_workload  # noqa: E402
from throughput_lib import run_engine_requests  # noqa: E402

from pagedinfer.engine.sampling_params import SamplingParams  # noqa: E402


def kernel_table(prof, steps: int) -> list[dict]:
    kernels: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA or not torch.cuda.is_available():
            kernels.setdefault(ev.name[:100], []).append(ev.device_time_total)
    rows = [
        {"name": n, "calls_per_step": len(v) / steps, "us_per_step": sum(v) / steps}
        for n, v in kernels.items()
    ]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def profiled_run(core, prompts, params) -> dict:
    activities = [
        torch.profiler.ProfilerActivity.CUDA
        if torch.cuda.is_available()
        else torch.profiler.ProfilerActivity.CPU
    ]
    with torch.profiler.profile(activities=activities) as prof:
        run = run_engine_requests(core, prompts, params)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    steps = [s for s in run.steps if s["pure_decode"]]
    table = kernel_table(prof, max(1, len(run.steps)))
    return {
        "steps": len(run.steps),
        "decode_steps": len(steps),
        "tokens": sum(len(t) for t in run.token_ids),
        "median_step_ms": sorted(s["ms"] for s in steps)[len(steps) // 2] if steps else None,
        "kernel_us_per_step": sum(r["us_per_step"] for r in table),
        "kernels_per_step": sum(r["calls_per_step"] for r in table),
        "top": table[:40],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--model", default="builtin://smollm2-135m")
    ap.add_argument("--workloads", default="ngram,pair")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--smoke", action="store_true", help="pair at toy size (CPU check of the code)")
    args = ap.parse_args()
    # what the workload builders read (bench/speculative.py's defaults)
    args.num_blocks, args.min_acceptance_rate, args.draft = 512, None, "self:layers=0-9,20-29"
    args.max_model_len = 1024
    args.draft_layers, args.target_agreement, args.prompt_len = 2, 0.8, 128
    args.batches = str(args.batch)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {}
    for name in args.workloads.split(","):
        w = pair_workload(args, [args.k]) if name == "pair" else smollm2_workload(args, [args.k], name)
        set_speculation(w.llm, w.spec_config(args.k), args.num_blocks)
        prompts = w.prompts(args.batch)
        greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=w.ignore_eos)
        for spec in (False, True):  # warm-up: kernels, graphs, allocator
            run_engine_requests(w.llm.core, prompts, replace(greedy, max_tokens=24, use_speculation=spec))
        result[name] = {
            mode: profiled_run(w.llm.core, prompts, replace(greedy, use_speculation=spec))
            for mode, spec in (("plain", False), ("spec", True))
        }
        for mode, r in result[name].items():
            print(
                f"\n== {name} {mode} B={args.batch} K={args.k}: {r['steps']} steps, {r['tokens']} tokens, "
                f"median step {r['median_step_ms']} ms, kernels {r['kernel_us_per_step']:.0f} us/step, "
                f"{r['kernels_per_step']:.0f} launches/step"
            )
            for row in r["top"][:25]:
                print(f"{row['us_per_step']:9.1f} us {row['calls_per_step']:7.1f}x  {row['name']}")
        del w
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    (args.out / "profile_spec.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
