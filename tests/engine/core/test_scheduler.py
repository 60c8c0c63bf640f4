"""Scheduler policy: token budget, chunked prefill, priorities, aging, admission, preemption."""

from __future__ import annotations

import importlib.util
import random

import pytest

from pagedinfer.engine.config import SchedulerConfig
from pagedinfer.engine.core.kv_cache_manager import KVCacheManager
from pagedinfer.engine.core.scheduler import Scheduler
from pagedinfer.engine.core.scheduler_output import ModelRunnerOutput, SampledTokens, SchedulerOutput
from pagedinfer.engine.outputs import FinishReason
from pagedinfer.engine.request import Request, RequestStatus
from pagedinfer.engine.sampling_params import SamplingParams

BACKENDS = []
if importlib.util.find_spec("pagedinfer._native") is not None:
    BACKENDS.append("native")
if importlib.util.find_spec("pagedinfer.engine.core.block_pool_ref") is not None:
    BACKENDS.append("ref")


def backend_factory(name: str):
    if name == "ref":
        from pagedinfer.engine.core.block_pool_ref import BlockManager
    else:
        from pagedinfer._native import BlockManager
    return lambda n, b, p: BlockManager(n, b, p)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(backend: str, num_blocks=64, block_size=4, max_model_len=256, clock=None, **cfg):
    kv = KVCacheManager(
        num_blocks,
        block_size,
        watermark_blocks=cfg.pop("watermark", 0),
        backend_factory=backend_factory(backend),
    )
    return Scheduler(SchedulerConfig(**cfg), kv, max_model_len, clock=clock or FakeClock())


def make_request(seq_id, prompt_len=8, max_tokens=4, priority=0, arrival=0.0, rid=None, **kw) -> Request:
    prompt = [(seq_id * 7 + i) % 50 + 3 for i in range(prompt_len)]
    return Request(
        seq_id=seq_id,
        request_id=rid or f"r{seq_id}",
        index=0,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, **kw),
        arrival_time=arrival,
        priority=priority,
        eos_token_ids=(2,),
    )


def next_token(history: list[int]) -> int:
    """A deterministic 'model': the next token is a hash of the whole history (never EOS=2)."""
    h = 17
    for t in history:
        h = (h * 31 + t) % 1000003
    return h % 47 + 3


def fake_run(
    scheduler: Scheduler, out: SchedulerOutput, eos_at: dict[int, int] | None = None
) -> ModelRunnerOutput:
    """Sample `next_token(history + [index])` for every sampling row (fork children included)."""
    sampled = []
    for s in out.sequences:
        if s.sample is None:
            continue
        seq = scheduler.get_sequence(s.seq_id)
        for row in (s.sample, *s.fork_rows):
            index = scheduler.get_sequence(row.seq_id).index
            token = next_token(seq.all_token_ids + [index])
            if eos_at and eos_at.get(row.seq_id) == row.output_position:
                token = 2
            sampled.append(SampledTokens(row.seq_id, [token]))
    return ModelRunnerOutput(sampled)


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000, on_step=None) -> int:
    steps = 0
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        scheduler.update(out, fake_run(scheduler, out))
        if on_step:
            on_step(steps, out)
        steps += 1
        assert steps < max_steps, "no progress"
    return steps


def step(s, eos_at=None):
    out = s.schedule()
    s.update(out, fake_run(s, out, eos_at))
    return out


