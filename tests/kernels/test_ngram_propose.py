"""n-gram accept + propose (kernels/ngram_ops.py): the torch version against a Python oracle
(greedy acceptance + engine.spec_decode.ngram.find_ngram_draft with context_window=0), and the
Triton kernel under TRITON_INTERPRET=1 against the torch version, on the CPU.

The interpreter must be enabled before triton is imported, so the Triton cases run in one
subprocess (`python -m tests.kernels.test_ngram_propose OUT.json`) that rebuilds each case from
its seed and writes the kernel's outputs; the comparisons happen here. The GPU test (marker gpu)
runs production shapes on CUDA with host synchronization turned into errors.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedinfer.engine.spec_decode.ngram import find_ngram_draft
from pagedinfer.kernels import ngram_ops, ngram_reference
from tests.kernels.interpreter_run import run_interpreted

KINDS = ("small_vocab", "period", "distinct", "start_match", "planted", "short")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    seed: int
    num_seqs: int
    hist_cap: int  # L
    max_drafts: int  # K
    ngram_min: int
    ngram_max: int
    num_next: int
    block: int = 16  # Triton: candidate ends per tile (small: several tiles per row)


@dataclasses.dataclass
class Inputs:
    argmax: torch.Tensor
    first_rows: torch.Tensor
    drafts: torch.Tensor
    num_drafts: torch.Tensor
    history: torch.Tensor
    history_len: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The fields in argument order, not copied (dataclasses.astuple deep-copies)."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def clone(self, device: str = "cpu") -> Inputs:
        return Inputs(*(t.clone().to(device) for t in self.tensors()))


def _final_tokens(rng: random.Random, kind: str, n: int, ngram_max: int) -> list[int]:
    """A sequence of n tokens (history + emitted) shaped to exercise one part of the rule."""
    if kind == "period":  # period 1, 2 or 3 after a short distinct prefix
        base = [rng.randrange(100, 200) for _ in range(rng.choice([1, 2, 3]))]
        prefix = list(range(900, 900 + rng.randrange(4)))
        return (prefix + base * n)[:n]
    if kind == "distinct":  # no token repeats: no match
        start = rng.randrange(1000, 2000)
        return list(range(start, start + n))
    m = rng.randint(1, ngram_max)
    if kind == "start_match" and n >= 2 * m:  # the suffix also starts the sequence
        head = [rng.randrange(300, 400) for _ in range(m)]
        return head + list(range(5000, 5000 + n - 2 * m)) + head
    if kind == "planted" and n >= 3 * m + 2:  # equally long matches at several places
        pattern = [rng.randrange(300, 310) for _ in range(m)]
        out = []
        while len(out) < n - m:
            out += pattern + [rng.randrange(400, 420) for _ in range(rng.randrange(1, 4))]
        return out[: n - m] + pattern
    vocab = rng.choice([2, 3, 5])  # short, long and tied matches everywhere
    return [rng.randrange(vocab) for _ in range(n)]


def make_inputs(case: Case) -> Inputs:
    """Random inputs of one call: per sequence a final token sequence, split into the old history
    and the emitted tokens, with drafts that accept a chosen number of them."""
    rng = random.Random(case.seed)
    gen = torch.Generator().manual_seed(case.seed)
    num_seqs, hist_cap, max_drafts = case.num_seqs, case.hist_cap, case.max_drafts
    # Stale tokens past each length: reading them would create false matches.
    history = torch.randint(0, 3, (num_seqs, hist_cap), generator=gen, dtype=torch.int32)
    history_len = torch.zeros(num_seqs, dtype=torch.int32)
    drafts = torch.randint(0, 3, (num_seqs, max_drafts), generator=gen)
    num_drafts = torch.zeros(num_seqs, dtype=torch.int64)
    groups: list[list[int]] = []
    for b in range(num_seqs):
        mode = rng.choice(["none", "all", "partial", "partial"])
        nd = 0 if mode == "none" else rng.randint(1, max_drafts) if max_drafts else 0
        a = nd if mode in ("none", "all") else rng.randint(0, nd)
        kind = rng.choice(KINDS)
        room = hist_cap - (nd - a)  # old length + nd + 1 <= L
        n = (
            rng.randint(a + 1, min(room, a + 1 + case.ngram_min))
            if kind == "short"
            else rng.randint(a + 1, room)
        )
        tokens = _final_tokens(rng, kind, n, case.ngram_max)
        old_len = n - a - 1
        history[b, :old_len] = torch.tensor(tokens[:old_len], dtype=torch.int32)
        history_len[b] = old_len
        rows = tokens[old_len:] + [rng.randrange(3) for _ in range(nd - a)]  # [nd + 1]
        drafts[b, :a] = torch.tensor(rows[:a], dtype=torch.int64)
        if a < nd:
            drafts[b, a] = rows[a] + 1  # the first mismatch
            for j in range(a + 1, nd):  # later drafts may match again: acceptance has stopped
                if rng.random() < 0.5:
                    drafts[b, j] = rows[j]
        num_drafts[b] = nd
        groups.append(rows)
    # Groups in a random order, then a few spare rows: first_rows is arbitrary, not b's rank.
    order = list(range(num_seqs))
    rng.shuffle(order)
    argmax: list[int] = []
    first_rows = torch.zeros(num_seqs, dtype=torch.int64)
    for b in order:
        first_rows[b] = len(argmax)
        argmax += groups[b]
    argmax += [rng.randrange(3) for _ in range(rng.randrange(3))]
    return Inputs(
        torch.tensor(argmax, dtype=torch.int64), first_rows, drafts, num_drafts, history, history_len
    )


def oracle(
    inputs: Inputs, ngram_min: int, ngram_max: int, num_next: int, search: bool = True
) -> dict[str, list]:
    """Per sequence in Python: greedy acceptance, append, find_ngram_draft(context_window=0)
    (search False: no lookup, the next drafts are the last emitted token)."""
    argmax = inputs.argmax.tolist()
    out: dict[str, list] = {k: [] for k in ("num_emitted", "emitted", "next_drafts", "has_match", "history")}
    for b in range(inputs.drafts.shape[0]):
        first, nd = int(inputs.first_rows[b]), int(inputs.num_drafts[b])
        a = 0
        while a < nd and int(inputs.drafts[b, a]) == argmax[first + a]:
            a += 1
        emitted = argmax[first : first + a + 1]
        tokens = inputs.history[b, : int(inputs.history_len[b])].tolist() + emitted
        draft = find_ngram_draft(np.array(tokens, dtype=np.int32), ngram_min, ngram_max, num_next, 0)
        if not search:
            draft = draft[:0]
        out["num_emitted"].append(a + 1)
        out["emitted"].append(emitted + [0] * (inputs.drafts.shape[1] + 1 - len(emitted)))
        out["next_drafts"].append(draft.tolist() if draft.size else [emitted[-1]] * num_next)
        out["has_match"].append(bool(draft.size))
        out["history"].append(tokens)
    return out


def as_lists(result, inputs: Inputs) -> dict[str, list]:
    """A call's outputs and its updated history (up to history_len) as lists."""
    lens = inputs.history_len.tolist()
    return {
        "num_emitted": result.num_emitted.tolist(),
        "emitted": result.emitted.tolist(),
        "next_drafts": result.next_drafts.tolist(),
        "has_match": result.has_match.tolist(),
        "history": [row[:n] for row, n in zip(inputs.history.tolist(), lens, strict=True)],
    }


