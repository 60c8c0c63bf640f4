"""Structured outputs with async scheduling (forced on, CPU, SmolLM2): grammar rows ride lookahead
steps whose sampling waits for the step before's tokens, and every output is what synchronous
steps give, including sequences that complete their document (EOS under a terminated grammar)
or are aborted while a step planned after them is in flight."""

from __future__ import annotations

import contextlib
import json

import jsonschema
import pytest

from pagedinfer.engine.config import DeviceConfig, EngineConfig, SchedulerConfig
from pagedinfer.engine.llm import LLM
from pagedinfer.engine.sampling_params import SamplingParams
from pagedinfer.engine.structured.spec import StructuredOutput

pytestmark = pytest.mark.timeout(600)

SMALL = {  # completes in a few tokens: its sequence stops on EOS while the batch runs on
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"],
    "additionalProperties": False,
}
LONG = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "tag": {"enum": ["red", "green", "blue"]}},
        "required": ["id", "tag"],
        "additionalProperties": False,
    },
}


def _llm(async_scheduling: bool) -> LLM:
    scheduler = SchedulerConfig(max_model_len=512, async_scheduling=async_scheduling)
    return LLM(EngineConfig(scheduler=scheduler, device=DeviceConfig(device="cpu")))


@pytest.fixture(scope="module")
def pair() -> tuple[LLM, LLM]:
    return _llm(False), _llm(True)


def _requests(llm: LLM) -> tuple[list[list[int]], list[SamplingParams]]:
    ask = [
        "Give one digit as JSON.",
        "List products as JSON records.",
        "Say hello.",
        "List colours as JSON.",
        "Pick a number as JSON.",
    ]
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in ask]
    small = StructuredOutput.json_schema(SMALL, strict=True)
    long = StructuredOutput.json_schema(LONG, strict=True)
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, structured_output=small),
        SamplingParams(max_tokens=33, temperature=0.0, structured_output=long),
        SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True),  # no grammar, same batch
        SamplingParams(max_tokens=30, temperature=0.7, seed=5, structured_output=long),
        SamplingParams(max_tokens=40, temperature=0.9, seed=9, structured_output=small),
    ]
    return prompts, params


def _assert_idle_and_free(llm: LLM) -> None:
    kv = llm.core.scheduler.kv
    assert not llm.core.has_unfinished()
    assert kv.num_free_blocks == kv.num_blocks


def test_grammar_batches_look_ahead_and_match_synchronous_steps(pair) -> None:
    sync, asyn = pair
    prompts, params = _requests(sync)
    before = asyn.core.num_deferred_sampling_steps
    expected = sync.generate(prompt_token_ids=prompts, sampling_params=params)
    got = asyn.generate(prompt_token_ids=prompts, sampling_params=params)
    assert asyn.core.num_deferred_sampling_steps - before >= 20  # grammar rows rode lookahead steps
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.completions[0].finish_reason for o in got] == [o.completions[0].finish_reason for o in expected]
    for out, p in zip(got, params, strict=True):
        if p.structured_output is not None and out.completions[0].finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), SMALL)  # only the small documents complete
    assert got[0].completions[0].finish_reason == "stop"  # ... one of them while the batch ran on
    _assert_idle_and_free(asyn)


def test_an_abort_while_a_grammar_lookahead_is_in_flight(pair) -> None:
    _, asyn = pair
    core = asyn.core
    prompts, params = _requests(asyn)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        core.add_request(f"abort-{i}", prompt, p)
    outputs = []
    for step in range(200):
        if not core.has_unfinished():
            break
        if step in (6, 9):  # each has a row in the lookahead step in flight, sampled after this
            request_id = f"abort-{1 if step == 6 else 3}"
            inflight = core._inflight[0]  # (white box: the case this test is about)
            seq_ids = {s.seq_id for s in inflight.sequences}
            assert inflight.defers_sampling
            assert any(r.request_id == request_id and r.seq_id in seq_ids for r in core.scheduler.running)
            outputs += core.abort(request_id)
        outputs += core.step()
    assert not core.has_unfinished()
    reasons = {o.request_id: o.deltas[0].finish_reason for o in outputs if o.finished}
    assert reasons == {"abort-0": "stop", "abort-1": "abort", "abort-2": "length", "abort-3": "abort"} | {
        "abort-4": reasons["abort-4"]  # sampled: its document may or may not complete in 40 tokens
    }
    _assert_idle_and_free(asyn)


def test_a_deferred_sampling_that_fails_to_launch_gives_back_its_slots(pair) -> None:
    """The deferred sampling launch of a grammar lookahead fails (a mask fill error, say): its
    KV slots go back like any dropped lookahead's, and a caller that keeps stepping gets the
    synchronous engine's output with no block left behind."""
    sync, asyn = pair
    prompts, params = _requests(sync)
    (expected,) = sync.generate(prompt_token_ids=[prompts[1]], sampling_params=params[1])
    core = asyn.core
    grammar = core.runner.grammar
    real_bitmask, calls = grammar.bitmask, [0]

    def flaky(rows, groups):
        calls[0] += 1
        if calls[0] == 3:  # the prefill's, then deferred launches: the second of those
            assert core.num_deferred_sampling_steps >= 2
            raise RuntimeError("transient failure")
        return real_bitmask(rows, groups)

    grammar.bitmask = flaky
    tokens: list[int] = []
    try:
        core.add_request("flaky", prompts[1], params[1])
        while core.has_unfinished():
            with contextlib.suppress(RuntimeError):
                for out in core.step():
                    tokens += out.deltas[0].token_ids
    finally:
        del grammar.bitmask  # the class's method again
    assert calls[0] > 3
    assert tokens == expected.token_ids
    _assert_idle_and_free(asyn)