def test_decodes_first_then_chunked_prefill_under_budget(backend):
    s = make_scheduler(backend, max_num_batched_tokens=16, max_num_seqs=8)
    a = make_request(1, prompt_len=10, max_tokens=50)
    s.add_request(a)
    out = step(s)
    assert [(x.seq_id, x.num_new_tokens) for x in out.sequences] == [(1, 10)]
    assert a.num_output_tokens == 1
    b = make_request(2, prompt_len=40, max_tokens=5)
    s.add_request(b)
    news = []
    for _ in range(3):
        out = step(s)
        news.append([(x.seq_id, x.num_new_tokens) for x in out.sequences])
    # The running decode keeps its token every step; the long prompt takes the rest in chunks.
    assert news == [[(1, 1), (2, 15)], [(1, 1), (2, 15)], [(1, 1), (2, 10)]]
    assert b.num_output_tokens == 1 and a.num_output_tokens == 4
    assert all(out.num_scheduled_tokens <= 16 for out in [out])


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget(backend):
    s = make_scheduler(backend, max_num_batched_tokens=16, enable_chunked_prefill=False)
    s.add_request(make_request(1, prompt_len=10, max_tokens=50))
    step(s)
    s.add_request(make_request(2, prompt_len=16, max_tokens=5))
    out = step(s)
    assert [x.seq_id for x in out.sequences] == [1]  # 1 + 16 > 16: not this step


def test_max_num_seqs_caps_the_batch(backend):
    s = make_scheduler(backend, max_num_seqs=2)
    for i in range(1, 5):
        s.add_request(make_request(i))
    out = s.schedule()
    assert len(out.sequences) == 2 and s.num_waiting == 2


def test_priority_then_fcfs(backend):
    clock = FakeClock()
    s = make_scheduler(backend, clock=clock, max_num_seqs=1, aging_seconds=1e9)
    reqs = [
        make_request(1, priority=0, arrival=1.0),
        make_request(2, priority=5, arrival=2.0),
        make_request(3, priority=5, arrival=3.0),
        make_request(4, priority=1, arrival=0.5),
    ]
    for r in reqs:
        s.add_request(r)
    order = []
    while s.has_unfinished():
        out = step(s)
        for x in out.sequences:
            if x.seq_id not in order:
                order.append(x.seq_id)
    assert order == [2, 3, 4, 1]


def test_aging_prevents_starvation(backend):
    clock = FakeClock()
    s = make_scheduler(backend, clock=clock, max_num_seqs=1, aging_seconds=10.0)
    old = make_request(1, priority=0, arrival=clock.now - 35.0)  # aged by 3 levels
    new = make_request(2, priority=2, arrival=clock.now)
    s.add_request(new)
    s.add_request(old)
    assert [x.seq_id for x in s.schedule().sequences] == [1]


def test_admission_respects_free_blocks_and_watermark(backend):
    # 10 blocks of 4 slots; watermark 2 blocks; a 30-token prompt needs 8 blocks.
    s = make_scheduler(backend, num_blocks=10, watermark=2)
    s.add_request(make_request(1, prompt_len=30))
    s.add_request(make_request(2, prompt_len=4))
    out = s.schedule()
    assert [x.seq_id for x in out.sequences] == [1]  # 8 + 1 + 2 > 10 for the second
    assert s.num_waiting == 1


def test_preemption_lowest_priority_most_recent_and_requeue_front(backend):
    # Every request needs 2 blocks for its prompt and grows; the pool runs out while decoding.
    s = make_scheduler(backend, num_blocks=6, block_size=4, max_num_seqs=8)
    reqs = [
        make_request(1, 7, 20, priority=1),
        make_request(2, 7, 20, priority=0),
        make_request(3, 7, 20, priority=1),
    ]
    for r in reqs:
        s.add_request(r)
    out = step(s)
    assert {x.seq_id for x in out.sequences} == {1, 2, 3}
    preempted = []
    for _ in range(3):
        preempted += step(s).preempted_seq_ids
    assert preempted[0] == 2  # lowest priority goes first
    assert reqs[1].status is RequestStatus.PREEMPTED and reqs[1].num_computed_tokens == 0
    s.add_request(make_request(4, 3, 2, priority=0, arrival=-1.0))
    waiting_order = sorted(s.waiting, key=s._waiting_key(s.clock()))
    assert waiting_order[0] is reqs[1]  # front of its class despite the earlier arrival of 4


