"""Chained speculative steps on the host side (core/spec_lookahead.py): what step N+1 reserves and
stages before N's acceptance is known, and what it becomes once N's tokens are applied."""

from __future__ import annotations

import random

import pytest

from pagedinfer.engine.config import SchedulerConfig
from pagedinfer.engine.core.block_pool_ref import BlockManager
from pagedinfer.engine.core.kv_cache_manager import KVCacheManager
from pagedinfer.engine.core.lookahead import PLACEHOLDER_TOKEN_ID, drop_lookahead
from pagedinfer.engine.core.scheduler import Scheduler
from pagedinfer.engine.core.scheduler_output import ModelRunnerOutput, SampledTokens
from pagedinfer.engine.core.spec_lookahead import plan_spec_lookahead, resolve_spec_lookahead
from pagedinfer.engine.request import Request
from pagedinfer.engine.sampling_params import SamplingParams

K = 3
BLOCK = 4


def _scheduler(num_blocks: int = 64) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK, backend_factory=lambda n, b, p: BlockManager(n, b, p))
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    return Scheduler(config, kv, 64, clock=lambda: 0.0)


def _verifying(s: Scheduler, drafts: list[list[int]]):
    """Sequences past their prefill, then a step N verifying the given host drafts."""
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    for i in range(len(drafts)):
        s.add_request(Request(i, f"r{i}", 0, [5 + i] * (3 + 2 * i), params, 0.0, eos_token_ids=(2,)))
    first = s.schedule()
    s.update(first, ModelRunnerOutput([SampledTokens(x.seq_id, [7]) for x in first.sequences]))
    for seq, d in zip(s.running, drafts, strict=True):
        seq.spec_token_ids = list(d)
    return s.schedule()


def _record(s: Scheduler, seq_id: int) -> list[int]:
    kv = s.kv
    tokens = []
    for block in kv.block_table(seq_id):
        tokens += list(kv._blocks.block_tokens(block))
    return tokens[: kv.num_tokens(seq_id)]


def _apply_then_resolve(s: Scheduler, step_n, drafts, nxt, rng):
    """N's outcome (a random accepted prefix of each sequence's drafts + a bonus token; the
    device's next drafts for N+1) applied with N+1 in flight, then N+1 resolved."""
    sampled, next_drafts = [], []
    for n, d in zip(step_n.sequences, drafts, strict=True):
        a = rng.randint(0, len(d))
        sampled.append(SampledTokens(n.seq_id, [*d[:a], 40 + n.seq_id]))
        next_drafts.append([rng.randrange(3, 30) for _ in range(K)])
    result = ModelRunnerOutput(sampled, next_drafts=next_drafts)
    s.update(step_n, result, frozenset(x.seq_id for x in nxt.sequences))
    resolve_spec_lookahead(s, nxt, result)
    return sampled, next_drafts


@pytest.mark.parametrize("seed", range(8))
def test_plan_then_resolve_matches_what_ran(seed):
    rng = random.Random(seed)
    s = _scheduler()
    drafts = [[rng.randrange(3, 30) for _ in range(rng.randint(0, K))] for _ in range(rng.randint(1, 4))]
    step_n = _verifying(s, drafts)
    nxt = plan_spec_lookahead(s, step_n, K)
    assert nxt is not None  # N's own host drafts do not stop a chain from starting
    assert nxt.feeds_drafts and all(x.num_spec_tokens == K for x in nxt.sequences)
    q = K + 1
    for b, (x, n, d) in enumerate(zip(nxt.sequences, step_n.sequences, drafts, strict=True)):
        base = n.num_computed_tokens + len(n.token_ids) - len(d)  # N's drafts all rejected
        # staged for "all accepted": positions base + len(d) + j, context base + len(d) + q
        assert nxt.layout.positions[b * q : (b + 1) * q].tolist() == [base + len(d) + j for j in range(q)]
        assert nxt.layout.context_lens[b] == base + len(d) + q
        assert s.get_sequence(x.seq_id).num_kv_tokens == base + len(d) + q
        assert x.token_ids == [PLACEHOLDER_TOKEN_ID] * q
    sampled, next_drafts = _apply_then_resolve(s, step_n, drafts, nxt, rng)
    for x, st, nd in zip(nxt.sequences, sampled, next_drafts, strict=True):
        seq = s.get_sequence(x.seq_id)
        assert seq.spec_token_ids == []
        assert x.num_computed_tokens == seq.num_computed_tokens == seq.num_tokens - 1
        assert x.token_ids == [st.token_ids[-1], *nd]
        assert x.sample.output_position == len(seq.output_token_ids)
        # the KV record: the known tokens, then N+1's inputs after the bonus token; nothing past
        assert seq.num_kv_tokens == seq.num_computed_tokens + q == s.kv.num_tokens(x.seq_id)
        assert _record(s, x.seq_id) == [*seq.prompt_token_ids, *seq.output_token_ids, *nd]
    drop_lookahead(s, nxt)  # never collected: back to what each sequence has computed
    for x in nxt.sequences:
        seq = s.get_sequence(x.seq_id)
        assert seq.num_kv_tokens == seq.num_computed_tokens == s.kv.num_tokens(x.seq_id)


