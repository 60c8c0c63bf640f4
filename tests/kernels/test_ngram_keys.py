"""Device n-gram drafts over match keys (engine.spec_decode.ngram_keys): the torch version and the
Triton kernel (TRITON_INTERPRET=1, in a subprocess) against find_ngram_draft with the same keys,
tie ranking on, on repetitive histories where folding ids into fewer keys changes the drafts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedinfer.engine.spec_decode.ngram import CONTEXT_WINDOW, MAX_RANKED_TIES, find_ngram_draft
from pagedinfer.kernels import ngram_ops, ngram_reference
from tests.kernels.interpreter_run import run_interpreted
from tests.kernels.test_ngram_ranking import K, case, drafts_of, tensors

# The histories of test_ngram_ranking.case use ids 0..5: three keys of two ids each. Ids 6 and up
# (only the garbage case below) are clamped to the table's last entry.
TABLE = np.array([0, 0, 2, 2, 4, 4], dtype=np.int32)
TRIALS = 600
KERNEL_TRIALS = 120


def host_rule(hists, extra, ngram_min, ngram_max) -> list[list[int]]:
    out = []
    for h, e in zip(hists, extra, strict=True):
        tokens = np.array([*h, e], dtype=np.int64)
        keys = np.take(TABLE, tokens, mode="clip")
        out.append(find_ngram_draft(tokens, ngram_min, ngram_max, K, CONTEXT_WINDOW, keys).tolist())
    return out


def unkeyed_rule(hists, extra, ngram_min, ngram_max) -> list[list[int]]:
    return [
        find_ngram_draft(np.array([*h, e], dtype=np.int64), ngram_min, ngram_max, K, CONTEXT_WINDOW).tolist()
        for h, e in zip(hists, extra, strict=True)
    ]


def _table() -> torch.Tensor:
    return torch.from_numpy(TABLE)


def test_torch_keys_are_the_host_rule():
    differ = 0
    for trial in range(TRIALS):
        hists, extra, lo, hi, cap = case(trial)
        out = ngram_reference.accept_and_propose(
            *tensors(hists, extra, cap), lo, hi, K, CONTEXT_WINDOW, MAX_RANKED_TIES, match_keys=_table()
        )
        want = host_rule(hists, extra, lo, hi)
        assert drafts_of(out) == want, (trial, hists, extra, lo, hi)
        differ += sum(a != b for a, b in zip(want, unkeyed_rule(hists, extra, lo, hi), strict=True))
    assert differ > TRIALS // 4  # the keys decided many of these drafts


def test_checks_reject_a_bad_table():
    args = (*tensors([[1, 2, 1]], [2], 8), 1, 2, K)
    with pytest.raises(ValueError, match="match_keys must be a 1-dim torch.int32"):
        ngram_ops.accept_and_propose(*args, match_keys=_table().long())
    with pytest.raises(ValueError, match="non-empty"):
        ngram_ops.accept_and_propose(*args, match_keys=_table()[:0])
    ok = ngram_ops.accept_and_propose(*args, backend="reference", match_keys=_table())
    assert drafts_of(ok) == host_rule([[1, 2, 1]], [2], 1, 2)


def main(path: str) -> None:
    from pagedinfer.kernels import ngram_propose

    results = {}
    for trial in range(KERNEL_TRIALS):
        hists, extra, lo, hi, cap = case(trial, num_seqs=2, cap=40)
        args = (*tensors(hists, extra, cap), lo, hi, K, CONTEXT_WINDOW, MAX_RANKED_TIES)
        out = ngram_propose.accept_and_propose(*args, block=8, match_keys=_table())  # several tiles
        results[str(trial)] = drafts_of(out)
    # ids past the table (garbage): clamped, as the torch version clamps them
    args = (*tensors([[7, 9, 3, 7, 1, 8, 9]], [9], 16), 1, 3, K, CONTEXT_WINDOW, MAX_RANKED_TIES)
    results["garbage"] = drafts_of(ngram_propose.accept_and_propose(*args, block=8, match_keys=_table()))
    Path(path).write_text(json.dumps(results))


def test_triton_keys_are_the_host_rule(tmp_path):
    pytest.importorskip("triton")
    got = run_interpreted("tests.kernels.test_ngram_keys", tmp_path / "results.json")
    for trial in range(KERNEL_TRIALS):
        hists, extra, lo, hi, _ = case(trial, num_seqs=2, cap=40)
        assert got[str(trial)] == host_rule(hists, extra, lo, hi), (trial, hists, extra, lo, hi)
    garbage = ([[7, 9, 3, 7, 1, 8, 9]], [9], 16)
    want = ngram_reference.accept_and_propose(
        *tensors(*garbage), 1, 3, K, CONTEXT_WINDOW, MAX_RANKED_TIES, match_keys=_table()
    )
    assert got["garbage"] == drafts_of(want) == host_rule(garbage[0], garbage[1], 1, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_keys_are_the_host_rule():
    table = _table().cuda()
    for trial in range(200):
        hists, extra, lo, hi, cap = case(trial, num_seqs=8, cap=300)
        args = [t.cuda() for t in tensors(hists, extra, cap)]
        out = ngram_ops.accept_and_propose(
            *args, lo, hi, K, "triton", CONTEXT_WINDOW, MAX_RANKED_TIES, match_keys=table
        )
        assert drafts_of(out) == host_rule(hists, extra, lo, hi), trial


if __name__ == "__main__":
    main(sys.argv[1])
