"""The verifier's all-greedy host path against the general rejection-sampling path.

That path on the runner's half-precision logits (no fp32 upcast): test_greedy_verification_bf16.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pagedinfer.engine.core.scheduler_output import SamplingRow
from pagedinfer.engine.sample.metadata import build_sampling_metadata
from pagedinfer.engine.sample.rejection_sampler import RejectionSampler, greedy_num_accepted
from pagedinfer.engine.sample.sampler import Sampler
from pagedinfer.engine.sampling_params import SamplingParams
from pagedinfer.engine.spec_decode import verifier as verifier_module
from pagedinfer.engine.spec_decode.verifier import SpecVerifier, _GroupArrays, _rejection_inputs
from pagedinfer.engine.worker.step_types import HostTokenIds, VerifyGroup

VOCAB = 30


def _step(gen: torch.Generator, ks: list[int], params: SamplingParams):
    """Groups with ks drafts (about 70% equal to the row's argmax), their rows, logits [N, V]."""
    groups, rows = [], []
    for b, k in enumerate(ks):
        groups.append(VerifyGroup(b, len(rows), []))
        prompt = torch.randint(0, VOCAB, (6,), generator=gen).tolist()
        history = torch.randint(0, VOCAB, (5,), generator=gen).tolist()
        rows += [SamplingRow(b, params, None, 5 + j, prompt, history) for j in range(k + 1)]
    logits = torch.randn(len(rows), VOCAB, generator=gen)  # [N, V]
    argmax = logits.argmax(-1)
    for g, k in zip(groups, ks, strict=True):
        for j in range(k):
            token = int(argmax[g.first_row + j])
            g.draft_token_ids.append(token if torch.rand(1, generator=gen) < 0.7 else (token + 1) % VOCAB)
    return groups, rows, logits


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, min_tokens=8, stop_token_ids=[3, 4]),
    ],
)
@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize("max_listed", [0, 100])  # acceptance in numpy, in Python lists
def test_greedy_host_path_equals_rejection_sampler(params, uniform, max_listed, monkeypatch):
    monkeypatch.setattr(verifier_module, "MAX_LISTED_GROUPS", max_listed)
    gen = torch.Generator().manual_seed(7)
    verifier = SpecVerifier(Sampler())
    num_accepted_seen = set()
    for _ in range(20):
        ks = [4] * 12 if uniform else torch.randint(0, 5, (12,), generator=gen).tolist()
        groups, rows, logits = _step(gen, ks, params)
        meta = build_sampling_metadata(rows, VOCAB, torch.device("cpu"), [(2,)] * len(rows))
        assert meta.all_greedy
        fast = verifier.sample(logits, meta, groups)
        # The general path: processed logits -> rejection inputs -> the sampler's non-greedy code
        # (is_greedy rows are decided there by torch.where).
        processed = verifier.sampler.process(logits, meta)
        inputs = _rejection_inputs(processed, meta, _GroupArrays.of(groups), groups, {})
        general = RejectionSampler()(dataclasses.replace(inputs, all_greedy=False)).to_lists()
        assert [s.token_ids for s in fast.sampled] == general
        assert [s.seq_id for s in fast.sampled] == [g.seq_id for g in groups]
        assert fast.num_draft_tokens == sum(ks)
        assert fast.num_accepted_tokens == sum(len(t) - 1 for t in general)
        num_accepted_seen.update(len(t) - 1 for t in general)
    assert len(num_accepted_seen) >= 3  # rejections early, late and full acceptance all occur


@pytest.mark.parametrize("num_logprobs", [None, 2])
def test_listed_and_numpy_greedy_paths_and_a_launched_argmax_agree(num_logprobs, monkeypatch):
    """The Python-list acceptance (few groups) against the numpy one, each with the argmax
    computed in sample() and with the one launch_draws enqueued (as the runner passes it)."""
    gen = torch.Generator().manual_seed(11)
    verifier = SpecVerifier(Sampler())
    params = SamplingParams(temperature=0.0, logprobs=num_logprobs)
    num_accepted = 0
    for _ in range(20):
        ks = torch.randint(0, 5, (int(torch.randint(1, 10, (1,), generator=gen)),), generator=gen).tolist()
        groups, rows, logits = _step(gen, ks, params)
        meta = build_sampling_metadata(rows, VOCAB, torch.device("cpu"), [(2,)] * len(rows))
        outs = []
        for max_listed in (0, 100):
            monkeypatch.setattr(verifier_module, "MAX_LISTED_GROUPS", max_listed)
            launched = HostTokenIds(verifier.launch_draws(logits, meta))
            outs += [
                verifier.sample(logits, meta, groups),
                verifier.sample(logits, meta, groups, None, launched),
            ]
        first = outs[0]
        num_accepted += first.num_accepted_tokens
        for out in outs[1:]:
            assert out.sampled == first.sampled
            assert (out.num_draft_tokens, out.num_accepted_tokens, out.num_verified_seqs) == (
                first.num_draft_tokens,
                first.num_accepted_tokens,
                first.num_verified_seqs,
            )
        assert (first.sampled[0].logprobs is None) == (num_logprobs is None)
    assert num_accepted > 20  # drafts were accepted, not only rejected


def test_greedy_num_accepted_equals_the_torch_greedy_path():
    rng = np.random.default_rng(3)
    target = rng.integers(0, 4, (50, 6))
    drafts = np.where(rng.random((50, 5)) < 0.8, target[:, :5], (target[:, :5] + 1) % 4)
    num_drafts = rng.integers(0, 6, 50)
    got = greedy_num_accepted(target, drafts, num_drafts)
    is_accepted = torch.from_numpy(drafts == target[:, :5]) & (
        torch.arange(5) < torch.from_numpy(num_drafts)[:, None]
    )
    want = is_accepted.int().cumprod(dim=1).sum(dim=1)
    assert got.tolist() == want.tolist()
    assert (got == 0).any() and (got == num_drafts).any() and ((got > 0) & (got < num_drafts)).any()


def test_group_arrays_pad_ragged_drafts():
    groups = [VerifyGroup(0, 0, [5, 6]), VerifyGroup(1, 3, []), VerifyGroup(2, 4, [7, 8, 9])]
    arrays = _GroupArrays.of(groups)
    assert arrays.draft_token_ids.tolist() == [[5, 6, 0], [0, 0, 0], [7, 8, 9]]
    assert arrays.index.tolist() == [[0, 1, 2, 2], [3, 3, 3, 3], [4, 5, 6, 7]]
