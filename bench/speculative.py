"""Speculative decoding: tokens/s and ms/token with and without speculation, side by side.

Each workload runs one engine; every row measures `use_speculation=False` requests (baseline)
and speculative ones on the same engine, same prompts, greedy, and checks the outputs match.
  (a) ngram: the n-gram proposer on editing tasks with SmolLM2 (rewrite a given text with one
      substitution, or fix its typos: the output copies long spans of the prompt, what prompt
      lookup is made for; each answer ends at the model's EOS, at most --max-tokens);
  (b) pair: a Llama-3-8B-shaped random bf16 target with a draft made of its own first L layers;
      the target's later layers are scaled down so the pair agrees (bench/spec_pair.py says how;
      the construction is recorded in the JSON);
  (c) selfdraft (CPU notes only): SmolLM2 verified by a subset of its own layers.
For each row: acceptance alpha (solved from the mean tokens emitted per verifying step), c (one
draft token's proposer time / one plain decode step of the same batch, same run), K, the
theoretical speedup (1 - alpha^(K+1)) / ((1 - alpha) (K c + 1)) and measured / theoretical.

    python -P bench/speculative.py --device cuda --model /path/smollm2.gguf --out OUT   # GPU: (a) + (b)
    python -P bench/speculative.py --workloads pair --smoke --out /tmp/x                 # CPU smoke of (b)
(-P: bench/operator.py must not shadow the stdlib `operator`.)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from pagedinfer.engine.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagedinfer.engine.llm import LLM  # noqa: E402
from pagedinfer.engine.sampling_params import SamplingParams  # noqa: E402
from pagedinfer.engine.spec_decode.factory import build_speculative_decoder  # noqa: E402


def _load_bench_module(name: str):
    # By path: bench/ holds operator.py, which must never shadow the stdlib module on sys.path.
    path = Path(__file__).resolve().parent / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


_throughput_lib = _load_bench_module("throughput_lib")
run_engine_requests, run_engine_closed_loop = (
    _throughput_lib.run_engine_requests,
    _throughput_lib.run_engine_closed_loop,
)
spec_pair = _load_bench_module("spec_pair")

# Editing tasks over given texts, long enough (~120-150 tokens) that the edited copy, not the
# model's own text, fills most of a 128-token answer. SmolLM2-135M copies the texts (partly: it
# drops or merges clauses, and often leaves the word to replace unchanged); asked to rename a
# variable in Python code it wrote new code instead, so no code task here (bench/NOTES.md).
TEXTS = [
    "The town council met on Monday evening to discuss the new budget for the coming year. Most of "
    "the money will go to the schools, the roads and the public library, which has asked for longer "
    "opening hours and more staff. The mayor said that the roads in the north of the town are in poor "
    "condition and must be repaired before the winter. Several residents spoke at the meeting and "
    "asked the council to build a new playground near the river. The council agreed to study the "
    "proposal and to present a plan at the next meeting, which will take place on Monday, the third "
    "of March, at seven in the evening.",
    "Our train leaves the central station at nine in the morning and arrives at the coast shortly "
    "after noon. On the way it stops in three small towns, where passengers can buy coffee and "
    "sandwiches on the platform. The last stop is a quiet harbor with a white lighthouse, a fish "
    "market and a few restaurants that serve fresh seafood. From the harbor a ferry goes to the "
    "island twice a day, once at two in the afternoon and once at six in the evening. Tickets for "
    "the ferry can be bought at the harbor office, which is open every day except Sunday.",
    "To make the vegetable soup, cut two onions, three carrots and four potatoes into small pieces. "
    "Melt some butter in a large pot and cook the onions for five minutes, until they are soft. Add "
    "the carrots and the potatoes, pour in two liters of water and add a spoon of salt. Bring the "
    "soup to a boil, then lower the heat and let it simmer for thirty minutes, stirring from time to "
    "time. When the vegetables are tender, blend the soup until it is smooth, taste it and add more "
    "salt or pepper if needed. Serve the soup hot with fresh bread and a little cream on top.",
    "The city library opens at eight in the morning and closes at six in the evening from Monday to "
    "Friday. On Saturday it opens at ten and closes at four. Visitors with a library card may borrow "
    "up to five books at a time, and books must be returned within three weeks. If a book is "
    "returned late, the library charges a small fee for each day. Children under twelve can borrow "
    "books for free and may join the reading club, which meets every Wednesday afternoon in the room "
    "next to the entrance. The library also offers free internet access and a quiet room for study.",
]
EDITS = [("Monday", "Tuesday"), ("ferry", "boat"), ("carrots", "leeks"), ("library", "archive")]


def with_typos(text: str, seed: int) -> str:
    """The text with adjacent letters swapped in about one word of five longer than five letters."""
    rng = random.Random(seed)
    words = text.split(" ")
    for i, word in enumerate(words):
        if len(word) > 5 and word.isalpha() and rng.random() < 0.2:
            j = rng.randrange(1, len(word) - 2)
            words[i] = word[:j] + word[j + 1] + word[j] + word[j + 2 :]
    return " ".join(words)


def tasks(num: int) -> list[str]:
    """Each text once with a replacement to make, then once with typos to fix; then again."""
    out = []
    for i in range(num):
        t = i % len(TEXTS)
        if (i // len(TEXTS)) % 2 == 0:
            old, new = EDITS[t]
            out.append(f"Rewrite the following text, replacing '{old}' with '{new}'. Text: {TEXTS[t]}")
        else:
            out.append(
                "Fix the spelling mistakes in the following text and return the corrected text. "
                f"Text: {with_typos(TEXTS[t], t)}"
            )
    return out


def solve_alpha(mean_emitted: float, k: int) -> float:
    """alpha with (1 - alpha^(k+1)) / (1 - alpha) == mean_emitted (bisection; 1 <= mean <= k+1)."""
    target = min(max(mean_emitted, 1.0), k + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        value = sum(mid**i for i in range(k + 1))
        lo, hi = (mid, hi) if value < target else (lo, mid)
    return (lo + hi) / 2


def theoretical_speedup(alpha: float, k: int, c: float) -> float:
    if alpha >= 1.0:
        return (k + 1) / (k * c + 1)
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1))


class Timed:
    """Wraps a bound method, summing its wall time (the callee ends in a host sync)."""

    def __init__(self, fn) -> None:
        self.fn, self.durations = fn, []

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.durations.append(time.perf_counter() - start)

    @property
    def median_s(self) -> float:
        # Median: the first call of a run also prefills the prompts into the draft cache.
        return statistics.median(self.durations) if self.durations else 0.0


def decode_ms_per_token(run) -> float:
    """Per-sequence ms per output token over the decode steps (the prefill step excluded)."""
    decode_ms = sum(s["ms"] for s in run.steps if s["pure_decode"])
    tokens_per_seq = (run.output_tokens - run.num_requests) / run.num_requests
    return decode_ms / max(tokens_per_seq, 1e-9)


def prefix_fraction(a: list[int], b: list[int]) -> float:
    """Tokens before the first difference over the longer length (1.0: identical)."""
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return n / max(len(a), len(b), 1)


@dataclass
class Workload:
    """One engine and how to feed it: prompts per batch size and a speculative config per K."""

    name: str
    llm: LLM
    prompts: Callable[[int], list[list[int]]]
    spec_config: Callable[[int], SpeculativeConfig]
    info: dict
    # False: requests end at the model's EOS, as a real answer does (capped by --max-tokens);
    # True: exactly --max-tokens each (a random model's EOS means nothing)
    ignore_eos: bool = True


def set_speculation(llm: LLM, config: SpeculativeConfig, num_blocks: int) -> None:
    """A fresh speculative decoder for this K; verification graphs recaptured for 1 + K."""
    runner = llm.core.runner
    spec = build_speculative_decoder(
        config,
        runner.model,
        llm.tokenizer,
        num_blocks=num_blocks,
        block_size=16,
        max_model_len=llm.max_model_len,
        attention_backend=runner.config.attention_backend,
    )
    llm.core.spec_decoder = runner.spec_decoder = spec
    if runner.graphs is not None and runner.config.num_speculative_tokens != config.num_speculative_tokens:
        runner.config = replace(runner.config, num_speculative_tokens=config.num_speculative_tokens)
        runner.graphs = None
        runner.capture_cuda_graphs()
    if runner.graphs is not None:
        spec.capture_cuda_graphs(runner.config.max_num_seqs)  # the draft model's steps


def baseline(core, prompts: list[list[int]], greedy: SamplingParams):
    base = run_engine_requests(core, prompts, replace(greedy, use_speculation=False))
    steps = sorted(s["ms"] for s in base.steps if s["pure_decode"])
    return base, steps[len(steps) // 2]  # the run, its median plain decode step (ms)


def measure(
    core, prompts: list[list[int]], base, base_step_ms: float, greedy: SamplingParams, k: int
) -> dict:
    spec = core.spec_decoder
    params = replace(greedy, use_speculation=True)
    before = replace(spec.stats)
    timer = Timed(spec.proposer.propose)
    spec.proposer.propose = timer
    try:
        fast = run_engine_requests(core, prompts, params)
    finally:
        del spec.proposer.propose  # back to the class method
    stats = spec.stats
    drafted = stats.num_draft_tokens - before.num_draft_tokens
    accepted = stats.num_accepted_tokens - before.num_accepted_tokens
    verifying = stats.num_verified_sequences - before.num_verified_sequences
    paused = stats.num_paused_sequence_steps - before.num_paused_sequence_steps
    emitted = stats.num_emitted_tokens - before.num_emitted_tokens
    mean_emitted = emitted / verifying if verifying else 1.0
    alpha = solve_alpha(mean_emitted, k)
    # c: one draft token's proposer time per step over one plain decode step of the same batch.
    c = (timer.median_s / k) / (base_step_ms / 1e3)
    theory = theoretical_speedup(alpha, k, c)
    base_ms, fast_ms = decode_ms_per_token(base), decode_ms_per_token(fast)
    measured = base_ms / fast_ms
    steady = full_batch_speedup(base, fast, len(prompts))
    same = [prefix_fraction(a, b) for a, b in zip(base.token_ids, fast.token_ids, strict=True)]
    return {
        "batch": len(prompts),
        "k": k,
        "identical_outputs": base.token_ids == fast.token_ids,
        "identical_prefix_fraction": round(statistics.mean(same), 4),
        "base_tok_s": round(base.output_tok_s, 2),
        "spec_tok_s": round(fast.output_tok_s, 2),
        "base_ms_per_token": round(base_ms, 3),
        "spec_ms_per_token": round(fast_ms, 3),
        "base_decode_step_ms": round(base_step_ms, 3),
        # Where a speculative step's time goes (host phases of EngineCore.step; the draft model
        # and the n-gram proposer run in `update`, the target's verification in `collect`).
        "spec_step_ms": step_median(fast, len(prompts)),
        # the distribution's tail: a mean far above the median means a few slow steps
        "spec_step_ms_mean_max": step_mean_max(fast, len(prompts)),
        "base_step_ms_mean_max": step_mean_max(base, len(prompts)),
        "spec_phases_ms": phase_medians(fast, len(prompts)),
        "base_phases_ms": phase_medians(base, len(prompts)),
        "proposer_ms_per_step": round(timer.median_s * 1e3, 3),
        # sequence-steps that verified drafts / that the policy had paused, and the tokens one
        # sequence gained per step while the batch was full (what the formula models)
        "verifying_sequence_steps": verifying,
        # sequence-steps with a draft over all (the formula assumes 1.0; an n-gram proposer
        # drafts only where the text so far holds a match)
        "draft_coverage": round(
            verifying / max(1, sum(s["batch"] for s in fast.steps if s["pure_decode"])), 3
        ),
        "paused_sequence_steps": paused,
        **draft_accounting(before, stats, fast),
        "full_batch_tokens_per_seq_step": full_batch_tokens_per_seq_step(fast, len(prompts)),
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_ratio": round(accepted / drafted, 4) if drafted else 0.0,
        "mean_emitted_per_verify_step": round(mean_emitted, 3),
        "alpha": round(alpha, 4),
        "c": round(c, 4),
        "theoretical_speedup": round(theory, 3),
        "measured_speedup": round(measured, 3),
        "measured_over_theoretical": round(measured / theory, 3),
        # the same over the steps with all B sequences running: what a continuously refilled batch
        # of B sees; the whole-run figure above also pays for the tail, where sequences that drew
        # fewer accepted drafts finish alone at a smaller batch
        "full_batch_steps": len(_full_steps(fast, len(prompts))),
        "all_steps": sum(1 for s in fast.steps if s["pure_decode"]),
        "measured_speedup_full_batch": steady,
        "full_batch_over_theoretical": round(steady / theory, 3) if steady else None,
    }


def draft_accounting(before, after, run) -> dict:
    """Why decoding sequence-steps had no draft, and the tokens one decoding sequence-step gave.

    The reasons are counted where drafts are decided (SpeculativeDecoder.propose): no n-gram
    match (`unmatched`), paused by the policy, no room left under max_tokens (`capped`, the last
    step of every sequence), the whole step above max_batch_size (`disabled`).
    """
    reasons = {
        name: getattr(after, f"num_{name}_sequence_steps") - getattr(before, f"num_{name}_sequence_steps")
        for name in ("unmatched", "paused", "capped", "disabled")
    }
    seq_steps = sum(s["batch"] for s in run.steps if s["pure_decode"])
    return {
        "no_draft_sequence_steps": reasons,
        # output tokens after each sequence's first (prefill) token over decoding sequence-steps:
        # 1.0 without speculation; what coverage and alpha together give
        "tokens_per_seq_step": round((run.output_tokens - run.num_requests) / max(seq_steps, 1), 3),
    }


def _full_steps(run, batch: int) -> list[dict]:
    return [s for s in run.steps if s["pure_decode"] and s["batch"] == batch]


def step_median(run, batch: int) -> float | None:
    steps = _full_steps(run, batch)
    return round(statistics.median(s["ms"] for s in steps), 3) if steps else None


def _full_batch_growth(run, batch: int) -> tuple[int, list[dict]] | None:
    """KV tokens gained from the first to the last step with the whole batch running (they grow
    by exactly the emitted tokens between such steps), and the steps after the first."""
    steps = _full_steps(run, batch)
    if len(steps) < 2:
        return None
    return steps[-1]["kv_tokens"] - steps[0]["kv_tokens"], steps[1:]


def full_batch_tokens_per_seq_step(run, batch: int) -> float | None:
    """Tokens a sequence gained per step over the steps with the whole batch running."""
    growth = _full_batch_growth(run, batch)
    if growth is None:
        return None
    gained, after = growth
    return round(gained / len(after) / batch, 3)


def full_batch_speedup(base, fast, batch: int) -> float | None:
    """Tokens per second of one sequence while the whole batch runs, speculative over plain
    (the plain run's batch stays full to its end)."""
    growths = [_full_batch_growth(run, batch) for run in (base, fast)]
    if None in growths:
        return None
    base_rate, fast_rate = (gained / sum(s["ms"] for s in after) for gained, after in growths)
    return round(fast_rate / base_rate, 3)


def step_mean_max(run, batch: int) -> list[float] | None:
    steps = [s["ms"] for s in _full_steps(run, batch)]
    return [round(statistics.mean(steps), 3), round(max(steps), 3)] if steps else None


def phase_medians(run, batch: int) -> dict[str, float]:
    phases = [s["phases_ms"] for s in _full_steps(run, batch) if "phases_ms" in s]
    return {k: round(statistics.median(p[k] for p in phases), 3) for k in phases[0]} if phases else {}


def refilled(core, pool: list[list[int]], batch: int, greedy: SamplingParams, speculate: bool):
    """Output lengths drawn per request (seeded: the same in both modes) from max_tokens / 2 to
    3 max_tokens / 2, as real traffic has them: plain decoding then also finishes and admits
    sequences at different steps, not all B at once."""
    rng = random.Random(len(pool))
    max_tokens = greedy.max_tokens
    params = [
        replace(
            greedy,
            max_tokens=rng.randint(max(2, max_tokens // 2), 3 * max_tokens // 2),
            use_speculation=speculate,
        )
        for _ in pool
    ]
    return run_engine_closed_loop(core, pool, params, batch)


def refilled_row(base, fast, row: dict) -> dict:
    """A batch kept full by new requests (continuous batching's steady state), both modes on the
    same pool of prompts; the formula's alpha and c come from the fixed-batch run of the row."""
    speedup = fast.steady_tok_s / base.steady_tok_s
    return {
        "refilled_base_tok_s": round(base.steady_tok_s, 2),
        "refilled_spec_tok_s": round(fast.steady_tok_s, 2),
        "refilled_steps": [base.steady_steps, fast.steady_steps],
        "refilled_speedup": round(speedup, 3),
        "refilled_over_theoretical": round(speedup / row["theoretical_speedup"], 3),
    }


def run_workload(
    w: Workload, batches: list[int], ks: list[int], max_tokens: int, num_blocks: int, refill: int = 0
) -> list[dict]:
    core, rows = w.llm.core, []
    warm = w.prompts(1)
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=w.ignore_eos)
    short = replace(greedy, max_tokens=8)
    bases = {}
    for k in ks:
        set_speculation(w.llm, w.spec_config(k), num_blocks)
        baseline(core, warm, short)  # warm-up: allocator, kernels, first-call costs
        measure(core, warm, *baseline(core, warm, short), short, k)
        for batch in batches:
            prompts = w.prompts(batch)
            if batch not in bases:
                bases[batch] = baseline(core, prompts, greedy)
            # Warm-up at this batch and K (kernels specialized or compiled on first use, the
            # draft's graphs): one-time costs stay out of the timed run.
            run_engine_requests(
                core, prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
            )
            row = measure(core, prompts, *bases[batch], greedy, k)
            if refill:
                pool = w.prompts(refill * batch)
                if ("loop", batch) not in bases:
                    bases["loop", batch] = refilled(core, pool, batch, greedy, False)
                row.update(refilled_row(bases["loop", batch], refilled(core, pool, batch, greedy, True), row))
            rows.append(row)
            print(w.name, json.dumps(row), flush=True)
    return rows


def _engine_config(args, model: str, dtype: str, spec: SpeculativeConfig) -> EngineConfig:
    return EngineConfig(
        model=model,
        # No prefix caching: every run here repeats the previous run's prompts, and cached prompt
        # blocks would make the later run's prefills (the refilled batch's admissions) cheaper.
        cache=CacheConfig(block_size=16, num_blocks=args.num_blocks, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_model_len=1024, max_num_seqs=16),
        device=DeviceConfig(device=args.device, dtype=dtype),
        speculative=spec,
    )


def _policy(args) -> dict:
    """--min-acceptance-rate 0 turns the per-sequence pause off (the formula assumes none)."""
    return {} if args.min_acceptance_rate is None else {"min_acceptance_rate": args.min_acceptance_rate}


def smollm2_workload(args, ks: list[int], method: str) -> Workload:
    """(a) n-gram, or (c) a self-draft of SmolLM2's own layers, on the editing task."""

    def spec_config(k: int) -> SpeculativeConfig:
        if method == "ngram":
            return SpeculativeConfig(
                method="ngram", num_speculative_tokens=k, ngram_min=1, ngram_max=3, **_policy(args)
            )
        return SpeculativeConfig(
            method="draft", num_speculative_tokens=k, draft_model=args.draft, **_policy(args)
        )

    llm = LLM(_engine_config(args, args.model, args.dtype, spec_config(ks[0])))
    encode = lambda text: llm.tokenizer.encode_chat([{"role": "user", "content": text}])  # noqa: E731
    info = {
        "model": args.model,
        "draft": args.draft if method == "draft" else None,
        "task": "rewrite with a replacement / fix typos, 4 texts; answers end at EOS",
    }
    return Workload(
        method if method == "ngram" else "selfdraft",
        llm,
        lambda b: [encode(t) for t in tasks(b)],
        spec_config,
        info,
        ignore_eos=False,
    )


def pair_workload(args, ks: list[int]) -> Workload:
    """(b) the 8B-shaped target and its first-L-layers draft (see bench/spec_pair.py)."""
    from pagedinfer.engine.engine_builder import assemble_engine
    from pagedinfer.kernels import ops

    shape = spec_pair.SMOKE if args.smoke else spec_pair.LLAMA3_8B
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    backend = ops.select_backend(torch.device(args.device), "auto")
    model, construction = spec_pair.build_pair(
        shape, args.draft_layers, args.target_agreement, args.device, dtype, backend
    )
    print("pair:", construction, flush=True)

    def spec_config(k: int) -> SpeculativeConfig:
        return SpeculativeConfig(
            method="draft", num_speculative_tokens=k, draft_model=construction.draft, **_policy(args)
        )

    config = _engine_config(
        args, "random-llama-3-8b-shape", str(dtype).removeprefix("torch."), spec_config(ks[0])
    )
    llm = LLM(config, builder=lambda cfg: assemble_engine(cfg, model, None))
    gen = torch.Generator().manual_seed(7)

    def prompts(batch: int) -> list[list[int]]:
        return [
            torch.randint(0, shape.vocab_size, (args.prompt_len,), generator=gen).tolist()
            for _ in range(batch)
        ]

    cached: dict[int, list[list[int]]] = {}

    def prompts_of(batch: int) -> list[list[int]]:  # the same prompts for a size, every call
        if batch not in cached:
            cached[batch] = prompts(batch)
        return cached[batch]

    for b in sorted({1, *[int(x) for x in args.batches.split(",")]}):
        prompts_of(b)
    return Workload("pair", llm, prompts_of, spec_config, {"construction": asdict(construction)})


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", help="dtype of the SmolLM2 workloads")
    parser.add_argument("--model", default="builtin://smollm2-135m", help="SmolLM2 for (a) / (c)")
    parser.add_argument("--workloads", default="ngram,pair", help="any of ngram, pair, selfdraft")
    parser.add_argument("--draft", default="self:layers=0-9,20-29", help="draft spec of selfdraft")
    parser.add_argument("--ks", default="4", help="K values, e.g. 2,4,6")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument("--draft-layers", type=int, default=2, help="pair: the draft is the first L layers")
    parser.add_argument("--target-agreement", type=float, default=0.8, help="pair: teacher-forced agreement")
    parser.add_argument("--prompt-len", type=int, default=128, help="pair: random prompt tokens")
    parser.add_argument("--smoke", action="store_true", help="pair at toy size (CPU check of the code)")
    parser.add_argument(
        "--refill",
        type=int,
        default=4,
        help="also run B x REFILL requests (output lengths drawn around --max-tokens) with B in flight, each finished one replaced; 0: off",
    )
    parser.add_argument(
        "--min-acceptance-rate",
        type=float,
        default=None,
        help="the policy's pause threshold (0: never pause)",
    )
    args = parser.parse_args()
    if args.refill == 1:
        parser.error("--refill must be 0 (off) or >= 2: with B prompts the batch is never refilled")
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    results: dict = {"machine": _machine(args), "workloads": {}}
    for name in args.workloads.split(","):
        start = time.perf_counter()
        try:
            w = pair_workload(args, ks) if name == "pair" else smollm2_workload(args, ks, name)
        except (ImportError, OSError, ValueError) as exc:  # ModelLoadError: no gguf, no SmolLM2 file
            print(f"{name}: skipped, the model could not be built: {type(exc).__name__}: {exc}", flush=True)
            results["workloads"][name] = {"skipped": f"{type(exc).__name__}: {exc}", "rows": []}
            continue
        rows = run_workload(w, batches, ks, args.max_tokens, args.num_blocks, args.refill)
        results["workloads"][name] = {
            **w.info,
            "rows": rows,
            "seconds": round(time.perf_counter() - start, 1),
        }
        del w
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "speculative.json").write_text(json.dumps(results, indent=2))
    (out / "speculative_summary.txt").write_text(_summary(results))
    _plot(results, out / "speculative.png")
    print(_summary(results))


def _machine(args) -> dict:
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    return {
        "device": device,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "smollm2_model": args.model,
        "ks": args.ks,
        "max_tokens": args.max_tokens,
        "greedy": True,
    }


def _summary(results: dict) -> str:
    lines = [f"speculative decoding on {results['machine']['device']} (greedy)"]
    lines.append(
        f"{'workload':9} {'B':>2} {'K':>2} {'base tok/s':>10} {'spec tok/s':>10} {'ms/tok':>15} {'alpha':>6} "
        f"{'c':>6} {'theory':>6} {'meas.':>6} {'ratio':>6} {'full-B':>6} {'ratio':>6} {'refill':>6} {'ratio':>6} {'steps':>7} paused same"
    )
    for name, workload in results["workloads"].items():
        if "skipped" in workload:
            lines.append(f"{name:9} skipped: {workload['skipped']}")
        for r in workload["rows"]:
            lines.append(
                f"{name:9} {r['batch']:>2} {r['k']:>2} {r['base_tok_s']:>10} {r['spec_tok_s']:>10} "
                f"{r['base_ms_per_token']:>7}->{r['spec_ms_per_token']:<7} {r['alpha']:>6} {r['c']:>6} "
                f"{r['theoretical_speedup']:>6} {r['measured_speedup']:>6} "
                f"{r['measured_over_theoretical']:>6} {r.get('measured_speedup_full_batch')!s:>6} "
                f"{r.get('full_batch_over_theoretical')!s:>6} "
                f"{r.get('refilled_speedup', '-')!s:>6} {r.get('refilled_over_theoretical', '-')!s:>6} "
                f"{r.get('full_batch_steps', '-')!s:>3}/{r.get('all_steps', '-')!s:<3} "
                f"{r.get('paused_sequence_steps', '-')!s:>6} {r['identical_outputs']}"
            )
        if "construction" in workload:
            lines.append(f"  {name}: {workload['construction']}")
    return "\n".join(lines) + "\n"


def _plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    labels, base, fast = [], [], []
    for name, workload in results["workloads"].items():
        for r in workload["rows"]:
            labels.append(f"{name}\nB={r['batch']} K={r['k']}\na={r['alpha']} c={r['c']}")
            base.append(r["base_tok_s"])
            fast.append(r["spec_tok_s"])
    if not labels:
        return
    xs = range(len(labels))
    fig, ax = plt.subplots(figsize=(1.6 * len(labels) + 2, 4.5))
    ax.bar([x - 0.2 for x in xs], base, 0.4, label="no speculation")
    ax.bar([x + 0.2 for x in xs], fast, 0.4, label="speculative")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("output tokens/s")
    ax.set_yscale("log")
    ax.set_title(f"Speculative decoding, {results['machine']['device']}, greedy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
