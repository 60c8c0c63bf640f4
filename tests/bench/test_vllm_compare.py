"""bench/vllm_compare.py: the ours-vs-vLLM table from the GPU run's JSON files (CPU, synthetic)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def vc(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("vllm_compare")


OURS = {
    "device": "NVIDIA H100 80GB HBM3",
    "torch": "2.11.0+cu130",
    "offline": {"output_tok_s": 9000.0},
    "decode_vs_floor": {"single_stream": {"median_step_ms": 6.0}, "batch256": {"median_step_ms": 40.0}},
    "vllm_peer_methods": {
        "single_stream": {"ms_per_token": 6.5, "ttft_ms": 50.0},
        "batch_decode": {"decode_step_ms": 42.0},
    },
}
VLLM = {
    "gpu": "NVIDIA H100 80GB HBM3, 81559 MiB, 580.159.04",
    "vllm": "0.26.0",
    "torch": "2.11.0+cu130",
    "offline": {"output_tok_s": 10000.0},
    "single_stream": {"ms_per_token": 6.0, "t1_s": [0.05, 0.04, 0.06]},
    "batch256_decode": {"decode_step_ms": 35.0},
    "errors": {},
}


def _write(d: Path, name: str, payload: dict) -> None:
    (d / name).parent.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(json.dumps(payload))


def test_speed_is_above_one_when_ours_is_faster(vc):
    assert vc.speed(200.0, 100.0, higher_is_better=True) == 2.0
    assert vc.speed(5.0, 10.0, higher_is_better=False) == 2.0
    assert vc.speed(None, 10.0, higher_is_better=False) is None
    assert vc.speed(5.0, 0.0, higher_is_better=True) is None


def test_offline_rows_use_the_peer_method_numbers(vc, tmp_path):
    _write(tmp_path, "throughput_gpu.json", OURS)
    _write(tmp_path, "vllm/vllm_peer.json", VLLM)
    result = vc.compare(tmp_path)
    rows = {r["metric"]: r for r in result["offline"]}
    assert rows["offline_tok_s"]["speed_vs_vllm"] == pytest.approx(0.9)
    assert rows["single_ms_per_token"]["ours"] == 6.5
    assert rows["single_ms_per_token"]["speed_vs_vllm"] == pytest.approx(6.0 / 6.5)
    assert rows["batch256_step_ms"]["speed_vs_vllm"] == pytest.approx(35.0 / 42.0)
    assert rows["ttft_ms"]["vllm"] == 50.0  # median of the 1-token runs
    assert rows["ttft_ms"]["speed_vs_vllm"] == pytest.approx(1.0)
    assert rows["offline_tok_s"]["vllm_match_ours"] is None
    assert "missing: vllm_match/vllm_peer.json" in result["notes"]
    assert result["ours_own_step_medians"] == {"single": 6.0, "batch256": 40.0}


def test_serving_rows_pair_the_engines_per_concurrency(vc):
    level = dict(ttft_p50=0.1, ttft_p99=0.2, itl_p50=0.01, itl_p99=0.02)
    s = {
        "results": [
            dict(mode="http/vllm", concurrency=16, tokens_per_second=1000.0, **level),
            dict(mode="http/ours", concurrency=16, tokens_per_second=1100.0, **level),
            dict(mode="http/vllm", concurrency=1, tokens_per_second=100.0, **level),
        ]
    }
    rows = vc.serving_rows(s)
    assert [r["concurrency"] for r in rows] == [1, 16]
    assert rows[0]["ours_tokens_per_second"] is None and rows[0]["speed_tok_s"] is None
    assert rows[1]["speed_tok_s"] == pytest.approx(1.1)


def test_main_writes_table_json_and_plot(vc, tmp_path):
    _write(tmp_path, "throughput_gpu.json", OURS)
    _write(tmp_path, "vllm/vllm_peer.json", VLLM)
    _write(tmp_path, "vllm_match/vllm_peer.json", VLLM | {"errors": {"batch256_decode": "boom"}})
    assert vc.main(["--dir", str(tmp_path)]) == 0
    text = (tmp_path / "vllm_compare_summary.txt").read_text()
    assert "| offline output tok/s (1,000 x ~512 -> 256) | tok/s | 9,000.0 | 10,000.0 | 0.90x |" in text
    assert "vLLM --match-ours batch256_decode: boom" in text
    assert json.loads((tmp_path / "vllm_compare.json").read_text())["vllm_version"] == "0.26.0"
    assert (tmp_path / "vllm_compare.png").read_bytes()[:4] == b"\x89PNG"
