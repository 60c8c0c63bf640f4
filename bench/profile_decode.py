"""Where a decode step's GPU time goes: torch.profiler over engine steps of the 8B-shaped model.

Builds the Llama-3-8B-shaped model with random bf16 weights directly (no transformers peer),
runs decode steps at the given batch sizes through the real engine (CUDA graphs as served),
and prints, per batch size: wall ms per step, summed kernel ms per step, and the kernels that
take the most time (name, calls per step, us per step). Writes profile_decode.json to --out.

    python bench/profile_decode.py --out /tmp/prof --batches 1,256
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from pathlib import Path

import torch

from pagedinfer.engine.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedinfer.engine.engine_builder import assemble_engine
from pagedinfer.engine.models.llama import LlamaForCausalLM
from pagedinfer.engine.models.shapes import LLAMA3_8B
from pagedinfer.engine.sampling_params import SamplingParams


def random_model(mc: ModelConfig) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(mc, torch.bfloat16, "cuda").requires_grad_(False)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02)
    return model.eval()


def profile_batch(
    core, batch: int, prompt_len: int, warm_steps: int, prof_steps: int, cprofile: bool = False
) -> dict:
    """Fill `batch` sequences, step into steady decode, then profile `prof_steps` decode steps."""
    params = SamplingParams(max_tokens=warm_steps + 2 * prof_steps + 8, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        ids = torch.randint(0, 128000, (prompt_len,), generator=g).tolist()
        core.add_request(f"p{batch}-{i}", ids, params)
    while core.scheduler.waiting or any(
        r.num_computed_tokens < r.num_tokens - 1 for r in core.scheduler.running
    ):
        core.step()
    for _ in range(warm_steps):
        core.step()
    torch.cuda.synchronize()
    walls = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(prof_steps):
            t0 = time.perf_counter()
            core.step()
            walls.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    host = io.StringIO()
    if cprofile:  # where the host's share of a step goes (cProfile slows Python ~1.5-2x)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(prof_steps):
            core.step()
        pr.disable()
        pstats.Stats(pr, stream=host).sort_stats("tottime").print_stats(25)
    while core.has_unfinished():
        core.step()
    kernels: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(ev.name, []).append(ev.device_time_total)
    rows = sorted(
        (
            {"name": n[:110], "calls_per_step": len(v) / prof_steps, "us_per_step": sum(v) / prof_steps}
            for n, v in kernels.items()
        ),
        key=lambda r: -r["us_per_step"],
    )
    total_us = sum(r["us_per_step"] for r in rows)
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "wall_ms_per_step_median": statistics.median(walls),
        "kernel_ms_per_step": total_us / 1e3,
        "kernels_per_step": sum(r["calls_per_step"] for r in rows),
        "top": rows[:30],
        "host_profile": host.getvalue(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,256")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--cprofile", action="store_true", help="also cProfile the host side of the steps")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = random_model(LLAMA3_8B)
    config = EngineConfig(
        cache=CacheConfig(block_size=16, gpu_memory_utilization=0.90),
        scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=2048),
        device=DeviceConfig(device="cuda", dtype="bfloat16"),
    )
    core = assemble_engine(config, model).core
    results = []
    for b in (int(x) for x in args.batches.split(",")):
        r = profile_batch(core, b, args.prompt_len, warm_steps=4, prof_steps=6, cprofile=args.cprofile)
        results.append(r)
        print(
            f"\n== batch {b}: wall {r['wall_ms_per_step_median']:.2f} ms/step, kernels "
            f"{r['kernel_ms_per_step']:.2f} ms/step, {r['kernels_per_step']:.0f} kernels/step"
        )
        for row in r["top"][:22]:
            print(f"{row['us_per_step']:9.1f} us {row['calls_per_step']:6.0f}x  {row['name']}")
        print(r["host_profile"])
    (args.out / "profile_decode.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
