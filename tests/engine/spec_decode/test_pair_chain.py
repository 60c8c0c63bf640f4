"""Draft-model steps chained on the device (DraftModelProposer.reserve_chained / launch_chained /
resolve_chained, core/spec_lookahead.py with `reserve_drafts`): each chained step is planned and
launched before the step before it is collected; the draft model drafts from the device token
histories that step's acceptance left. Same tokens as plain greedy decoding, the same drafts as
the synchronous pair, and every KV record (target and draft) ends right."""

from __future__ import annotations

import random

import pytest
import torch

from pagedinfer.engine.config import SpeculativeConfig
from pagedinfer.engine.sampling_params import SamplingParams
from pagedinfer.engine.spec_decode.controller import SpeculativeDecoder
from pagedinfer.engine.spec_decode.device_chain import DeviceNgramChain
from pagedinfer.engine.spec_decode.self_draft import LayerSubsetDraft
from tests.engine.spec_decode.test_spec_engine import (
    MAX_MODEL_LEN,
    SEEDED_MIX,
    assert_no_leak,
    attach_draft,
    greedy_workload,
    kv_record,
    make_llm,
    prompts,
    run_requests,
    step_through,
    trace_admissions,
    trace_chained_requests,
)

K = 3
LATER_LAYER_SCALE = 0.3  # the target's layer 1 scaled down: its 1-layer draft agrees often, not always


def _scaled(llm):
    """The tiny target with its second layer's residual updates scaled (bench/spec_pair.py's way
    of making a draft of its first layers agree with it part of the time)."""
    layer = llm.core.runner.model.model.layers[1]
    with torch.no_grad():
        layer.self_attn.o_proj.weight.mul_(LATER_LAYER_SCALE)
        layer.mlp.down_proj.weight.mul_(LATER_LAYER_SCALE)
    return llm


class _Written:
    """The draft model, noting which (token id, position) each KV slot was last computed from."""

    def __init__(self, model) -> None:
        self.__dict__.update(model=model, slots={})

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, ids, positions, kv_caches, md):
        n = int(md.slot_mapping.shape[0])
        for t, p, slot in zip(
            ids[:n].tolist(), positions[:n].tolist(), md.slot_mapping[:n].tolist(), strict=True
        ):
            self.slots[slot] = (t, p)
        return self.model(ids, positions, kv_caches, md)


def _pair(folder, chained: bool, draft_blocks: int = 128, k: int = K, min_acceptance_rate=0.0, **sched):
    """An engine verifying a 1-layer draft of itself; `chained`: steps chained on the device."""
    llm = _scaled(make_llm(folder, async_scheduling=True, **sched))
    draft = _Written(LayerSubsetDraft(llm.core.runner.model, [0]))
    proposer = attach_draft(llm, draft, k=k, num_blocks=draft_blocks).proposer
    copy_blocks = proposer._copy_blocks

    def copy_and_note(copies):  # copy-on-write moves K/V between blocks: the notes follow
        size = proposer.kv.block_size
        for src, dst in copies:
            for o in range(size):
                written = draft.slots.get(src * size + o)
                if written is None:
                    draft.slots.pop(dst * size + o, None)
                else:
                    draft.slots[dst * size + o] = written
        copy_blocks(copies)

    proposer._copy_blocks = copy_and_note
    chain = None
    if chained:
        chain = DeviceNgramChain(32, MAX_MODEL_LEN, k, 1, 4, torch.device("cpu"), "reference", search=False)
    config = SpeculativeConfig(
        method="draft", num_speculative_tokens=k, min_acceptance_rate=min_acceptance_rate
    )
    spec = SpeculativeDecoder(config, proposer, MAX_MODEL_LEN, device_chain=chain)
    llm.core.spec_decoder = spec
    llm.core.runner.spec_decoder = spec
    return llm