def test_outputs_identical_with_preemption_and_chunking(backend):
    def workload(**cfg):
        s = make_scheduler(backend, **cfg)
        reqs = [make_request(i, prompt_len=5 + 3 * i, max_tokens=12 + i) for i in range(1, 9)]
        for r in reqs:
            s.add_request(r)
        run_to_completion(s)
        assert s.kv.num_free_blocks == s.kv.num_blocks
        return [r.output_token_ids for r in reqs], s.num_preemptions_total

    baseline, p0 = workload(num_blocks=256)
    chunked, _ = workload(num_blocks=256, max_num_batched_tokens=7)
    tight, preemptions = workload(num_blocks=14)
    assert p0 == 0 and preemptions > 0
    assert baseline == chunked == tight


def test_single_request_that_cannot_fit_errors_instead_of_deadlock(backend):
    s = make_scheduler(backend, num_blocks=3, block_size=4)
    r = make_request(1, prompt_len=8, max_tokens=100)
    s.add_request(r)
    run_to_completion(s, max_steps=50)
    assert r.finish_reason is FinishReason.ERROR and "KV cache" in r.error
    assert [x.seq_id for x in s.take_finished()] == [1]
    assert s.kv.num_free_blocks == 3


def test_abort_frees_blocks_immediately(backend):
    s = make_scheduler(backend, num_blocks=20)
    a, b = make_request(1, 8, 50), make_request(2, 8, 50)
    s.add_request(a)
    s.add_request(b)
    step(s)
    free_before = s.kv.num_free_blocks
    assert [x.seq_id for x in s.abort_request("r1")] == [1]
    assert s.kv.num_free_blocks > free_before and a.finish_reason is FinishReason.ABORT
    assert s.abort_request("r1") == [] and s.abort_request("unknown") == []
    assert s.num_running == 1


def test_stop_conditions(backend):
    s = make_scheduler(backend, max_model_len=14)
    eos = make_request(1, 4, 10)
    min_tok = make_request(2, 4, 10, min_tokens=3)
    length = make_request(3, 4, 3)
    ctx = make_request(4, 10, 100)
    stop_id = make_request(5, 4, 10, stop_token_ids=(2,), ignore_eos=True)
    for r in (eos, min_tok, length, ctx, stop_id):
        s.add_request(r)
    eos_at = {1: 1, 2: 2, 5: 0}
    while s.has_unfinished():
        step(s, eos_at)
        eos_at[2] = min_tok.num_output_tokens  # keep offering EOS to the min_tokens request
    assert (eos.output_token_ids[-1], eos.num_output_tokens, eos.finish_reason) == (2, 2, FinishReason.STOP)
    assert min_tok.num_output_tokens == 4 and min_tok.finish_reason is FinishReason.STOP
    assert length.num_output_tokens == 3 and length.finish_reason is FinishReason.LENGTH
    assert ctx.num_tokens == 14 and ctx.finish_reason is FinishReason.LENGTH
    assert stop_id.stop_reason == 2 and stop_id.num_output_tokens == 1


def test_n_children_fork_from_the_prompt_blocks(backend):
    s = make_scheduler(backend, num_blocks=40, block_size=4)
    leader = make_request(1, prompt_len=10, max_tokens=6, rid="g")
    children = [
        Request(
            seq_id=10 + i,
            request_id="g",
            index=i,
            prompt_token_ids=leader.prompt_token_ids,
            sampling_params=leader.sampling_params,
            arrival_time=0.0,
            eos_token_ids=(2,),
        )
        for i in (1, 2)
    ]
    s.add_request(leader, children)
    out = step(s)
    assert [r.seq_id for r in out.sequences[0].fork_rows] == [11, 12]
    # Three sequences share the prompt's 3 blocks: only 3 are used.
    assert s.kv.num_free_blocks == 40 - 3
    run_to_completion(s)
    outs = [leader.output_token_ids, children[0].output_token_ids, children[1].output_token_ids]
    assert all(len(o) == 6 for o in outs) and len({tuple(o) for o in outs}) == 3
    assert s.kv.num_free_blocks == 40


