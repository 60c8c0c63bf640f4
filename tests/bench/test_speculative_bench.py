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
    assert (tmp_path / "speculative.png").exists()


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


def test_full_batch_ratio_splits_into_tokens_and_step_cost():
    """Over the full-batch window, measured / theory = (tokens a forward pass gave / the
    formula's) / (a verifying pass's time / a plain pass's): the split the table prints."""
    sys.path.insert(0, str(ROOT / "bench"))
    from speculative_report import full_batch_speedup, step_cost_split
    from throughput_lib import EngineRun

    def run(ms: float, passes: int, gain: int) -> EngineRun:
        # batch 2: a prefill step, then four full-batch steps, each `passes` forward passes
        # adding `gain` KV tokens per sequence
        steps = [{"ms": 9.0, "batch": 2, "kv_tokens": 20, "pure_decode": False, "device_steps": 1}]
        steps += [
            {
                "ms": ms,
                "batch": 2,
                "kv_tokens": 20 + 2 * gain * i,
                "pure_decode": True,
                "device_steps": passes,
            }
            for i in range(4)
        ]
        return EngineRun(1.0, 2, 0, 20, steps)

    base, fast = run(1.0, 1, 1), run(6.0, 4, 10)  # a verifying pass 1.5 ms, 2.5 tokens each
    split = step_cost_split(base, fast, 2, formula_tokens=3.0)
    assert split["verify_step_cost"] == pytest.approx(1.5)
    assert split["full_batch_tokens_per_device_step"] == pytest.approx(2.5)
    assert split["tokens_over_formula"] == pytest.approx(2.5 / 3.0, abs=1e-3)
    ratio = full_batch_speedup(base, fast, 2) / 3.0  # theory 3.0 at c = 0
    assert ratio == pytest.approx(split["tokens_over_formula"] / split["verify_step_cost"], abs=2e-3)
    # runs without per-step pass counts (older results) leave the split out
    for s in fast.steps:
        del s["device_steps"]
    assert step_cost_split(base, fast, 2, formula_tokens=3.0) == {}
