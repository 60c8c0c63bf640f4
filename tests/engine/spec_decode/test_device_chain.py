"""Chained n-gram speculation (spec_decode/device_chain.py, core/spec_lookahead.py) on a tiny
random Llama, CPU, async scheduling forced on: greedy output is token-for-token the plain
output, chained steps really run, and every KV block (and prefix-cache entry) ends right."""

from __future__ import annotations

import random

import pytest

from pagedinfer.engine.config import SpeculativeConfig
from pagedinfer.engine.sampling_params import SamplingParams
from tests.engine.spec_decode.test_spec_engine import (
    SEEDED_MIX,
    assert_no_leak,
    follow_up_reuse,
    generate,
    greedy_workload,
    make_llm,
    prompts,
    run_requests,
    trace_admissions,
    trace_chained_requests,
)

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3)


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return make_llm(tiny_llama_dir)


def unpaused(device_steps: int) -> SpeculativeConfig:
    """N-gram, K 3, up to 3-grams, no pauses (a batch paused whole would end chains)."""
    return SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=3,
        ngram_max=3,
        min_acceptance_rate=0.0,
        device_chain_steps=device_steps,
    )


def chained(folder, spec=NGRAM, **sched):
    return make_llm(folder, spec, async_scheduling=True, **sched)


def test_chained_greedy_output_is_the_plain_output(tiny_llama_dir, plain):
    llm = chained(tiny_llama_dir)
    assert generate(llm) == generate(plain)
    stats = llm.core.spec_decoder.stats
    assert llm.core.num_chained_steps > 0  # chained steps ran
    assert stats.num_accepted_tokens > 0 and stats.mean_accepted_length > 1.0
    assert_no_leak(llm)


def test_chain_off_gives_the_same_output(tiny_llama_dir, plain):
    off = chained(
        tiny_llama_dir, SpeculativeConfig(method="ngram", num_speculative_tokens=3, device_chain=False)
    )
    assert off.core.spec_decoder.device_chain is None
    assert generate(off) == generate(plain)
    assert off.core.num_lookahead_steps == 0


@pytest.mark.parametrize(("seed", "device_steps"), [(1, 1), (2, 1), (1, 4), (2, 3)])
def test_mixed_lengths_stops_and_a_queue(tiny_llama_dir, plain, seed, device_steps):
    """Sequences finish at different steps (max_tokens, stop ids; with several device steps a
    launch, also inside one), requests wait for seats: chains end and start again; outputs equal,
    nothing leaks."""
    ps, params = greedy_workload(random.Random(seed), 9, seed, (1, 30), stop_every=2, num_stops=3)
    want = [o.token_ids for o in plain.generate(prompt_token_ids=ps, sampling_params=params)]
    spec = SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3, device_chain_steps=device_steps
    )
    llm = chained(tiny_llama_dir, spec, max_num_seqs=4)
    got = [o.token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params)]
    assert got == want
    assert llm.core.num_lookahead_steps > 0
    assert_no_leak(llm)


def test_a_chain_stays_inside_the_token_budget(tiny_llama_dir, plain):
    """Four sequences of K + 1 = 4 rows would overflow a 10-token step budget (and the runner's
    input buffers): such steps are not chained but scheduled within the budget."""
    ps = [[5, 6, 7, 8, 9] * 4, [11, 12] * 8, [40, 41, 42] * 5, [7, 8] * 6]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    llm = chained(tiny_llama_dir, unpaused(1), max_num_seqs=4, max_num_batched_tokens=10)
    got = [o.token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params)]
    assert got == [o.token_ids for o in plain.generate(prompt_token_ids=ps, sampling_params=params)]
    assert llm.core.num_chained_steps > 0  # chained once fewer sequences remain
    assert_no_leak(llm)