def run_reference(case: Case, search: bool = True) -> tuple[dict[str, list], Inputs]:
    inputs = make_inputs(case)
    updated = inputs.clone()
    result = ngram_ops.accept_and_propose(
        *updated.tensors(), case.ngram_min, case.ngram_max, case.num_next, backend="reference", search=search
    )
    assert result.num_emitted.dtype == torch.int64 and result.emitted.dtype == torch.int64
    assert result.next_drafts.dtype == torch.int64 and result.has_match.dtype == torch.bool
    assert tuple(result.emitted.shape) == (case.num_seqs, case.max_drafts + 1)
    assert tuple(result.next_drafts.shape) == (case.num_seqs, case.num_next)
    # Past the new lengths the rows are untouched.
    for b, n in enumerate(updated.history_len.tolist()):
        assert torch.equal(updated.history[b, n:], inputs.history[b, n:])
    return as_lists(result, updated), inputs


_C = Case
RANDOM_CASES = [
    _C(f"r{seed}", seed, num_seqs, hist_cap, max_drafts, lo, hi, num_next)
    for seed, (num_seqs, hist_cap, max_drafts, lo, hi, num_next) in enumerate(
        [
            (16, 24, 4, 1, 1, 3),
            (16, 40, 4, 1, 3, 4),
            (16, 64, 8, 2, 4, 8),
            (16, 64, 0, 1, 2, 5),
            (12, 30, 3, 3, 8, 7),
            (16, 100, 5, 1, 8, 1),
            (8, 12, 2, 2, 2, 6),
            (24, 200, 8, 1, 5, 8),
        ]
        * 4
    )
]


