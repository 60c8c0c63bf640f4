"""The scheduler's fast paths for decodes with drafts against the general definitions."""

from __future__ import annotations

import random

from pagedinfer.engine.config import SchedulerConfig
from pagedinfer.engine.core.block_pool_ref import BlockManager
from pagedinfer.engine.core.kv_cache_manager import KVCacheManager
from pagedinfer.engine.core.scheduler import Scheduler, may_stop_tokens
from pagedinfer.engine.core.scheduler_output import ModelRunnerOutput, SampledTokens
from pagedinfer.engine.request import Request
from pagedinfer.engine.sampling_params import SamplingParams
from pagedinfer.engine.stop_checker import check_token_stop


def test_may_stop_tokens_is_a_superset_of_check_token_stop_per_token():
    rng = random.Random(0)
    max_model_len = 40
    num_clear = 0
    for i in range(3000):
        max_tokens = rng.choice([None, rng.randint(1, 30)])
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min(rng.randint(0, 5), max_tokens or 5),
            ignore_eos=rng.random() < 0.5,
            stop_token_ids=tuple(rng.sample(range(2, 12), rng.randint(0, 2))),
        )
        prompt = [3] * rng.randint(1, 20)
        seq = Request(i, f"r{i}", 0, prompt, params, 0.0, eos_token_ids=(2,))
        seq.output_token_ids = [rng.randrange(2, 12) for _ in range(rng.randint(0, 35 - len(prompt)))]
        tokens = [rng.randrange(2, 12) for _ in range(rng.randint(1, 5))]
        may = may_stop_tokens(seq, tokens, max_model_len)
        num_clear += not may
        for token in tokens:
            seq.output_token_ids.append(token)
            assert may or check_token_stop(seq, max_model_len) is None, (params, prompt, seq.output_token_ids)
    assert num_clear > 300  # the fast path is taken often


def _scheduler(max_model_len: int = 64, budget: int = 64) -> Scheduler:
    kv = KVCacheManager(64, 4, backend_factory=lambda n, b, p: BlockManager(n, b, p))
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget)
    return Scheduler(config, kv, max_model_len, clock=lambda: 0.0)


def _decoding(s: Scheduler, num: int) -> list[Request]:
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    for i in range(num):
        s.add_request(Request(i, f"r{i}", 0, [5 + i] * (3 + i), params, 0.0, eos_token_ids=(2,)))
    out = s.schedule()
    s.update(out, ModelRunnerOutput([SampledTokens(x.seq_id, [7]) for x in out.sequences]))
    return list(s.running)


def test_decode_with_drafts_is_scheduled_as_the_general_definition():
    s = _scheduler()
    seqs = _decoding(s, 3)
    seqs[0].spec_token_ids = [8, 9, 10]
    seqs[2].spec_token_ids = [11]
    out = s.schedule()
    for item, seq in zip(out.sequences, seqs, strict=True):
        k = len(seq.spec_token_ids)
        assert item.token_ids == seq.token_ids_range(seq.num_computed_tokens, seq.num_tokens_with_spec)
        assert item.num_spec_tokens == k and item.num_new_tokens == 1 + k
        assert item.sample.output_position == seq.num_output_tokens
        assert item.sample.output_token_ids is seq.output_token_ids
        assert s.kv.num_tokens(seq.seq_id) == seq.num_kv_tokens == seq.num_tokens_with_spec
    # Accept 2 of 3 drafts, the only one, none: rolled back to the accepted tokens.
    sampled = [SampledTokens(0, [8, 9, 4]), SampledTokens(1, [6]), SampledTokens(2, [3])]
    updates = s.update(out, ModelRunnerOutput(sampled))
    assert [u.new_token_ids for u in updates] == [[8, 9, 4], [6], [3]]
    for seq in seqs:
        assert (
            seq.num_computed_tokens == seq.num_kv_tokens == seq.num_tokens - 1 == s.kv.num_tokens(seq.seq_id)
        )
        assert seq.spec_token_ids == []


def test_drafts_past_the_budget_or_context_take_the_general_path():
    s = _scheduler(max_model_len=12, budget=3)
    (seq,) = _decoding(s, 1)  # 3 prompt tokens + 1 output
    seq.spec_token_ids = [8, 9, 10, 11]
    out = s.schedule()
    (item,) = out.sequences
    assert item.num_new_tokens == 3 and item.num_spec_tokens == 2  # budget-capped chunk of drafts
    assert item.token_ids == [7, 8, 9]
