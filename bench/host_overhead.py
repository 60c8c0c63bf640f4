"""Host (Python) cost of one steady-state decode step, with a stub model of negligible cost.

On the GPU, the step's host work that does not overlap the forward pass (collect -> update ->
schedule -> prepare -> replay) leaves the GPU idle; at batch 256 it was ~7 ms of a 17.7 ms step
(bench/NOTES.md). This script drives the real EngineCore (scheduler, KV manager, model runner,
sampler, output processor) on the CPU with a stub model whose forward is a few tiny tensor ops,
and splits each step's wall time into:
  - critical: host work the GPU would wait for (step - overlap - model stub),
  - overlap: between launch() returning and collect() starting (runs while the GPU works),
  - model: the stub forward + logits (excluded),
  - gc: cyclic garbage collection, mean per step (a full collection every ~100 steps is
    invisible in a median but not in throughput).
Times are thread CPU time on the CPU (the machine is shared) and wall time with --device cuda,
where the host cost also covers host->device copies, graph replay and the sampler's launches.

    OMP_NUM_THREADS=1 python bench/host_overhead.py --out bench/results [--baseline FILE]
    python bench/host_overhead.py --device cuda --out bench/results --name host_overhead_cuda

Prints ms per step at batch 1/64/256 and, given a baseline JSON, the ratio to it.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from pagedinfer.engine.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from pagedinfer.engine.engine_builder import assemble_engine
from pagedinfer.engine.sampling_params import SamplingParams

VOCAB = 512


class StubModel(torch.nn.Module):
    """Greedy-deterministic fake LM: the next token is a hash of (input id, position)."""

    def __init__(self, config: ModelConfig, device: torch.device, clock) -> None:
        super().__init__()
        self.config = config
        self.device = device
        self.dtype = torch.float32
        self.clock = clock
        self.seconds = 0.0

    def forward(self, input_ids, positions, kv_caches, attn_metadata) -> torch.Tensor:
        t0 = self.clock()
        hidden = ((input_ids * 31 + positions) % self.config.vocab_size).float()[:, None]  # [T, 1]
        self.seconds += self.clock() - t0
        return hidden

    def compute_logits(
        self, hidden: torch.Tensor, upcast: bool = True, backend: str | None = None
    ) -> torch.Tensor:
        t0 = self.clock()
        token = (hidden.long() * 7 + 3) % self.config.vocab_size  # [N, 1]
        logits = torch.zeros(hidden.shape[0], self.config.vocab_size, device=hidden.device)  # [N, V]
        logits.scatter_(1, token, 1.0)
        self.seconds += self.clock() - t0
        return logits


def build(batch: int, device: torch.device, clock):
    mc = ModelConfig(
        architecture="llama",
        vocab_size=VOCAB,
        hidden_size=8,
        intermediate_size=16,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=8,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=1e4,
    )
    cfg = EngineConfig(
        cache=CacheConfig(block_size=16, num_blocks=batch * 40 + 64),
        scheduler=SchedulerConfig(
            max_num_seqs=max(batch, 1), max_num_batched_tokens=8192, max_model_len=4096
        ),
        device=DeviceConfig(device=device.type, dtype="float32"),
    )
    model = StubModel(mc, device, clock)
    return assemble_engine(cfg, model).core, model


class _Timer:
    """Wraps bound methods on an instance to timestamp their entry and exit."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.marks: dict[str, float] = {}
        self.gc_seconds = 0.0
        self._gc_start = 0.0

    def on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = self.clock()
        else:
            self.gc_seconds += self.clock() - self._gc_start

    def wrap(self, obj, name: str) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            self.marks[name + ".start"] = self.clock()
            out = fn(*args, **kwargs)
            self.marks[name + ".end"] = self.clock()
            return out

        setattr(obj, name, timed)


def measure(
    batch: int,
    num_steps: int,
    device: torch.device,
    num_waiting: int = 0,
    prompt_len: int = 64,
    seed: int = 0,
) -> dict:
    clock = time.perf_counter if device.type == "cuda" else time.thread_time
    core, model = build(batch, device, clock)
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        core.add_request(f"r{i}", torch.randint(0, VOCAB, (prompt_len,), generator=gen).tolist(), params)
    while core.scheduler.waiting or any(r.num_output_tokens < 2 for r in core.scheduler.running):
        core.step()
    for i in range(num_waiting):  # queued behind a full batch, as in an offline run
        core.add_request(f"w{i}", torch.randint(0, VOCAB, (prompt_len,), generator=gen).tolist(), params)
    for _ in range(5):
        core.step()
    timer = _Timer(clock)
    for name in ("launch_forward", "launch_sampling", "collect"):
        timer.wrap(core.runner, name)
    for name in ("schedule", "update"):
        timer.wrap(core.scheduler, name)
    rows = []
    gc.callbacks.append(timer.on_gc)
    for _ in range(num_steps):
        model.seconds = 0.0
        t0 = clock()
        core.step()
        total = clock() - t0
        m = timer.marks
        overlap = m["collect.start"] - m["launch_sampling.end"]
        rows.append(
            {
                "step": total,
                "overlap": overlap,
                "model": model.seconds,
                "critical": total - overlap - model.seconds,
                "schedule": m["schedule.end"] - m["schedule.start"],
                "launch": m["launch_forward.end"]
                - m["launch_forward.start"]
                + m["launch_sampling.end"]
                - m["launch_sampling.start"]
                - model.seconds,
                "collect": m["collect.end"] - m["collect.start"],
                "update": m["update.end"] - m["update.start"],
            }
        )
    gc.callbacks.remove(timer.on_gc)
    assert len(core.scheduler.running) == batch, "the batch must stay whole while measuring"
    out = {k: statistics.median(r[k] for r in rows) * 1e3 for k in rows[0]}
    out["gc_mean"] = timer.gc_seconds / num_steps * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3, help="best median of this many runs")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--name", default="host_overhead_cpu")
    parser.add_argument("--baseline", type=Path, default=None, help="a previous JSON to compare with")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--waiting", type=int, default=0, help="requests queued behind the batch")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here; nothing measured")
        return
    device = torch.device(args.device)
    torch.set_num_threads(1)
    gc.collect()
    results = {}
    for batch in args.batches:
        runs = [measure(batch, args.steps, device, args.waiting) for _ in range(args.repeats)]
        best = min(runs, key=lambda r: r["critical"])
        results[str(batch)] = best
        line = ", ".join(f"{k} {v:.3f}" for k, v in best.items())
        print(f"batch {batch:4d}: ms/step {line}")
    # A file of this script ("results"), or bench/results/host_overhead_cpu.json ("before").
    doc = json.loads(args.baseline.read_text()) if args.baseline else {}
    baseline = doc.get("results", doc.get("before"))
    if baseline:
        for batch, r in results.items():
            if batch in baseline:
                before = baseline[batch]["critical"]
                print(
                    f"batch {batch:>4}: critical host ms {before:.3f} -> {r['critical']:.3f} "
                    f"({before / r['critical']:.1f}x less)"
                )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        doc = {
            "unit": "ms per decode step (median; gc_mean: mean)",
            "device": args.device,
            "torch_threads": 1,
            "num_waiting": args.waiting,
            "results": results,
        }
        if baseline:
            doc["baseline"] = baseline
        (args.out / f"{args.name}.json").write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
