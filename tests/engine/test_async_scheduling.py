"""Async scheduling (engine/core/lookahead.py) on a tiny random Llama (CPU, forced on): every
output, seed and KV block ends exactly as with synchronous steps, and lookahead steps really run."""

from __future__ import annotations

import contextlib
import random

import pytest

from pagedinfer.engine.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from pagedinfer.engine.llm import LLM
from pagedinfer.engine.sampling_params import SamplingParams


def make_llm(folder, async_scheduling: bool, num_blocks=256, **sched) -> LLM:
    config = EngineConfig(
        model=str(folder),
        cache=CacheConfig(block_size=4, num_blocks=num_blocks),
        scheduler=SchedulerConfig(
            max_model_len=96, async_scheduling=async_scheduling, aging_seconds=0, **sched
        ),
        device=DeviceConfig(device="cpu", dtype="float32"),
    )
    return LLM(config)


@pytest.fixture(scope="module")
def pair(tiny_llama_dir):
    return make_llm(tiny_llama_dir, False), make_llm(tiny_llama_dir, True)


def prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randint(3, 30))] for _ in range(n)]


def mixed_params(n: int) -> list[SamplingParams]:
    """Greedy and seeded sampling with different lengths, stop tokens and min_tokens (all
    lookahead-eligible), plus rows that keep their steps synchronous (penalties, logprobs)."""
    rng = random.Random(1)
    out = []
    for i in range(n):
        kind = i % 6
        kw = dict(max_tokens=rng.randint(1, 20), seed=100 + i)
        if kind == 0:
            out.append(SamplingParams(temperature=0.0, ignore_eos=True, **kw))
        elif kind == 1:
            out.append(SamplingParams(temperature=0.9, top_p=0.9, ignore_eos=True, **kw))
        elif kind == 2:
            out.append(
                SamplingParams(temperature=1.0, top_k=20, stop_token_ids=[7, 11, 19], min_tokens=2, **kw)
            )
        elif kind == 3:
            out.append(SamplingParams(temperature=0.0, stop_token_ids=[3, 5, 9], **kw))
        elif kind == 4:
            out.append(SamplingParams(temperature=0.8, presence_penalty=0.5, **kw))
        else:
            out.append(SamplingParams(temperature=0.0, logprobs=2, ignore_eos=True, **kw))
    return out


def run(llm, ps, params):
    outs = llm.generate(prompt_token_ids=ps, sampling_params=params)
    return [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.completions] for o in outs]


def assert_idle_and_free(llm):
    core = llm.core
    assert not core.has_unfinished()
    kv = core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks  # free or prefix-cached: nothing leaked


def test_greedy_and_seeded_outputs_are_identical(pair):
    sync, asyn = pair
    ps = prompts(8, seed=4)
    params = [
        SamplingParams(max_tokens=16 + i, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True)
        for i in range(8)
    ]
    before = asyn.core.num_lookahead_steps
    assert run(asyn, ps, params) == run(sync, ps, params)
    # Most decode steps of this batch go ahead of their predecessor's tokens.
    assert asyn.core.num_lookahead_steps - before >= 15
    assert sync.core.num_lookahead_steps == 0
    assert_idle_and_free(asyn)


def test_mixed_workload_with_stops_and_synchronous_rows_is_identical(pair):
    sync, asyn = pair
    ps = prompts(12, seed=5)
    params = mixed_params(12)
    before = asyn.core.num_lookahead_steps
    assert run(asyn, ps, params) == run(sync, ps, params)
    assert asyn.core.num_lookahead_steps > before
    assert_idle_and_free(asyn)


def test_only_eligible_batches_look_ahead(pair):
    _, asyn = pair
    ps = prompts(4, seed=6)
    before = asyn.core.num_lookahead_steps
    asyn.generate(prompt_token_ids=ps, sampling_params=SamplingParams(max_tokens=10, presence_penalty=1.0))
    asyn.generate(prompt_token_ids=ps, sampling_params=SamplingParams(max_tokens=10, logprobs=1))
    assert asyn.core.num_lookahead_steps == before  # penalties and logprobs keep steps synchronous
    assert_idle_and_free(asyn)


