"""Sampler: filters against a per-row reference, seeded reproducibility, penalties, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from pagedinfer.engine.core.scheduler_output import SamplingRow
from pagedinfer.engine.sample.metadata import build_sampling_metadata
from pagedinfer.engine.sample.sampler import Sampler
from pagedinfer.engine.sampling_params import SamplingParams

V = 50


def row(seq_id: int = 0, seed: int | None = None, pos: int = 0, out=(), prompt=(), **kw) -> SamplingRow:
    return SamplingRow(seq_id, SamplingParams(**kw), seed, pos, list(prompt), list(out))


def meta(rows, eos=None):
    return build_sampling_metadata(rows, V, torch.device("cpu"), eos)


def reference_allowed(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    """Per-row, loop-based reference of top-k, then top-p, then min-p on sorted probabilities."""
    probs = (logits / p.temperature).softmax(-1).tolist()
    order = sorted(range(V), key=lambda i: -probs[i])
    allowed = set(range(V))
    if p.min_p > 0:
        allowed = {i for i in allowed if probs[i] >= p.min_p * max(probs)}
    if p.top_k:
        allowed &= set(order[: p.top_k])
    if p.top_p < 1:
        kept = [i for i in order if i in allowed]
        mass = sum(probs[i] for i in kept)
        cum, keep = 0.0, set()
        for i in kept:
            if cum >= p.top_p * mass and keep:
                break
            keep.add(i)
            cum += probs[i]
        allowed = keep
    return allowed


@pytest.mark.parametrize(
    "kw",
    [
        dict(top_k=5),
        dict(top_p=0.5),
        dict(min_p=0.2),
        dict(top_k=10, top_p=0.8, temperature=0.7),
        dict(top_k=1),
    ],
)
def test_filters_match_reference(kw):
    torch.manual_seed(0)
    logits = torch.randn(1, V) * 3
    sampler = Sampler()
    m = meta([row(**kw)])
    processed = sampler.process(logits, m)
    kept = set(torch.isfinite(processed[0]).nonzero().squeeze(1).tolist())
    p = SamplingParams(**kw)
    if p.top_p < 1 and (p.top_k or p.min_p):
        # Our top-p renormalizes over the top-k survivors, like the reference does.
        pass
    assert kept == reference_allowed(logits[0], p)
    draws = {int(sampler.draw(processed, m)[0]) for _ in range(200)}
    assert draws <= kept


def test_greedy_is_argmax_and_mixed_batch():
    logits = torch.randn(3, V)
    rows = [row(0, temperature=0.0), row(1, seed=7, temperature=1.0), row(2, temperature=0.0)]
    out = Sampler()(logits, meta(rows))
    assert out.token_ids[0] == logits[0].argmax()
    assert out.token_ids[2] == logits[2].argmax()


def test_seeded_rows_independent_of_batch_composition():
    torch.manual_seed(1)
    logits = torch.randn(4, V)
    target = row(9, seed=1234, pos=3, temperature=1.0)
    alone = Sampler()(logits[1:2], meta([target])).token_ids[0]
    for other in range(3):
        rows = [row(1, temperature=1.0), target, row(2, seed=other, temperature=0.9), row(3, temperature=0)]
        assert Sampler()(logits, meta(rows)).token_ids[1] == alone
    # Different positions and seeds draw differently somewhere.
    tokens = {int(Sampler()(logits[1:2], meta([row(9, seed=s, pos=3)])).token_ids[0]) for s in range(40)}
    assert len(tokens) > 3


def test_seeded_draws_follow_the_distribution():
    logits = torch.tensor([[math.log(0.7), math.log(0.2), math.log(0.1)] + [-1e9] * (V - 3)])
    counts = torch.zeros(V)
    for s in range(3000):
        counts[Sampler()(logits, meta([row(0, seed=s)])).token_ids[0]] += 1
    freq = counts[:3] / counts.sum()
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_penalties_and_min_tokens():
    logits = torch.zeros(1, V)
    logits[0, 3] = 2.0
    logits[0, 4] = -2.0
    m = meta(
        [
            row(
                0,
                out=[3, 3, 5],
                prompt=[4],
                pos=3,
                repetition_penalty=2.0,
                frequency_penalty=0.5,
                presence_penalty=0.25,
                temperature=0,
            )
        ]
    )
    out = Sampler().process(logits, m)[0]
    assert out[3] == pytest.approx(2.0 / 2 - 0.5 * 2 - 0.25)
    assert out[4] == pytest.approx(-4.0)  # prompt token: repetition penalty only
    assert out[5] == pytest.approx(0.0 - 0.5 - 0.25)
    eos = [[7]]
    logits = torch.zeros(1, V)
    logits[0, 7] = 10.0
    banned = Sampler()(logits, meta([row(0, pos=0, min_tokens=2, temperature=0, stop_token_ids=(8,))], eos))
    assert int(banned.token_ids[0]) not in (7, 8)
    allowed = Sampler()(logits, meta([row(0, pos=2, min_tokens=2, temperature=0)], eos))
    assert int(allowed.token_ids[0]) == 7


def test_logprobs_are_raw_model_logprobs():
    logits = torch.randn(2, V)
    rows = [row(0, temperature=0, logprobs=3), row(1, temperature=0)]
    out = Sampler()(logits, meta(rows))
    ref = logits.log_softmax(-1)
    assert torch.allclose(out.logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_token_ids.shape == (2, 3)
    assert torch.equal(out.top_token_ids[0], ref[0].topk(3).indices)


def test_plain_greedy_takes_argmax_of_half_precision_logits():
    # bf16 rounding creates ties: the fast path must still pick the fp32 upcast's first maximum.
    logits = (torch.randn(64, V) * 0.01).to(torch.bfloat16)
    logits[3, [7, 20]] = logits[3].max() + 1  # an exact tie: the first index wins
    m = meta([row(i, temperature=0) for i in range(64)])
    out = Sampler()(logits, m)
    assert torch.equal(out.token_ids, logits.float().argmax(-1)) and int(out.token_ids[3]) == 7
    penalized = meta([row(0, out=[7], pos=1, temperature=0, presence_penalty=2.0)])
    assert int(Sampler()(logits[3:4], penalized).token_ids[0]) == 20  # the slow path still applies


def test_process_never_writes_into_the_logits():
    logits = torch.randn(2, V)
    before = logits.clone()
    rows = [
        row(0, out=[1, 1], pos=2, temperature=0, frequency_penalty=1.0),
        row(1, pos=0, min_tokens=3, temperature=0),
    ]
    processed = Sampler().process(logits, meta(rows, [[4], [4]]))
    assert processed.dtype == torch.float32 and torch.equal(logits, before)
    assert processed[1, 4] == float("-inf") and processed[0, 1] < logits[0, 1]
    greedy = Sampler().process(logits.bfloat16(), meta([row(0, temperature=0), row(1, temperature=0)]))
    assert greedy.dtype == torch.float32  # process() keeps its fp32 contract


def test_logit_bias_removes_and_forces_tokens_per_row():
    """OpenAI's logit_bias: -100 takes away the token greedy would pick, +100 forces one, and
    each row keeps its own biases (one vectorized index_put_ for the batch)."""
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    top = logits.argmax(-1).tolist()
    rows = [
        row(0, temperature=0.0, logit_bias={top[0]: -100.0}),
        row(1, temperature=0.0, logit_bias={7: 100.0}),
        row(2, temperature=0.0),
    ]
    out = Sampler()(logits, meta(rows)).token_ids.tolist()
    second = logits[0].clone()
    second[top[0]] = float("-inf")
    assert out == [int(second.argmax()), 7, top[2]]
    biased = [row(i, seed=i, pos=i, logit_bias={top[0]: -100.0}) for i in range(64)]
    sampled = Sampler()(logits[:1].expand(64, V).contiguous(), meta(biased))
    assert top[0] not in sampled.token_ids.tolist()  # (a -100 bias leaves it e^-100 of its mass)


def test_top_k_minus_one_means_disabled():
    assert SamplingParams(top_k=-1).top_k == 0
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-2)