def test_a_waiting_greedy_request_rides_in_the_chain_one_that_samples_ends_it():
    """A request the synchronous step would admit is admitted behind the chained rows when it is
    plain greedy (one device step; dropping the step puts it back at the queue's head); one that
    samples ends the chain, and planning leaves no trace (queue, KV, reservations)."""
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    s = _scheduler()
    step_n = _verifying(s, [[9, 9], [8]])
    s.add_request(Request(9, "w", 0, [3] * 5, greedy, 0.0, eos_token_ids=(2,)))
    nxt = plan_spec_lookahead(s, step_n, K, max_device_steps=4)
    assert nxt is not None and nxt.num_fed == 2 and nxt.feed_rows == [0, 1] and nxt.num_device_steps == 1
    admitted = nxt.sequences[2]
    assert (admitted.seq_id, admitted.token_ids, admitted.num_computed_tokens) == (9, [3] * 5, 0)
    assert admitted.sample is not None and s.get_sequence(9) in s.running
    drop_lookahead(s, nxt)
    assert [w.seq_id for w in s.waiting] == [9] and s.get_sequence(9) not in s.running
    sampled = _scheduler()
    step_n = _verifying(sampled, [[9, 9], [8]])
    kv_before = [sampled.kv.num_tokens(x.seq_id) for x in step_n.sequences]
    free_before = sampled.kv.num_free_blocks
    sampled.add_request(Request(9, "w", 0, [3] * 5, SamplingParams(max_tokens=4, temperature=0.8), 0.0))
    assert plan_spec_lookahead(sampled, step_n, K) is None  # the synchronous step admits it
    assert [w.seq_id for w in sampled.waiting] == [9] and len(sampled.running) == 2
    assert [sampled.kv.num_tokens(x.seq_id) for x in step_n.sequences] == kv_before
    assert sampled.kv.num_free_blocks == free_before
    s2 = _scheduler(num_blocks=8)
    step_n = _verifying(s2, [[9]])
    s2.add_request(Request(9, "w", 0, [3] * 40, SamplingParams(max_tokens=4), 0.0, eos_token_ids=(2,)))
    assert plan_spec_lookahead(s2, step_n, K) is not None  # it fits no free blocks: waits anyway
    s3 = _scheduler()
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    s3.add_request(Request(0, "r", 0, [5, 6, 7], params, 0.0, eos_token_ids=(2,)))
    first = s3.schedule()
    s3.update(first, ModelRunnerOutput([SampledTokens(0, [7])]))
    assert plan_spec_lookahead(s3, s3.schedule(), K) is None  # ends at N for certain (max_tokens)