@pytest.mark.parametrize("device_steps", [1, 4])
def test_prefix_cache_sees_the_real_tokens(tiny_llama_dir, plain, device_steps):
    """Blocks computed by chained steps are hashed with the real ids, not the placeholders: a
    request whose prompt is the first one's prompt + output reuses them (cached tokens reach into
    the output), one with placeholder ids there reuses none of them; both decode like plain."""
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, device_chain_steps=device_steps)
    llm = chained(tiny_llama_dir, spec)
    prompt = [5, 6, 7, 8, 9] * 4
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    assert llm.core.num_chained_steps > 0
    short = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    plain_ids = lambda ps, p: [o.token_ids for o in plain.generate(prompt_token_ids=ps, sampling_params=p)]  # noqa: E731
    real, placeholder = follow_up_reuse(llm, plain_ids, prompt, first.token_ids, short)
    cached_prompt = (len(prompt) // 4) * 4  # block_size 4
    assert real - cached_prompt >= (len(first.token_ids) // 4 - 2) * 4
    assert placeholder - cached_prompt <= 0
    assert_no_leak(llm)


def test_a_chain_runs_until_its_batch_changes(tiny_llama_dir, plain):
    """Without pauses (min_acceptance_rate 0) one long sequence chains every step after its first
    two (the prompt's, then the first with host drafts); two sequences until the shorter stops,
    then again."""
    spec = unpaused(1)
    llm = chained(tiny_llama_dir, spec)
    prompt = [[5, 6, 7, 8, 9] * 4]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompt_token_ids=prompt, sampling_params=params)] == [
        o.token_ids for o in plain.generate(prompt_token_ids=prompt, sampling_params=params)
    ]
    steps, chained_steps = llm.core._step, llm.core.num_chained_steps
    assert chained_steps >= steps - 3, (steps, chained_steps)
    two = [[5, 6, 7, 8, 9] * 4, [11, 12] * 8]
    lengths = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (10, 60)]
    assert [o.token_ids for o in llm.generate(prompt_token_ids=two, sampling_params=lengths)] == [
        o.token_ids for o in plain.generate(prompt_token_ids=two, sampling_params=lengths)
    ]
    steps, chained_steps = llm.core._step - steps, llm.core.num_chained_steps - chained_steps
    assert chained_steps >= steps - 6, (steps, chained_steps)
    assert_no_leak(llm)


def test_several_device_steps_per_launch_verify_as_one_step_each(tiny_llama_dir, plain):
    """With 4 device steps a launch the engine takes far fewer steps for the same output, and the
    speculation totals (drafts, accepted, verifications) are those of one device step per launch:
    the same verifications happen, only grouped."""
    prompt = [[5, 6, 7, 8, 9] * 4]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompt_token_ids=prompt, sampling_params=params)]
    runs = {}
    for device_steps in (1, 4):
        spec = unpaused(device_steps)
        llm = chained(tiny_llama_dir, spec)
        got = [o.token_ids for o in llm.generate(prompt_token_ids=prompt, sampling_params=params)]
        assert got == want
        stats = llm.core.spec_decoder.stats
        totals = (stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_verified_sequences)
        runs[device_steps] = (llm.core._step, llm.core.num_chained_steps, totals)
        assert_no_leak(llm)
    (steps_1, chained_1, totals_1), (steps_4, chained_4, totals_4) = runs[1], runs[4]
    assert totals_4 == totals_1 and totals_1[1] > 0
    assert chained_4 >= chained_1 - 3  # the same device steps (a launch may run a few past the end)
    assert steps_4 * 2 < steps_1, runs


def _run_with_aborts(llm, ps, params, abort_at: dict[int, int]) -> dict[str, list[int]]:
    """Step the engine core by hand, aborting request i at step abort_at[i]; token ids streamed
    per request."""
    core = llm.core
    streamed: dict[str, list[int]] = {}
    for i, (p, sp) in enumerate(zip(ps, params, strict=True)):
        core.add_request(f"r{i}", p, sp)
        streamed[f"r{i}"] = []
    step = 0
    while core.has_unfinished():
        outs = core.step()
        for i, at in abort_at.items():
            if at == step:
                outs += core.abort(f"r{i}")
        for out in outs:
            for delta in out.deltas:
                streamed[out.request_id] += delta.token_ids
        step += 1
        assert step < 2000
    return streamed


@pytest.mark.parametrize("seed", range(4))
def test_aborts_and_a_tight_pool_with_several_device_steps(tiny_llama_dir, plain, seed):
    """Random lengths, stop ids, aborts at random steps (inside launches of 4 device steps) and a
    KV pool small enough that launches cannot always reserve their tokens: every request that
    was not aborted streams the plain greedy tokens, an aborted one a prefix of them, and no
    block leaks."""
    rng = random.Random(100 + seed)
    ps, params = greedy_workload(rng, 6, seed, (5, 40), stop_every=3)
    want = [o.token_ids for o in plain.generate(prompt_token_ids=ps, sampling_params=params)]
    spec = unpaused(4)
    llm = make_llm(tiny_llama_dir, spec, num_blocks=48, async_scheduling=True, max_num_seqs=4)
    abort_at = {i: rng.randint(2, 25) for i in rng.sample(range(len(ps)), 2)}
    got = _run_with_aborts(llm, ps, params, abort_at)
    assert llm.core.num_chained_steps > 0
    for i, tokens in enumerate(want):
        if i in abort_at:
            assert got[f"r{i}"] == tokens[: len(got[f"r{i}"])]
        else:
            assert got[f"r{i}"] == tokens, i
    assert_no_leak(llm)


