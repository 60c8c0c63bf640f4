"""Helpers of bench/throughput.py: timed engine runs, bandwidth floor, plots."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import common  # bench/ is on sys.path (bench/throughput.py puts it there)
import torch

from pagedinfer.engine.sampling_params import SamplingParams


@dataclass
class EngineRun:
    seconds: float
    num_requests: int
    output_tokens: int
    prompt_tokens: int
    steps: list[dict] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    gpu_idle_s: float = 0.0
    gpu_busy_s: float = 0.0
    finish_step: list[int] = field(default_factory=list)  # per request: index of the step it ended

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    def summary(self) -> dict:
        decode = [s["ms"] for s in self.steps if s["pure_decode"]]
        return {
            "requests": self.num_requests,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "seconds": round(self.seconds, 3),
            "output_tok_s": round(self.output_tok_s, 1),
            "total_tok_s": round((self.output_tokens + self.prompt_tokens) / self.seconds, 1),
            "num_steps": len(self.steps),
            "median_decode_step_ms": round(sorted(decode)[len(decode) // 2], 3) if decode else None,
            "gpu_idle_s": round(self.gpu_idle_s, 3),
            "gpu_idle_fraction": round(self.gpu_idle_s / self.seconds, 4) if self.seconds else 0.0,
        }


def run_engine_requests(core, prompts: list[list[int]], params: SamplingParams) -> EngineRun:
    """Submit every prompt at once and step the engine until all finish; per-step timing."""
    ids = [f"bench-{uuid.uuid4().hex[:8]}-{i}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {r: [] for r in ids}
    finish_step: dict[str, int] = {}
    runner = core.runner
    idle0, busy0 = getattr(runner, "gpu_idle_s_total", 0.0), getattr(runner, "gpu_busy_s_total", 0.0)
    runner._prev_end = None  # no idle time across runs
    # speculation totals, counted as a step applies verified drafts (SpeculativeDecoder.observe)
    spec_stats = getattr(getattr(core, "spec_decoder", None), "stats", None)
    steps = []
    start = time.perf_counter()
    for rid, p in zip(ids, prompts, strict=True):
        core.add_request(rid, p, params)
    while core.has_unfinished():
        running = core.scheduler.running
        kv_tokens = sum(r.num_tokens for r in running)
        batch = len(running)
        # Decode-only: every running sequence brings exactly its last token and nobody waits.
        pure = (
            batch > 0
            and not core.scheduler.waiting
            and all(r.num_computed_tokens == r.num_tokens - 1 for r in running)
        )
        forwards = getattr(runner, "num_device_steps", 0)
        applied = getattr(core, "num_applied_device_steps", None)
        if spec_stats is not None:
            verified, emitted = spec_stats.num_verified_sequences, spec_stats.num_emitted_tokens
        t0 = time.perf_counter()
        for out in core.step():
            for d in out.deltas:
                tokens[out.request_id].extend(d.token_ids)
            if out.finished:
                finish_step[out.request_id] = len(steps)
        ms = (time.perf_counter() - t0) * 1e3
        phases = getattr(core, "last_step_phases", None)
        step = {"ms": ms, "batch": batch, "kv_tokens": kv_tokens, "pure_decode": pure}
        # forward passes launched in this step (a chained speculative step launches several; an
        # async step launches the next one's, so a window of steps is off by at most one step's)
        step["device_steps"] = getattr(runner, "num_device_steps", 0) - forwards
        if applied is not None:  # passes whose tokens this step applied (its kv_tokens growth)
            step["applied_device_steps"] = core.num_applied_device_steps - applied
        if spec_stats is not None:  # sequence-steps that verified drafts, and what they emitted
            step["verified"] = spec_stats.num_verified_sequences - verified
            step["emitted"] = spec_stats.num_emitted_tokens - emitted
        if phases is not None:  # host ms per phase of this step (EngineCore.StepPhases)
            step["phases_ms"] = {k: getattr(phases, k) * 1e3 for k in phases.__slots__}
        steps.append(step)
    seconds = time.perf_counter() - start
    return EngineRun(
        seconds=seconds,
        num_requests=len(prompts),
        output_tokens=sum(len(t) for t in tokens.values()),
        prompt_tokens=sum(len(p) for p in prompts),
        steps=steps,
        token_ids=[tokens[r] for r in ids],
        gpu_idle_s=getattr(runner, "gpu_idle_s_total", 0.0) - idle0,
        gpu_busy_s=getattr(runner, "gpu_busy_s_total", 0.0) - busy0,
        finish_step=[finish_step.get(r, len(steps) - 1) for r in ids],
    )


@dataclass
class ClosedLoopRun:
    """A batch kept at `concurrency` sequences: each finished request is replaced at once by the
    next prompt of the pool. The steady part ends with the step that admits the pool's last
    prompt (after it the batch drains)."""

    steady_seconds: float
    steady_output_tokens: int
    steady_steps: int
    seconds: float
    output_tokens: int

    @property
    def steady_tok_s(self) -> float:
        return self.steady_output_tokens / self.steady_seconds if self.steady_seconds else 0.0


def run_engine_closed_loop(
    core, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], concurrency: int
) -> ClosedLoopRun:
    """Run the prompts with `concurrency` in flight (the next one submitted when one finishes);
    params: one for all, or one per prompt."""
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    pending = list(enumerate(prompts))
    tag = uuid.uuid4().hex[:8]
    in_flight, steady = 0, None
    steps, output_tokens = 0, 0
    start = time.perf_counter()

    def submit() -> None:
        nonlocal in_flight
        while pending and in_flight < concurrency:
            i, prompt = pending.pop(0)
            core.add_request(f"loop-{tag}-{i}", prompt, per_prompt[i])
            in_flight += 1

    submit()
    while core.has_unfinished():
        for out in core.step():
            output_tokens += sum(len(d.token_ids) for d in out.deltas)
            in_flight -= int(out.finished)
        steps += 1
        if steady is None and not pending:  # the pool's last prompt went in during the previous step
            steady = (time.perf_counter() - start, output_tokens, steps)
        submit()
    seconds = time.perf_counter() - start
    steady = steady or (seconds, output_tokens, steps)
    return ClosedLoopRun(steady[0], steady[1], steady[2], seconds, output_tokens)


def copy_bandwidth_gbps(num_bytes: int = 1 << 30, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth counting bytes read + written (GB/s)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del src, dst
    torch.cuda.empty_cache()
    return 2 * num_bytes * repeats / seconds / 1e9


def kv_bytes_per_token(model_config, elem_bytes: int) -> int:
    mc = model_config
    return 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * elem_bytes


def decode_floor_ms(weight_bytes: int, kv_bytes: int, bandwidth_gbps: float) -> float:
    """One decode step must read every weight and every cached K/V byte once."""
    return (weight_bytes + kv_bytes) / (bandwidth_gbps * 1e9) * 1e3


def plot_results(result: dict, path) -> None:
    is_cpu = result["mode"] == "cpu"
    drawn = common.subplots(path, 1, 1 if is_cpu else 2, figsize=(6, 4) if is_cpu else (11, 4))
    if drawn is None:
        return
    fig, axes = drawn
    if is_cpu:
        ax = axes
        names = ["pagedinfer\n16 concurrent", "transformers\none by one"]
        values = [
            result["ours_16_concurrent"]["output_tok_s"],
            result["transformers_sequential"]["output_tok_s"],
        ]
        ax.bar(names, values, color=["tab:blue", "tab:gray"])
        ax.set_ylabel("output tokens / s")
        ax.set_title(f"SmolLM2-135M on CPU: {result['ratio']:.1f}x")
    else:
        a1, a2 = axes
        curve = result["concurrency_curve"]
        a1.plot(
            [c["concurrency"] for c in curve], [c["output_tok_s"] for c in curve], "o-", label="pagedinfer"
        )
        for name, peer in result["peers"].items():
            if "output_tok_s" in peer:
                a1.axhline(peer["output_tok_s"], ls="--", color="gray", label=name)
        a1.set_xscale("log", base=2)
        a1.set_xlabel("concurrent requests")
        a1.set_ylabel("output tokens / s")
        a1.legend()
        floors = [f for f in result["decode_vs_floor"].values() if "floor_ms" in f]
        labels = [f"batch {f['batch']}" for f in floors]
        x = range(len(floors))
        a2.bar([i - 0.2 for i in x], [f["median_step_ms"] for f in floors], 0.4, label="measured step")
        a2.bar([i + 0.2 for i in x], [f["floor_ms"] for f in floors], 0.4, label="bandwidth floor")
        a2.set_xticks(list(x), labels)
        a2.set_ylabel("ms per decode step")
        a2.legend()
    common.save(fig, path, dpi=120)
