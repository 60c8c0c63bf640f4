"""kernels/hash_uniform.py against engine/sample/rng.py's torch ops, bit for bit: under
TRITON_INTERPRET=1 on the CPU (one subprocess) and at a vocabulary's size on CUDA (marker gpu).

Seeds cover both 32-bit halves (0, the low half full, the high half set, 2**63 - 1, a negative
salted seed), positions 0 to ~10**6 (the position's product with the multiplier passes 2**32),
and vocabularies that leave the last block partial."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from pagedinfer.engine.sample.rng import hash_uniform, hash_uniform_reference
from tests.kernels.interpreter_run import run_interpreted

SEEDS = [0, 1, 2**32 - 1, 2**32, 2**62 + 12345, 2**63 - 1, -7, 987654321987]
POSITIONS = [0, 7, 1023, 123456, 999999, 5, 64, 3]
VOCABS = [1, 37, 1024, 5000]


def _case(vocab: int, device: str = "cpu"):
    seeds = torch.tensor(SEEDS, dtype=torch.int64, device=device)
    positions = torch.tensor(POSITIONS, dtype=torch.int64, device=device)
    return seeds, positions, vocab


def _run_interpreter(out: str) -> None:
    from pagedinfer.kernels.hash_uniform import hash_uniform_kernel

    results = {}
    for vocab in VOCABS:
        u = hash_uniform_kernel(*_case(vocab), backend="triton")
        results[str(vocab)] = u.view(torch.int32).tolist()  # the bits
    Path(out).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_interpreted("tests.kernels.test_hash_uniform", tmp_path_factory.mktemp("hash") / "out.json")


@pytest.mark.parametrize("vocab", VOCABS)
def test_interpreter_kernel_matches_the_torch_ops_bit_for_bit(interpreted, vocab):
    want = hash_uniform_reference(*_case(vocab))
    assert interpreted[str(vocab)] == want.view(torch.int32).tolist()
    assert bool(((want > 0) & (want < 1)).all())


def test_cpu_runs_the_torch_ops():
    seeds, positions, vocab = _case(300)
    assert torch.equal(hash_uniform(seeds, positions, vocab), hash_uniform_reference(seeds, positions, vocab))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("vocab", [49152, 128256, 1])
def test_gpu_kernel_matches_the_torch_ops_bit_for_bit(vocab):
    from pagedinfer.kernels.hash_uniform import hash_uniform_kernel

    seeds, positions, _ = _case(vocab, "cuda")
    got = hash_uniform_kernel(seeds, positions, vocab)
    assert torch.equal(
        got.view(torch.int32), hash_uniform_reference(seeds, positions, vocab).view(torch.int32)
    )
    assert torch.equal(hash_uniform(seeds, positions, vocab), got)  # the engine's entry takes the kernel


if __name__ == "__main__":
    _run_interpreter(sys.argv[1])
