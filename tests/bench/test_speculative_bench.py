"""bench/speculative.py end to end on the CPU at toy size (--smoke): the draft/target pair with
its steps chained on the device (async scheduling forced on) and synchronous, so the benchmark
that the GPU run relies on keeps running. Speed is not looked at here, only that every row ran,
its outputs matched plain decoding and its chain engaged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("chain", ["on", "off"])
def test_pair_smoke_rows_match_plain_decoding(tmp_path, chain):
    cmd = [
        sys.executable, "-P", str(ROOT / "bench" / "speculative.py"), "--workloads", "pair", "--smoke",
        "--ks", "3", "--batches", "1,2", "--max-tokens", "12", "--refill", "0",
        "--async-scheduling", "on", "--device-chain", chain, "--out", str(tmp_path),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, timeout=600)
    results = json.loads((tmp_path / "speculative.json").read_text())
    rows = results["workloads"]["pair"]["rows"]
    assert [(r["batch"], r["k"]) for r in rows] == [(1, 3), (2, 3)]
    for r in rows:
        assert r["identical_outputs"], r
        assert r["verifying_sequence_steps"] > 0 and r["accepted_tokens"] > 0
        assert (r["chained_steps"] > 0) is (chain == "on"), r
        assert r["request_speedup"] > 0 and r["base_request_ms_per_token"] > 0, r
        # shares of sequence-steps, not of host steps (a chained host step runs several passes)
        assert 0 < r["draft_coverage"] <= 1 and 1 <= r["tokens_per_seq_step"] <= r["k"] + 1, r
        # every pass launched is applied by some step, and a step's KV growth (the next step's
        # kv_tokens over its own, at a full batch) comes with passes applied
        # the per-step verification counts add up to the row's totals (the window's alpha)
        spec_trace = r["step_trace"]["spec"]
        assert sum(t[6] for t in spec_trace) == r["verifying_sequence_steps"], spec_trace
        emitted = sum(t[7] for t in spec_trace)
        assert emitted == pytest.approx(
            r["mean_emitted_per_verify_step"] * r["verifying_sequence_steps"], abs=0.01
        )
        assert sum(t[6] for t in r["step_trace"]["base"]) == 0
        for trace in r["step_trace"].values():
            assert sum(t[3] for t in trace) == sum(t[4] for t in trace) > 0, trace
            for now, nxt in zip(trace, trace[1:], strict=False):
                if now[5] and nxt[1] == now[1] and nxt[2] > now[2]:
                    assert now[4] > 0, trace
    assert (tmp_path / "speculative.png").exists()


def test_ngram_chained_rows_count_sequence_steps(tmp_path):
    """n-gram on the embedded SmolLM2 with its steps chained on the device: one host step runs
    several passes, so coverage and tokens per sequence-step must count sequence-steps (they
    read 2.3-3.7 when they divided by host steps)."""
    cmd = [
        sys.executable, "-P", str(ROOT / "bench" / "speculative.py"), "--workloads", "ngram",
        "--ks", "3", "--batches", "1,2", "--max-tokens", "16", "--refill", "0",
        "--async-scheduling", "on", "--device-chain", "on", "--out", str(tmp_path),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, timeout=600)
    rows = json.loads((tmp_path / "speculative.json").read_text())["workloads"]["ngram"]["rows"]
    assert [(r["batch"], r["k"]) for r in rows] == [(1, 3), (2, 3)]
    for r in rows:
        assert r["identical_outputs"] and r["chained_steps"] > 0, r
        seq_steps = r["verifying_sequence_steps"] + sum(r["no_draft_sequence_steps"].values())
        assert r["draft_coverage"] == round(r["verifying_sequence_steps"] / seq_steps, 3) <= 1, r
        assert 1 <= r["tokens_per_seq_step"] <= r["k"] + 1, r
        # alpha over every asked sequence-step: the formula's tokens a step at it are the tokens
        # those steps gave (a step without a match gave 1), and it is below the verifications'
        asked = r["verifying_sequence_steps"] + r["no_draft_sequence_steps"]["unmatched"]
        tokens = r["verified_emitted_tokens"] + r["no_draft_sequence_steps"]["unmatched"]
        formula = sum(r["alpha_all_steps"] ** i for i in range(r["k"] + 1))
        assert formula == pytest.approx(tokens / asked, abs=1e-3), r
        assert r["alpha_all_steps"] <= r["alpha"] + 1e-4, r


def test_request_ms_per_token_charges_each_request_its_own_steps():
    """Per-request TPOT: a request that ended at step 1 is not charged for steps 2-3 (the
    whole-batch figure is); the prefill step (not pure decode) counts for neither."""
    sys.path.insert(0, str(ROOT / "bench"))
    from speculative_report import decode_ms_per_token, mean_request_ms_per_token
    from throughput_lib import EngineRun

    steps = [{"ms": 5.0, "pure_decode": False}] + [{"ms": 1.0, "pure_decode": True}] * 3
    run = EngineRun(1.0, 2, 6, 4, steps, token_ids=[[1, 2], [1, 2, 3, 4]], finish_step=[1, 3])
    # request 0: 1 ms over 1 decoded token; request 1: 3 ms over 3 -> 1.0 each
    assert mean_request_ms_per_token(run) == pytest.approx(1.0)
    assert decode_ms_per_token(run) == pytest.approx(3.0 / 2.0)  # 3 ms over (6 - 2) / 2 tokens a request


def _async_run(pass_ms: float, gain: int, applied: list[int], first_ms: float | None = None):
    """A batch-2 run after its prefill step: step i applies (waits for, then adds the KV tokens
    of) the `applied[i]` forward passes the step before launched, each `pass_ms` long and adding
    `gain` tokens a sequence; step i launches the next step's passes. `first_ms`: the first
    decode step's time where its passes, queued behind the prefill, partly ran before it."""
    from throughput_lib import EngineRun

    steps = [{"ms": 9.0, "batch": 2, "kv_tokens": 20, "pure_decode": False, "device_steps": 1,
              "applied_device_steps": 1}]  # fmt: skip
    kv = 20
    for i, passes in enumerate(applied):
        launched = applied[i + 1] if i + 1 < len(applied) else 0
        steps.append({
            "ms": pass_ms * passes, "batch": 2, "kv_tokens": kv, "pure_decode": True,
            "device_steps": launched, "applied_device_steps": passes,
        })  # fmt: skip
        kv += 2 * gain * passes
    if first_ms is not None:
        steps[1]["ms"] = first_ms
    return EngineRun(1.0, 2, 0, 20, steps)


