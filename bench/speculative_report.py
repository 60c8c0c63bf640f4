"""Row metrics of bench/speculative.py (alpha, c, the formula, full-batch figures) and its reports.

Everything here reads finished runs (throughput_lib.EngineRun) and SpeculationStats; nothing
drives an engine.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import common  # bench/ is on sys.path (bench/speculative.py puts it there)


def solve_alpha(mean_emitted: float, k: int) -> float:
    """alpha with (1 - alpha^(k+1)) / (1 - alpha) == mean_emitted (bisection; 1 <= mean <= k+1)."""
    target = min(max(mean_emitted, 1.0), k + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        value = sum(mid**i for i in range(k + 1))
        lo, hi = (mid, hi) if value < target else (lo, mid)
    return (lo + hi) / 2


def alpha_all_steps(verified: int, emitted: int, unmatched: int, k: int) -> float | None:
    """alpha over every sequence-step that asked the proposer for drafts, a step it had none for
    (no n-gram match) counted as a draft rejected at its first token: 1 token, what that step
    gave. The formula assumes a draft every step; alpha over the verifications alone (the rows'
    `alpha`) promises the unmatched steps tokens they had no draft to earn (tok/f < 1). This is
    Leviathan et al.'s alpha, E[beta] over every step, of the same proposer made to draft
    something where it has no match (a draft target decoding would reject, whose verification
    rows skipping the step saves). None without such steps. A draft model is asked every step
    (unmatched 0): both alphas are the same."""
    steps = verified + unmatched
    return solve_alpha((emitted + unmatched) / steps, k) if steps else None


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


def mean_request_ms_per_token(run) -> float:
    """Each request's decode time (the decode steps until the one it ended in) over its decoded
    tokens, averaged over the requests: the per-request time per output token (TPOT) that a
    client sees. Unlike `decode_ms_per_token` (the whole batch's decode time) it does not charge
    a request that finished early for the steps of the ones still running."""
    per_request = []
    for ids, end in zip(run.token_ids, run.finish_step, strict=True):
        ms = sum(s["ms"] for s in run.steps[: end + 1] if s["pure_decode"])
        per_request.append(ms / max(len(ids) - 1, 1))
    return sum(per_request) / max(len(per_request), 1)


def prefix_fraction(a: list[int], b: list[int]) -> float:
    """Tokens before the first difference over the longer length (1.0: identical)."""
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return n / max(len(a), len(b), 1)


def draft_accounting(before, after, run) -> dict:
    """Why decoding sequence-steps had no draft, the share that had one, and the tokens one
    decoding sequence-step gave.

    The reasons are counted where drafts are decided (SpeculativeDecoder.propose): no n-gram
    match (`unmatched`), paused by the policy, no room left under max_tokens (`capped`, the last
    step of every sequence), the whole step above max_batch_size (`disabled`). A decoding
    sequence-step either verified drafts or has one of these reasons, so they count the
    sequence-steps; the run's host steps do not (a chained host step runs several passes).
    """
    reasons = {
        name: getattr(after, f"num_{name}_sequence_steps") - getattr(before, f"num_{name}_sequence_steps")
        for name in ("unmatched", "paused", "capped", "disabled")
    }
    verified = after.num_verified_sequences - before.num_verified_sequences
    seq_steps = verified + sum(reasons.values())
    return {
        "no_draft_sequence_steps": reasons,
        # sequence-steps with a draft over all (the formula assumes 1.0; an n-gram proposer
        # drafts only where the text so far holds a match)
        "draft_coverage": round(verified / max(seq_steps, 1), 3),
        # output tokens after each sequence's first (prefill) token over decoding sequence-steps:
        # 1.0 without speculation; what coverage and alpha together give
        "tokens_per_seq_step": round((run.output_tokens - run.num_requests) / max(seq_steps, 1), 3),
    }


def full_steps(run, batch: int) -> list[dict]:
    return [s for s in run.steps if s["pure_decode"] and s["batch"] == batch]


def step_median(run, batch: int) -> float | None:
    steps = full_steps(run, batch)
    return round(statistics.median(s["ms"] for s in steps), 3) if steps else None


def _full_batch_growth(run, batch: int) -> tuple[int, list[dict]] | None:
    """KV tokens gained over the steps with the whole batch running, and the steps that applied
    them. kv_tokens is read before a step, so it grows by exactly what each step applies; an
    async step applies (and waits for) the passes the step before launched. The first full step
    is left out: its passes were queued behind the prefill step and partly ran during that
    step's host time (H100, batch 8: 2.8 ms for 4 passes against 3.9), so its own time is short.
    The window: tokens from the second full step's kv_tokens to the last's, applied by the full
    steps between (the last one's time and passes belong to tokens after the window)."""
    steps = full_steps(run, batch)
    if len(steps) < 3:
        return None
    return steps[-1]["kv_tokens"] - steps[1]["kv_tokens"], steps[1:-1]


def full_batch_tokens_per_host_step(run, batch: int) -> float | None:
    """Tokens a sequence gained per host step over the steps with the whole batch running. A
    chained host step runs several forward passes: `full_batch_tokens_per_device_step` is per
    pass (this was `full_batch_tokens_per_seq_step` in results before 2026-12-06 09:00 UTC)."""
    growth = _full_batch_growth(run, batch)
    if growth is None:
        return None
    gained, applying = growth
    return round(gained / len(applying) / batch, 3)


def full_batch_speedup(base, fast, batch: int) -> float | None:
    """Tokens per second of one sequence while the whole batch runs, speculative over plain
    (the plain run's batch stays full to its end)."""
    growths = [_full_batch_growth(run, batch) for run in (base, fast)]
    if None in growths:
        return None
    base_rate, fast_rate = (gained / sum(s["ms"] for s in applying) for gained, applying in growths)
    return round(fast_rate / base_rate, 3)


def full_batch_alpha(run, batch: int, k: int) -> float | None:
    """alpha solved from the verifying sequence-steps that the full-batch window's steps applied:
    the theory for that window. Acceptance is not flat over a response (an edit's first words are
    new, later ones copy more), so the whole run's alpha would understate the window's theory.
    None without per-step counts (results before 2026-12-06) or without a verification."""
    growth = _full_batch_growth(run, batch)
    if growth is None or any(s.get("verified") is None for s in growth[1]):
        return None
    verified = sum(s["verified"] for s in growth[1])
    if not verified:
        return None
    return solve_alpha(sum(s["emitted"] for s in growth[1]) / verified, k)


def _full_batch_passes(run, batch: int) -> tuple[int, float, int] | None:
    """(KV tokens gained, host ms, forward passes whose tokens those steps applied) over the
    window of `full_batch_speedup`; None without that window or per-step applied-pass counts
    (results before 2026-12-06 counted passes at launch, one async step off the tokens)."""
    growth = _full_batch_growth(run, batch)
    if growth is None or any("applied_device_steps" not in s for s in growth[1]):
        return None
    gained, applying = growth
    passes = sum(s["applied_device_steps"] for s in applying)
    return (gained, sum(s["ms"] for s in applying), passes) if passes else None


def step_cost_split(base, fast, batch: int, formula_tokens: float) -> dict:
    """The full-batch ratio as (tokens a device step gave / the formula's) over (a verifying
    device step's time / a plain one's): the first is the workload (steps with no n-gram match,
    device steps of a chain past a sequence's end), the second the implementation (the formula
    takes 1 + K c: a plain step plus the drafts). `formula_tokens`: (1 - alpha^(K+1)) / (1 - alpha)."""
    windows = [_full_batch_passes(run, batch) for run in (base, fast)]
    if None in windows:
        return {}
    (_, base_ms, base_passes), (gained, spec_ms, passes) = windows
    base_step_ms, spec_step_ms = round(base_ms / base_passes, 4), round(spec_ms / passes, 4)
    per_device_step = gained / batch / passes  # tokens a sequence gained per forward pass
    return {
        "full_batch_device_step_ms": [base_step_ms, spec_step_ms],
        "verify_step_cost": round(spec_step_ms / base_step_ms, 3),
        "full_batch_tokens_per_device_step": round(per_device_step, 3),
        "tokens_over_formula": round(per_device_step / formula_tokens, 3),
    }


def full_batch_alpha_all_steps(run, batch: int, k: int) -> float | None:
    """`alpha_all_steps` over the full-batch window: solved from the tokens a sequence gained per
    forward pass, every sequence-step of the window counted (one without a draft gave 1 token;
    a paused one too: none of the rows here paused). None without per-step applied passes."""
    window = _full_batch_passes(run, batch)
    if window is None:
        return None
    gained, _, passes = window
    return solve_alpha(gained / batch / passes, k)


def full_batch_columns(base, fast, batch: int, k: int, c: float, run_theory: float) -> dict:
    """A row's full-batch columns: the window's speedup against the theory at the window's own
    alpha (`full_batch_alpha`; the whole run's theory `run_theory` where the steps carry no
    verification counts), its split into tok/f and vstep (`step_cost_split`), and the same
    speedup against the theory at the window's `alpha_all_steps`."""
    steady = full_batch_speedup(base, fast, batch)
    alpha = full_batch_alpha(fast, batch, k)
    theory = run_theory if alpha is None else theoretical_speedup(alpha, k, c)
    alpha_all = full_batch_alpha_all_steps(fast, batch, k)
    theory_all = None if alpha_all is None else theoretical_speedup(alpha_all, k, c)
    return {
        "measured_speedup_full_batch": steady,
        "full_batch_alpha": None if alpha is None else round(alpha, 4),
        "full_batch_theoretical_speedup": round(theory, 3),
        "full_batch_over_theoretical": round(steady / theory, 3) if steady else None,
        **step_cost_split(base, fast, batch, theory * (k * c + 1)),
        "full_batch_alpha_all_steps": None if alpha_all is None else round(alpha_all, 4),
        "full_batch_theoretical_speedup_all_steps": None if theory_all is None else round(theory_all, 3),
        "full_batch_over_theoretical_all_steps": (
            round(steady / theory_all, 3) if steady and theory_all else None
        ),
    }


def all_steps_columns(row: dict) -> dict:
    """A row's whole-run and per-request ratios against the theory at `alpha_all_steps`, from
    the row's own counts (so older results recompute too; none before draft accounting)."""
    if "no_draft_sequence_steps" not in row:
        return {}
    verified = row["verifying_sequence_steps"]
    unmatched = row["no_draft_sequence_steps"]["unmatched"]
    # the exact count where the row has it (rows from before session 29: the rounded mean)
    emitted = row.get("verified_emitted_tokens", row["mean_emitted_per_verify_step"] * verified)
    alpha = alpha_all_steps(verified, emitted, unmatched, row["k"])
    if alpha is None:
        return {}
    theory = theoretical_speedup(alpha, row["k"], row["c"])
    return {
        "alpha_all_steps": round(alpha, 4),
        "theoretical_speedup_all_steps": round(theory, 3),
        "measured_over_theoretical_all_steps": round(row["measured_speedup"] / theory, 3),
        "request_over_theoretical_all_steps": round(row["request_speedup"] / theory, 3),
    }


# A step trace's columns: host ms, batch, kv_tokens before the step, passes launched, passes
# applied, pure decode, then the sequence-steps that verified drafts and the tokens they emitted
# (traces before 2026-12-06 end after pure decode; passes applied are None in the first ones).
TRACE_FIELDS = (
    "ms", "batch", "kv_tokens", "device_steps", "applied_device_steps", "pure_decode", "verified", "emitted",
)  # fmt: skip


def step_trace(run) -> list[list]:
    """The run's steps, compact (TRACE_FIELDS), to recompute any window from the JSON."""
    return [
        [round(s["ms"], 4), s["batch"], s["kv_tokens"], s.get("device_steps"),
         s.get("applied_device_steps"), s["pure_decode"], s.get("verified"), s.get("emitted")]
        for s in run.steps
    ]  # fmt: skip


def steps_from_trace(trace: list[list]) -> list[dict]:
    """The steps of a `step_trace`, as the windows above read them (an older, shorter trace
    leaves the later columns out)."""
    if any(len(t) > len(TRACE_FIELDS) for t in trace):
        raise ValueError(f"a step trace has more columns than {TRACE_FIELDS}")
    return [dict(zip(TRACE_FIELDS, t, strict=False)) for t in trace]


def recompute_row(row: dict) -> dict:
    """A JSON row's full-batch and all-steps columns recomputed from its `step_trace` (e.g. after
    a window's definition changed): the theory at the window's own alpha where the trace has
    per-step verification counts, else at the whole run's (as recorded then)."""
    from throughput_lib import EngineRun

    base, fast = (EngineRun(0.0, 0, 0, 0, steps_from_trace(row["step_trace"][n])) for n in ("base", "spec"))
    window = full_batch_columns(base, fast, row["batch"], row["k"], row["c"], row["theoretical_speedup"])
    return {**window, **all_steps_columns(row)}


def step_mean_max(run, batch: int) -> list[float] | None:
    steps = [s["ms"] for s in full_steps(run, batch)]
    return [round(statistics.mean(steps), 3), round(max(steps), 3)] if steps else None


def phase_medians(run, batch: int) -> dict[str, float]:
    phases = [s["phases_ms"] for s in full_steps(run, batch) if "phases_ms" in s]
    return {k: round(statistics.median(p[k] for p in phases), 3) for k in phases[0]} if phases else {}


def refilled_row(base, fast, alpha: float, theory: float) -> dict:
    """A batch kept full by new requests (continuous batching's steady state), both modes on the
    same pool of prompts; alpha is the refilled speculative run's own (its prompts are not the
    fixed-batch run's), theory the formula at that alpha and the row's c."""
    speedup = fast.steady_tok_s / base.steady_tok_s
    return {
        "refilled_base_tok_s": round(base.steady_tok_s, 2),
        "refilled_spec_tok_s": round(fast.steady_tok_s, 2),
        "refilled_steps": [base.steady_steps, fast.steady_steps],
        "refilled_alpha": round(alpha, 4),
        "refilled_theoretical_speedup": round(theory, 3),
        "refilled_speedup": round(speedup, 3),
        "refilled_over_theoretical": round(speedup / theory, 3),
    }


def idle_pair(row: dict) -> str:
    """'plain/spec' device idle fractions of a row ('-' off CUDA or in older results)."""
    base, spec = row.get("base_gpu_idle_fraction"), row.get("spec_gpu_idle_fraction")
    if base is None or spec is None:
        return "-"
    return f"{base:.2f}/{spec:.2f}"


def summary(results: dict) -> str:
    lines = [f"speculative decoding on {results['machine']['device']} (greedy)"]
    lines.append(
        f"{'workload':9} {'B':>2} {'K':>2} {'base tok/s':>10} {'spec tok/s':>10} {'ms/tok':>15} {'alpha':>6} "
        f"{'c':>6} {'theory':>6} {'meas.':>6} {'ratio':>6} {'req.':>6} {'ratio':>6} {'full-B':>6} {'a(fB)':>6} {'ratio':>6} {'vstep':>6} {'tok/f':>6} {'refill':>6} {'ratio':>6} {'steps':>7} paused same idle"
    )
    for name, workload in results["workloads"].items():
        if "skipped" in workload:
            lines.append(f"{name:9} skipped: {workload['skipped']}")
        for r in workload["rows"]:
            lines.append(
                f"{name:9} {r['batch']:>2} {r['k']:>2} {r['base_tok_s']:>10} {r['spec_tok_s']:>10} "
                f"{r['base_ms_per_token']:>7}->{r['spec_ms_per_token']:<7} {r['alpha']:>6} {r['c']:>6} "
                f"{r['theoretical_speedup']:>6} {r['measured_speedup']:>6} "
                f"{r['measured_over_theoretical']:>6} {r.get('request_speedup', '-')!s:>6} "
                f"{r.get('request_over_theoretical', '-')!s:>6} {r.get('measured_speedup_full_batch')!s:>6} "
                f"{r.get('full_batch_alpha') or '-'!s:>6} {r.get('full_batch_over_theoretical')!s:>6} "
                f"{r.get('verify_step_cost', '-')!s:>6} {r.get('tokens_over_formula', '-')!s:>6} "
                f"{r.get('refilled_speedup', '-')!s:>6} {r.get('refilled_over_theoretical', '-')!s:>6} "
                f"{r.get('full_batch_steps', '-')!s:>3}/{r.get('all_steps', '-')!s:<3} "
                f"{r.get('paused_sequence_steps', '-')!s:>6} {r['identical_outputs']!s:5} "
                f"{idle_pair(r)}{' host-bound plain' if r.get('baseline_host_bound') else ''}"
            )
        if "construction" in workload:
            lines.append(f"  {name}: {workload['construction']}")
    lines.append("")
    lines.append(
        "against the theory at alpha over every sequence-step asked for drafts (no match = rejected at once;"
        " the table the target is judged on, the one above at alpha given a match is a diagnostic)"
    )
    lines.append(
        f"{'workload':9} {'B':>2} {'K':>2} {'cover':>6} {'alpha':>6} {'theory':>6} {'ratio':>6} {'req.':>6} "
        f"{'a(fB)':>6} {'theory':>6} {'full-B':>6}"
    )
    for name, workload in results["workloads"].items():
        for r in workload["rows"]:
            lines.append(
                f"{name:9} {r['batch']:>2} {r['k']:>2} {r.get('draft_coverage', '-')!s:>6} "
                f"{r.get('alpha_all_steps', '-')!s:>6} {r.get('theoretical_speedup_all_steps', '-')!s:>6} "
                f"{r.get('measured_over_theoretical_all_steps', '-')!s:>6} "
                f"{r.get('request_over_theoretical_all_steps', '-')!s:>6} "
                f"{r.get('full_batch_alpha_all_steps', '-')!s:>6} "
                f"{r.get('full_batch_theoretical_speedup_all_steps', '-')!s:>6} "
                f"{r.get('full_batch_over_theoretical_all_steps', '-')!s:>6}"
            )
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    labels, base, fast = [], [], []
    for name, workload in results["workloads"].items():
        for r in workload["rows"]:
            labels.append(f"{name}\nB={r['batch']} K={r['k']}\na={r['alpha']} c={r['c']}")
            base.append(r["base_tok_s"])
            fast.append(r["spec_tok_s"])
    if not labels:
        return
    xs = range(len(labels))
    drawn = common.subplots(path, figsize=(1.6 * len(labels) + 2, 4.5))
    if drawn is None:
        return
    fig, ax = drawn
    ax.bar([x - 0.2 for x in xs], base, 0.4, label="no speculation")
    ax.bar([x + 0.2 for x in xs], fast, 0.4, label="speculative")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("output tokens/s")
    ax.set_yscale("log")
    ax.set_title(f"Speculative decoding, {results['machine']['device']}, greedy")
    ax.legend()
    common.save(fig, path, dpi=120)
