"""SamplingMetadataBuilder (cached parameter tensors) against build_sampling_metadata."""

from __future__ import annotations

import dataclasses
import random

import torch

from pagedinfer.engine.core.scheduler_output import SamplingRow
from pagedinfer.engine.sample.metadata import (
    PenaltyTensors,
    SamplingMetadataBuilder,
    build_sampling_metadata,
)
from pagedinfer.engine.sampling_params import SamplingParams

VOCAB = 64
CPU = torch.device("cpu")


def _assert_same(a, b) -> None:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, PenaltyTensors):
            _assert_same(x, y)
        elif isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), f.name
        else:
            assert x == y, f.name


def _params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.7, 1.0]),
        top_k=rng.choice([0, 5]),
        top_p=rng.choice([1.0, 0.9]),
        min_tokens=rng.choice([0, 0, 4]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.2]),
        logprobs=rng.choice([None, 2]),
        stop_token_ids=rng.choice([(), (7,)]),
        seed=rng.choice([None, 11]),
    )


def test_builder_matches_the_function_across_steady_and_changing_batches():
    rng = random.Random(0)
    builder = SamplingMetadataBuilder(VOCAB, CPU)
    pool = [_params(rng) for _ in range(6)]
    outputs = {i: [] for i in range(8)}
    for step in range(40):
        if step % 10 == 0:  # a new batch composition; otherwise the same params, one step later
            members = rng.sample(range(8), rng.randint(1, 8))
            chosen = {i: rng.choice(pool) for i in members}
            if step == 20:  # equal by value, distinct objects: still a valid cache hit
                chosen = {i: dataclasses.replace(p) for i, p in chosen.items()}
        rows = []
        for i in members:
            outputs[i].append(rng.randrange(VOCAB))
            rows.append(
                SamplingRow(
                    i, chosen[i], 100 + i if chosen[i].seed else None, len(outputs[i]), [1, 2, 3], outputs[i]
                )
            )
        eos = [(2,)] * len(rows)
        cached = builder.build(rows, eos)
        fresh = build_sampling_metadata(rows, VOCAB, CPU, eos)
        _assert_same(cached, fresh)
        banned = {i for i, r in enumerate(rows) if r.output_position < r.sampling_params.min_tokens}
        assert set(cached.ban_rows.tolist() if cached.ban_rows is not None else []) == banned


def test_builder_reuses_parameter_tensors_while_the_batch_is_unchanged():
    params = [SamplingParams(temperature=0.5), SamplingParams(temperature=0.0)]
    builder = SamplingMetadataBuilder(VOCAB, CPU)
    rows = [SamplingRow(i, p, None, 0, [1], []) for i, p in enumerate(params)]
    first = builder.build(rows)
    second = builder.build([dataclasses.replace(r, output_position=1) for r in rows])
    assert second is not first and second.temperature is first.temperature
    third = builder.build(rows[::-1])
    assert torch.equal(third.temperature, torch.tensor([1.0, 0.5]))  # greedy rows hold 1.0
