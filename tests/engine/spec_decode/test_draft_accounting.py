"""Every decoding sequence-step either verifies drafts or has its reason counted (no match,
paused, capped by max_tokens, step above max_batch_size): what bench/speculative.py reports."""

from __future__ import annotations

import random

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
from pagedinfer.engine.spec_decode.policy import SpeculationStats


def _llm(folder, spec: SpeculativeConfig, async_scheduling: bool | None = None) -> LLM:
    return LLM(
        EngineConfig(
            model=str(folder),
            cache=CacheConfig(block_size=4, num_blocks=256),
            scheduler=SchedulerConfig(max_model_len=128, async_scheduling=async_scheduling),
            device=DeviceConfig(device="cpu", dtype="float32"),
            speculative=spec,
        )
    )


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    out = [[rng.randrange(3, 256) for _ in range(rng.randint(3, 24))] for _ in range(5)]
    return out + [[5, 6, 7, 8, 9] * 4, [11, 12] * 8]  # repetitive: the n-gram proposer matches


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _accounted(stats: SpeculationStats) -> int:
    return (
        stats.num_verified_sequences
        + stats.num_unmatched_sequence_steps
        + stats.num_paused_sequence_steps
        + stats.num_capped_sequence_steps
        + stats.num_disabled_sequence_steps
    )


def test_each_decoding_step_of_a_lone_sequence_is_accounted_for(tiny_llama_dir):
    llm = _llm(tiny_llama_dir, SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    steps = []
    llm.core.add_step_listener(steps.append)
    num_decode_steps = 0
    for prompt in _prompts():  # one at a time: every step after the prefill decodes it
        before = len(steps)
        llm.generate(prompt_token_ids=[prompt], sampling_params=_greedy(20))
        num_decode_steps += len(steps) - before - 1
    stats = llm.core.spec_decoder.stats
    assert _accounted(stats) == num_decode_steps
    # random prompts find no match somewhere; the repetitive ones draft
    assert stats.num_unmatched_sequence_steps > 0 and stats.num_verified_sequences > 0


def test_one_token_left_under_max_tokens_is_capped(tiny_llama_dir):
    llm = _llm(tiny_llama_dir, SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    llm.generate(prompt_token_ids=[_prompts()[-1]], sampling_params=_greedy(2))
    stats = llm.core.spec_decoder.stats
    assert stats.num_capped_sequence_steps == 1 and stats.num_draft_tokens == 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_step_above_the_batch_cutoff_counts_its_sequences_as_disabled(tiny_llama_dir, async_scheduling):
    """Also where such steps are planned ahead without drafts (async): they never reach propose()."""
    llm = _llm(tiny_llama_dir, SpeculativeConfig(method="ngram", max_batch_size=2), async_scheduling)
    llm.generate(prompt_token_ids=_prompts(), sampling_params=_greedy(8))
    stats = llm.core.spec_decoder.stats
    assert (llm.core.num_lookahead_steps > 0) is async_scheduling
    # 7 sequences run together to the end (same max_tokens): 7 per decoding step, none drafts
    assert stats.num_disabled_sequence_steps == 7 * 7 and stats.num_draft_tokens == 0


def _usage_totals(outputs) -> tuple[int, int]:
    return sum(o.usage.draft_tokens for o in outputs), sum(o.usage.accepted_draft_tokens for o in outputs)


@pytest.mark.parametrize("chained", [False, True], ids=["sync", "chained"])
def test_each_request_reports_its_own_drafts_in_its_usage(tiny_llama_dir, chained):
    """The per-request counts (usage.draft_tokens / accepted_draft_tokens, what the servers show)
    add up to the engine's totals, with n = 2 and, chained, several verifications per host step."""
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, device_chain_steps=3)
    llm = _llm(tiny_llama_dir, spec, async_scheduling=chained)
    params = [_greedy(24 + 3 * i) for i in range(len(_prompts()))]
    params[-1] = SamplingParams(max_tokens=20, temperature=0.8, seed=3, n=2, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=_prompts(), sampling_params=params)
    stats = llm.core.spec_decoder.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    # chained: host steps that applied several device steps (verifications) at once
    assert (llm.core.num_applied_device_steps > llm.core._step) is chained
    assert _usage_totals(outputs) == (stats.num_draft_tokens, stats.num_accepted_tokens)
    for out in outputs:
        u = out.usage
        assert 0 <= u.accepted_draft_tokens <= u.draft_tokens
        assert u.accepted_draft_tokens <= u.completion_tokens  # accepted drafts are output tokens
    repetitive = outputs[-2].usage  # [5..9] x 4: drafts from the prompt
    assert repetitive.draft_tokens > 0
    plain = llm.generate(
        prompt_token_ids=_prompts()[-2:-1],
        sampling_params=SamplingParams(max_tokens=8, use_speculation=False),
    )
    assert _usage_totals(plain) == (0, 0)
