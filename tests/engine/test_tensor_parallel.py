"""Tensor parallelism on the CPU (gloo): tp = 2 and 3 against tp = 1 on the same checkpoint.

Per model: the logits of a prefill and of a decode step match tp = 1 within fp32 tolerance
(the ranks' partial sums add up in another order), and greedy generation is token-for-token
the same through the engine under chunked prefill, preemption, prefix caching, n > 1 (forks:
copy-on-write block copies reach every rank) and n-gram speculative decoding. Models: tiny
random Llama (vocabulary padded: 385 over 2 ranks), a 6-head Llama over 3 ranks, Qwen2 with
one KV head (replicated on both ranks) and the embedded SmolLM2 GGUF (9 query / 3 KV heads)
over 3 ranks; SmolLM2 over 2 ranks is refused at startup, naming the numbers.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pagedinfer.engine.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagedinfer.engine.engine_builder import build_engine
from pagedinfer.engine.llm import LLM
from pagedinfer.engine.parallel.plan import TensorParallelConfigError
from pagedinfer.engine.sampling_params import SamplingParams
from pagedinfer.engine.worker.attn_metadata import AttentionMetadata

sys.path.insert(0, str(Path(__file__).parent / "models"))
from hf_tiny import build_hf_model, save_hf_model  # noqa: E402

SMOLLM2 = "builtin://smollm2-135m"
SIX_HEADS = dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=192)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(variant, overrides) -> folder of a tiny random HF checkpoint."""
    cache: dict = {}

    def get(variant: str, **overrides) -> str:
        key = (variant, tuple(sorted(overrides.items())))
        if key not in cache:
            folder = tmp_path_factory.mktemp(variant)
            cache[key] = str(save_hf_model(build_hf_model(variant, **overrides), folder))
        return cache[key]

    return get


def _config(model: str, tp: int, *, is_mixed: bool) -> EngineConfig:
    """is_mixed: a small KV cache (preemption), a small token budget (chunked prefill), prefix
    caching and n-gram speculation; else a plain engine."""
    if not is_mixed:
        return EngineConfig(
            model=model,
            tensor_parallel_size=tp,
            device=DeviceConfig(device="cpu"),
            cache=CacheConfig(num_blocks=64),
        )
    return EngineConfig(
        model=model,
        tensor_parallel_size=tp,
        device=DeviceConfig(device="cpu"),
        cache=CacheConfig(block_size=16, num_blocks=11, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32),
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3),
    )


@torch.inference_mode()
def _logits(engine: LLM, prompt: list[int]) -> torch.Tensor:
    """Logits [len(prompt) + 1, vocab] of a prefill of `prompt` and of one decode step after
    it, straight through the runner's model and KV cache (blocks from 0: the engine is idle)."""
    runner = engine.core.runner
    block_size = runner.config.block_size
    n = len(prompt)
    num_blocks = -(-(n + 1) // block_size)
    table = torch.arange(num_blocks, dtype=torch.int32)[None, :]
    rows = []
    for start, ids in ((0, prompt), (n, [prompt[-1]])):
        t = len(ids)
        md = AttentionMetadata(
            slot_mapping=torch.arange(start, start + t),
            positions=torch.arange(start, start + t),
            block_tables=table,
            query_start_loc=torch.tensor([0, t], dtype=torch.int32),
            seq_lens=torch.tensor([start + t], dtype=torch.int32),
            logits_indices=torch.arange(t),
            max_query_len=t,
            max_seq_len=start + t,
            is_pure_decode=t == 1,
            backend=runner.config.attention_backend,
        )
        hidden = runner.model(torch.tensor(ids), md.positions, runner.kv_caches, md)
        rows.append(runner.model.compute_logits(hidden[md.logits_indices]))
    return torch.cat(rows)


def _mixed_run(engine: LLM) -> tuple[list[list[list[int]]], dict]:
    """Greedy outputs of a workload that chunks, forks, hits the prefix cache, speculates and
    preempts; the counters that prove each of those happened."""
    stats = {"drafts": 0}
    engine.core.add_step_listener(lambda s: stats.__setitem__("drafts", stats["drafts"] + s.num_draft_tokens))
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    pattern = [11, 12, 13, 14, 15, 16, 17, 18]
    first = engine.generate(prompt_token_ids=[pattern * 5], sampling_params=greedy)  # 40: chunked
    prompts = [
        pattern * 4 + [3, 4, 5, 6],  # the first prompt's 32-token prefix: two cached blocks
        [21, 22, 23, 24] * 9,
        [31, 32, 33] * 12,
        [41, 42] * 19,
    ]
    params = [greedy, SamplingParams(max_tokens=24, temperature=0.0, n=2, ignore_eos=True), greedy, greedy]
    rest = engine.generate(prompt_token_ids=prompts, sampling_params=params)
    outputs = [[c.token_ids for c in out.completions] for out in first + rest]
    core_stats = engine.core.stats()
    return outputs, {**stats, **core_stats}


def _greedy_run(engine: LLM, prompt: list[int]) -> tuple[list[int], dict]:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return engine.generate(prompt_token_ids=[prompt], sampling_params=params)[0].token_ids, {}


def _compare(model: str, tp: int, prompt: list[int], *, is_mixed: bool, atol: float = 1e-4) -> None:
    results = {}
    for size in (1, tp):
        engine = LLM(_config(model, size, is_mixed=is_mixed))
        try:
            logits = _logits(engine, prompt)
            run = _mixed_run(engine) if is_mixed else _greedy_run(engine, prompt)
            results[size] = (logits, *run)
        finally:
            engine.core.close()
    (ref_logits, ref_out, ref_stats), (tp_logits, tp_out, tp_stats) = results[1], results[tp]
    assert tp_logits.shape == ref_logits.shape
    torch.testing.assert_close(tp_logits, ref_logits, rtol=1e-4, atol=atol)
    assert tp_out == ref_out
    if is_mixed:
        for stats in (ref_stats, tp_stats):
            assert stats["preemptions_total"] > 0, stats
            assert stats["prefix_cache_hit_rate"] > 0, stats
            assert stats["drafts"] > 0, stats
        assert ref_out[2][0] == ref_out[2][1]  # n = 2, greedy: both forks alike


def test_llama_tp2_padded_vocab(checkpoint):
    _compare(checkpoint("llama-gqa", vocab_size=385), 2, [5, 17, 33, 2, 9, 100, 7] * 3, is_mixed=True)


def test_llama_six_heads_tp3(checkpoint):
    _compare(checkpoint("llama-gqa", **SIX_HEADS), 3, [9, 8, 7, 200, 300, 12] * 3, is_mixed=True)


def test_qwen2_one_kv_head_replicated_tp2(checkpoint):
    _compare(checkpoint("qwen2"), 2, [5, 17, 33, 2, 9, 100, 7, 8], is_mixed=False)


def test_smollm2_gguf_tp3():
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198]
    _compare(SMOLLM2, 3, prompt, is_mixed=False, atol=2e-3)


