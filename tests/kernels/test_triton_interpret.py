"""Every Triton kernel under TRITON_INTERPRET=1 against the float64 reference, on the CPU.

The interpreter must be enabled before triton is imported, so the cases run in one subprocess
(kernels/testing.py's main) and each case's result is checked here. The decode kernel's
small-grid path (DecodeConfig.q_in_loop, the CUDA default under SMALL_GRID programs, with and
without capacity_splits, pdl_prologue and prefetch_ids) runs its own cases the same way: `python -m tests.kernels.test_triton_interpret
OUT.json` runs SMALL_GRID_CASES with that config forced on.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

from pagedinfer.kernels.testing import INTERPRETER_CASES, INTERPRETER_DTYPES, AttentionCase, run_case
from tests.kernels.interpreter_run import run_interpreted, run_interpreter_cases

pytest.importorskip("triton")

CASE_IDS = [
    (case.name, str(dtype).removeprefix("torch."))
    for case in INTERPRETER_CASES
    for dtype in INTERPRETER_DTYPES
]

_C = AttentionCase
# Small-grid path (the CUDA default under SMALL_GRID programs: query loaded in the loop, 32-token
# tiles), with and without capacity splits (the table is wider than most contexts here, so those
# splits and tiles past a context are empty): split token counts that are not a multiple of the
# tile, one-tile splits, empty sequences, tiles spanning several blocks or inside one, shared
# prefixes; and the same with pdl_prologue (first tile peeled, the newest token's K/V loaded
# apart; no gdc_wait in the interpreter), and with prefetch_ids (the next tile's block ids loaded
# one iteration early). Entries: (case, block_n, capacity_splits, pdl_prologue[, prefetch_ids]).
SMALL_GRID_CASES = (
    (_C("small_split1", "decode", (1, 15, 16, 17, 33, 70), num_heads=9, num_kv_heads=3, num_splits=1), 16, True, False),
    (_C("small_ragged_splits", "decode", (0, 1, 70, 130), num_splits=3, shared_blocks=2), 16, False, False),
    (_C("small_ragged_splits_cap", "decode", (0, 1, 70, 130), num_splits=3, shared_blocks=2), 16, True, False),
    (_C("small_one_tile_splits", "decode", (64, 61), num_heads=8, num_kv_heads=2, num_splits=4), 16, False, False),
    (_C("small_auto_splits", "decode", (200, 37), num_heads=8, num_kv_heads=2), 32, False, False),
    (_C("small_bs8_d128_cap", "decode", (47, 100), num_heads=8, num_kv_heads=2, head_dim=128, block_size=8,
        num_splits=2), 32, True, False),
    (_C("small_bs64_fused_cap", "decode", (3, 65, 100), num_heads=16, num_kv_heads=1, block_size=64,
        num_splits=2, merge="fused", repeat_splits=(1, 5)), 16, True, False),
    (_C("small_d80_pdl", "decode", (9, 24, 31), num_heads=4, num_kv_heads=4, head_dim=80, num_splits=2,
        merge="pdl"), 16, False, False),
    # bounded: splits sized from max_context_len (below the table's width), not the table
    (_C("small_bounded_cap", "decode", (0, 1, 70, 130), num_splits=3, shared_blocks=2, max_context_len=130),
        16, True, False),
    (_C("small_bounded_loose_cap", "decode", (47, 100), num_heads=8, num_kv_heads=2, head_dim=128, block_size=8,
        max_context_len=103), 32, True, False),
    (_C("pdl_split1", "decode", (1, 15, 16, 17, 33, 70), num_heads=9, num_kv_heads=3, num_splits=1), 16, False, True),
    (_C("pdl_ragged_splits", "decode", (0, 1, 70, 130), num_splits=3, shared_blocks=2), 16, False, True),
    (_C("pdl_ragged_splits_cap", "decode", (0, 1, 70, 130), num_splits=3, shared_blocks=2), 16, True, True),
    (_C("pdl_one_tile_splits", "decode", (64, 61, 2), num_heads=8, num_kv_heads=2, num_splits=4), 16, False, True),
    (_C("pdl_auto_splits_bs8", "decode", (200, 37), num_heads=8, num_kv_heads=2, block_size=8), 32, False, True),
    (_C("pdl_bs64_fused_cap", "decode", (3, 65, 100), num_heads=16, num_kv_heads=1, block_size=64,
        num_splits=2, merge="fused", repeat_splits=(1, 5)), 16, True, True),
    (_C("prefetch_split1", "decode", (1, 15, 16, 17, 33, 70), num_heads=9, num_kv_heads=3, num_splits=1),
        16, True, False, True),
    (_C("prefetch_ragged_splits", "decode", (0, 1, 70, 130), num_splits=3, shared_blocks=2), 16, False, False, True),
    (_C("prefetch_bounded_cap", "decode", (0, 1, 70, 130), num_splits=3, shared_blocks=2, max_context_len=130),
        16, True, False, True),
    (_C("prefetch_bs8_d128_cap", "decode", (47, 100), num_heads=8, num_kv_heads=2, head_dim=128, block_size=8,
        num_splits=2), 32, True, False, True),
    (_C("prefetch_pdl_bs64_fused", "decode", (3, 65, 100), num_heads=16, num_kv_heads=1, block_size=64,
        num_splits=2, merge="fused", repeat_splits=(1, 5)), 16, True, True, True),
)  # fmt: skip
SMALL_GRID_IDS = [f"{case.name}-bn{block_n}" for case, block_n, *_ in SMALL_GRID_CASES]


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory) -> dict[tuple[str, str], dict]:
    return run_interpreter_cases("pagedinfer.kernels.testing", tmp_path_factory.mktemp("interp"))


@pytest.mark.parametrize("name,dtype", CASE_IDS, ids=[f"{n}-{d}" for n, d in CASE_IDS])
def test_triton_kernel_matches_reference(interpreter_results, name, dtype):
    result = interpreter_results[(name, dtype)]
    assert result["rel_err"] <= result["tolerance"], result


@pytest.fixture(scope="module")
def small_grid_results(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("interp_small_grid") / "results.json"
    return {r["id"]: r for r in run_interpreted("tests.kernels.test_triton_interpret", out)}


@pytest.mark.parametrize("case_id", SMALL_GRID_IDS)
def test_decode_small_grid_path_matches_reference(small_grid_results, case_id):
    result = small_grid_results[case_id]
    assert result["forced"], result  # the launcher really took the forced config
    assert result["rel_err"] <= result["tolerance"], result


def _run_small_grid_cases() -> list[dict]:
    """SMALL_GRID_CASES in fp32 with the small-grid config forced on (interpreter subprocess only)."""
    from pagedinfer.kernels import decode_attention as da

    results, original = [], da.default_config
    for i, (case, block_n, capacity, pdl, *prefetch) in enumerate(SMALL_GRID_CASES):
        used = []

        def forced(*args, block_n=block_n, capacity=capacity, pdl=pdl, prefetch=any(prefetch), used=used):
            used.append(True)
            changes = {
                "block_n": block_n,
                "q_in_loop": True,
                "capacity_splits": capacity,
                "pdl_prologue": pdl,
                "prefetch_ids": prefetch,
            }
            return dataclasses.replace(original(*args), min_split_tokens=block_n, **changes)

        da.default_config = forced
        try:
            result = dataclasses.asdict(run_case(case, torch.float32, "cpu", backend="triton", seed=100 + i))
        finally:
            da.default_config = original
        results.append({**result, "id": SMALL_GRID_IDS[i], "forced": bool(used)})
    return results


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(json.dumps(_run_small_grid_cases(), indent=1))