def test_full_batch_ratio_splits_into_tokens_and_step_cost():
    """Over the full-batch window, measured / theory = (tokens a forward pass gave / the
    formula's) / (a verifying pass's time / a plain pass's): the split the table prints. The
    chain's lengths vary (4, 4, 1, 4, 2, 3 passes a step) and an async step launches the passes
    the next step applies: counted at launch, the window's passes were off by a step's. The
    first decode step is short (its passes partly ran under the prefill step): left out."""
    sys.path.insert(0, str(ROOT / "bench"))
    from speculative_report import full_batch_speedup, step_cost_split

    base = _async_run(1.0, 1, [1] * 6)
    fast = _async_run(1.5, 2, [4, 4, 1, 4, 2, 3], first_ms=2.0)  # a pass 1.5 ms, 2 tokens each
    split = step_cost_split(base, fast, 2, formula_tokens=2.5)
    assert split["verify_step_cost"] == pytest.approx(1.5)
    assert split["full_batch_tokens_per_device_step"] == pytest.approx(2.0)
    assert split["tokens_over_formula"] == pytest.approx(2.0 / 2.5, abs=1e-3)
    ratio = full_batch_speedup(base, fast, 2) / 2.5  # theory 2.5 at c = 0
    assert ratio == pytest.approx(2.0 / 1.5 / 2.5, abs=2e-3)
    assert ratio == pytest.approx(split["tokens_over_formula"] / split["verify_step_cost"], abs=2e-3)
    # results without per-step applied-pass counts (before 2026-12-06) leave the split out
    for s in fast.steps:
        del s["applied_device_steps"]
    assert step_cost_split(base, fast, 2, formula_tokens=2.5) == {}


def test_windows_recompute_a_row_from_its_step_traces():
    """speculative_report.recompute_row rebuilds both runs from a JSON row's step_trace and gives
    the row's full-batch columns as speculative_report computes them on the runs themselves."""
    sys.path.insert(0, str(ROOT / "bench"))
    from speculative_report import full_batch_speedup, recompute_row, step_cost_split, step_trace

    base = _async_run(1.0, 1, [1] * 6)
    fast = _async_run(1.5, 2, [4, 4, 1, 4, 2, 3], first_ms=2.0)
    row = {"batch": 2, "k": 2, "c": 0.0, "theoretical_speedup": 2.5}
    row["step_trace"] = json.loads(json.dumps({"base": step_trace(base), "spec": step_trace(fast)}))
    again = recompute_row(row)
    assert again["full_batch_over_theoretical"] == round(full_batch_speedup(base, fast, 2) / 2.5, 3)
    assert again["full_batch_alpha"] is None  # no per-step verification counts: the row's theory
    assert again["full_batch_theoretical_speedup"] == 2.5
    assert again["measured_speedup_full_batch"] == full_batch_speedup(base, fast, 2)
    window = ("full_batch_over_theoretical", "full_batch_alpha", "full_batch_theoretical_speedup")
    split = {
        k: again[k]
        for k in again
        if k not in (*window, "measured_speedup_full_batch") and not k.endswith("_all_steps")
    }
    assert split == step_cost_split(base, fast, 2, formula_tokens=2.5)
    assert again["verify_step_cost"] == pytest.approx(1.5)


