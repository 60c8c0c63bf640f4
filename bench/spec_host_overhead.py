"""Host (Python) cost of one speculative decode step vs one plain decode step.

Modes (--modes): plain and spec (synchronous steps), plain_async and chained (async scheduling
forced on; chained: n-gram steps chained on the device, whose accept + propose and input feed run
here as torch ops and are taken out of the host time: on a GPU each is one kernel launch); pair
and pair_chained: the same with a draft model (a stub like the target's, its forwards taken out
too), every step synchronous or chained on the device.

The sibling of bench/host_overhead.py for issue 6: the real EngineCore (scheduler, KV manager,
runner, verifier, n-gram proposer) drives a stub model of negligible cost whose greedy output is
mostly periodic (the next token is the input id + 1 mod 13, jumping at pseudo-random positions), so
prompt lookup finds drafts and some of them are rejected. Each step's thread CPU time is split
into schedule / launch (sampling plan, input staging, metadata, minus the stub) / collect
(verification) / update / after_step (acceptance bookkeeping + the proposer), median over steps.
The same batch runs once without speculation ("plain") and once with it ("spec").

    OMP_NUM_THREADS=1 python bench/spec_host_overhead.py --out bench/results --name NAME [--baseline FILE]

Prints host ms per step and per emitted token at each batch, and the ratio to a baseline JSON.
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
    SpeculativeConfig,
)
from pagedinfer.engine.engine_builder import assemble_engine
from pagedinfer.engine.sampling_params import SamplingParams

VOCAB = 512
PERIOD = 13  # generated tokens cycle through 0..12
JUMP_MASK = 7  # ... except at pseudo-random positions (1 in 8), where the next token jumps by 5


class PeriodicStub(torch.nn.Module):
    """Greedy-deterministic fake LM with repetitive output (n-gram drafts mostly accepted)."""

    def __init__(self, config: ModelConfig, clock) -> None:
        super().__init__()
        self.config = config
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.clock = clock
        self.seconds = 0.0

    def forward(self, input_ids, positions, kv_caches, attn_metadata) -> torch.Tensor:
        t0 = self.clock()
        jump = ((positions * 40503 >> 7) & JUMP_MASK == 0).long() * 4  # [T]
        hidden = ((input_ids + 1 + jump) % PERIOD).float()[:, None]  # [T, 1] next token id
        self.seconds += self.clock() - t0
        return hidden

    def compute_logits(
        self, hidden: torch.Tensor, upcast: bool = True, backend: str | None = None
    ) -> torch.Tensor:
        t0 = self.clock()
        logits = torch.zeros(hidden.shape[0], self.config.vocab_size)  # [N, V]
        logits.scatter_(1, hidden.long(), 1.0)
        self.seconds += self.clock() - t0
        return logits


class DraftStub(PeriodicStub):
    """A draft for the stub: the same cycle with jumps at other positions (some drafts rejected);
    its time counts as the target stub's (device work on a GPU)."""

    def __init__(self, config: ModelConfig, clock, target: PeriodicStub) -> None:
        super().__init__(config, clock)
        self.target = target

    def forward(self, input_ids, positions, kv_caches, attn_metadata) -> torch.Tensor:
        t0 = self.clock()
        jump = ((positions * 40503 >> 9) & JUMP_MASK == 0).long() * 4  # [T]
        hidden = ((input_ids + 1 + jump) % PERIOD).float()[:, None]
        self.target.seconds += self.clock() - t0
        return hidden

    def compute_logits(self, hidden, upcast: bool = True, backend: str | None = None) -> torch.Tensor:
        t0 = self.clock()
        logits = torch.zeros(hidden.shape[0], self.config.vocab_size)
        logits.scatter_(1, hidden.long(), 1.0)
        self.target.seconds += self.clock() - t0
        return logits


# mode -> (drafts per step, async scheduling, drafts and acceptance on the device, device steps
# per chained launch, speculative method)
MODES = {
    "plain": (0, False, False, 1, None),
    "spec": (None, False, False, 1, "ngram"),  # None: --k
    "plain_async": (0, True, False, 1, None),
    "chained": (None, True, True, 1, "ngram"),
    "chained_multi": (None, True, True, None, "ngram"),  # None: --device-steps
    # a draft model (DraftStub): every step synchronous (drafts left on the device), or chained
    "pair": (None, False, False, 1, "draft"),
    "pair_chained": (None, True, True, 1, "draft"),
}


