"""The scheduler's steady-decode fast paths against the general definitions they shortcut."""

from __future__ import annotations

import importlib.util
import random

import pytest

from pagedinfer.engine.config import SchedulerConfig
from pagedinfer.engine.core.kv_cache_manager import KVCacheManager
from pagedinfer.engine.core.scheduler import Scheduler
from pagedinfer.engine.core.scheduler_output import ModelRunnerOutput, SampledTokens, SchedulerOutput
from pagedinfer.engine.request import Request
from pagedinfer.engine.sampling_params import SamplingParams
from pagedinfer.engine.stop_checker import check_token_stop, may_stop

BACKENDS = ["ref"]
if importlib.util.find_spec("pagedinfer._native") is not None:
    BACKENDS.append("native")


def _scheduler(backend: str, num_blocks: int, max_model_len: int, **cfg) -> Scheduler:
    if backend == "ref":
        from pagedinfer.engine.core.block_pool_ref import BlockManager
    else:
        from pagedinfer._native import BlockManager
    kv = KVCacheManager(num_blocks, 4, backend_factory=lambda n, b, p: BlockManager(n, b, p))
    return Scheduler(SchedulerConfig(**cfg), kv, max_model_len, clock=lambda: 0.0)


def _check_against_definition(s: Scheduler, out: SchedulerOutput) -> None:
    """Each scheduled sequence as `_scheduled`'s general definition has it (token_ids_range etc.)."""
    for item in out.sequences:
        seq = s.get_sequence(item.seq_id)
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens
        assert item.num_computed_tokens == start
        assert item.token_ids == seq.token_ids_range(start, end)
        assert item.num_prompt_tokens == seq.num_prompt_tokens
        assert item.num_spec_tokens == max(end - seq.num_tokens, 0)
        assert (item.sample is not None) == (end >= seq.num_tokens)
        if item.sample is not None:
            assert item.sample.output_position == seq.num_output_tokens
            assert item.sample.output_token_ids is seq.output_token_ids
            assert item.sample.seed == seq.seed and item.sample.sampling_params is seq.sampling_params
        assert s.kv.num_tokens(seq.seq_id) == seq.num_kv_tokens


def _fake_run(s: Scheduler, out: SchedulerOutput, rng: random.Random) -> ModelRunnerOutput:
    """Random tokens (EOS=2 now and then); drafts are accepted up to a random point."""
    sampled = []
    for item in out.sequences:
        if item.sample is None:
            continue
        drafts = item.token_ids[len(item.token_ids) - item.num_spec_tokens :] if item.num_spec_tokens else []
        accepted = drafts[: rng.randint(0, len(drafts))]
        sampled.append(SampledTokens(item.seq_id, [*accepted, rng.choice([2, 3, 4, 5, 6, 7, 8])]))
        for row in item.fork_rows:
            sampled.append(SampledTokens(row.seq_id, [rng.randrange(3, 9)]))
    return ModelRunnerOutput(sampled)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_schedule_matches_definition_under_chunking_preemption_and_drafts(backend, seed):
    rng = random.Random(seed)
    s = _scheduler(
        backend,
        num_blocks=40,
        max_model_len=48,
        max_num_seqs=6,
        max_num_batched_tokens=rng.choice([7, 16, 64]),
    )
    next_id = 1
    for _ in range(300):
        if rng.random() < 0.3 and next_id < 40:
            max_tokens = rng.randint(1, 30)
            params = SamplingParams(
                max_tokens=max_tokens,
                min_tokens=min(rng.choice([0, 0, 3]), max_tokens),
                ignore_eos=rng.random() < 0.3,
                stop_token_ids=rng.choice([(), (5,)]),
                n=rng.choice([1, 1, 2]),
                temperature=1.0,
            )
            prompt = [rng.randrange(3, 50) for _ in range(rng.randint(1, 20))]
            group = [
                Request(next_id + i, f"r{next_id}", i, list(prompt), params, 0.0, eos_token_ids=(2,))
                for i in range(params.n)
            ]
            next_id += params.n
            s.add_request(group[0], group[1:])
        for seq in s.running:  # some decodes carry drafts this step (the general path)
            if seq.num_computed_tokens == seq.num_tokens - 1 and rng.random() < 0.2:
                seq.spec_token_ids = [rng.randrange(3, 9) for _ in range(rng.randint(1, 3))]
        out = s.schedule()
        _check_against_definition(s, out)
        s.update(out, _fake_run(s, out, rng))
    while s.has_unfinished():
        out = s.schedule()
        _check_against_definition(s, out)
        s.update(out, _fake_run(s, out, rng))
    assert s.kv.num_free_blocks == 40  # every block came back


def test_may_stop_is_a_superset_of_check_token_stop():
    rng = random.Random(0)
    max_model_len = 40
    for i in range(3000):
        max_tokens = rng.choice([None, rng.randint(1, 30)])
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min(rng.randint(0, 5), max_tokens or 5),
            ignore_eos=rng.random() < 0.5,
            stop_token_ids=tuple(rng.sample(range(2, 8), rng.randint(0, 2))),
        )
        prompt = [3] * rng.randint(1, 20)
        seq = Request(i, f"r{i}", 0, prompt, params, 0.0, eos_token_ids=(2,))
        seq.output_token_ids = [rng.randrange(2, 8) for _ in range(rng.randint(0, 40 - len(prompt) - 1))]
        token = rng.randrange(2, 8)
        may = may_stop(seq, token, max_model_len)
        seq.output_token_ids.append(token)
        decision = check_token_stop(seq, max_model_len)
        assert may or decision is None, (params, len(prompt), seq.output_token_ids)
