"""Draft-model drafts left on the device (spec_decode/draft_model.py `_propose_on_device`; greedy,
and sampled without penalties, q kept there too;
SpeculativeDecoder.feed_device_drafts / record_device_drafts): the draft steps feed each other and
the verification's inputs on the device, the host learns the ids after the verification. Same
tokens and the same verifications as drafts read by the host, and every record ends right."""

from __future__ import annotations

import random

import pytest

from pagedinfer.engine.sampling_params import SamplingParams
from pagedinfer.engine.spec_decode.draft_model import DraftModelProposer
from tests.engine.spec_decode.test_spec_engine import (
    assert_no_leak,
    attach_draft,
    follow_up_reuse,
    greedy_workload,
    kv_record,
    make_llm,
    prompts,
    step_through,
)


def _workload(seed: int):
    return greedy_workload(random.Random(seed), 6, seed, (3, 30), stop_every=3)


def _run(folder, ps, params, device_drafts: bool, draft_layers=None, draft_blocks=128, **sched):
    llm = make_llm(folder, **sched)
    model = llm.core.runner.model
    draft = model if draft_layers is None else _first_layers(model, draft_layers)
    spec = attach_draft(llm, draft, k=3, num_blocks=draft_blocks)
    spec.proposer.device_drafts = device_drafts
    calls = {"device": 0}
    on_device = spec.proposer._propose_on_device

    def counted(requests):
        calls["device"] += 1
        return on_device(requests)

    spec.proposer._propose_on_device = counted
    outs = [o.token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params)]
    stats = spec.stats
    totals = (stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_verified_sequences)
    assert_no_leak(llm)
    return outs, totals, calls["device"], llm


def _first_layers(model, n):
    from pagedinfer.engine.spec_decode.self_draft import LayerSubsetDraft

    return LayerSubsetDraft(model, list(range(n)))


@pytest.mark.parametrize(
    ("seed", "draft_layers", "draft_blocks", "sched"),
    [
        (0, None, 128, {}),
        (1, 1, 128, {}),
        (2, None, 10, {}),  # the draft cache fills up: sequences stop drafting mid-proposal
        (3, 1, 128, {"num_blocks": 40, "max_num_batched_tokens": 9}),  # preemption, partial drafts
    ],
)
def test_device_drafts_verify_the_same_drafts_as_host_drafts(
    tiny_llama_dir, plain_outputs, seed, draft_layers, draft_blocks, sched
):
    ps, params = _workload(seed)
    want = plain_outputs(ps, params)
    host = _run(tiny_llama_dir, ps, params, False, draft_layers, draft_blocks, **sched)
    device = _run(tiny_llama_dir, ps, params, True, draft_layers, draft_blocks, **sched)
    assert host[0] == want and device[0] == want
    assert host[2] == 0 and device[2] > 0  # the device path ran, and only there
    assert device[1] == host[1] and host[1][1] > 0  # drafts, accepted, verifications


SAMPLED = [
    SamplingParams(max_tokens=20, temperature=0.7, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=14, temperature=1.0, top_k=6, top_p=0.9, seed=4, ignore_eos=True),
    SamplingParams(max_tokens=18, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=16, temperature=0.5, min_p=0.05, seed=5, ignore_eos=True, n=2),
]


@pytest.mark.parametrize(("draft_layers", "draft_blocks"), [(1, 128), (None, 128), (1, 10)])
def test_sampled_drafts_on_the_device_are_the_host_drafts(tiny_llama_dir, draft_layers, draft_blocks):
    """Seeded sampled requests (with a greedy one): each draft drawn on the device with the noise
    the host path draws it with, its q kept there for the rejection sampler. The same drafts,
    hence the same verifications and the same tokens as drafts read by the host."""
    ps = prompts(2, seed=4)
    params = [SAMPLED[i % len(SAMPLED)] for i in range(len(ps))]
    host = _run(tiny_llama_dir, ps, params, False, draft_layers, draft_blocks)
    device = _run(tiny_llama_dir, ps, params, True, draft_layers, draft_blocks)
    assert device[0] == host[0]
    assert host[2] == 0 and device[2] > 0  # the device path ran, and only there
    assert device[1] == host[1] and host[1][1] > 0  # drafts, accepted, verifications