def test_a_request_that_fits_once_the_chain_lets_go_is_admitted(tiny_llama_dir):
    """The chain's KV reservations for drafts not yet verified count as free when deciding whether
    a waiting request could be admitted: a request that fits only once they are released ends the
    chain and is admitted long before the running request finishes."""
    spec = unpaused(4)
    llm = make_llm(tiny_llama_dir, spec, num_blocks=40, async_scheduling=True, max_num_seqs=4)
    core = llm.core
    core.add_request(
        "r0", [5, 6, 7, 8, 9] * 4, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    )
    added_at = admitted_at = None
    while core.has_unfinished():
        core.step()
        r0 = [s for s in core.scheduler.running if s.request_id == "r0"]
        outputs = len(r0[0].output_token_ids) if r0 else None
        if added_at is None and outputs is not None and outputs >= 20:
            long_prompt = [17, 18, 19, 20] * 26  # 104 tokens: 26 of the 40 blocks
            core.add_request(
                "r1", long_prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            )
            added_at = outputs
        if (
            added_at is not None
            and admitted_at is None
            and any(s.request_id == "r1" for s in core.scheduler.running)
        ):
            admitted_at = outputs
    assert core.num_chained_steps > 0
    assert admitted_at is not None and admitted_at <= added_at + 16, (added_at, admitted_at)
    assert_no_leak(llm)


def test_no_launch_runs_after_its_sequence_has_certainly_finished(tiny_llama_dir, plain):
    """A launch plans no device step that starts after max_tokens was certainly reached (every
    device step of the launch before emits >= 1 token)."""
    spec = unpaused(4)
    llm = chained(tiny_llama_dir, spec)
    launches = []
    plan = llm.core.runner.launch_forward

    def record(sched, feed=None):
        if sched.feeds_drafts:
            seq = llm.core.scheduler.get_sequence(sched.sequences[0].seq_id)
            launches.append((sched.num_device_steps, len(seq.output_token_ids)))
        return plan(sched, feed)

    llm.core.runner.launch_forward = record
    for max_tokens in (10, 17, 40):
        launches.clear()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        prompt = [[5, 6, 7, 8, 9] * 4]
        got = [o.token_ids for o in llm.generate(prompt_token_ids=prompt, sampling_params=params)]
        assert got == [o.token_ids for o in plain.generate(prompt_token_ids=prompt, sampling_params=params)]
        assert launches
        # A launch is planned while its predecessor runs; both emit >= 1 token a device step, so
        # outputs applied + the predecessor's device steps + its own stay within max_tokens (the
        # first one's predecessor is a synchronous step).
        prev_steps = [1] + [steps for steps, _ in launches[:-1]]
        for (steps, known), before in zip(launches, prev_steps, strict=True):
            assert known + before + steps <= max_tokens, (max_tokens, launches)
    assert_no_leak(llm)


@pytest.mark.parametrize("device_steps", [1, 4])
def test_a_chain_goes_on_when_a_sequence_stops(tiny_llama_dir, plain, device_steps):
    """Sequences that stop at different steps (max_tokens, stop ids) leave the chain; the others
    go on chained (their device histories compacted), so after the prompt's step and the first
    with host drafts every step is planned ahead; outputs equal plain greedy, nothing leaks."""
    spec = unpaused(device_steps)
    llm = chained(tiny_llama_dir, spec)
    ps = [[5, 6, 7, 8, 9] * 4, [11, 12] * 8, [21, 22, 23] * 5, [31, 32, 33, 34] * 4]
    want_params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 60, 30, 45)]
    want = [o.token_ids for o in plain.generate(prompt_token_ids=ps, sampling_params=want_params)]
    stop_mid = want[3][20]  # the fourth sequence stops on a sampled id instead of by length
    params = [
        *want_params[:3],
        SamplingParams(max_tokens=45, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_mid]),
    ]
    steps, launches = llm.core._step, llm.core.num_lookahead_steps
    got = [o.token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params)]
    assert got[:3] == want[:3] and got[3] == want[3][: want[3].index(stop_mid) + 1]
    steps, launches = llm.core._step - steps, llm.core.num_lookahead_steps - launches
    assert launches >= steps - 3, (steps, launches)
    assert_no_leak(llm)


def _run(core, ps, params) -> list[list[int]]:
    """Each request's output ids (requests r0, r1, ... of one completion each)."""
    outs = run_requests(core, ps, params)
    return [outs.get((f"r{i}", 0), []) for i in range(len(ps))]