def test_generated_blocks_are_prefix_cached_under_their_real_tokens(pair):
    """Placeholders are resolved before hashing: a follow-up prompt made of the prompt and the
    answer reuses the answer's blocks exactly as with synchronous steps."""
    sync, asyn = pair
    p = prompts(1, seed=7)[0]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    cached = []
    for llm in (sync, asyn):
        (first,) = llm.generate(prompt_token_ids=[p], sampling_params=params)
        follow = p + first.token_ids + [42, 43]
        (second,) = llm.generate(prompt_token_ids=[follow], sampling_params=params)
        cached.append((first.token_ids, second.usage.cached_prompt_tokens, second.token_ids))
    assert cached[0] == cached[1]
    assert cached[1][1] >= (len(p) + 24) // 4 * 4 - 4  # the answer's full blocks were hit


def test_random_arrivals_aborts_and_preemptions_leave_no_block_behind(tiny_llama_dir):
    """Requests arrive and are aborted between steps while a lookahead step is in flight; a
    tight pool forces preemptions. Same tokens per surviving request as synchronous steps."""
    results = {}
    for async_scheduling in (False, True):
        llm = make_llm(
            tiny_llama_dir, async_scheduling, num_blocks=40, max_num_batched_tokens=32, max_num_seqs=6
        )
        core, rng = llm.core, random.Random(3)
        steps = []
        core.add_step_listener(steps.append)
        live: list[str] = []
        aborted: set[str] = set()
        tokens: dict[str, dict[int, list[int]]] = {}

        def absorb(outs, tokens=tokens):
            for out in outs:
                for d in out.deltas:
                    tokens.setdefault(out.request_id, {}).setdefault(d.index, []).extend(d.token_ids)

        for step in range(160):
            if step < 110 and rng.random() < 0.35:
                rid = f"r{step}"
                params = SamplingParams(
                    n=rng.choice([1, 1, 1, 2]),
                    max_tokens=rng.randint(1, 24),
                    temperature=rng.choice([0.0, 0.9]),
                    seed=step,
                    ignore_eos=True,
                )
                core.add_request(rid, prompts(1, seed=step)[0], params, priority=rng.randint(0, 1))
                live.append(rid)
            if live and rng.random() < 0.08:
                rid = live.pop(rng.randrange(len(live)))
                absorb(core.abort(rid))
                aborted.add(rid)
            if core.has_unfinished():
                absorb(core.step())
        while core.has_unfinished():
            absorb(core.step())
        results[async_scheduling] = {rid: t for rid, t in tokens.items() if rid not in aborted}
        kv = core.scheduler.kv
        assert kv.num_free_blocks == kv.num_blocks
        assert len(core.outputs) == 0
        # each preemption in exactly one step's stats (a step planned ahead runs no schedule())
        assert sum(s.num_preemptions for s in steps) == core.scheduler.num_preemptions_total > 0
        if async_scheduling:
            assert core.num_lookahead_steps > 20
    assert results[True] == results[False] and len(results[True]) > 20


def _keep_stepping_through_a_failure(folder, make_flaky) -> None:
    """Sync and async engines generate one sequence while `make_flaky(core)` makes one call fail;
    the caller keeps stepping. Then a prompt made of the prompt and the first 6 generated tokens
    must hit the generated blocks in the prefix cache and continue exactly alike in both: no
    placeholder was cached and no slot leaked."""
    prompt = [10, 20, 30, 40, 50, 60]
    greedy = dict(temperature=0.0, ignore_eos=True)
    outs = {}
    for asyn in (False, True):
        llm = make_llm(folder, asyn)
        core = llm.core
        core.add_request("a", prompt, SamplingParams(max_tokens=12, **greedy))
        make_flaky(core)
        core.step()
        (seq,) = core.scheduler.running
        while core.has_unfinished():
            with contextlib.suppress(RuntimeError):
                core.step()
        seq_tokens = list(seq.output_token_ids)
        probe = prompt + seq_tokens[:6] + [77]
        (o,) = llm.generate(prompt_token_ids=[probe], sampling_params=SamplingParams(max_tokens=6, **greedy))
        outs[asyn] = (seq_tokens, o.usage.cached_prompt_tokens, o.completions[0].token_ids)
        assert_idle_and_free(llm)
    assert outs[True] == outs[False]
    assert outs[True][1] == 12  # three full blocks of 4 came from the prefix cache


def test_a_failed_step_gives_back_its_lookahead_slots(tiny_llama_dir):
    """A step that fails after its lookahead was launched: the placeholder's KV slot is given
    back, so a caller that keeps stepping caches the block under the real tokens and gets the
    synchronous engine's output."""

    def make_flaky(core):
        real_collect, calls = core.runner.collect, [0]

        def flaky(pending):
            calls[0] += 1
            if calls[0] == 3:  # a lookahead (launched in this call) is in flight by now
                raise RuntimeError("transient device failure")
            return real_collect(pending)

        core.runner.collect = flaky

    _keep_stepping_through_a_failure(tiny_llama_dir, make_flaky)


