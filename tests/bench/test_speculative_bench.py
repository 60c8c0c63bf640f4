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