def test_a_dropped_chained_step_gives_back_its_reservation_before_or_after_the_update():
    """The step fails between N's update and N+1's resolve, or before N's update: either way the
    sequences keep KV for exactly what they have computed, so the next synchronous step is exact."""
    for update_first in (False, True):
        s = _scheduler()
        step_n = _verifying(s, [[9, 9, 9], [8, 8]])
        nxt = plan_spec_lookahead(s, step_n, K)
        if update_first:
            sampled = [SampledTokens(x.seq_id, [41]) for x in step_n.sequences]  # all drafts rejected
            s.update(step_n, ModelRunnerOutput(sampled), frozenset(x.seq_id for x in nxt.sequences))
        drop_lookahead(s, nxt)
        for x in nxt.sequences:
            seq = s.get_sequence(x.seq_id)
            assert seq.num_kv_tokens == seq.num_computed_tokens == s.kv.num_tokens(x.seq_id)


@pytest.mark.parametrize("seed", range(8))
def test_several_device_steps_reserve_resolve_and_record_what_ran(seed):
    """A launch of M device steps: KV for M x (K + 1) tokens, the layout of the last device step if
    every draft survives; resolved, its first inputs known; applied, the KV record holds the real
    tokens the device steps consumed and each sequence computed all but its last token."""
    rng = random.Random(seed)
    steps = rng.randint(2, 4)
    s = _scheduler(num_blocks=128)
    drafts = [[rng.randrange(3, 30) for _ in range(rng.randint(0, K))] for _ in range(rng.randint(1, 4))]
    step_n = _verifying(s, drafts)
    nxt = plan_spec_lookahead(s, step_n, K, steps)
    assert nxt is not None and nxt.num_device_steps == steps
    q, reserve = K + 1, steps * (K + 1)
    for b, (x, n) in enumerate(zip(nxt.sequences, step_n.sequences, strict=True)):
        end = n.num_computed_tokens + len(n.token_ids)
        last = end + reserve - q
        assert nxt.layout.positions[b * q : (b + 1) * q].tolist() == [last + j for j in range(q)]
        assert nxt.layout.context_lens[b] == end + reserve
        assert s.get_sequence(x.seq_id).num_kv_tokens == end + reserve
        assert x.token_ids == [PLACEHOLDER_TOKEN_ID] * reserve and x.num_spec_tokens == reserve - 1
    sampled, next_drafts = _apply_then_resolve(s, step_n, drafts, nxt, rng)
    for x, st, nd in zip(nxt.sequences, sampled, next_drafts, strict=True):
        seq = s.get_sequence(x.seq_id)
        assert x.token_ids == [st.token_ids[-1], *nd, *[PLACEHOLDER_TOKEN_ID] * (reserve - q)]
        assert seq.num_kv_tokens == seq.num_computed_tokens + reserve == s.kv.num_tokens(x.seq_id)
    # The launch's outcome: per device step an accepted prefix of its K drafts + a bonus token (the
    # first step's drafts are the resolved ones; later ones are whatever the device drafted).
    emitted, device_steps = [], []
    for nd in next_drafts:
        tokens, per_step, step_drafts = [], [], nd
        for _ in range(steps):
            a = rng.randint(0, K)
            tokens += [*step_drafts[:a], rng.randrange(3, 30)]
            per_step.append((K, a + 1))
            step_drafts = [rng.randrange(3, 30) for _ in range(K)]
        emitted.append(tokens)
        device_steps.append(per_step)
    sampled = [SampledTokens(x.seq_id, t) for x, t in zip(nxt.sequences, emitted, strict=True)]
    verified = [sum(k for k, _ in p) for p in device_steps]
    result = ModelRunnerOutput(sampled, verified_drafts=verified, device_steps=device_steps)
    known = {
        x.seq_id: [*s.get_sequence(x.seq_id).prompt_token_ids, *s.get_sequence(x.seq_id).output_token_ids]
        for x in nxt.sequences
    }
    s.update(nxt, result)
    for x, tokens in zip(nxt.sequences, emitted, strict=True):
        seq = s.get_sequence(x.seq_id)
        assert seq.output_token_ids[-len(tokens) :] == tokens
        assert seq.num_computed_tokens == seq.num_tokens - 1 == len(known[x.seq_id]) + len(tokens) - 1
        assert seq.num_kv_tokens == seq.num_computed_tokens == s.kv.num_tokens(x.seq_id)
        assert _record(s, x.seq_id) == [*known[x.seq_id], *tokens][: seq.num_computed_tokens]