@pytest.mark.parametrize("case", RANDOM_CASES, ids=[c.name for c in RANDOM_CASES])
def test_reference_matches_oracle(case):
    got, inputs = run_reference(case)
    assert got == oracle(inputs, case.ngram_min, case.ngram_max, case.num_next)


@pytest.mark.parametrize("case", RANDOM_CASES[:8], ids=[c.name for c in RANDOM_CASES[:8]])
def test_reference_full_width_matches_oracle(case, monkeypatch):
    """The search over every column (the path off the CPU) equals the trimmed one's oracle."""
    monkeypatch.setattr(ngram_reference, "_search_width", lambda tokens, last: tokens.shape[1])
    got, inputs = run_reference(case)
    assert got == oracle(inputs, case.ngram_min, case.ngram_max, case.num_next)


@pytest.mark.parametrize("case", RANDOM_CASES[:8], ids=[c.name for c in RANDOM_CASES[:8]])
def test_reference_without_search_accepts_only(case):
    """search=False (a draft model's chain): the same acceptance and history, no lookup."""
    expect, inputs = run_reference(case, search=False)
    assert expect == oracle(inputs, case.ngram_min, case.ngram_max, case.num_next, search=False)
    searched, _ = run_reference(case)
    assert any(searched["has_match"])  # the cases do hold matches: skipping them is visible
    assert {k: v for k, v in expect.items() if k not in ("next_drafts", "has_match")} == {
        k: v for k, v in searched.items() if k not in ("next_drafts", "has_match")
    }


def test_random_cases_cover_the_rule():
    """The random corpus holds matches and misses, no drafts, all rejected, all 8 accepted, and
    drafts that repeat tokens (periodic extension)."""
    has, num_emitted, wrapped = set(), set(), 0
    for case in RANDOM_CASES:
        inputs = make_inputs(case)
        ref = oracle(inputs, case.ngram_min, case.ngram_max, case.num_next)
        has |= set(ref["has_match"])
        num_emitted |= {
            (n, n - 1 == nd) for n, nd in zip(ref["num_emitted"], inputs.num_drafts.tolist(), strict=True)
        }
        wrapped += sum(
            len(set(d)) < len(d) for d, h in zip(ref["next_drafts"], ref["has_match"], strict=True) if h
        )
    assert has == {True, False} and wrapped > 20
    assert {(1, True), (1, False), (9, True)} <= num_emitted


# (tokens, ngram_min, ngram_max, num_next, next drafts or None for no match)
RULE_CASES = [
    ([7, 1, 7, 2, 7], 1, 2, 4, [2, 7, 2, 7]),  # tie: the latest, periodic
    ([5, 6, 9, 1, 6, 2, 5, 6], 1, 3, 3, [9, 1, 6]),  # the longest beats a later one
    ([4, 8, 4, 8, 4], 1, 8, 5, [8, 4, 8, 4, 8]),  # period 2
    ([3, 3, 3], 1, 8, 4, [3, 3, 3, 3]),  # period 1
    ([1, 2, 3, 9, 8, 1, 2], 2, 3, 3, [3, 9, 8]),  # the match starts the sequence
    ([1, 2, 7, 1, 2, 0, 1, 2], 1, 3, 2, [0, 1]),  # a match at the start stops there
    ([1, 2, 0, 1, 2], 3, 3, 2, None),
    ([1, 2, 3, 1, 5, 3], 1, 3, 3, [1, 5, 3]),
    ([1, 2, 3, 1, 5, 3], 2, 3, 3, None),  # only 1 token long: below ngram_min
    ([5, 5, 5], 3, 4, 2, None),  # n < ngram_min + 1
    ([1, 2, 3, 4], 1, 4, 2, None),
    ([9], 1, 1, 2, None),
]


