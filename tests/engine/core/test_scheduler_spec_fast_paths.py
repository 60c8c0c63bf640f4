"""The scheduler's fast paths for decodes with drafts against the general definitions."""

from __future__ import annotations

import random

import pytest

from pagedinfer.engine.config import SchedulerConfig
from pagedinfer.engine.core.block_pool_ref import BlockManager
from pagedinfer.engine.core.kv_cache_manager import KVCacheManager
from pagedinfer.engine.core.scheduler import Scheduler
from pagedinfer.engine.core.scheduler_output import ModelRunnerOutput, SampledTokens, SchedulerOutput
from pagedinfer.engine.core.scheduler_update import may_stop_tokens
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


def _schedule_with_drafts(
    max_model_len: int, num_drafts: list[int], config: SchedulerConfig | None = None, general: bool = False
) -> tuple[Scheduler, list[Request], SchedulerOutput]:
    """Decoding sequences (i: 3 + i prompt tokens + 1 output) with drafts, scheduled under
    `config` by the batched fast path or, with `general`, by the one-at-a-time general path
    (`_num_new_tokens` / `_reserve_slots` / `_scheduled`)."""
    s = _scheduler(max_model_len)
    seqs = _decoding(s, len(num_drafts))  # the prompts fit the default budget in one step
    if config is not None:
        s.config = config
    if general:
        s._schedule_running_batched = lambda budget, scheduled, copies, reserves=None: None
    for seq, k in zip(seqs, num_drafts, strict=True):
        seq.spec_token_ids = [20 + j for j in range(k)]
    return s, seqs, s.schedule()


def _summary(s: Scheduler, out: SchedulerOutput) -> list[tuple]:
    return [
        (
            x.seq_id,
            x.num_computed_tokens,
            x.token_ids,
            x.num_spec_tokens,
            x.sample is not None,
            s.kv.num_tokens(x.seq_id),
            s.get_sequence(x.seq_id).num_kv_tokens,
        )
        for x in out.sequences
    ]


def test_drafts_near_max_model_len_are_trimmed_as_by_the_general_path():
    # Sequence i has 4 + i tokens (3 + i computed) and 4 drafts: with max_model_len 10 the first
    # three's 1 + 4 inputs fit (the third's exactly: fast path), the last three's cross the context.
    max_model_len, num_drafts = 10, [4] * 6
    fast, seqs, out = _schedule_with_drafts(max_model_len, num_drafts)
    general, _, general_out = _schedule_with_drafts(max_model_len, num_drafts, general=True)
    assert _summary(fast, out) == _summary(general, general_out)
    assert [x.num_spec_tokens for x in out.sequences] == [4, 4, 4, 3, 2, 1]
    for x, seq in zip(out.sequences, seqs, strict=True):
        assert x.num_computed_tokens + x.num_new_tokens <= max_model_len  # no KV past the context
        assert x.token_ids == [7, *seq.spec_token_ids[: x.num_spec_tokens]]
    # Every draft accepted: no sequence grows past max_model_len (those that reach it stop there).
    sampled = [SampledTokens(x.seq_id, [*x.token_ids[1:], 6]) for x in out.sequences]
    updates = fast.update(out, ModelRunnerOutput(sampled))
    assert updates == general.update(general_out, ModelRunnerOutput(sampled))
    assert [len(u.new_token_ids) for u in updates] == [5, 5, 4, 3, 2, 1]
    assert [seq.num_tokens for seq in seqs] == [9] + [max_model_len] * 5
    assert [u.is_finished for u in updates] == [False] + [True] * 5


def test_fast_path_matches_the_general_path_at_the_context_limit_randomized():
    rng = random.Random(1)
    num_trimmed = 0
    for _ in range(300):
        max_model_len = rng.randint(9, 12)
        num_drafts = [rng.randint(0, 6) for _ in range(rng.randint(1, min(6, max_model_len - 4)))]
        config = SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=rng.randint(1, 40),
            enable_chunked_prefill=rng.random() < 0.7,
        )
        fast, seqs, out = _schedule_with_drafts(max_model_len, num_drafts, config)
        general, _, general_out = _schedule_with_drafts(max_model_len, num_drafts, config, general=True)
        assert _summary(fast, out) == _summary(general, general_out), (max_model_len, config, num_drafts)
        for x in out.sequences:
            end = x.num_computed_tokens + x.num_new_tokens
            assert end <= max_model_len  # no KV past the context
            num_trimmed += end == max_model_len < seqs[x.seq_id].num_tokens_with_spec
    assert num_trimmed > 100  # the context limit, not only the budget, trims scheduled drafts


def _at_a_block_boundary(num_blocks: int) -> tuple[Scheduler, KVCacheManager]:
    """Three decodes whose next token opens a block (8 prompt tokens = 2 full blocks each, one
    sampled), 4 drafts each, in a pool of `num_blocks` blocks of 4."""
    kv = KVCacheManager(num_blocks, 4, backend_factory=lambda n, b, p: BlockManager(n, b, p))
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv, 64, clock=lambda: 0.0)
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    for i in range(3):
        s.add_request(Request(i, f"r{i}", 0, [5 + i] * 8, params, 0.0, eos_token_ids=(2,)))
    out = s.schedule()
    s.update(out, ModelRunnerOutput([SampledTokens(x.seq_id, [7]) for x in out.sequences]))
    for seq in s.running:
        seq.spec_token_ids = [20, 21, 22, 23]
    return s, kv


@pytest.mark.parametrize(
    "num_blocks,expected",
    [
        (9, [(0, 4, 3), (1, 4, 3), (2, 4, 3)]),  # 3 free: each own token's block, its 3 free slots
        (10, [(0, 5, 4), (1, 4, 3), (2, 4, 3)]),  # one more: the first one's drafts take it whole
    ],
)
def test_one_sequences_drafts_never_preempt_another(num_blocks, expected):
    """A pool too short for every draft: each running sequence's own token is placed first and
    drafts only in what is left, so no sequence is preempted for another's drafts (before: the
    first sequences' drafts took the free blocks and the last one was preempted; a review,
    2026-12-06). Own token + 4 drafts take 2 new blocks each."""
    s, kv = _at_a_block_boundary(num_blocks)
    assert kv.num_free_blocks == num_blocks - 6
    out = s.schedule()
    assert out.preempted_seq_ids == []
    assert [(x.seq_id, x.num_new_tokens, x.num_spec_tokens) for x in out.sequences] == expected
    for x in out.sequences:
        assert x.token_ids == [7, 20, 21, 22, 23][: x.num_new_tokens]
        assert kv.num_tokens(x.seq_id) == s.get_sequence(x.seq_id).num_kv_tokens == 8 + x.num_new_tokens
    assert kv.num_free_blocks == 0