def test_device_steps_stop_short_of_max_tokens_and_the_context():
    """No device step starts where max_tokens has certainly been reached (each emits >= 1 token),
    and the reservation stays inside max_model_len."""
    s = _scheduler()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    s.add_request(Request(0, "r", 0, [5, 6, 7], params, 0.0, eos_token_ids=(2,)))
    first = s.schedule()
    s.update(first, ModelRunnerOutput([SampledTokens(0, [7])]))
    step_n = s.schedule()  # output position 1: N emits the 2nd token, room for 2 more device steps
    assert plan_spec_lookahead(s, step_n, K, 8).num_device_steps == 2
    s2 = _scheduler()
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    s2.add_request(Request(0, "r", 0, [5] * 45, params, 0.0, eos_token_ids=(2,)))
    first = s2.schedule()
    s2.update(first, ModelRunnerOutput([SampledTokens(0, [7])]))
    step_n = s2.schedule()  # its input ends at 46 of max_model_len 64: 18 // (K + 1) = 4 steps
    assert plan_spec_lookahead(s2, step_n, K, 8).num_device_steps == 4


def test_device_steps_stop_at_the_expected_end_of_the_longest_running_sequence():
    """With the expected tokens a step emits, a chain plans no more device steps than the sequence
    that runs longest is expected to need before max_tokens (at least one); without it, as many as
    the certain bound allows."""

    def step_n_of(max_tokens: list[int | None]):
        s = _scheduler()
        for i, m in enumerate(max_tokens):
            params = SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
            s.add_request(Request(i, f"r{i}", 0, [5, 6, 7], params, 0.0, eos_token_ids=(2,)))
        first = s.schedule()
        s.update(first, ModelRunnerOutput([SampledTokens(x.seq_id, [7]) for x in first.sequences]))
        return s, s.schedule()  # N at output position 1, one device step in flight

    def steps(max_tokens, per_step):
        s, step_n = step_n_of(max_tokens)
        estimate = None if per_step is None else (lambda seq_id: per_step[seq_id])
        return plan_spec_lookahead(s, step_n, K, 8, tokens_per_step=estimate).num_device_steps

    # 19 tokens left before N, N expected to emit 4: ceil(15 / 4) = 4 more steps, not 8
    assert steps([20], None) == 8
    assert steps([20], {0: 4.0}) == 4
    assert steps([20], {0: 1.0}) == 8  # one token a step: the certain bound (18) is above 8
    assert steps([20], {0: 30.0}) == 1  # expected to end within N: one step, not none
    # the longest-running sequence decides: one without max_tokens, or one far from it
    assert steps([20, None], {0: 30.0, 1: 4.0}) == 8
    assert steps([20, 40], {0: 30.0, 1: 4.0}) == 8  # 39 left: ceil(35 / 4) = 9, capped at 8
    assert steps([20, 30], {0: 30.0, 1: 4.0}) == 7  # 29 left: ceil(25 / 4) = 7


def test_device_steps_stop_where_a_stop_token_is_expected():
    """`tokens_to_stop` (the proposer's view of where a stop token comes) bounds the device steps
    like max_tokens does, the nearer of the two; a sequence with none ahead keeps its bound."""

    def steps(max_tokens: list[int | None], stop: dict[int, int | None], per_step: float = 4.0):
        s = _scheduler()
        for i, m in enumerate(max_tokens):
            params = SamplingParams(max_tokens=m, temperature=0.0)
            s.add_request(Request(i, f"r{i}", 0, [5, 6, 7], params, 0.0, eos_token_ids=(2,)))
        first = s.schedule()
        s.update(first, ModelRunnerOutput([SampledTokens(x.seq_id, [7]) for x in first.sequences]))
        step_n = s.schedule()
        horizons = []

        def to_stop(seq, row, horizon):
            assert row.seq_id == seq.seq_id and row.output_position == 1
            horizons.append(horizon)
            return stop[seq.seq_id]

        planned = plan_spec_lookahead(
            s, step_n, K, 8, tokens_per_step=lambda seq_id: per_step, tokens_to_stop=to_stop
        )
        assert horizons and all(h == (1 + 8) * (K + 1) for h in horizons)  # N's steps and 8 more
        return planned.num_device_steps

    # a stop 9 tokens on, N expected to emit 4: ceil(5 / 4) = 2 steps (max_tokens alone: 8)
    assert steps([None], {0: 9}) == 2
    assert steps([100], {0: 9}) == 2
    assert steps([100], {0: None}) == 8
    assert steps([None], {0: None}) == 8
    assert steps([20], {0: 60}) == 4  # max_tokens nearer: as before (ceil(15 / 4))
    assert steps([None], {0: 3}) == 1  # expected within N: one step, not none
    # the sequence that runs longest decides
    assert steps([None, None], {0: 3, 1: 17}) == 4  # ceil(13 / 4)
    assert steps([None, None], {0: 3, 1: None}) == 8