def test_speculative_tokens_are_extra_new_tokens_and_rejections_truncate(backend):
    s = make_scheduler(backend, num_blocks=40, block_size=4)
    r = make_request(1, prompt_len=6, max_tokens=20)
    s.add_request(r)
    step(s)
    r.spec_token_ids = [7, 8, 9]
    out = s.schedule()
    (x,) = out.sequences
    assert x.num_new_tokens == 4 and x.num_spec_tokens == 3 and x.token_ids[1:] == [7, 8, 9]
    from pagedinfer.engine.core.scheduler_output import ModelRunnerOutput, SampledTokens

    s.update(out, ModelRunnerOutput([SampledTokens(1, [7, 11])]))  # one draft accepted + bonus
    assert r.output_token_ids[-2:] == [7, 11]
    assert r.num_computed_tokens == 6 + 1 + 1 and s.kv.num_tokens(1) == 8
    assert r.num_tokens == 9


def test_no_block_leak_after_random_workload(backend):
    rng = random.Random(0)
    s = make_scheduler(backend, num_blocks=40, block_size=4, max_num_batched_tokens=24, max_num_seqs=6)
    next_id = 1
    live = []
    for step_no in range(400):
        if step_no < 300 and rng.random() < 0.4:
            n = rng.choice([1, 1, 2, 3])
            leader = make_request(next_id, rng.randint(1, 30), rng.randint(1, 20), priority=rng.randint(0, 2))
            kids = [
                Request(
                    seq_id=next_id + i,
                    request_id=leader.request_id,
                    index=i,
                    prompt_token_ids=leader.prompt_token_ids,
                    sampling_params=leader.sampling_params,
                    arrival_time=0.0,
                    eos_token_ids=(2,),
                )
                for i in range(1, n)
            ]
            s.add_request(leader, kids)
            live.append(leader.request_id)
            next_id += n
        if live and rng.random() < 0.1:
            s.abort_request(live.pop(rng.randrange(len(live))))
        step(s)
        for seq in s.running:  # the Python-side slot count mirrors the KV manager's
            assert s.kv.num_tokens(seq.seq_id) == seq.num_kv_tokens
    run_to_completion(s)
    assert s.num_preemptions_total > 0
    assert s.kv.num_free_blocks == s.kv.num_blocks
    assert not s.by_seq_id and not s._by_request_id


def test_higher_priority_arrival_preempts_lower_priority_running(backend):
    # 8 blocks of 4 slots: the low-priority request holds 6; the urgent one needs 5.
    s = make_scheduler(backend, num_blocks=8, block_size=4, max_num_seqs=4)
    low = make_request(1, prompt_len=22, max_tokens=8, priority=0)
    s.add_request(low)
    step(s)
    urgent = make_request(2, prompt_len=18, max_tokens=3, priority=5)
    s.add_request(urgent)
    out = step(s)
    assert out.preempted_seq_ids == [1] and low.status is RequestStatus.PREEMPTED
    assert [x.seq_id for x in out.sequences] == [2]
    # An equal-priority arrival never preempts: it waits.
    s2 = make_scheduler(backend, num_blocks=8, block_size=4)
    s2.add_request(make_request(1, prompt_len=22, max_tokens=50, priority=1))
    step(s2)
    s2.add_request(make_request(2, prompt_len=18, max_tokens=3, priority=1))
    assert step(s2).preempted_seq_ids == [] and s2.num_waiting == 1
    run_to_completion(s)
    assert low.num_output_tokens == 8 and low.finish_reason is FinishReason.LENGTH
    assert s.kv.num_free_blocks == 8


