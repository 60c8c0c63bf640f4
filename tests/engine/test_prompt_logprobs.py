"""prompt_logprobs: every prompt token's logprob equals transformers' (fp32, CPU), whether the
prompt is prefilled whole or in chunks, and when its prefix is in the prefix cache."""

from __future__ import annotations

import pytest
import torch

from pagedinfer.engine.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from pagedinfer.engine.llm import LLM
from pagedinfer.engine.sampling_params import SamplingParams

PROMPT = [5, 17, 99, 3, 200, 41, 41, 7, 150, 62, 8, 230, 19, 77, 101, 4, 66, 12, 90, 33, 21]
PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=3)


def make_llm(folder, max_num_batched_tokens: int) -> LLM:
    config = EngineConfig(
        model=str(folder),
        cache=CacheConfig(block_size=4, num_blocks=64),
        scheduler=SchedulerConfig(max_model_len=128, max_num_batched_tokens=max_num_batched_tokens),
        device=DeviceConfig(device="cpu", dtype="float32"),
    )
    return LLM(config)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> torch.Tensor:
    """transformers' log-softmax at every prompt position: [len(PROMPT), V]."""
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir).float().eval()
    with torch.no_grad():
        return hf(torch.tensor([PROMPT])).logits[0].float().log_softmax(-1)


def _check(out, reference: torch.Tensor) -> None:
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(PROMPT) - 1  # the first token has none
    for pos, lp in enumerate(lps):
        target = PROMPT[pos + 1]
        assert lp.sampled.token_id == target
        assert lp.sampled.logprob == pytest.approx(reference[pos, target].item(), abs=1e-4)
        top_lp, top_ids = reference[pos].topk(3)
        assert [t.token_id for t in lp.top] == top_ids.tolist()
        assert [t.logprob for t in lp.top] == pytest.approx(top_lp.tolist(), abs=1e-4)


@pytest.mark.parametrize("max_num_batched_tokens", [128, 5], ids=["whole", "chunked"])
def test_prompt_logprobs_match_transformers(tiny_llama_dir, reference, max_num_batched_tokens):
    llm = make_llm(tiny_llama_dir, max_num_batched_tokens)
    _check(llm.generate(prompt_token_ids=[PROMPT], sampling_params=PARAMS)[0], reference)


def test_prompt_logprobs_with_a_cached_prefix(tiny_llama_dir, reference):
    llm = make_llm(tiny_llama_dir, 128)
    plain = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompt_token_ids=[PROMPT], sampling_params=plain)[0]
    again = llm.generate(prompt_token_ids=[PROMPT], sampling_params=plain)[0]
    assert first.prompt_logprobs is None and again.usage.cached_prompt_tokens > 0  # the prefix is cached
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=PARAMS)[0]
    assert out.usage.cached_prompt_tokens == 0  # prompt_logprobs skip the prefix cache (as vLLM)
    _check(out, reference)
    assert out.token_ids == first.token_ids


def test_prompt_logprobs_with_n_and_a_batch(tiny_llama_dir, reference):
    llm = make_llm(tiny_llama_dir, 8)
    params = SamplingParams(n=2, max_tokens=2, temperature=1.0, seed=1, prompt_logprobs=3)
    outs = llm.generate(
        prompt_token_ids=[PROMPT, PROMPT[:7]], sampling_params=[params, SamplingParams(max_tokens=3)]
    )
    _check(outs[0], reference)
    assert outs[1].prompt_logprobs is None
