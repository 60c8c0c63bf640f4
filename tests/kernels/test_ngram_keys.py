"""Device n-gram drafts with match keys (engine.spec_decode.ngram_keys): ids first, keys where the
ids match nowhere. The torch version and the Triton kernel (TRITON_INTERPRET=1, in a subprocess)
against find_ngram_draft with the same table, tie ranking on, over steps that accept drafts."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedinfer.engine.spec_decode.ngram import CONTEXT_WINDOW, MAX_RANKED_TIES, find_ngram_draft
from pagedinfer.kernels import ngram_ops, ngram_reference
from tests.kernels.interpreter_run import run_interpreted
from tests.kernels.test_ngram_ranking import drafts_of

K = 3
# Histories use ids 0..5; the emitted tokens also 6..11, which fold onto 0..5 (id % 6). Keys are
# not ids (100 + ...), so a search that compared an id with a key would find nothing.
TABLE = np.array([100 + i % 6 for i in range(12)], dtype=np.int32)
TRIALS = 500
KERNEL_TRIALS = 100


def case(trial: int, num_seqs: int = 3, cap: int = 72):
    """Repetitive histories over 0..5 and, per sequence, the K + 1 argmax rows of a step whose
    first `accept` drafts are right (tokens from 0..11: a new id often has no exact match)."""
    rng = random.Random(trial)
    vocab = rng.choice([3, 4, 6])
    hists, rows, drafts, accepts = [], [], [], []
    for _ in range(rng.randint(1, num_seqs)):
        n = rng.randint(1, cap - 2 * (K + 1))
        period = [rng.randrange(vocab) for _ in range(rng.randint(1, 9))]
        h = (period * cap)[:n]
        for _ in range(rng.randint(0, 4)):
            h[rng.randrange(n)] = rng.randrange(vocab)
        target = [rng.randrange(12) for _ in range(K + 1)]
        accept = rng.randint(0, K)
        draft = [t if i < accept else (t + 1) % 12 for i, t in enumerate(target[:K])]
        hists.append(h), rows.append(target), drafts.append(draft), accepts.append(accept)
    ngram_min = rng.choice([1, 1, 2])
    return hists, rows, drafts, accepts, ngram_min, rng.choice([ngram_min, 3]), cap


def tensors(hists, rows, drafts, cap):
    num = len(hists)
    history = torch.zeros((num, cap), dtype=torch.int32)
    for b, h in enumerate(hists):
        history[b, : len(h)] = torch.tensor(h, dtype=torch.int32)
    lens = torch.tensor([len(h) for h in hists], dtype=torch.int32)
    argmax = torch.tensor([t for r in rows for t in r], dtype=torch.int64)
    first_rows = torch.arange(num) * (K + 1)
    return argmax, first_rows, torch.tensor(drafts), torch.full((num,), K), history, lens


def host_rule(hists, rows, accepts, lo, hi, table=TABLE) -> list[list[int]]:
    out = []
    for h, r, a in zip(hists, rows, accepts, strict=True):
        tokens = np.array([*h, *r[: a + 1]], dtype=np.int64)
        out.append(find_ngram_draft(tokens, lo, hi, K, CONTEXT_WINDOW, table).tolist())
    return out


def _table() -> torch.Tensor:
    return torch.from_numpy(TABLE)


def test_torch_keys_are_the_host_rule():
    keyed = 0
    for trial in range(TRIALS):
        hists, rows, drafts, accepts, lo, hi, cap = case(trial)
        args = tensors(hists, rows, drafts, cap)
        out = ngram_reference.accept_and_propose(
            *args, lo, hi, K, CONTEXT_WINDOW, MAX_RANKED_TIES, match_keys=_table()
        )
        assert out.num_emitted.tolist() == [a + 1 for a in accepts]
        want = host_rule(hists, rows, accepts, lo, hi)
        assert drafts_of(out) == want, (trial, hists, rows, accepts, lo, hi)
        keyed += sum(a != b for a, b in zip(want, host_rule(hists, rows, accepts, lo, hi, None), strict=True))
    assert keyed > TRIALS // 4  # the keys drafted where the ids found nothing


def test_ids_go_first():
    """An exact match of 1 token wins over a longer match of keys: keys only fill in."""
    table = np.array([100 + i % 6 for i in range(12)], dtype=np.int32)
    # suffix 7 1: ids match "1" (then 5); keys match "7 1" as "1 1" (then 2)
    tokens = np.array([1, 1, 2, 0, 1, 5, 3, 7, 1])
    assert find_ngram_draft(tokens, 1, 2, 1, 0, table).tolist() == [5]
    assert find_ngram_draft(np.array([3, 1, 4, 0, 7]), 1, 2, 1, 0, table).tolist() == [4]  # keys: 7 ~ 1
    hist = torch.tensor([tokens.tolist()], dtype=torch.int32)
    out = ngram_reference.accept_and_propose(
        torch.tensor([1]), torch.tensor([0]), torch.zeros((1, 1), dtype=torch.int64), torch.tensor([0]),
        hist[:, :-1].contiguous(), torch.tensor([8], dtype=torch.int32), 1, 2, 1, match_keys=_table(),
    )  # fmt: skip
    assert drafts_of(out) == [[5]]


def test_checks_reject_a_bad_table():
    hists, rows, drafts, _, _, _, cap = case(3)
    args = (*tensors(hists, rows, drafts, cap), 1, 2, K)
    with pytest.raises(ValueError, match="match_keys must be a 1-dim torch.int32"):
        ngram_ops.accept_and_propose(*args, match_keys=_table().long())
    with pytest.raises(ValueError, match="non-empty"):
        ngram_ops.accept_and_propose(*args, match_keys=_table()[:0])


def main(path: str) -> None:
    from pagedinfer.kernels import ngram_propose

    results = {}
    for trial in range(KERNEL_TRIALS):
        hists, rows, drafts, _, lo, hi, _ = case(trial, num_seqs=2, cap=40)
        args = (*tensors(hists, rows, drafts, 40), lo, hi, K, CONTEXT_WINDOW, MAX_RANKED_TIES)
        out = ngram_propose.accept_and_propose(*args, block=8, match_keys=_table())  # several tiles
        results[str(trial)] = drafts_of(out)
    # ids past the table (garbage): clamped, as the torch version clamps them
    garbage = ([[7, 9, 3, 7, 1, 8, 9, 40]], [[41, 2, 5, 1]], [[41, 2, 0]])
    args = (*tensors(*garbage, 16), 1, 3, K, CONTEXT_WINDOW, MAX_RANKED_TIES)
    results["garbage"] = drafts_of(ngram_propose.accept_and_propose(*args, block=8, match_keys=_table()))
    Path(path).write_text(json.dumps(results))


def test_triton_keys_are_the_host_rule(tmp_path):
    pytest.importorskip("triton")
    got = run_interpreted("tests.kernels.test_ngram_keys", tmp_path / "results.json")
    keyed = 0
    for trial in range(KERNEL_TRIALS):
        hists, rows, _, accepts, lo, hi, _ = case(trial, num_seqs=2, cap=40)
        want = host_rule(hists, rows, accepts, lo, hi)
        assert got[str(trial)] == want, (trial, hists, rows, accepts, lo, hi)
        keyed += want != host_rule(hists, rows, accepts, lo, hi, None)
    assert keyed > KERNEL_TRIALS // 5
    garbage = ([[7, 9, 3, 7, 1, 8, 9, 40]], [[41, 2, 5, 1]], [[41, 2, 0]])
    want = ngram_reference.accept_and_propose(
        *tensors(*garbage, 16), 1, 3, K, CONTEXT_WINDOW, MAX_RANKED_TIES, match_keys=_table()
    )
    assert got["garbage"] == drafts_of(want) == host_rule(garbage[0], garbage[1], [2], 1, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_keys_are_the_host_rule():
    table = _table().cuda()
    for trial in range(200):
        hists, rows, drafts, accepts, lo, hi, _ = case(trial, num_seqs=8, cap=300)
        args = [t.cuda() for t in tensors(hists, rows, drafts, 300)]
        out = ngram_ops.accept_and_propose(
            *args, lo, hi, K, "triton", CONTEXT_WINDOW, MAX_RANKED_TIES, match_keys=table
        )
        assert drafts_of(out) == host_rule(hists, rows, accepts, lo, hi), trial


if __name__ == "__main__":
    main(sys.argv[1])