def test_head_count_tp_does_not_divide_is_refused_at_startup():
    config = EngineConfig(model=SMOLLM2, tensor_parallel_size=2, device=DeviceConfig(device="cpu"))
    with pytest.raises(
        TensorParallelConfigError, match="size 2 does not divide the model's 9 attention heads"
    ):
        build_engine(config)


def test_one_message_per_step_and_prompt_logprobs_beside_it(checkpoint):
    """A step is one message to the workers (the LM head at the sampled rows rides the forward);
    prompt logprobs, an LM head at other rows, still match tp = 1 around it."""
    model = checkpoint("llama-gqa", vocab_size=385)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    prompts = [[5, 17, 33, 2, 9, 100, 7], [40, 41, 42, 43]]
    results = {}
    sent: list[str] = []

    def counting(send):
        return lambda msg: (sent.append(type(msg).__name__), send(msg))[1]

    for size in (1, 2):
        engine = LLM(_config(model, size, is_mixed=False))
        try:
            if size == 2:
                workers = engine.core.runner.model.workers
                workers.send = counting(workers.send)
            forwards = engine.core.runner.num_device_steps
            outs = engine.generate(prompt_token_ids=prompts, sampling_params=params)
            forwards = engine.core.runner.num_device_steps - forwards
            results[size] = [
                (o.token_ids, [(p.sampled.token_id, p.sampled.logprob) for p in o.prompt_logprobs])
                for o in outs
            ]
        finally:
            engine.core.close()
    assert sent.count("ForwardCall") == forwards  # one message a step ...
    assert sent.count("LogitsCall") == len(prompts)  # ... plus each prompt's prompt-logprobs LM head
    for (ids, lps), (ref_ids, ref_lps) in zip(results[2], results[1], strict=True):
        assert ids == ref_ids
        assert [t for t, _ in lps] == [t for t, _ in ref_lps]
        torch.testing.assert_close([lp for _, lp in lps], [lp for _, lp in ref_lps], rtol=1e-4, atol=1e-4)


def test_lookahead_and_deferred_grammar_sampling_under_tp3():
    """Async scheduling under tensor parallelism: plain and grammar lookahead steps (whose
    sampling comes a call later) take the logits every rank computed with their forward, and
    outputs equal synchronous steps' at the same tp."""
    from pagedinfer.engine.structured.spec import StructuredOutput

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    spec = StructuredOutput.json_schema(schema, strict=True)
    sent: list[str] = []
    results = {}
    for async_scheduling in (False, True):
        config = EngineConfig(
            model=SMOLLM2,
            tensor_parallel_size=3,
            device=DeviceConfig(device="cpu"),
            cache=CacheConfig(num_blocks=64),
            scheduler=SchedulerConfig(async_scheduling=async_scheduling),
        )
        engine = LLM(config)
        try:
            prompts = [
                engine.tokenizer.encode_chat([{"role": "user", "content": q}])
                for q in ("Give a number as JSON.", "Say hi.")
            ]
            params = [
                SamplingParams(max_tokens=12, temperature=0.0, structured_output=spec),
                SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),  # alone at the end
            ]
            workers = engine.core.runner.model.workers
            send = workers.send
            if async_scheduling:
                workers.send = lambda msg, send=send: (sent.append(type(msg).__name__), send(msg))[1]
            outs = engine.generate(prompt_token_ids=prompts, sampling_params=params)
            results[async_scheduling] = [o.token_ids for o in outs]
            if async_scheduling:
                assert engine.core.num_deferred_sampling_steps > 0
                assert engine.core.num_lookahead_steps > engine.core.num_deferred_sampling_steps
        finally:
            engine.core.close()
    assert "ForwardCall" in sent and "LogitsCall" not in sent  # every step's logits came with it
    assert results[True] == results[False]
