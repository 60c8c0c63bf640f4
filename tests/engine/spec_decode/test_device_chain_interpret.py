"""The chained n-gram kernels (kernels/ngram_propose.py: packed accept + propose in a chain's first
and chained steps, and the input feed) under TRITON_INTERPRET=1 against the torch path, over
several steps of a simulated chain on the CPU."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch

from tests.kernels.interpreter_run import run_interpreted

K, BLOCK_SIZE, MAX_LEN, STEPS = 3, 4, 96, 6


def simulate(backend: str, seed: int, pair: bool = False) -> list:
    """A chain of STEPS steps over B sequences: step 0 verifies host drafts, later ones the device
    drafts; each step's argmax agrees with a random prefix of its drafts. Records every packed
    result, the histories and the fed inputs. `pair`: the drafts come from elsewhere on the device
    (a draft model's): the first step's as a tensor, the later ones put in by `with_drafts`."""
    from pagedinfer.engine.spec_decode.device_chain import DeviceNgramChain, feed_inputs_torch

    rng = random.Random(seed)
    num_seqs = rng.randint(1, 5)
    chain = DeviceNgramChain(8, MAX_LEN, K, 1, 3, torch.device("cpu"), backend)
    histories = [[rng.randrange(2, 9) for _ in range(rng.randint(2, 30))] for _ in range(num_seqs)]
    chain.start(histories)
    host_drafts = [[rng.randrange(2, 9) for _ in range(rng.randint(0, K))] for _ in range(num_seqs)]
    record, prev, prev_next = [], None, []
    for _ in range(STEPS):
        if pair and prev is not None:  # the draft model's drafts replace the prompt-lookup ones
            prev_next = [[rng.randrange(2, 9) for _ in range(K)] for _ in range(num_seqs)]
            prev = chain.with_drafts(prev, torch.tensor(prev_next))
        drafts = host_drafts if prev is None else prev_next
        counts = [len(d) for d in drafts] if prev is None else [K] * num_seqs
        first_rows, argmax, row = [], [], 0
        for d, n in zip(drafts, counts, strict=True):
            first_rows.append(row)
            agree = rng.randint(0, n)
            argmax += [*d[:agree], *(rng.randrange(2, 9) for _ in range(n + 1 - agree))]
            row += n + 1
        on_device = None
        if pair and prev is None:  # drafts left on the device (0-padded), their counts from the host
            on_device = torch.tensor([[*d, *[0] * (K - len(d))] for d in host_drafts])
            placeholders = [[-1] * len(d) for d in host_drafts]
            out = chain.accept(torch.tensor(argmax), first_rows, placeholders, None, device_drafts=on_device)
        else:
            out = chain.accept(torch.tensor(argmax), first_rows, None if prev else host_drafts, prev)
        packed = out.packed.tolist()
        prev_next = [r[-K:] for r in packed]
        record.append({"packed": packed, "history": chain.history[:num_seqs].tolist()})
        # The next step's inputs, fed on the device over buffers holding anything (both paths).
        gen = torch.Generator().manual_seed(seed * 100 + len(record))
        tables = torch.randint(0, 50, (num_seqs, MAX_LEN // BLOCK_SIZE), dtype=torch.int32, generator=gen)
        fed = []
        for own in (True, False):  # the chain's own backend, then torch
            q = K + 1
            ids = torch.zeros(num_seqs * q, dtype=torch.int64)
            pos = torch.randint(-5, 90, (num_seqs * q,), dtype=torch.int64, generator=gen)
            slots = torch.full((num_seqs * q,), -1, dtype=torch.int64)
            lens = torch.randint(-5, 90, (num_seqs,), dtype=torch.int32, generator=gen)
            if own:
                chain.feed(out, ids, pos, slots, lens, tables, BLOCK_SIZE)
            else:
                feed_inputs_torch(out, chain.history_len, ids, pos, slots, lens, tables, BLOCK_SIZE)
            fed.append([ids.tolist(), pos.tolist(), slots.tolist(), lens.tolist()])
        record[-1]["history_len"] = chain.history_len[:num_seqs].tolist()
        record[-1]["fed"] = fed
        prev = out
    return record


def main(path: str) -> None:
    runs = {str(seed): simulate("triton", seed) for seed in range(6)}
    runs.update({f"pair{seed}": simulate("triton", seed, pair=True) for seed in range(3)})
    Path(path).write_text(json.dumps(runs))


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    pytest.importorskip("triton")
    out = tmp_path_factory.mktemp("chain_interp") / "results.json"
    return run_interpreted("tests.engine.spec_decode.test_device_chain_interpret", out)


@pytest.mark.parametrize("seed", range(6))
def test_triton_chain_matches_the_torch_chain(interpreted, seed):
    want = simulate("reference", seed)
    got = interpreted[str(seed)]
    assert got == want
    for step in want:
        triton_fed, torch_fed = step["fed"]
        assert triton_fed == torch_fed
    # each sequence's inputs start at its bonus token, the last of its history
    for step in want:
        ids, pos, slots, lens = step["fed"][1]
        q = K + 1
        for b, (n, r) in enumerate(zip(step["history_len"], step["packed"], strict=True)):
            assert pos[b * q : (b + 1) * q] == list(range(n - 1, n - 1 + q))
            assert lens[b] == n - 1 + q
            assert ids[b * q] == step["history"][b][n - 1] == r[4 + r[2] - 1]
            assert ids[b * q + 1 : (b + 1) * q] == r[-K:]
    # the chain really accepted drafts and rejected some
    assert any(r[2] > 1 for step in want for r in step["packed"])
    assert any(r[0] > r[2] - 1 for step in want for r in step["packed"])


@pytest.mark.parametrize("seed", range(3))
def test_triton_chain_verifies_drafts_made_elsewhere_like_the_torch_chain(interpreted, seed):
    """A draft model's drafts (a chain's first step reading them on the device, later steps fed
    them by `with_drafts`): the Triton kernels accept them as the torch path does."""
    want = simulate("reference", seed, pair=True)
    assert interpreted[f"pair{seed}"] == want
    for step in want:
        triton_fed, torch_fed = step["fed"]
        assert triton_fed == torch_fed
    # every chained step verified all K drafts, and some were accepted
    assert all(r[1] == K for step in want[1:] for r in step["packed"])
    assert any(r[2] > 1 for step in want for r in step["packed"])


if __name__ == "__main__":
    main(sys.argv[1])