def test_no_lookahead_slot_for_a_sequence_that_finishes_by_length(tiny_llama_dir):
    """Rows that reach max_tokens at step N take no lookahead slot: with the pool exhausted, the
    synchronous engine keeps a prefix-cached block that a placeholder would have evicted."""
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    p1, a = list(range(10, 18)), list(range(40, 48))  # two full blocks each
    cached = {}
    for asyn in (False, True):
        llm = make_llm(tiny_llama_dir, asyn, num_blocks=5)
        llm.generate(prompt_token_ids=[p1], sampling_params=one)
        llm.generate(prompt_token_ids=[a], sampling_params=one)  # its sample would need a 3rd block
        (q,) = llm.generate(prompt_token_ids=[p1 + [99]], sampling_params=one)
        cached[asyn] = q.usage.cached_prompt_tokens
    assert cached[True] == cached[False] == 8


def test_a_batch_that_ends_by_length_runs_no_dead_step(tiny_llama_dir):
    """When every row finishes at N by max_tokens, no step N+1 is launched; a batch where only
    some do keeps looking ahead with the others (rows mapped from N's samples)."""
    ps = [[5 + i, 6, 7, 8, 9, 10, 11] for i in range(4)]
    steps, results = {}, {}
    for asyn in (False, True):
        llm = make_llm(tiny_llama_dir, asyn)
        core = llm.core
        s0 = core._step
        results[asyn] = run(llm, ps, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        steps[asyn] = core._step - s0
        staggered = [SamplingParams(max_tokens=2 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(4)]
        l0 = core.num_lookahead_steps
        results[asyn] += run(llm, ps, staggered)
        if asyn:
            assert core.num_lookahead_steps - l0 >= 8  # lookahead continued past the early finishers
        assert_idle_and_free(llm)
    assert steps[True] == steps[False]
    assert results[True] == results[False]


def test_a_lookahead_that_fails_to_launch_gives_back_its_slots(tiny_llama_dir):
    """The lookahead's launch itself fails (after its KV slot was reserved under the placeholder):
    that slot is given back too, so a caller that keeps stepping matches the synchronous engine."""

    def make_flaky(core):
        real_launch, calls = core.runner.launch_forward, [0]

        def flaky(sched, feed=None):
            if feed is not None:
                calls[0] += 1
                if calls[0] == 2:  # the second lookahead launch
                    raise RuntimeError("transient device failure")
            return real_launch(sched, feed=feed)

        core.runner.launch_forward = flaky

    _keep_stepping_through_a_failure(tiny_llama_dir, make_flaky)


def test_a_queue_is_admitted_by_lookahead_steps(tiny_llama_dir):
    """More requests than seats (an offline batch): sequences end at staggered steps and waiting
    requests take their seats inside lookahead steps, so most steps stay asynchronous; every
    output is the synchronous engine's."""
    ps = prompts(24, seed=8)
    params = [
        SamplingParams(
            max_tokens=4 + (i * 7) % 13, temperature=0.0 if i % 3 else 0.8, seed=i, ignore_eos=True
        )
        for i in range(24)
    ]
    results, counts = {}, {}
    for asyn in (False, True):
        llm = make_llm(tiny_llama_dir, asyn, max_num_seqs=4, max_num_batched_tokens=64)
        core = llm.core
        s0, l0, a0 = core._step, core.num_lookahead_steps, core.num_lookahead_admissions
        results[asyn] = run(llm, ps, params)
        counts[asyn] = (core._step - s0, core.num_lookahead_steps - l0, core.num_lookahead_admissions - a0)
        assert_idle_and_free(llm)
    assert results[True] == results[False]
    steps, lookahead_steps, admissions = counts[True]
    assert counts[False][1:] == (0, 0)
    assert admissions >= 10  # most of the queue entered through lookahead steps
    assert lookahead_steps >= 0.6 * steps, counts


def test_a_failed_lookahead_returns_its_admissions_to_the_queue(tiny_llama_dir):
    """A lookahead that admitted waiting requests fails to launch: they go back to the queue
    with their blocks, run later, and every sequence ends with the synchronous engine's tokens
    (read from the scheduler: a step that raises does not return the outputs it had flushed)."""
    ps = prompts(10, seed=9)
    params = [SamplingParams(max_tokens=3 + i % 5, temperature=0.0, ignore_eos=True) for i in range(10)]
    results = {}
    for asyn in (False, True):
        llm = make_llm(tiny_llama_dir, asyn, max_num_seqs=3)
        core = llm.core
        failed = []
        if asyn:
            real_launch = core.runner.launch_forward

            def flaky(sched, feed=None, real_launch=real_launch, failed=failed):
                if feed is not None and len(sched.sequences) > sched.num_fed and not failed:
                    failed.append([s.seq_id for s in sched.sequences[sched.num_fed :]])
                    raise RuntimeError("transient device failure")
                return real_launch(sched, feed=feed)

            core.runner.launch_forward = flaky
        for i, (p, sp) in enumerate(zip(ps, params, strict=True)):
            core.add_request(f"r{i}", p, sp)
        seqs = {r.request_id: r for r in core.scheduler.waiting}
        while core.has_unfinished():
            try:
                core.step()
            except RuntimeError:
                if asyn:  # the admitted requests are queued again, holding no blocks
                    waiting = {r.seq_id for r in core.scheduler.waiting}
                    assert set(failed[0]) <= waiting
                    for seq_id in failed[0]:  # freed: the KV manager no longer knows them
                        with pytest.raises(KeyError):
                            core.scheduler.kv.block_table(seq_id)
                    # never scheduled after all: no queue time ended, no cached tokens counted
                    requeued = [r for r in core.scheduler.waiting if r.seq_id in failed[0]]
                    assert all(r.first_scheduled_time is None and r.num_cached_tokens == 0 for r in requeued)
        results[asyn] = {rid: list(r.output_token_ids) for rid, r in seqs.items()}
        if asyn:
            assert failed, "no lookahead admitted a request"
        kv = core.scheduler.kv
        assert kv.num_free_blocks == kv.num_blocks
    assert results[True] == results[False]
    assert [len(t) for t in results[True].values()] == [sp.max_tokens for sp in params]


def test_a_lookahead_that_fails_while_planned_gives_back_its_slots(tiny_llama_dir):
    """Planning itself fails after the placeholder slots were reserved (in the admission step):
    nothing is in flight yet, so the planner undoes them; a caller that keeps stepping matches the
    synchronous engine, prefix-cache hits included (no block cached under a placeholder)."""

    def make_flaky(core):
        real_admit, calls = core.scheduler.admit_waiting, [0]

        def flaky(budget, scheduled):
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("failure while planning a lookahead")
            return real_admit(budget, scheduled)

        core.scheduler.admit_waiting = flaky

    _keep_stepping_through_a_failure(tiny_llama_dir, make_flaky)


def test_sequences_stopping_on_sampled_tokens_do_not_end_the_lookahead(pair):
    """Sequences that stop on stop ids at different steps: after each stop the batch goes on
    ahead without the stopped sequence (its row in the launched step is dropped), so every decode
    step but the first is a lookahead; outputs equal the synchronous ones."""
    sync, asyn = pair
    rng = random.Random(3)
    ps = prompts(16, seed=9)
    params = [
        SamplingParams(
            max_tokens=60, temperature=0.0, stop_token_ids=[rng.randrange(3, 256) for _ in range(6)]
        )
        for _ in ps
    ]
    steps, ahead = asyn.core._step, asyn.core.num_lookahead_steps
    want = run(sync, ps, params)
    assert run(asyn, ps, params) == want
    assert len({len(r[0][0]) for r in want}) > 6  # the stops fall in many different steps
    steps, ahead = asyn.core._step - steps, asyn.core.num_lookahead_steps - ahead
    assert ahead >= steps - 2, (steps, ahead)
    assert_idle_and_free(asyn)


def test_a_whole_batch_stopping_at_once_with_a_queue(tiny_llama_dir, pair):
    """Every running sequence stops on the same step while requests wait for seats: the next step
    has nothing to continue (no lookahead) and admits the queue; outputs equal the synchronous."""
    sync, _ = pair
    asyn = make_llm(tiny_llama_dir, True, max_num_seqs=2)
    ps = [[5, 6, 7, 8, 9, 10]] * 4
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    stop = run(sync, ps[:1], [greedy])[0][0][0][6]
    params = [SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop]) for _ in ps]
    assert run(asyn, ps, params) == run(sync, ps, params)
    assert_idle_and_free(asyn)