class _DeviceStandIns:
    """On the CPU a chained step's device work (accept + propose, the input feed) runs as torch ops
    on the host; on a GPU each is one kernel launch. Their time is counted here and taken out of the
    host time, like the stub model's: out of the phase each call ran in (`within`), the outermost
    call only where one stand-in calls another (the rejection sampler runs the sampler's)."""

    def __init__(self, clock) -> None:
        from pagedinfer.engine.sample.rejection_sampler import RejectionSampler
        from pagedinfer.engine.sample.sampler import Sampler
        from pagedinfer.engine.spec_decode import device_chain
        from pagedinfer.kernels import ngram_reference

        self.seconds = 0.0
        self.intervals: list[tuple[float, float]] = []  # (start, end) of each outermost call
        self._depth = 0
        self._patched = []
        # Sampling (--temperature) is device work too: the sampler's and the rejection sampler's
        # tensor ops (a greedy step's one argmax stays in the host time, as before).
        for owner, name in (
            (ngram_reference, "accept_and_propose"),
            (device_chain, "feed_inputs_torch"),
            (Sampler, "process"),
            (Sampler, "draw"),
            (RejectionSampler, "__call__"),
        ):
            fn = getattr(owner, name)
            self._patched.append((owner, name, fn))
            setattr(owner, name, self._timed(fn, clock))

    def _timed(self, fn, clock):
        def timed(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = clock()
                self._depth -= 1
                self.seconds += t1 - t0
                self.intervals.append((t0, t1))

        return timed

    def within(self, start: float, end: float) -> float:
        """Stand-in seconds inside [start, end] (a phase of the step)."""
        return sum(t1 - t0 for t0, t1 in self.intervals if start <= t0 and t1 <= end)

    def restore(self) -> None:
        for module, name, fn in self._patched:
            setattr(module, name, fn)


def build(
    batch: int,
    k: int,
    clock,
    async_scheduling: bool = False,
    device_chain: bool = False,
    device_steps: int = 1,
    method: str | None = "ngram",
):
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
    spec = SpeculativeConfig(
        method=method if k else None,
        draft_model="stub" if method == "draft" else None,
        num_speculative_tokens=max(k, 1),
        max_batch_size=max(batch, 1),
        device_chain=device_chain,
        device_chain_steps=device_steps,
        min_acceptance_rate=0.0,  # no pauses: a batch paused whole would end chains
    )
    cfg = EngineConfig(
        cache=CacheConfig(block_size=16, num_blocks=batch * 200 + 64),  # room for 60 launches of 4 steps
        scheduler=SchedulerConfig(
            max_num_seqs=batch,
            max_num_batched_tokens=8192,
            max_model_len=4096,
            async_scheduling=async_scheduling,
        ),
        device=DeviceConfig(device="cpu", dtype="float32"),
        speculative=spec,
    )
    model = PeriodicStub(mc, clock)
    if spec.method != "draft":
        return assemble_engine(cfg, model).core, model
    from pagedinfer.engine import engine_builder

    load = engine_builder.load_draft_model
    engine_builder.load_draft_model = lambda *args: DraftStub(mc, clock, model)
    try:
        return assemble_engine(cfg, model).core, model
    finally:
        engine_builder.load_draft_model = load


class _Timer:
    """Wraps bound methods on an instance to timestamp their entry and exit."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.marks: dict[str, float] = {}

    def wrap(self, obj, name: str) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            self.marks[name + ".start"] = self.clock()
            out = fn(*args, **kwargs)
            self.marks[name + ".end"] = self.clock()
            return out

        setattr(obj, name, timed)

    def span(self, name: str) -> float:
        return self.marks.get(name + ".end", 0.0) - self.marks.get(name + ".start", 0.0)


def measure(
    batch: int,
    k: int,
    num_steps: int,
    prompt_len: int = 64,
    seed: int = 0,
    async_scheduling: bool = False,
    device_chain: bool = False,
    device_steps: int = 1,
    method: str | None = "ngram",
    temperature: float = 0.0,
) -> dict:
    clock = time.thread_time
    core, model = build(batch, k, clock, async_scheduling, device_chain, device_steps, method)
    stand_ins = _DeviceStandIns(clock)
    try:
        return _measure(core, model, stand_ins, batch, num_steps, prompt_len, seed, temperature)
    finally:
        stand_ins.restore()


def _measure(core, model, stand_ins, batch, num_steps, prompt_len, seed, temperature=0.0) -> dict:
    clock = time.thread_time
    gen = torch.Generator().manual_seed(seed)
    # Sampled (seeded): the stub's one-hot logits at a low temperature keep its cycle likely, so
    # drafts are still accepted and the sampled paths run with the same batch shapes.
    params = SamplingParams(
        max_tokens=100_000,
        temperature=temperature,
        seed=seed + 1 if temperature > 0 else None,
        ignore_eos=True,
    )
    for i in range(batch):
        prompt = torch.randint(0, VOCAB, (prompt_len,), generator=gen).tolist()
        core.add_request(f"r{i}", prompt, params)
    for _ in range(8):  # prompts, then a few steps for the proposer to find its cycle
        core.step()
    timer = _Timer(clock)
    for name in ("launch_forward", "launch_sampling", "collect"):
        timer.wrap(core.runner, name)
    for name in ("schedule", "update"):
        timer.wrap(core.scheduler, name)
    if core.spec_decoder is not None:
        timer.wrap(core.spec_decoder, "after_step")
    rows = []
    num_emitted = num_chained = num_launches = 0
    for _ in range(num_steps):
        before = sum(r.num_output_tokens for r in core.scheduler.running)
        model.seconds = stand_ins.seconds = 0.0
        stand_ins.intervals.clear()
        timer.marks.clear()
        chained = core.num_chained_steps
        t0 = clock()
        core.step()
        total = clock() - t0 - stand_ins.seconds
        num_chained += core.num_chained_steps - chained
        num_launches += core.num_chained_steps > chained  # (one chained launch a step at most)
        num_emitted += sum(r.num_output_tokens for r in core.scheduler.running) - before

        def host(phase: str) -> float:  # the phase's time, its device stand-ins taken out
            start, end = timer.marks.get(phase + ".start", 0.0), timer.marks.get(phase + ".end", 0.0)
            return end - start - stand_ins.within(start, end)

        rows.append(
            {
                "step": total - model.seconds,
                "schedule": host("schedule"),
                "launch": host("launch_forward") + host("launch_sampling") - model.seconds,
                "collect": host("collect"),
                "update": host("update"),
                "after_step": host("after_step"),
            }
        )
    assert len(core.scheduler.running) == batch, "the batch must stay whole while measuring"
    out = {key: statistics.median(r[key] for r in rows) * 1e3 for key in rows[0]}
    out["tokens_per_seq_step"] = num_emitted / num_steps / batch
    out["ms_per_token"] = out["step"] / (out["tokens_per_seq_step"] * batch)
    if core.spec_decoder is not None:
        out["acceptance_rate"] = core.spec_decoder.stats.acceptance_rate
    out["chained_device_steps_per_step"] = num_chained / num_steps
    # Forward passes per engine step: a chained launch runs several, any other step one.
    device_steps_per_step = (num_steps - num_launches + num_chained) / num_steps
    out["device_steps_per_step"] = device_steps_per_step
    out["ms_per_device_step"] = out["step"] / device_steps_per_step
    out["steps_planned_ahead"] = core.num_lookahead_steps
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--k", type=int, default=4, help="drafts per step (n-gram)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--device-steps", type=int, default=4, help="device steps a chained_multi launch")
    parser.add_argument("--repeats", type=int, default=3, help="best median of this many runs")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--name", default="spec_host_overhead_cpu")
    parser.add_argument("--baseline", type=Path, default=None, help="a previous JSON to compare with")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="> 0: every request samples, seeded (the stub's logits are one-hot: ~0.05 keeps drafts accepted)",
    )
    parser.add_argument(
        "--modes",
        default="plain,spec",
        help=f"any of {', '.join(MODES)} (plain_async / chained: async scheduling forced on, the "
        "chained step's device work taken out of its host time like the model's)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    gc.collect()
    results: dict[str, dict] = {}
    for batch in args.batches:
        entry = {}
        for mode in args.modes.split(","):
            k, async_scheduling, device_chain, device_steps, method = MODES[mode]
            k = args.k if k is None else k
            device_steps = args.device_steps if device_steps is None else device_steps
            runs = [
                measure(
                    batch,
                    k,
                    args.steps,
                    async_scheduling=async_scheduling,
                    device_chain=device_chain,
                    device_steps=device_steps,
                    method=method,
                    temperature=args.temperature,
                )
                for _ in range(args.repeats)
            ]
            entry[mode] = min(runs, key=lambda r: r["step"])
            line = ", ".join(f"{key} {v:.3f}" for key, v in entry[mode].items())
            print(f"batch {batch:3d} {mode:5s}: {line}")
        pairs = (
            ("spec", "plain"),
            ("chained", "plain_async"),
            ("chained_multi", "plain_async"),
            ("pair", "plain"),
            ("pair_chained", "plain_async"),
        )
        for spec_mode, plain_mode in pairs:
            if spec_mode in entry and plain_mode in entry:
                ratio = entry[spec_mode]["ms_per_device_step"] / entry[plain_mode]["ms_per_device_step"]
                entry[f"{spec_mode}_over_{plain_mode}_step"] = ratio
                print(f"batch {batch:3d}: {spec_mode} / {plain_mode} host time per forward {ratio:.2f}x")
        results[str(batch)] = entry
    baseline = json.loads(args.baseline.read_text())["results"] if args.baseline else None
    if baseline:
        for batch, r in results.items():
            if batch in baseline and "spec" in r and "spec" in baseline[batch]:
                before, after = baseline[batch]["spec"]["step"], r["spec"]["step"]
                print(
                    f"batch {batch:>3}: spec step host ms {before:.3f} -> {after:.3f} ({before / after:.2f}x less)"
                )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        doc = {
            "unit": "thread CPU ms per engine step (median; stub model excluded)",
            "k": args.k,
            "method": "ngram (spec, chained*); draft stub (pair*)",
            "torch_threads": 1,
            "temperature": args.temperature,
            "results": results,
        }
        if baseline:
            doc["baseline"] = baseline
        (args.out / f"{args.name}.json").write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