def _one(tokens: list[int], ngram_min: int, ngram_max: int, num_next: int, run=None) -> list[int] | None:
    """Next drafts for a history of `tokens` whose last token is emitted with no drafts; `run`
    (default: the reference launcher) is called with the arguments."""
    inputs = Inputs(
        torch.tensor([tokens[-1]]),
        torch.tensor([0]),
        torch.zeros((1, 2), dtype=torch.int64),
        torch.tensor([0]),
        torch.tensor([tokens[:-1] + [0] * 3], dtype=torch.int32),
        torch.tensor([len(tokens) - 1], dtype=torch.int32),
    )
    out = (run or ngram_ops.accept_and_propose)(*inputs.tensors(), ngram_min, ngram_max, num_next)
    assert inputs.history[0, : len(tokens)].tolist() == tokens and int(inputs.history_len[0]) == len(tokens)
    return out.next_drafts[0].tolist() if bool(out.has_match[0]) else None


@pytest.mark.parametrize("tokens,ngram_min,ngram_max,num_next,expect", RULE_CASES)
def test_rule_by_hand(tokens, ngram_min, ngram_max, num_next, expect):
    assert _one(tokens, ngram_min, ngram_max, num_next) == expect
    draft = find_ngram_draft(np.array(tokens, dtype=np.int32), ngram_min, ngram_max, num_next, 0)
    assert (draft.tolist() if draft.size else None) == expect  # the host rule agrees


def test_acceptance_by_hand():
    history = torch.zeros((3, 8), dtype=torch.int32)
    history[2, :5] = torch.tensor([8, 5, 8, 7, 0])
    history_len = torch.tensor([2, 0, 5], dtype=torch.int32)
    argmax = torch.tensor([8, 4, 5, 6, 1, 9, 3, 7])  # groups: seq 2 (row 0), seq 0, seq 1
    out = ngram_ops.accept_and_propose(
        argmax,
        torch.tensor([1, 4, 0]),
        torch.tensor([[4, 5, 0], [1, 2, 3], [6, 6, 6]]),
        torch.tensor([2, 3, 0]),
        history,
        history_len,
        1,
        2,
        2,
    )
    assert out.num_emitted.tolist() == [3, 2, 1]  # all, stop at the first mismatch, none
    assert out.emitted.tolist() == [[4, 5, 6, 0], [1, 9, 0, 0], [8, 0, 0, 0]]
    assert history_len.tolist() == [5, 2, 6]
    assert history.tolist() == [[0, 0, 4, 5, 6, 0, 0, 0], [1, 9, 0, 0, 0, 0, 0, 0], [8, 5, 8, 7, 0, 8, 0, 0]]
    assert out.has_match.tolist() == [False, False, True]
    assert out.next_drafts.tolist() == [[6, 6], [9, 9], [7, 0]]  # no match: the last token