def test_penalties_keep_the_drafts_on_the_host(tiny_llama_dir):
    """A row whose sampling reads the drafts before it (penalties) cannot be drawn on the device
    before they are known there as ids: the host drafts that batch."""
    ps = prompts(1, seed=5)
    params = SamplingParams(max_tokens=12, temperature=0.7, repetition_penalty=1.2, seed=6, ignore_eos=True)
    host = _run(tiny_llama_dir, ps, params, False)
    device = _run(tiny_llama_dir, ps, params, True)
    assert device[0] == host[0] and device[2] == 0


def test_the_draft_cache_records_the_fed_drafts(tiny_llama_dir):
    """After `resolve`, each sequence's draft KV record is its cached ids, whose tail is the
    drafts it was fed on the device."""
    llm = make_llm(tiny_llama_dir)
    spec = attach_draft(llm, _first_layers(llm.core.runner.model, 1), k=3)
    proposer: DraftModelProposer = spec.proposer
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    checked = 0
    for _ in step_through(llm.core, prompts(3, 5), params):
        drafts = spec.device_drafts
        if drafts is None:
            continue
        fed = dict(proposer._placeholders)
        proposer.resolve()
        lists = drafts.to_host()
        for seq_id, first in fed.items():
            state = proposer._seqs.get(seq_id)
            if state is None:
                continue
            assert kv_record(proposer.kv, seq_id) == state.cached_ids
            assert state.cached_ids[first:] == lists[seq_id][: len(state.cached_ids) - first]
            checked += 1
    assert checked > 5
    assert_no_leak(llm)


@pytest.fixture(scope="module")
def plain_outputs(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)

    def run(ps, params):
        return [o.token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params)]

    return run


def test_prefix_cache_hashes_the_verified_drafts(tiny_llama_dir, plain_outputs):
    """The target's KV record gets the drafts' ids before the update hashes its blocks: a prompt
    of the first request's prompt + output reuses the blocks computed from verified drafts, one
    with placeholder ids (0) there reuses none of them."""
    llm = make_llm(tiny_llama_dir)
    spec = attach_draft(llm, llm.core.runner.model, k=3)  # the target as its draft: all accepted
    prompt = prompts(1, 7)[0][:8]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    assert spec.stats.num_accepted_tokens > 20
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    real, placeholder = follow_up_reuse(llm, plain_outputs, prompt, first.token_ids, short)
    assert real - len(prompt) >= len(first.token_ids) - 8  # block_size 4, prompt 8
    assert placeholder - len(prompt) <= 0
    assert_no_leak(llm)


class _CharTokenizer:
    """One printable character per id: stop strings then match single tokens."""

    def encode(self, text):
        return [ord(c) - 0x100 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(0x100 + i) for i in ids)


@pytest.mark.parametrize("device_drafts", [True, False])
def test_a_stop_string_during_verification(tiny_llama_dir, plain_outputs, device_drafts):
    """A stop string found in the step before's outputs (processed while the verification runs)
    finishes a sequence whose drafts are being verified: the step goes on for the others and the
    finished one ends at its stop string, token ids and usage included (accepted drafts past it
    are not output); nothing leaks."""
    ps = prompts(3, 11)
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    plain = plain_outputs(ps, [greedy] * len(ps))
    llm = make_llm(tiny_llama_dir)
    llm.core.outputs.tokenizer = _CharTokenizer()
    spec = attach_draft(llm, llm.core.runner.model, k=3)
    spec.proposer.device_drafts = device_drafts
    stops = [_CharTokenizer().decode([out[7]]) for out in plain]
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=(stop,)) for stop in stops]
    outs = llm.generate(prompt_token_ids=ps, sampling_params=params)
    for out, want, stop in zip(outs, plain, stops, strict=True):
        end = want.index(ord(stop) - 0x100)
        assert out.completions[0].finish_reason.value == "stop"
        # as one token a step: up to and including the token that completed the stop string
        assert out.token_ids == want[: end + 1]
        assert out.usage.completion_tokens == end + 1
    assert spec.stats.num_draft_tokens > 0
    assert_no_leak(llm)
