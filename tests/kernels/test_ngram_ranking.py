"""Device n-gram drafts with the host proposer's tie-break (context_window > 0): equally long
matches ranked by context overlap among the latest max_ties, then the latest. The torch version
and the Triton kernel (TRITON_INTERPRET=1, in a subprocess) against find_ngram_draft itself, on
repetitive histories where the ranking changes the draft."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedinfer.engine.spec_decode.ngram import CONTEXT_WINDOW, MAX_RANKED_TIES, find_ngram_draft
from pagedinfer.kernels import ngram_reference
from tests.kernels.interpreter_run import run_interpreted

K = 3
# The last token 12 follows "1 .. 7" as it did at position 7 (then 10, 9, 9), but its latest
# occurrence follows eight 9s (then 11, 1, 2): ranked by context the older one wins.
TIE_CASE = ([[1, 2, 3, 4, 5, 6, 7, 12, 10, *[9] * 8, 12, 11, 1, 2, 3, 4, 5, 6, 7]], [12])
TIE_RANKED, TIE_LATEST = [10, 9, 9], [11, 1, 2]
# The same with six 9s: the two 12s end at 7 and 15, one lane of two tiles of 8 candidate ends
# (the kernel counts equally long matches per lane across tiles, and ranks only if there are two).
SAME_LANE_CASE = ([[1, 2, 3, 4, 5, 6, 7, 12, 10, *[9] * 6, 12, 11, 1, 2, 3, 4, 5, 6, 7]], [12])


def case(trial: int, num_seqs: int = 3, cap: int = 72):
    """Histories of a short random period with a few edits (many equally long matches)."""
    rng = random.Random(trial)
    vocab = rng.choice([2, 3, 4, 6])
    hists = []
    for _ in range(rng.randint(1, num_seqs)):
        n = rng.randint(1, cap - 10)
        period = [rng.randrange(vocab) for _ in range(rng.randint(1, 9))]
        h = (period * cap)[:n]
        for _ in range(rng.randint(0, 4)):
            h[rng.randrange(n)] = rng.randrange(vocab)
        hists.append(h)
    extra = [rng.randrange(vocab) for _ in hists]
    ngram_min = rng.choice([1, 1, 2])
    return hists, extra, ngram_min, rng.choice([ngram_min, 3]), cap


def tensors(hists, extra, cap):
    history = torch.zeros((len(hists), cap), dtype=torch.int32)
    for b, h in enumerate(hists):
        history[b, : len(h)] = torch.tensor(h, dtype=torch.int32)
    lens = torch.tensor([len(h) for h in hists], dtype=torch.int32)
    num = len(hists)
    no_drafts = (torch.zeros((num, K), dtype=torch.int64), torch.zeros(num, dtype=torch.int64))
    return (torch.tensor(extra, dtype=torch.int64), torch.arange(num), *no_drafts, history, lens)


def drafts_of(out) -> list[list[int]]:
    return [d if m else [] for d, m in zip(out.next_drafts.tolist(), out.has_match.tolist(), strict=True)]


def host_rule(hists, extra, ngram_min, ngram_max, window):
    return [
        find_ngram_draft(np.array([*h, e], dtype=np.int64), ngram_min, ngram_max, K, window).tolist()
        for h, e in zip(hists, extra, strict=True)
    ]


def test_torch_ranking_is_the_host_rule():
    ranked = 0
    for trial in range(1500):
        hists, extra, lo, hi, cap = case(trial)
        out = ngram_reference.accept_and_propose(
            *tensors(hists, extra, cap), lo, hi, K, CONTEXT_WINDOW, MAX_RANKED_TIES
        )
        want = host_rule(hists, extra, lo, hi, CONTEXT_WINDOW)
        assert drafts_of(out) == want, (trial, hists, extra, lo, hi)
        ranked += sum(a != b for a, b in zip(want, host_rule(hists, extra, lo, hi, 0), strict=True))
    assert ranked > 10  # the tie-break decided some of these drafts


def test_ties_ranked_only_among_the_latest():
    """An older match whose context is the suffix's wins the ranking, unless only the latest
    max_ties ties are ranked and it is not among them."""
    (history,), (x,) = TIE_CASE
    for ties, want in ((MAX_RANKED_TIES, TIE_RANKED), (1, TIE_LATEST)):
        out = ngram_reference.accept_and_propose(*tensors(*TIE_CASE, 64), 1, 1, K, CONTEXT_WINDOW, ties)
        assert drafts_of(out) == [want]
    assert host_rule(*TIE_CASE, 1, 1, CONTEXT_WINDOW) == [TIE_RANKED]
    assert host_rule(*TIE_CASE, 1, 1, 0) == [TIE_LATEST]


def main(path: str) -> None:
    from pagedinfer.kernels import ngram_propose

    results = {}
    for ties in (MAX_RANKED_TIES, 1):
        args = (*tensors(*TIE_CASE, 64), 1, 1, K, CONTEXT_WINDOW, ties)
        results[f"tie{ties}"] = drafts_of(ngram_propose.accept_and_propose(*args, block=8))
    args = (*tensors(*SAME_LANE_CASE, 64), 1, 1, K, CONTEXT_WINDOW, MAX_RANKED_TIES)
    results["same_lane"] = drafts_of(ngram_propose.accept_and_propose(*args, block=8))
    for trial in range(150):
        hists, extra, lo, hi, cap = case(trial, num_seqs=2, cap=40)
        args = (*tensors(hists, extra, cap), lo, hi, K, CONTEXT_WINDOW, MAX_RANKED_TIES)
        results[str(trial)] = drafts_of(ngram_propose.accept_and_propose(*args, block=8))  # several tiles
    Path(path).write_text(json.dumps(results))


def test_triton_ranking_is_the_host_rule(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "results.json"
    got = run_interpreted("tests.kernels.test_ngram_ranking", out)
    assert got[f"tie{MAX_RANKED_TIES}"] == [TIE_RANKED] and got["tie1"] == [TIE_LATEST]
    assert host_rule(*SAME_LANE_CASE, 1, 1, CONTEXT_WINDOW) == [TIE_RANKED]
    assert got["same_lane"] == [TIE_RANKED]
    for trial in range(150):
        hists, extra, lo, hi, _ = case(trial, num_seqs=2, cap=40)
        want = host_rule(hists, extra, lo, hi, CONTEXT_WINDOW)
        assert got[str(trial)] == want, (trial, hists, extra, lo, hi)


if __name__ == "__main__":
    main(sys.argv[1])
