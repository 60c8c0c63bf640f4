"""The embedded SmolLM2-135M with the n-gram proposer: greedy and seeded sampled output identical
to plain decoding.

One engine serves both runs: `use_speculation=False` per request gives the plain baseline, so
the model loads once. The task (rewrite a given text with one change) is the repetitive kind
where prompt lookup pays: drafts must actually be accepted for the test to pass.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench import editing_tasks
from pagedinfer.engine.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagedinfer.engine.llm import LLM
from pagedinfer.engine.sampling_params import SamplingParams
from tests.engine.spec_decode.test_spec_engine import trace_wasted_device_steps

TEXT = (
    "The committee met on Monday to review the budget. The committee approved the budget for "
    "the library and the budget for the park, and asked for a new report on Friday."
)
TASKS = [f"Rewrite the following text, replacing 'Monday' with 'Tuesday'. Text: {TEXT}"]


def make_engine(**scheduler) -> LLM:
    config = EngineConfig(
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(max_model_len=512, **scheduler),
        device=DeviceConfig(device="cpu", dtype="float32"),
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=3),
    )
    return LLM(config)


@pytest.fixture(scope="module")
def llm():
    return make_engine()


def test_smollm2_ngram_greedy_is_identical_and_accepts_drafts(llm):
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in TASKS]
    plain = SamplingParams(max_tokens=32, temperature=0.0, use_speculation=False)
    fast = SamplingParams(max_tokens=32, temperature=0.0)
    expected = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=plain)]
    assert llm.core.spec_decoder.stats.num_draft_tokens == 0
    got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=fast)]
    assert got == expected
    stats = llm.core.spec_decoder.stats
    assert stats.acceptance_rate > 0.3 and stats.mean_accepted_length > 1.5, stats
    kv = llm.core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=32, temperature=0.7, seed=5),
        SamplingParams(max_tokens=32, temperature=1.0, top_k=20, top_p=0.9, seed=6, n=2),
        SamplingParams(
            max_tokens=32, temperature=0.7, repetition_penalty=1.05, frequency_penalty=0.1, seed=7
        ),
    ],
    ids=["temperature", "top-k-top-p-n2", "penalties"],
)
def test_smollm2_ngram_seeded_sampling_emits_the_plain_tokens(llm, params):
    """n-gram drafts (a point-mass q) are verified by drawing every row as the plain sampler
    does, with the row's seeded noise at its output position, and matching: a seeded request
    emits exactly its tokens without speculation. (A rejection sampler would draw other noise
    for the acceptance and the residual, and give other tokens.)"""
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in TASKS]
    plain = replace(params, use_speculation=False)
    expected = [
        [c.token_ids for c in o.completions]
        for o in llm.generate(prompt_token_ids=prompts, sampling_params=plain)
    ]
    stats = llm.core.spec_decoder.stats
    before = (stats.num_draft_tokens, stats.num_accepted_tokens)
    got = [
        [c.token_ids for c in o.completions]
        for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)
    ]
    assert got == expected
    drafted, accepted = stats.num_draft_tokens - before[0], stats.num_accepted_tokens - before[1]
    assert accepted >= 10, (drafted, accepted)  # several tokens a step came from the matching
    kv = llm.core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


MAX_TOKENS_OF_CHAINS = (31, 34, 37, 40, 43, 46)  # every alignment of the end with a launch's 4 steps


def test_smollm2_chains_stop_at_the_expected_end(llm):
    """Chained on the device (async scheduling, 4 device steps a launch), a sequence that accepts
    ~3 drafts a step would leave up to 3 device steps running past max_tokens under the certain
    bound (one token a step); planned from its recent tokens a step, at most one a request runs
    past the end on average. Output identical to plain decoding either way."""
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in TASKS]
    plain = SamplingParams(
        max_tokens=max(MAX_TOKENS_OF_CHAINS), temperature=0.0, ignore_eos=True, use_speculation=False
    )
    expected = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=plain)]
    chained = make_engine(async_scheduling=True)
    runs = {}
    for capped in (False, True):
        core = chained.core
        if not capped:  # one token a step: no more than the certain bound
            core.spec_decoder.tokens_per_step = lambda seq_id: 1.0
        wasted = trace_wasted_device_steps(core)
        before = core.num_chained_steps
        for max_tokens in MAX_TOKENS_OF_CHAINS:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            got = [o.token_ids for o in chained.generate(prompt_token_ids=prompts, sampling_params=params)]
            assert got == [e[:max_tokens] for e in expected]
        if not capped:
            del core.spec_decoder.tokens_per_step
        runs[capped] = (sum(wasted), core.num_chained_steps - before)
        del core.spec_decoder.observe  # (the tracer's wrapper)
        assert runs[capped][1] > 0  # chains ran
    n = len(MAX_TOKENS_OF_CHAINS)  # (measured: 15 wasted device steps -> 5 over the 6 requests)
    assert runs[True][0] <= n and runs[False][0] >= runs[True][0] + n, runs
    assert chained.core.spec_decoder.stats.mean_accepted_length > 2.5
    kv = chained.core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_smollm2_chains_stop_where_the_copied_text_ends(llm):
    """Answers that end at EOS (two of the n-gram benchmark's editing tasks): the copy of the
    quoted text runs into the end of the user's turn, so prompt lookup sees the EOS coming and
    the chain plans no launch of device steps behind the one expected to end the answer (planned
    blind, such a launch runs whole: 4 device steps wasted). Output identical to plain decoding
    either way."""
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in editing_tasks.tasks(2)]
    plain = SamplingParams(max_tokens=160, temperature=0.0, use_speculation=False)
    expected = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=plain)]
    assert all(len(e) < 160 for e in expected)  # every answer ends at EOS
    chained = make_engine(async_scheduling=True)
    core, runs = chained.core, {}
    for predicted in (False, True):
        if not predicted:
            core.spec_decoder.tokens_to_stop = lambda seq, row, horizon: None
        wasted = trace_wasted_device_steps(core)
        before = core.num_chained_steps
        params = SamplingParams(max_tokens=160, temperature=0.0)
        for prompt, want in zip(prompts, expected, strict=True):  # batch 1, one after the other
            assert chained.generate(prompt_token_ids=[prompt], sampling_params=params)[0].token_ids == want
        if not predicted:
            del core.spec_decoder.tokens_to_stop
        del core.spec_decoder.observe  # (the tracer's wrapper)
        runs[predicted] = (sum(wasted), core.num_chained_steps - before)
        assert runs[predicted][1] > 0  # chains ran
    # (measured: 9 wasted device steps -> 0, 68 chained device steps -> 61)
    n = len(prompts)
    assert runs[True][0] <= n and runs[False][0] >= runs[True][0] + 2 * n, runs
    assert runs[True][1] < runs[False][1], runs
    kv = core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_smollm2_stop_string_inside_an_accepted_draft_counts_only_the_output(llm):
    """A verification step emits several tokens; a stop string inside them cuts the ones after
    it. Output, finish and usage equal plain decoding's, and the engine's counters (stats() and
    the step listeners' StepStats) count the output tokens, not the cut ones, and every finished
    sequence once."""
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in TASKS]
    stop = dict(max_tokens=48, temperature=0.0, stop=["budget for the park"], n=2)
    core = llm.core
    steps = []
    core.add_step_listener(steps.append)
    try:
        results = {}
        for spec in (False, True):
            steps.clear()
            before = core.stats()["generation_tokens_total"]
            drafts = core.spec_decoder.stats.num_accepted_tokens
            cut = core.outputs.num_cut_tokens
            params = SamplingParams(**stop, use_speculation=spec)
            out = llm.generate(prompt_token_ids=prompts, sampling_params=params)[0]
            completion = out.usage.completion_tokens
            assert sum(s.num_generation_tokens for s in steps) == completion
            assert core.stats()["generation_tokens_total"] - before == completion
            assert sum(s.num_finished for s in steps) == 2
            results[spec] = (
                out.completions,
                completion,
                core.spec_decoder.stats.num_accepted_tokens - drafts,
            )
            assert (core.outputs.num_cut_tokens > cut) == spec  # tokens past the stop: spec only
    finally:
        core._listeners.remove(steps.append)
    (plain, plain_usage, _), (fast, fast_usage, accepted) = results[False], results[True]
    assert accepted > 0  # drafts ran through the stop
    assert fast_usage == plain_usage
    assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in fast] == [
        (c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in plain
    ]
    assert all(c.stop_reason == "budget for the park" for c in plain)