@pytest.mark.parametrize("chunked", [True, False])
def test_a_preempted_sequence_that_outgrew_the_pool_or_budget_ends_with_an_error(backend, chunked):
    """A preempted sequence comes back with its outputs: one that the whole pool (or, without
    chunked prefill, the whole token budget) can no longer hold ends with an error instead of
    waiting forever at the head of the strict-order queue with everything behind it. (Reachable
    with speculation: a sequence sharing its prompt blocks with siblings ran K + 1 tokens a step
    past what the pool holds alone; found by a review, 2026-12-06.)"""
    s = make_scheduler(backend, num_blocks=8, block_size=4, max_num_seqs=4, enable_chunked_prefill=chunked,
                       max_num_batched_tokens=64 if chunked else 24)  # fmt: skip
    grown = make_request(1, 8, 40)
    s.add_request(grown)
    grown.output_token_ids.extend([5] * (33 if chunked else 20))  # 41 tokens > 32 slots; 28 > 24
    grown.status = RequestStatus.PREEMPTED  # (as Scheduler._preempt leaves it: no KV, waiting)
    behind = make_request(2, 6, 2)
    s.add_request(behind)
    out = step(s)
    assert [x.seq_id for x in out.sequences] == [2]
    finished = s.take_finished()
    assert finished == [grown] and grown.finish_reason is FinishReason.ERROR, finished
    assert "does not fit" in grown.error or "max_num_batched_tokens" in grown.error
    while s.has_unfinished():
        step(s)
    assert s.kv.num_free_blocks == s.kv.num_blocks


@pytest.mark.parametrize("chunked", [True, False])
def test_drafts_leave_the_next_admission_its_share_of_the_budget(backend, chunked):
    """Two decodes with 5 drafts each and a 10-token prompt waiting, budget 16: the decodes' own
    tokens leave 14; the prompt is held half of that with chunked prefill (7), all of it
    without (what plain decoding would give it); the drafts get what is left, the first sequence's before the second's (and a token
    held for the second's own). No seat for the waiting request: drafts take it all."""
    s = make_scheduler(backend, max_num_batched_tokens=16, max_num_seqs=3, enable_chunked_prefill=chunked)
    for i in range(2):
        s.add_request(make_request(i, prompt_len=6, max_tokens=20))
    step(s)  # both prompts (12 tokens)
    for seq in s.running:
        seq.spec_token_ids = [9] * 5
    s.add_request(make_request(2, prompt_len=10, max_tokens=20))
    assert s.admission_reserve(16) == (7 if chunked else 10)
    out = s.schedule()
    got = {x.seq_id: (x.num_new_tokens, x.num_spec_tokens) for x in out.sequences}
    if chunked:  # 1 + 5 (16 - 7 held - 1 for the second), 1 + 2 (10 - 7 held): the prompt 7
        assert got == {0: (6, 5), 1: (3, 2), 2: (7, 0)}, got
    else:  # 1 + 4 and 1 + 0 leave the whole prompt its 10
        assert got == {0: (5, 4), 1: (1, 0), 2: (10, 0)}, got
    # a full house: nobody to admit, the drafts take the budget in order
    full = make_scheduler(backend, max_num_batched_tokens=8, max_num_seqs=2, enable_chunked_prefill=chunked)
    for i in range(2):
        full.add_request(make_request(i, prompt_len=4, max_tokens=20))
    step(full)
    for seq in full.running:
        seq.spec_token_ids = [9] * 5
    full.add_request(make_request(2, prompt_len=4, max_tokens=20))
    assert full.admission_reserve(8) == 0
    out = full.schedule()
    assert [(x.num_new_tokens, x.num_spec_tokens) for x in out.sequences] == [(6, 5), (2, 1)]


def _decoding(s, *requests):
    for r in requests:
        s.add_request(r)
    step(s)


def test_a_prompt_between_decodes_leaves_the_later_decode_its_token(backend):
    """Running order A (decode, priority 1), P (a prompt being chunked, priority 1), B (decode,
    priority 0), budget 8. Plain: P's chunk leaves B its token (6, not 7: B got none before,
    until P's prompt was done). With 6 drafts for A: A's drafts leave B its token and P up to
    half of what the three tokens leave (2), so A 1 + 3, P 3, B 1 (before: A 1 + 6, P 1, B 0)."""
    for drafts, want in (
        ([], {0: (1, 0), 2: (6, 0), 1: (1, 0)}),
        ([9] * 6, {0: (4, 3), 2: (3, 0), 1: (1, 0)}),
    ):
        s = make_scheduler(backend, max_num_batched_tokens=8, max_num_seqs=4, enable_chunked_prefill=True)
        _decoding(
            s,
            make_request(0, prompt_len=4, max_tokens=30, priority=1),
            make_request(1, prompt_len=4, max_tokens=30),
        )
        s.add_request(make_request(2, prompt_len=20, max_tokens=30, priority=1))
        step(s)  # A and B decode, P's first chunk (6)
        s.get_sequence(0).spec_token_ids = list(drafts)
        out = s.schedule()
        assert [x.seq_id for x in out.sequences] == [0, 2, 1]  # (priority, then admission order)
        got = {x.seq_id: (x.num_new_tokens, x.num_spec_tokens) for x in out.sequences}
        assert got == want, (drafts, got)