def test_full_batch_theory_takes_the_window_alpha():
    """Acceptance grows over a response: the full-batch window (second full step to the last)
    is compared with the theory at the alpha of the verifications its steps applied, not the
    whole run's. Older traces without per-step counts give None (the run's alpha is used)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from speculative_report import full_batch_alpha, solve_alpha, step_trace, steps_from_trace
    from throughput_lib import EngineRun

    fast = _async_run(1.5, 2, [4, 4, 4, 4, 4], first_ms=2.0)
    # (verifying sequence-steps, tokens they emitted) per step: 1.5 a step first, then 3.0
    counts = [(0, 0), (8, 12), (8, 24), (8, 24), (8, 24), (8, 24)]
    for step, (verified, emitted) in zip(fast.steps, counts, strict=True):
        step["verified"], step["emitted"] = verified, emitted
    # the window's steps are full steps 2-4 (indices 2..4): 24 verifications, 72 tokens
    assert full_batch_alpha(fast, 2, 4) == pytest.approx(solve_alpha(3.0, 4))
    assert full_batch_alpha(fast, 2, 4) > solve_alpha((12 + 4 * 24) / 40, 4)  # the whole run's
    # a trace round-trips the counts; a trace from before them (6 columns) has no window alpha
    again = EngineRun(0.0, 0, 0, 0, steps_from_trace(json.loads(json.dumps(step_trace(fast)))))
    assert full_batch_alpha(again, 2, 4) == full_batch_alpha(fast, 2, 4)
    old = EngineRun(0.0, 0, 0, 0, steps_from_trace([t[:6] for t in step_trace(fast)]))
    assert full_batch_alpha(old, 2, 4) is None
    with pytest.raises(ValueError):
        steps_from_trace([[*t, 0] for t in step_trace(fast)])


def test_median_round_skips_host_bound_baselines():
    """A round whose plain run left the device idle > 10% of the time compares against the
    host's Python, not the device: the row is the median of the device-bound rounds, and is
    flagged when every round was host-bound. Off CUDA (no idle figure) every round counts."""
    sys.path.insert(0, str(ROOT / "bench"))
    from speculative import median_round

    def trial(ratio, idle):
        return {
            "measured_over_theoretical": ratio,
            "full_batch_over_theoretical": ratio,
            "base_gpu_idle_fraction": idle,
        }

    # the host-bound rounds read high (a slow baseline); the median of all five would be 1.2
    row = median_round(
        [trial(1.3, 0.3), trial(0.88, 0.03), trial(1.2, 0.25), trial(0.9, 0.05), trial(0.86, 0.04)]
    )
    assert row["measured_over_theoretical"] == 0.88 and not row["baseline_host_bound"]
    assert row["rounds"] == 5 and row["rounds_device_bound"] == 3
    assert row["rounds_base_gpu_idle_fraction"] == [0.3, 0.03, 0.25, 0.05, 0.04]
    row = median_round([trial(1.3, 0.3), trial(1.1, 0.2), trial(1.2, 0.25)])
    assert row["measured_over_theoretical"] == 1.2 and row["baseline_host_bound"]
    row = median_round([trial(0.7, None), trial(0.9, None), trial(0.8, None)])
    assert row["measured_over_theoretical"] == 0.8 and row["rounds_device_bound"] == 3


def test_alpha_all_steps_counts_a_step_without_a_draft_as_one_token():
    """A sequence-step the proposer had no draft for gave 1 token: alpha over every asked step
    is solved from (emitted + unmatched) / (verified + unmatched); without such steps it is the
    verifications' alpha, and with none at all there is none."""
    sys.path.insert(0, str(ROOT / "bench"))
    from speculative_report import alpha_all_steps, solve_alpha

    assert alpha_all_steps(10, 30, 0, 4) == pytest.approx(solve_alpha(3.0, 4))
    assert alpha_all_steps(8, 30, 2, 4) == pytest.approx(solve_alpha(32 / 10, 4))
    assert alpha_all_steps(8, 30, 2, 4) < alpha_all_steps(8, 30, 0, 4)
    assert alpha_all_steps(0, 0, 5, 4) == pytest.approx(0.0, abs=1e-9)  # no draft ever: 1 token a step
    assert alpha_all_steps(0, 0, 0, 4) is None


def test_full_batch_all_steps_ratio_is_the_verification_cost_at_zero_c():
    """At c = 0 the theory at the window's alpha over every sequence-step is the tokens a pass
    gave, so the full-batch ratio against it is a plain pass's time over a verifying pass's
    (1 / vstep), whatever share of the steps had a draft."""
    sys.path.insert(0, str(ROOT / "bench"))
    from speculative_report import full_batch_columns

    base = _async_run(1.0, 1, [1] * 6)
    fast = _async_run(1.5, 2, [4, 4, 1, 4, 2, 3], first_ms=2.0)
    cols = full_batch_columns(base, fast, 2, 4, 0.0, run_theory=3.0)
    assert cols["full_batch_theoretical_speedup_all_steps"] == pytest.approx(2.0, abs=2e-3)
    assert cols["full_batch_over_theoretical_all_steps"] == pytest.approx(1 / 1.5, abs=3e-3)
    assert cols["full_batch_over_theoretical_all_steps"] == pytest.approx(
        1 / cols["verify_step_cost"], abs=3e-3
    )
