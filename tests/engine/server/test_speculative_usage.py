"""A request's speculation counts (usage.draft_tokens / accepted_draft_tokens) against the engine's
totals where a sequence ends inside a step: a stop string found while the next step already
verified drafts for it, and max_tokens ending it inside a verification's tokens. (Found by a
fuzzing review: the first lost drafts from the usage, the second reported more accepted drafts
than completion tokens.) The tiny byte-level model of this folder's conftest, on the CPU."""

from __future__ import annotations

import pytest

from pagedinfer.engine.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagedinfer.engine.llm import LLM
from pagedinfer.engine.sampling_params import SamplingParams


def _llm(model: str, method: str, k: int, chained: bool) -> LLM:
    spec = SpeculativeConfig(
        method=method,
        num_speculative_tokens=k,
        device_chain_steps=2,
        draft_model="self:first=1" if method == "draft" else None,
    )
    return LLM(
        EngineConfig(
            model=model,
            cache=CacheConfig(block_size=4, num_blocks=512),
            scheduler=SchedulerConfig(max_model_len=160, async_scheduling=chained),
            device=DeviceConfig(device="cpu", dtype="float32"),
            speculative=spec,
        )
    )


def _check(llm: LLM, outputs) -> None:
    """Usage sums equal the engine's totals, except where a stop string (found by the detokenizer,
    after the totals counted the step) cut accepted drafts off a completion: there below them."""
    stats = llm.core.spec_decoder.stats
    totals = (stats.num_draft_tokens, stats.num_accepted_tokens)
    usage = (sum(o.usage.draft_tokens for o in outputs), sum(o.usage.accepted_draft_tokens for o in outputs))
    cut = llm.core.outputs.num_cut_tokens
    assert usage == totals if not cut else usage <= totals, (usage, totals, cut)
    for o in outputs:
        u = o.usage
        assert 0 <= u.accepted_draft_tokens <= min(u.draft_tokens, u.completion_tokens), u


@pytest.mark.parametrize("chained", [False, True], ids=["sync", "chained"])
@pytest.mark.parametrize(
    "method,prompt,stop",
    [("ngram", "xyzxyzxyzxyzxyzxyz", "y"), ("ngram", "foo bar baz foo bar baz foo bar", "b"),
     ("draft", "ab ab ab ab ab ab ab ab ab ab ab ab", "\\")],
)  # fmt: skip
def test_a_stop_string_keeps_usage_and_totals_equal(tiny_model, method, prompt, stop, chained):
    llm = _llm(tiny_model, method, 3, chained)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])
    outputs = llm.generate([prompt], params)
    assert outputs[0].completions[0].finish_reason.name == "STOP"
    _check(llm, outputs)


@pytest.mark.parametrize("chained", [False, True], ids=["sync", "chained"])
def test_max_tokens_inside_a_verification_counts_only_kept_drafts(tiny_model, chained):
    llm = _llm(tiny_model, "draft", 6, chained)
    params = SamplingParams(max_tokens=2, temperature=0.5, seed=4)
    outputs = llm.generate(["ab ab ab ab ab ab ab ab ab ab ab ab"], params)
    _check(llm, outputs)
    assert llm.core.outputs.num_cut_tokens == 0  # (so usage and totals are equal)


@pytest.mark.parametrize("chained", [False, True], ids=["sync", "chained"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("max_tokens", [5, 9, 17, 33])
def test_emitted_tokens_are_the_decoded_tokens(tiny_model, method, max_tokens, chained):
    """Every decoded token (after the prefill's) came from a verification (its `emitted`) or from
    a sequence-step without a draft (one token): the identity that the benchmark's alpha and
    tokens per sequence-step rest on. A verification cut by max_tokens inside its accepted
    drafts emitted only the tokens that stand (it counted one more, the bonus, before)."""
    llm = _llm(tiny_model, method, 6, chained)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts = ["ab ab ab ab ab ab ab ab ab ab ab ab", "xyzxyzxyzxyzxyzxyz", "foo bar baz foo bar baz foo bar"]
    outputs = llm.generate(prompts, params)
    stats = llm.core.spec_decoder.stats
    assert stats.num_verified_sequences > 0
    no_draft = sum(
        getattr(stats, f"num_{name}_sequence_steps") for name in ("unmatched", "paused", "capped", "disabled")
    )
    decoded = sum(o.usage.completion_tokens for o in outputs) - len(outputs)
    assert stats.num_emitted_tokens + no_draft == decoded, (stats, decoded)