def test_consecutive_steps_match_oracle():
    """Ten steps on the same history, each verifying the previous step's drafts."""
    rng = random.Random(7)
    case = _C("steps", 3, 8, 160, 4, 1, 3, 4)
    inputs = make_inputs(case)
    inputs.history = torch.cat([inputs.history, torch.ones((case.num_seqs, 60), dtype=torch.int32)], dim=1)
    for _ in range(10):
        expect = oracle(inputs.clone(), case.ngram_min, case.ngram_max, case.num_next)
        out = ngram_ops.accept_and_propose(*inputs.tensors(), 1, 3, 4)
        assert as_lists(out, inputs) == expect
        # Next step: drafts are this step's proposal, the target agrees with a random prefix.
        num_drafts = torch.tensor([rng.randint(0, 4) for _ in range(case.num_seqs)])
        rows = [
            [*out.next_drafts[b, : rng.randint(0, nd)].tolist(), *(rng.randrange(3) for _ in range(5))][
                : nd + 1
            ]
            for b, nd in enumerate(num_drafts.tolist())
        ]
        inputs.argmax = torch.tensor([t for r in rows for t in r])
        inputs.first_rows = torch.tensor([0, *np.cumsum([len(r) for r in rows])[:-1].tolist()])
        inputs.drafts, inputs.num_drafts = out.next_drafts.clone(), num_drafts


def _overflow(run) -> dict[str, list]:
    """Rows with room for 2, 1 and 0 of their 3 emitted tokens (checks bypassed: the device clamp)."""
    inputs = Inputs(
        torch.tensor([1, 2, 3] * 3),
        torch.tensor([0, 3, 6]),
        torch.tensor([[1, 2]] * 3),
        torch.tensor([2, 2, 2]),
        torch.arange(1, 7, dtype=torch.int32).repeat(3, 1),
        torch.tensor([4, 5, 6], dtype=torch.int32),
    )
    return as_lists(run(*inputs.tensors(), 1, 4, 4), inputs)


OVERFLOW_EXPECT = {
    "num_emitted": [3, 3, 3],
    "emitted": [[1, 2, 3]] * 3,
    "next_drafts": [[3, 4, 1, 2], [2, 3, 4, 5], [3, 3, 3, 3]],
    "has_match": [True, True, False],
    "history": [[1, 2, 3, 4, 1, 2], [1, 2, 3, 4, 5, 1], [1, 2, 3, 4, 5, 6]],
}


def test_reference_clamps_overflow():
    assert _overflow(ngram_reference.accept_and_propose) == OVERFLOW_EXPECT


def test_empty_batch_and_checks():
    empty = ngram_ops.accept_and_propose(
        torch.zeros(0, dtype=torch.int64),
        torch.zeros(0, dtype=torch.int64),
        torch.zeros((0, 3), dtype=torch.int64),
        torch.zeros(0, dtype=torch.int64),
        torch.zeros((0, 5), dtype=torch.int32),
        torch.zeros(0, dtype=torch.int32),
        1,
        2,
        3,
    )
    assert tuple(empty.emitted.shape) == (0, 4) and tuple(empty.next_drafts.shape) == (0, 3)
    good = make_inputs(_C("checks", 1, 4, 32, 3, 1, 2, 2))

    def call(ngram=(1, 2, 2), **changes):
        args = dataclasses.replace(good.clone(), **changes)
        return ngram_ops.accept_and_propose(*args.tensors(), *ngram)

    call()
    bad = [
        {"ngram": (0, 2, 2)},
        {"ngram": (3, 2, 2)},
        {"ngram": (1, 2, 0)},
        {"history": good.history.long()},
        {"history_len": good.history_len.long()},
        {"argmax": good.argmax.int()},
        {"drafts": good.drafts[:, :1].t()},
        {"num_drafts": good.num_drafts.clone().fill_(4)},  # > K
        {"first_rows": good.first_rows + good.argmax.shape[0]},  # past argmax
        {"history_len": good.history_len.clone().fill_(30)},  # no room for num_drafts + 1
        {"argmax": good.argmax[:3]},  # fewer rows than sequences
    ]
    for changes in bad:
        with pytest.raises(ValueError):
            call(**changes)
    # the Triton kernel ranks the ties as one vector: a bounded width, refused above it
    args = good.clone().tensors()
    ngram_ops.accept_and_propose(*args, 1, 2, 2, context_window=8, max_ties=ngram_ops.MAX_TIES_LIMIT)
    for ties in (0, ngram_ops.MAX_TIES_LIMIT + 1):
        with pytest.raises(ValueError, match="max_ties"):
            ngram_ops.accept_and_propose(*args, 1, 2, 2, context_window=8, max_ties=ties)