def test_a_chained_step_leaves_the_admission_what_the_synchronous_step_would():
    """Budget 16, K 3: step N verifies A and B (a draft each) and admits P's whole 12-token
    prompt. W waits. After N, A, B and P decode a token each, so the synchronous step leaves W up
    to half of 16 - 3 (6) beyond what drafts take; a chained step of three sequences x 4 rows
    leaves 4, so it declines. (Before, the chained step counted P's 12 prompt tokens, N's
    inputs not yet applied, as P's own tokens in it: W's share read 2 and the chain went on.)"""
    kv = KVCacheManager(64, BLOCK, backend_factory=lambda n, b, p: BlockManager(n, b, p))
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16), kv, 64, clock=lambda: 0.0)
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    for i in range(2):
        s.add_request(Request(i, f"r{i}", 0, [5 + i] * 3, params, 0.0, eos_token_ids=(2,)))
    first = s.schedule()
    s.update(first, ModelRunnerOutput([SampledTokens(x.seq_id, [7]) for x in first.sequences]))
    for seq, d in zip(s.running, ([9], [8]), strict=True):
        seq.spec_token_ids = d
    s.add_request(Request(5, "p", 0, [4] * 12, params, 0.0, eos_token_ids=(2,)))
    step_n = s.schedule()
    got = {x.seq_id: (len(x.token_ids), x.num_spec_tokens) for x in step_n.sequences}
    assert got == {0: (2, 1), 1: (2, 1), 5: (12, 0)}
    s.add_request(Request(9, "w", 0, [3] * 10, params, 0.0, eos_token_ids=(2,)))
    assert s.admission_reserve(16, own=3) == 6
    assert plan_spec_lookahead(s, step_n, K) is None


def test_a_chained_step_shares_the_budget_as_the_synchronous_step_after_its_predecessor():
    """Budget 12, K 3: A and B verify a draft each at N, C ends at N (max_tokens 2), W waits
    with 10 tokens. After N the synchronous step runs A and B and keeps W half of 12 - 2 (5);
    the chained step's rows (2 x 4) leave 4, so it declines (before, the share counted C,
    which is not in the chained step: 4, and the chain went on)."""
    kv = KVCacheManager(64, BLOCK, backend_factory=lambda n, b, p: BlockManager(n, b, p))
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=12), kv, 64, clock=lambda: 0.0)
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    ends = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for i, p in ((0, params), (1, params), (2, ends)):
        s.add_request(Request(i, f"r{i}", 0, [5 + i] * 3, p, 0.0, eos_token_ids=(2,)))
    first = s.schedule()
    s.update(first, ModelRunnerOutput([SampledTokens(x.seq_id, [7]) for x in first.sequences]))
    s.get_sequence(0).spec_token_ids = [9]
    s.get_sequence(1).spec_token_ids = [8]
    step_n = s.schedule()
    s.add_request(Request(9, "w", 0, [3] * 10, params, 0.0, eos_token_ids=(2,)))
    assert s.admission_reserve(12, own=2) == 5
    assert plan_spec_lookahead(s, step_n, K) is None
