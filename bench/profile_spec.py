"""Where a speculative step's GPU time goes, against a plain decode step: torch.profiler kernel
tables per step for bench/speculative.py's workloads (n-gram on SmolLM2, the 8B-shaped pair).

The same prompts run twice through the same engine: speculation off (plain decode steps) and on
(K drafts verified per step), each profiled over the whole generation after a warm-up, kernels
summed by name and divided by the run's step count. The formula of issue 6 charges a verification
step as one plain step; the difference of the two tables is what it does not count.

    python -P bench/profile_spec.py --device cuda --out OUT --workloads ngram,pair --model X.gguf --k 4
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative import build_parser, set_speculation  # noqa: E402  (bench/ is not a package)
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


def device_busy_us(prof) -> tuple[float, float]:
    """(union of the device's kernel and copy intervals, first start to last end), in us: the
    difference is time the GPU sat idle, waiting for the host."""
    spans = sorted(
        (ev.time_range.start, ev.time_range.end)
        for ev in prof.events()
        if ev.device_type == torch.autograd.DeviceType.CUDA
    )
    if not spans:
        return 0.0, 0.0
    busy, cur_start, cur_end = 0.0, *spans[0]
    for start, end in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    return busy, max(e for _, e in spans) - spans[0][0]


CATEGORIES = (  # kernel name fragment -> what it does in a step (first match wins)
    ("gemv", "linear (GEMV)"),
    ("_add_prenorm_kernel", "linear (GEMV)"),  # kernels/norm_epilogue.py: GEMVs carrying the norm
    ("_rstd_linear_kernel", "linear (GEMV)"),
    ("nvjet", "linear (cuBLAS)"),
    ("gemm", "linear (cuBLAS)"),
    ("extend", "attention"),
    ("_decode_kernel", "attention"),
    ("_reduce_kernel", "attention"),
    ("rms_norm", "norm"),
    ("silu", "elementwise"),
    ("rotary", "elementwise"),
    ("ngram", "accept / drafts"),
    ("accept", "accept / drafts"),
    ("feed", "accept / drafts"),
    ("ArgMax", "argmax / sampling"),
    ("Memcpy", "copies"),
)


def by_category(table: list[dict]) -> dict[str, float]:
    out: dict[str, float] = {}
    for row in table:
        cat = next((c for frag, c in CATEGORIES if frag in row["name"]), "other")
        out[cat] = round(out.get(cat, 0.0) + row["us_per_step"], 1)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def profiled_run(core, prompts, params) -> dict:
    activities = [
        torch.profiler.ProfilerActivity.CUDA
        if torch.cuda.is_available()
        else torch.profiler.ProfilerActivity.CPU
    ]
    forwards = core.runner.num_device_steps
    with torch.profiler.profile(activities=activities) as prof:
        run = run_engine_requests(core, prompts, params)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    steps = [s for s in run.steps if s["pure_decode"]]
    table = kernel_table(prof, max(1, len(run.steps)))
    busy, span = device_busy_us(prof) if torch.cuda.is_available() else (0.0, 0.0)
    n = max(1, len(run.steps))
    # A chained host step launches several forward passes: the kernels per device step compare
    # a verification pass with a plain one.
    device_steps = max(1, core.runner.num_device_steps - forwards)
    categories = by_category(table)
    return {
        "device_steps": device_steps,
        "kernel_us_per_device_step": round(sum(r["us_per_step"] for r in table) * n / device_steps, 1),
        "by_category_us_per_device_step": {
            c: round(us * n / device_steps, 1) for c, us in categories.items()
        },
        "device_busy_us_per_step": round(busy / n, 1),
        "device_span_us_per_step": round(span / n, 1),
        "device_idle_us_per_step": round((span - busy) / n, 1),
        "ms_per_token": round(
            run.seconds * 1e3 / max(1, sum(len(t) for t in run.token_ids) / len(prompts)), 3
        ),
        "by_category_us_per_step": categories,
        "steps": len(run.steps),
        "decode_steps": len(steps),
        "tokens": sum(len(t) for t in run.token_ids),
        "median_step_ms": sorted(s["ms"] for s in steps)[len(steps) // 2] if steps else None,
        "kernel_us_per_step": sum(r["us_per_step"] for r in table),
        "kernels_per_step": sum(r["calls_per_step"] for r in table),
        "top": table[:40],
    }


def main() -> None:
    ap = build_parser(__doc__)  # the workloads' options, as bench/speculative.py takes them
    ap.set_defaults(out=None, device="cuda", max_tokens=128, batches="1", ks="4")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tag", default="", help="suffix of the JSON file's name (several runs, one folder)")
    args = ap.parse_args()
    args.out = Path(args.out or "bench/results")
    args.batches, args.ks = str(args.batch), str(args.k)
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
                f"{r['kernels_per_step']:.0f} launches/step, device busy {r['device_busy_us_per_step']:.0f} / "
                f"idle {r['device_idle_us_per_step']:.0f} us/step, {r['ms_per_token']} ms/token; "
                f"{r['device_steps']} device steps, kernels {r['kernel_us_per_device_step']:.0f} us a device step"
            )
            print("   by category (us/device step):", r["by_category_us_per_device_step"])
            print("   by category (us/step):", r["by_category_us_per_step"])
            for row in r["top"][:25]:
                print(f"{row['us_per_step']:9.1f} us {row['calls_per_step']:7.1f}x  {row['name']}")
        del w
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    (args.out / f"profile_spec{args.tag}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