# Triton under the interpreter: small shapes, tiles of 16-64 ends (several per row, boundaries
# inside and at the end of the appended tokens), and one call through the default launcher.
INTERPRETER_CASES = [
    _C("i_small", 101, 8, 40, 3, 1, 2, 3, block=16),
    _C("i_ngram_min", 102, 8, 70, 4, 2, 4, 5, block=16),
    _C("i_long_max", 103, 6, 90, 8, 3, 8, 8, block=32),
    _C("i_no_drafts", 104, 6, 50, 0, 1, 3, 4, block=16),
    _C("i_wide_tile", 105, 6, 100, 5, 1, 5, 2, block=64),
    _C("i_one_next", 106, 8, 33, 2, 1, 1, 1, block=16),
    _C("i_launcher", 107, 4, 60, 4, 1, 4, 4, block=0),  # 0: ngram_ops with backend="triton"
]


def _run_triton_cases(path: str) -> None:
    """INTERPRETER_CASES through the Triton kernel (interpreter subprocess only)."""
    from pagedinfer.kernels import ngram_propose

    results = {}
    for case in INTERPRETER_CASES:
        inputs = make_inputs(case)
        args = (*inputs.tensors(), case.ngram_min, case.ngram_max, case.num_next)
        if case.block:
            ngram_ops.check_accept_and_propose(*args)
            out = ngram_propose.accept_and_propose(*args, block=case.block)
        else:
            out = ngram_ops.accept_and_propose(*args, backend="triton")
        results[case.name] = as_lists(out, inputs)
    for case in INTERPRETER_CASES[:2]:  # acceptance only (SEARCH off)
        inputs = make_inputs(case)
        args = (*inputs.tensors(), case.ngram_min, case.ngram_max, case.num_next)
        out = ngram_propose.accept_and_propose(*args, block=case.block, search=False)
        results[case.name + "_no_search"] = as_lists(out, inputs)
    tiny = functools.partial(ngram_propose.accept_and_propose, block=4)  # several tiles
    results["rules"] = [_one(*rule[:4], run=tiny) for rule in RULE_CASES]
    results["overflow"] = _overflow(tiny)
    Path(path).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def triton_results(tmp_path_factory) -> dict[str, dict]:
    pytest.importorskip("triton")
    out = tmp_path_factory.mktemp("ngram_interp") / "results.json"
    return run_interpreted("tests.kernels.test_ngram_propose", out)


@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=[c.name for c in INTERPRETER_CASES])
def test_triton_interpreter_matches_reference(triton_results, case):
    expect, inputs = run_reference(case)
    assert expect == oracle(inputs, case.ngram_min, case.ngram_max, case.num_next)
    assert triton_results[case.name] == expect


@pytest.mark.parametrize("case", INTERPRETER_CASES[:2], ids=[c.name for c in INTERPRETER_CASES[:2]])
def test_triton_interpreter_without_search_matches_reference(triton_results, case):
    expect, _ = run_reference(case, search=False)
    assert triton_results[case.name + "_no_search"] == expect


def test_triton_interpreter_rule_by_hand(triton_results):
    assert triton_results["rules"] == [rule[4] for rule in RULE_CASES]
    assert triton_results["overflow"] == OVERFLOW_EXPECT


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize(
    "hist_cap,ngram,search", [(8192, (1, 4), True), (32768, (2, 8), True), (8192, (1, 4), False)]
)
def test_gpu_matches_cpu_reference_without_sync(backend, hist_cap, ngram, search):
    case = _C("gpu", 11, 256, hist_cap, 8, *ngram, 8)
    expect, inputs = run_reference(case, search)
    warm, cuda = inputs.clone("cuda"), inputs.clone("cuda")
    ngram_ops.accept_and_propose(*warm.tensors(), *ngram, 8, backend=backend, search=search)  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a host synchronization raises
    try:
        out = ngram_ops.accept_and_propose(*cuda.tensors(), *ngram, 8, backend=backend, search=search)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert as_lists(out, cuda) == expect


if __name__ == "__main__":
    _run_triton_cases(sys.argv[1])