def _generate(llm, ps, params):
    """Outputs, and each request's verifications in order: (drafts, accepted), from its first
    one on, steps without drafts after it included as (0, 0)."""
    spec = llm.core.spec_decoder
    checks: dict[int, list[tuple[int, int]]] = {}
    observe = spec.policy.observe

    def record(seq_id, k, accepted):
        # (steps without drafts are observed for their tokens only; one after the first
        # verification, where the token budget left a sequence none, ends `_same_drafts`)
        if k > 0 or seq_id in checks:
            checks.setdefault(seq_id, []).append((k, accepted))
        observe(seq_id, k, accepted)

    spec.policy.observe = record
    outs = [o.token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params)]
    return outs, [checks.get(seq_id, []) for seq_id in sorted(checks)]


def _same_drafts(sync: list[tuple[int, int]], chained: list[tuple[int, int]], k: int = K) -> int:
    """Verifications compared in order while the synchronous pair drafted all K (near max_tokens
    it drafts fewer, or none where the token budget leaves it only its own token; a chained step
    always K): equal accepted counts. Returns how many compared."""
    n = 0
    for (k_sync, a_sync), (k_chained, a_chained) in zip(sync, chained, strict=False):
        if k_sync != k:
            break
        assert (k_chained, a_chained) == (k, a_sync), n
        n += 1
    return n


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    llm = _scaled(make_llm(tiny_llama_dir))
    return lambda ps, params: [o.token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params)]


@pytest.mark.parametrize(
    ("seed", "sched", "k"),
    [
        (0, {}, K),
        (1, {}, K),
        (2, {"max_num_seqs": 3}, K),
        (3, {"num_blocks": 48, "max_num_seqs": 4}, K),
        (4, {"max_num_batched_tokens": 10, "max_num_seqs": 4}, K),  # 4 chained rows of K + 1 exceed it
        # Draft steps 2..5 advance on the device from step 1's staging, across block boundaries.
        (5, {"max_num_seqs": 4}, 6),
    ],
)
def test_chained_pair_matches_plain_and_the_synchronous_pair(tiny_llama_dir, plain, seed, sched, k):
    ps, params = greedy_workload(random.Random(seed), 6, seed, (3, 30), stop_every=3)
    want = plain(ps, params)
    sync = _pair(tiny_llama_dir, False, k=k, **sched)
    chained = _pair(tiny_llama_dir, True, k=k, **sched)
    sync_out, sync_checks = _generate(sync, ps, params)
    chained_out, chained_checks = _generate(chained, ps, params)
    assert sync_out == want and chained_out == want
    assert sync.core.num_chained_steps == 0 and chained.core.num_chained_steps > 5
    # The chained steps drafted what the synchronous pair drafted: the same acceptance, step by
    # step, with partial acceptance common (a wrong position or context would show).
    assert len(sync_checks) == len(chained_checks)
    compared = sum(_same_drafts(a, b, k) for a, b in zip(sync_checks, chained_checks, strict=True))
    partial = sum(0 < a < k for checks in sync_checks for _, a in checks)
    assert compared > 20 and partial > 10, (compared, partial)
    assert_no_leak(sync)
    assert_no_leak(chained)


def test_draft_records_hold_the_real_tokens_while_chained(tiny_llama_dir):
    """After every step: each draft sequence's KV record is its cached ids, and those before its
    first placeholder are the sequence's own tokens."""
    llm = _pair(tiny_llama_dir, True)
    proposer = llm.core.spec_decoder.proposer
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    core, checked = llm.core, 0
    for _ in step_through(core, prompts(3, 7), params):
        kv = proposer.kv
        for seq_id, state in proposer._seqs.items():
            seq = core.scheduler.get_sequence(seq_id)
            if seq is None:
                continue
            assert kv_record(kv, seq_id) == state.cached_ids
            known = proposer._placeholders.get(seq_id, len(state.cached_ids))
            tokens = [*seq.prompt_token_ids, *seq.output_token_ids]
            assert state.cached_ids[:known] == tokens[:known]
            checked += seq_id in proposer._chained
    assert checked > 10 and core.num_chained_steps > 10
    assert_no_leak(llm)