def test_drafts_leave_an_admission_the_last_token_of_the_budget(backend):
    """Three decodes with 3 drafts each, budget 4, a prompt waiting, chunked prefill: the decodes'
    own tokens leave 1, and plain decoding gives it to the prompt; so do the drafts now (before:
    they took it, and the prompt waited until a decode ended)."""
    s = make_scheduler(backend, max_num_batched_tokens=4, max_num_seqs=4, enable_chunked_prefill=True)
    for i in range(3):
        s.add_request(make_request(i, prompt_len=4, max_tokens=30))
    while len(s.running) < 3 or any(r.num_computed_tokens < 4 for r in s.running):
        step(s)
    for seq in s.running:
        seq.spec_token_ids = [9] * 3
    s.add_request(make_request(3, prompt_len=6, max_tokens=30))
    out = s.schedule()
    got = {x.seq_id: (x.num_new_tokens, x.num_spec_tokens) for x in out.sequences}
    assert got == {0: (1, 0), 1: (1, 0), 2: (1, 0), 3: (1, 0)}, got


def test_priority_preemption_never_preempts_what_aging_readmits_first(backend):
    """A low-priority request aged above a high-priority arrival: preempting it for the arrival
    (a strictly higher base priority) put it back at the head of the queue, aged first, so it
    was admitted again ahead of the arrival and recomputed its prompt, and preempted again: 4
    times here; in a scheduler fuzz case (a 61-token recompute over a 55-token budget) every
    step, forever. Now the preemption does not happen: the old request runs on, then the
    arrival."""
    clock = FakeClock()
    s = make_scheduler(
        backend,
        clock=clock,
        num_blocks=12,
        block_size=4,
        max_num_seqs=2,
        aging_seconds=3.0,
        max_num_batched_tokens=16,  # its prompt takes two steps: it never got past the first
    )
    old = make_request(1, prompt_len=30, max_tokens=4, priority=0, arrival=clock.now - 10.0)  # aged 0 + 3
    s.add_request(old)
    step(s)  # the first 16 of its 30 prompt tokens: 4 of the 12 blocks
    s.add_request(make_request(2, prompt_len=20, max_tokens=4, priority=1, arrival=clock.now))  # 5 blocks
    run_to_completion(s, max_steps=50)  # (asserts progress)
    assert s.num_preemptions_total == 0


def test_drafts_give_way_to_an_admission_their_kv_blocks_would_keep_out(backend):
    """A pool of 12 blocks of 4: A decodes at 4 tokens (1 block), W waits with a 42-token prompt
    (11 blocks). Plain decoding admits W at once; A's 3 drafts would take a second block, so
    this step A verifies none and W is admitted (before: W waited until A ended). With room for
    both, A keeps its drafts."""
    for num_blocks, want in ((12, {0: (1, 0), 1: (31, 0)}), (13, {0: (4, 3), 1: (28, 0)})):
        s = make_scheduler(
            backend, num_blocks=num_blocks, block_size=4, max_num_batched_tokens=32, max_num_seqs=4
        )
        _decoding(s, make_request(0, prompt_len=3, max_tokens=30))
        s.get_sequence(0).spec_token_ids = [9, 9, 9]
        s.add_request(make_request(1, prompt_len=42, max_tokens=30))
        out = s.schedule()
        got = {x.seq_id: (x.num_new_tokens, x.num_spec_tokens) for x in out.sequences}
        assert got == want, (num_blocks, got)