@pytest.mark.parametrize(("seed", "device_steps"), [(3, 1), (4, 4), (5, 4)])
def test_a_queue_is_admitted_into_chained_steps(tiny_llama_dir, plain, seed, device_steps):
    """Requests waiting for a seat are admitted into the chained step behind its chained rows
    (that step runs one device step) and chain from the next: a refilled batch stays chained.
    Outputs equal plain greedy; nothing leaks."""
    ps, params = greedy_workload(random.Random(seed), 10, seed, (4, 30), stop_every=3)
    want = [o.token_ids for o in plain.generate(prompt_token_ids=ps, sampling_params=params)]
    llm = chained(tiny_llama_dir, unpaused(device_steps), max_num_seqs=3)
    log = trace_admissions(llm.core)
    assert _run(llm.core, ps, params) == want
    admitting = [chained_step for admits, chained_step in log[1:] if admits]
    # (before: every admission was a synchronous step)
    assert len(admitting) >= 5 and sum(admitting) >= len(admitting) - 1, log
    assert llm.core.num_lookahead_admissions >= len(admitting) - 1
    assert_no_leak(llm)


def test_only_history_free_sampling_is_admitted_into_a_chain(tiny_llama_dir, plain):
    """A chained n-gram step draws every row on the device as the plain sampler would: a waiting
    request that samples (temperature > 0, seeded) joins it, one that asks for logprobs or has
    penalties (they read the tokens before, still on the device) ends the chain instead, and the
    synchronous step admits it. Every request's tokens equal the plain engine's (same seeds)."""
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True)
    with_logprobs = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
    penalized = SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.2, ignore_eos=True)
    ps = [[5, 6, 7, 8, 9] * 4, [11, 12] * 8, [40, 41, 42] * 5, [7, 8] * 6, [9, 10] * 6]
    short = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)  # r2 waits for its seat
    params = [greedy, short, sampled, with_logprobs, penalized]
    want = [o.token_ids for o in plain.generate(prompt_token_ids=ps, sampling_params=params)]
    llm = chained(tiny_llama_dir, unpaused(1), max_num_seqs=2)
    in_chains = trace_chained_requests(llm.core)
    assert _run(llm.core, ps, params) == want
    assert {"r0", "r1", "r2"} <= in_chains and not {"r3", "r4"} & in_chains, in_chains
    assert_no_leak(llm)


@pytest.mark.parametrize(("device_steps", "max_num_seqs"), [(1, 8), (4, 8), (1, 3), (4, 3)])
def test_seeded_sampling_in_chains_is_the_plain_output(tiny_llama_dir, plain, device_steps, max_num_seqs):
    """Seeded sampled requests (temperature, top-k / top-p / min-p) with greedy ones, chained on
    the device, several device steps a launch, and (3 seats) admitted into chained steps: each
    row is drawn with its seeded noise at an output position read from the device's histories,
    so every request's tokens equal the plain engine's. Drafts are accepted; nothing leaks."""
    ps = prompts(4, seed=9) + prompts(3, seed=10)
    params = [SEEDED_MIX[i % len(SEEDED_MIX)] for i in range(len(ps))]
    want = [o.token_ids for o in plain.generate(prompt_token_ids=ps, sampling_params=params)]
    llm = chained(tiny_llama_dir, unpaused(device_steps), max_num_seqs=max_num_seqs)
    in_chains = trace_chained_requests(llm.core)
    assert _run(llm.core, ps, params) == want
    sampled = {f"r{i}" for i, p in enumerate(params) if p.temperature > 0}
    assert sampled <= in_chains, in_chains
    assert llm.core.num_chained_steps >= 10
    assert llm.core.spec_decoder.stats.num_accepted_tokens > 0
    assert_no_leak(llm)


def test_a_paused_sequence_rides_the_chain(tiny_llama_dir, plain):
    """A sequence the policy paused rides a chain of others that draft, as it rides a synchronous
    step where others draft (its drafts are verified; the step costs the same); only a batch
    paused whole stops chaining (and drafting). Outputs equal plain greedy either way."""
    ps, params = greedy_workload(random.Random(11), 4, 11, (20, 40), stop_every=5)
    want = [o.token_ids for o in plain.generate(prompt_token_ids=ps, sampling_params=params)]
    for paused_whole in (False, True):
        llm = chained(tiny_llama_dir, unpaused(1))
        policy = llm.core.spec_decoder.policy
        first: list[int] = []

        def is_paused(seq_id, first=first, whole=paused_whole):
            if not first:
                first.append(seq_id)
            return whole or seq_id == first[0]

        policy.is_paused = is_paused
        if paused_whole:
            policy.should_speculate = lambda seq_id: False
        assert [o.token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params)] == want
        if paused_whole:
            assert llm.core.num_chained_steps == 0 and llm.core.spec_decoder.stats.num_draft_tokens == 0
        else:
            assert llm.core.num_chained_steps > 10, llm.core.num_chained_steps
        assert_no_leak(llm)