def test_a_full_draft_cache_ends_the_chain_not_the_output(tiny_llama_dir, plain):
    """Too few draft blocks for every sequence's chained reservation: those steps run
    synchronously (drafting what fits), the output stays plain greedy's, nothing leaks."""
    ps, params = greedy_workload(random.Random(5), 6, 5, (10, 40), stop_every=4)
    llm = _pair(tiny_llama_dir, True, draft_blocks=24)
    out, checks = _generate(llm, ps, params)
    assert out == plain(ps, params)
    assert sum(a for c in checks for _, a in c) > 0
    assert_no_leak(llm)


@pytest.mark.parametrize(("start", "stop"), [(0, 5), (1, 3), (2, 4), (3, 5), (4, 4), (0, 0)])
def test_span_of_prompt_and_output(start, stop):
    from pagedinfer.engine.spec_decode.draft_records import token_span

    prompt, output = [10, 11, 12], [13, 14]
    assert token_span(prompt, output, start, stop) == [*prompt, *output][start:stop]


def _check_draft_kv(proposer) -> int:
    """Each draft sequence's records before its first placeholder say what its KV was computed
    from (the draft model's noted slots); returns the positions checked."""
    kv, checked = proposer.kv, 0
    for seq_id, state in proposer._seqs.items():
        table = kv.block_table(seq_id)
        known = min(proposer._computed[seq_id], proposer._placeholders.get(seq_id, len(state.cached_ids)))
        for p in range(known):
            slot = table[p // kv.block_size] * kv.block_size + p % kv.block_size
            assert proposer.model.slots.get(slot) == (state.cached_ids[p], p), (seq_id, p)
        checked += known
    return checked


@pytest.mark.parametrize(
    ("device_drafts", "min_acceptance_rate", "k"),
    [
        (True, 0.0, K),
        (True, 0.95, 4),  # sequences paused right after a chain: no proposal for many steps
        (False, 0.0, K),  # drafts the host read (their ids recorded and hashed): no chain from them
    ],
)
def test_draft_records_match_the_written_kv(tiny_llama_dir, plain, device_drafts, min_acceptance_rate, k):
    llm = _pair(tiny_llama_dir, True, k=k, min_acceptance_rate=min_acceptance_rate)
    proposer = llm.core.spec_decoder.proposer
    proposer.device_drafts = device_drafts
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    ps = [[17, 43, 99, 250, 8, 61, 77, 12, 130, 5, 201]]
    if min_acceptance_rate == 0.0:  # (paused: one sequence, so that none drafts for a while)
        ps += prompts(2, 3)
    core, checked = llm.core, 0
    for _ in step_through(core, ps, params):
        checked += _check_draft_kv(proposer)
    assert checked > 200
    assert (core.num_chained_steps > 5) is device_drafts
    assert_no_leak(llm)


def test_a_chain_paused_whole_settles_its_draft_records(tiny_llama_dir):
    """Every sequence paused right after a chained step (no proposal for several steps, the
    sequences decode on): the draft records are settled from the tokens right after the chain,
    not from the later ones (its rejected drafts' KV must not be taken for those tokens)."""
    llm = _pair(tiny_llama_dir, True, k=4)
    spec, core = llm.core.spec_decoder, llm.core
    proposer = spec.proposer
    pause = {"from": None}

    def paused(seq_id):
        start = pause["from"]
        return start is not None and start <= core._step < start + 8

    spec.policy.is_paused = paused
    should = spec.policy.should_speculate
    spec.policy.should_speculate = lambda seq_id: not paused(seq_id) and should(seq_id)
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    pauses = 0
    for _ in step_through(core, prompts(2, 11), params):
        _check_draft_kv(proposer)
        if (
            core.num_chained_steps >= 3 * (pauses + 1)
            and pause["from"] is None
            or (pause["from"] is not None and core._step >= pause["from"] + 12)
        ):
            pause["from"], pauses = core._step, pauses + 1
    assert pauses >= 3
    assert_no_leak(llm)


@pytest.mark.parametrize(
    ("seed", "sched"),
    [
        (5, {"max_num_seqs": 3}),
        (6, {"max_num_seqs": 2}),
        (7, {"max_num_seqs": 3, "num_blocks": 40}),  # tight: some admissions wait for blocks
    ],
)
def test_an_admitted_prompt_joins_the_chain_at_once(tiny_llama_dir, plain, seed, sched):
    """A queue refills the batch as sequences end: a chained step admits the prompt behind its
    chained rows (the step stays chained), and the step after it chains the new sequence too (its
    draft cache prefilled when that step is planned), with no synchronous step for either. Same
    tokens as plain greedy; draft records equal the written KV after every step; nothing leaks."""
    ps, params = greedy_workload(random.Random(seed), 9, seed, (8, 30), stop_every=3)
    want = plain(ps, params)
    llm = _pair(tiny_llama_dir, True, **sched)
    core, proposer = llm.core, llm.core.spec_decoder.proposer
    log = trace_admissions(core)
    checks: list[int] = []
    outs = run_requests(core, ps, params, lambda: checks.append(_check_draft_kv(proposer)))
    checked = sum(checks)
    assert [outs.get((f"r{i}", 0), []) for i in range(len(ps))] == want
    admissions = [i for i, (admits, _) in enumerate(log[:-1]) if admits and i > 0]
    in_chain = sum(1 for i in admissions if log[i][1])
    joined = sum(1 for i in admissions if log[i + 1][1])
    # (before: every admission was a synchronous step, and so was the step after it; an admission
    # short of blocks for the chain's reservations still is)
    assert len(admissions) >= 3 and in_chain >= len(admissions) - 1, (in_chain, admissions, log)
    assert joined >= len(admissions) - 1, (joined, admissions, log)
    assert checked > 200
    assert_no_leak(llm)


@pytest.mark.parametrize("sched", [{}, {"max_num_seqs": 3}], ids=["batch", "queue"])
def test_sampled_requests_ride_the_pairs_chains(tiny_llama_dir, sched):
    """Seeded sampled requests (with greedy ones) through the pair: chained steps draw the drafts
    on the device with each request's parameters (seeded rows at output positions read from the
    device's histories), keep their q there, and the rejection sampler decides every group there;
    prompts admitted into chained steps too (3 seats). The same tokens and the same verifications
    as the synchronous pair, step by step; the draft records equal the written KV; no leak."""
    ps = prompts(4, seed=8)
    params = [SEEDED_MIX[i % len(SEEDED_MIX)] for i in range(len(ps))]
    sync = _pair(tiny_llama_dir, False, **sched)
    sync_out, sync_checks = _generate(sync, ps, params)
    llm = _pair(tiny_llama_dir, True, **sched)
    core = llm.core
    in_chains = trace_chained_requests(core)
    chained_out, chained_checks = _generate(llm, ps, params)
    # Every token the same draw, up to max_tokens: near it a seeded request's drafts stay K in the
    # synchronous pair too, as in a chained step (before, it drafted fewer there, and a token
    # could be an accepted draft in one and the target's own draw in the other). (This workload
    # pauses no sequence: a paused one still drafts in a chained step only, and may differ.)
    assert [len(t) for t in chained_out] == [p.max_tokens for p in params]
    assert chained_out == sync_out
    assert core.num_chained_steps > 10
    sampled = {i for i, p in enumerate(params) if p.temperature > 0}
    chained_prompts = {int(rid.rsplit("-", 1)[1]) for rid in in_chains}  # (LLM ids end in the prompt's index)
    assert len(sampled) >= 4 and sampled <= chained_prompts, in_chains
    assert len(sync_checks) == len(chained_checks)
    compared = sum(_same_drafts(a, b) for a, b in zip(sync_checks, chained_checks, strict=True))
    partial = sum(0 < a < K for checks in sync_checks for _, a in checks)
    assert compared > 20 and partial > 5, (compared, partial)
    assert _check_draft_kv(llm.core.spec_decoder.proposer) >= 0
    assert_no_leak(sync)
    assert_no_leak(llm)


def _add_greedy(core, ps: list[list[int]]) -> list[str]:
    """Requests a0, a1, ... of 40 greedy tokens each; their ids."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ids = [f"a{i}" for i in range(len(ps))]
    for rid, p in zip(ids, ps, strict=True):
        core.add_request(rid, p, params)
    return ids


@pytest.mark.parametrize("when", [3, 6, 9])
def test_aborting_every_request_mid_chain_frees_the_draft_cache(tiny_llama_dir, when):
    """Requests aborted while a chained step is in flight: once the engine is idle, both KV
    managers hold nothing (not only after some later request's proposal)."""
    llm = _pair(tiny_llama_dir, True)
    core = llm.core
    ids = _add_greedy(core, prompts(4, 9)[:4])
    for _ in range(when):
        core.step()
    assert core.num_chained_steps > 0
    for rid in ids:
        core.abort(rid)
    while core.has_unfinished():
        core.step()
    assert_no_leak(llm)


@pytest.mark.parametrize("fail_at", [2, 4, 7])
def test_a_failed_chained_launch_leaves_no_draft_blocks_held(tiny_llama_dir, fail_at):
    """A chained step's launch fails (after its draft reservation): step() raises, the caller
    aborts every request; once idle, the draft cache holds nothing either."""
    llm = _pair(tiny_llama_dir, True)
    core = llm.core
    ids = _add_greedy(core, prompts(3, 4)[:3])
    launch, calls = core.runner.launch_forward, []

    def failing(sched, *args, **kwargs):
        if sched.feeds_drafts:
            calls.append(1)
            if len(calls) == fail_at:
                raise RuntimeError("injected launch failure")
        return launch(sched, *args, **kwargs)

    core.runner.launch_forward = failing
    with pytest.raises(RuntimeError, match="injected"):
        for _ in range(100):
            core.step()
    for rid in ids:
        core.abort(rid)
    while core.has_unfinished():
        core.step()
    assert_no_leak(llm)


@pytest.mark.parametrize("chained", [True, False])
def test_forked_greedy_requests_keep_the_draft_cache_right(tiny_llama_dir, plain, chained):
    """Greedy n = 2 requests: the children share their prompt's draft blocks through the prefix
    cache, and a child's draft step writes into a shared block only after a copy-on-write. Every
    draft record equals the written K/V after every step (the notes follow the copies: without
    that the chained case fails here), outputs equal plain greedy, nothing leaks."""
    llm = _pair(tiny_llama_dir, chained, draft_blocks=40, k=4, max_num_seqs=4)
    proposer = llm.core.spec_decoder.proposer
    ps = [[17, 43, 99, 250, 8, 61, 77, 12, 130, 5, 201, 33, 91], [5, 6, 7, 8, 9] * 5, [40, 41] * 7]
    params = SamplingParams(n=2, max_tokens=40, temperature=0.0, ignore_eos=True)
    want = plain(ps, params)
    checks: list[int] = []
    outs = run_requests(llm.core, ps, [params] * len(ps), lambda: checks.append(_check_draft_kv(proposer)))
    assert [outs[(f"r{i}", 0)] for i in range(len(ps))] == want
    assert all(outs[(f"r{i}", 1)] == outs[(f"r{i}", 0)] for i in range(len(ps)))  # greedy twins
    assert sum(checks) > 300
    assert_no_leak(llm)