def test_drafts_vs_admission_counts_a_forks_copy_on_write_blocks(backend):
    """A group of two (leader and child) shares a 10-token prompt's 3 blocks of 4, the last
    half full: their first output tokens copy it once (the second writer writes in place).
    Pool of 12: 9 free, the copy leaves 8, and W's 28-token prompt needs 7, so plain decoding
    admits W. With two drafts each, the group's drafts take 2 more blocks: W would wait, so
    nobody drafts this step (before, the copy was not counted and the drafts took W's blocks).
    With a pool of 14 there is room for both, and the drafts stay."""
    for num_blocks, want in (
        (12, {1: (1, 0), 11: (1, 0), 2: (28, 0)}),
        (14, {1: (3, 2), 11: (3, 2), 2: (28, 0)}),
    ):
        s = make_scheduler(
            backend, num_blocks=num_blocks, block_size=4, max_num_batched_tokens=64, max_num_seqs=4
        )
        leader = make_request(1, prompt_len=10, max_tokens=30, rid="g")
        child = Request(
            seq_id=11,
            request_id="g",
            index=1,
            prompt_token_ids=leader.prompt_token_ids,
            sampling_params=leader.sampling_params,
            arrival_time=0.0,
            eos_token_ids=(2,),
        )
        s.add_request(leader, [child])
        step(s)
        assert s.kv.num_free_blocks == num_blocks - 3
        for seq_id in (1, 11):
            s.get_sequence(seq_id).spec_token_ids = [9, 9]
        s.add_request(make_request(2, prompt_len=28, max_tokens=30))
        out = s.schedule()
        got = {x.seq_id: (x.num_new_tokens, x.num_spec_tokens) for x in out.sequences}
        assert got == want, (num_blocks, got)


def test_drafts_vs_admission_counts_the_drafts_the_budget_gives(backend):
    """Without chunked prefill, budget 8, a pool of 3 blocks of 4: A decodes at 3 tokens (one
    block), W waits with 4 tokens (one block). Plain decoding admits W. A's 8 drafts would take
    2 more blocks and keep W out, but the budget gives A 3 of them (W keeps its 4 tokens), which
    fit one block: A verifies 3 and W is admitted (before, all 8 were counted and A verified
    none)."""
    s = make_scheduler(
        backend, num_blocks=3, block_size=4, max_num_batched_tokens=8, enable_chunked_prefill=False
    )
    _decoding(s, make_request(0, prompt_len=3, max_tokens=30))
    s.get_sequence(0).spec_token_ids = [9] * 8
    s.add_request(make_request(9, prompt_len=4, max_tokens=30))
    out = s.schedule()
    assert {x.seq_id: (x.num_new_tokens, x.num_spec_tokens) for x in out.sequences} == {0: (4, 3), 9: (4, 0)}
    assert s.kv.num_free_blocks == 0


def test_drafts_are_not_withheld_for_a_request_plain_decoding_does_not_admit(backend):
    """Without chunked prefill, budget 16: three decodes' own tokens leave 13 of it, and W's
    prompt is 14 tokens, so plain decoding does not admit W this step. The pool is short (W's
    4 blocks would fit the 5 free ones, the drafts' 3 leave 2), but nothing is to be kept for W:
    the drafts go (before, all 9 were withheld and W waited anyway)."""
    s = make_scheduler(
        backend,
        num_blocks=8,
        block_size=4,
        max_num_batched_tokens=16,
        max_num_seqs=8,
        enable_chunked_prefill=False,
    )
    _decoding(s, *(make_request(i, prompt_len=3, max_tokens=30) for i in range(3)))
    for r in s.running:
        r.spec_token_ids = [9, 9, 9]
    s.add_request(make_request(9, prompt_len=14, max_tokens=30))
    out = s.schedule()
    assert {x.seq_id: (x.num_new_tokens, x.num_spec_tokens) for x in out.sequences} == {
        i: (4, 3) for i in range(3)
    }
