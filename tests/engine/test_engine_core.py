"""End-to-end engine behaviour on a tiny random Llama (CPU): greedy invariance, seeds, leaks."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from pagedinfer.engine.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from pagedinfer.engine.engine_core import defers_outputs
from pagedinfer.engine.errors import InvalidRequestError
from pagedinfer.engine.llm import LLM
from pagedinfer.engine.outputs import FinishReason
from pagedinfer.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def make_llm(folder, num_blocks=256, block_size=4, **sched) -> LLM:
    config = EngineConfig(
        model=str(folder),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_model_len=128, **sched),
        device=DeviceConfig(device="cpu", dtype="float32"),
    )
    return LLM(config)


def prompts(n=6, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randint(3, 30))] for _ in range(n)]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir)


@pytest.fixture(scope="module")
def baseline(llm):
    """Each prompt alone, whole-prompt prefill: the reference greedy outputs."""
    return [llm.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0].token_ids for p in prompts()]


def test_greedy_matches_transformers(tiny_llama_dir, baseline):
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir).float().eval()
    p = prompts()[0]
    with torch.no_grad():
        out = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert out[0, len(p) :].tolist() == baseline[0]


def test_greedy_identical_batched(llm, baseline):
    outs = llm.generate(prompt_token_ids=prompts(), sampling_params=GREEDY)
    assert [o.token_ids for o in outs] == baseline
    assert all(o.finish_reason is FinishReason.LENGTH and o.usage.completion_tokens == 12 for o in outs)


def test_greedy_identical_with_chunked_prefill_and_preemption(tiny_llama_dir, baseline):
    chunked = make_llm(tiny_llama_dir, max_num_batched_tokens=5)
    assert [
        o.token_ids for o in chunked.generate(prompt_token_ids=prompts(), sampling_params=GREEDY)
    ] == baseline
    tight = make_llm(tiny_llama_dir, num_blocks=14)
    outs = tight.generate(prompt_token_ids=prompts(), sampling_params=GREEDY)
    assert tight.core.scheduler.num_preemptions_total > 0
    assert [o.token_ids for o in outs] == baseline
    kv = tight.core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks == 13  # one of the 14 is the padding scratch block


def test_prefix_cache_hits_do_not_change_outputs(llm, baseline):
    p = prompts()[1]
    first = llm.generate(prompt_token_ids=[p + [7, 8, 9]], sampling_params=GREEDY)[0]
    again = llm.generate(prompt_token_ids=[p + [7, 8, 9]], sampling_params=GREEDY)[0]
    assert again.usage.cached_prompt_tokens > 0 and again.token_ids == first.token_ids


def test_seeded_sampling_reproducible_across_batches(llm):
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    p = prompts()[2]
    alone = llm.generate(prompt_token_ids=[p], sampling_params=params)[0].token_ids
    mixed = llm.generate(
        prompt_token_ids=[prompts()[0], p, prompts()[3]],
        sampling_params=[SamplingParams(max_tokens=5, temperature=0.8), params, GREEDY],
    )
    assert mixed[1].token_ids == alone
    other = llm.generate(
        prompt_token_ids=[p], sampling_params=SamplingParams(max_tokens=10, seed=43, ignore_eos=True)
    )
    assert other[0].token_ids != alone


def test_n_completions_fork_and_differ(llm):
    params = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=1, ignore_eos=True, logprobs=2)
    (out,) = llm.generate(prompt_token_ids=[prompts()[4]], sampling_params=params)
    assert [c.index for c in out.completions] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 and len(c.logprobs) == 8 for c in out.completions)
    assert len({tuple(c.token_ids) for c in out.completions}) > 1
    assert out.usage.completion_tokens == 32
    lp = out.completions[0].logprobs[0]
    assert lp.sampled.logprob <= 0 and len(lp.top) == 2 and lp.top[0].logprob >= lp.top[1].logprob
    assert llm.core.scheduler.kv.num_free_blocks == llm.core.scheduler.kv.num_blocks


def test_speculative_drafts_as_extra_tokens_keep_greedy_outputs(llm, baseline):
    """Perfect and wrong drafts through the verification path give the same greedy text."""
    core = llm.core
    ps = prompts()[:3]
    for mode in ("perfect", "wrong"):
        ids = [f"spec-{mode}-{i}" for i in range(3)]
        for rid, p in zip(ids, ps, strict=True):
            core.add_request(rid, p, GREEDY)
        tokens = {rid: [] for rid in ids}
        while core.has_unfinished():
            for seq in core.scheduler.running:
                if seq.num_computed_tokens == seq.num_tokens - 1 and seq.output_token_ids:
                    i = ids.index(seq.request_id)
                    n = seq.num_output_tokens
                    good = baseline[i][n : n + 3]
                    seq.spec_token_ids = good if mode == "perfect" else [t ^ 1 for t in good]
            for out in core.step():
                for d in out.deltas:
                    tokens[out.request_id].extend(d.token_ids)
        assert [tokens[r] for r in ids] == baseline[:3]
        assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.num_blocks


def test_invalid_requests_raise_before_queueing(llm):
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate(prompt_token_ids=[[]], sampling_params=GREEDY)
    with pytest.raises(InvalidRequestError, match="context"):
        llm.generate(prompt_token_ids=[[5] * 128], sampling_params=GREEDY)
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.generate(prompt_token_ids=[[5, 999]], sampling_params=GREEDY)
    assert not llm.core.has_unfinished()


def test_max_model_len_stops_with_length(llm):
    (out,) = llm.generate(
        prompt_token_ids=[[5] * 120], sampling_params=SamplingParams(max_tokens=None, temperature=0)
    )
    assert len(out.token_ids) <= 8 and out.usage.prompt_tokens + out.usage.completion_tokens <= 128


def test_no_block_leak_after_random_workload(tiny_llama_dir):
    # Aging is wall-clock based; switch it off so the schedule (and its preemptions) does not
    # depend on how loaded the machine is. Aging has its own policy tests.
    llm = make_llm(tiny_llama_dir, num_blocks=24, max_num_batched_tokens=16, max_num_seqs=6, aging_seconds=0)
    core, rng = llm.core, random.Random(3)
    live: list[str] = []
    for step in range(150):
        if step < 100 and rng.random() < 0.5:
            rid = f"w{step}"
            params = SamplingParams(
                n=rng.choice([1, 1, 2, 3]),
                max_tokens=rng.randint(1, 12),
                temperature=rng.choice([0.0, 1.0]),
                seed=step,
            )
            core.add_request(rid, prompts(1, seed=step)[0], params, priority=rng.randint(0, 2))
            live.append(rid)
        if live and rng.random() < 0.15:
            core.abort(live.pop(rng.randrange(len(live))))
        if core.has_unfinished():
            core.step()
    while core.has_unfinished():
        core.step()
    kv = core.scheduler.kv
    assert core.scheduler.num_preemptions_total > 0
    assert kv.num_free_blocks == kv.num_blocks
    assert len(core.outputs) == 0


def test_step_stats_count_every_token_once(tiny_llama_dir):
    # Stats are accounted one step late (during the next forward) and flushed when idle.
    chunked = make_llm(tiny_llama_dir, max_num_batched_tokens=7)
    steps = []
    chunked.core.add_step_listener(steps.append)
    outs = chunked.generate(prompt_token_ids=prompts(), sampling_params=GREEDY)
    computed_prompt = sum(len(o.prompt_token_ids) - o.usage.cached_prompt_tokens for o in outs)
    assert [s.step for s in steps] == list(range(1, len(steps) + 1))
    assert sum(s.num_prompt_tokens for s in steps) == computed_prompt
    assert sum(s.num_generation_tokens for s in steps) == 12 * len(outs)
    assert sum(s.num_finished for s in steps) == len(outs)
    assert sum(s.num_scheduled_tokens for s in steps) == computed_prompt + 11 * len(outs)
    assert chunked.core.stats()["generation_tokens_total"] == 12 * len(outs)


def test_cpu_hands_each_step_its_own_tokens(tiny_llama_dir):
    """On the CPU the forward runs as it is launched: a step's tokens come out of that step's
    step() (TTFT is not a step late), while a CUDA runner defers them to overlap the next forward."""
    llm = make_llm(tiny_llama_dir)
    core = llm.core
    assert core.defers_outputs is False
    core.add_request("r", prompts(1)[0], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    seen = []
    for _ in range(3):  # prefill + first token, then one token a step
        (out,) = core.step()
        seen.append(sum(len(d.token_ids) for d in out.deltas))
    assert seen == [1, 1, 1] and out.finished
    assert not core.step()  # nothing left over for a later step
    # a runner whose forward runs asynchronously (CUDA) gets them one step later instead
    cuda = SimpleNamespace(config=SimpleNamespace(device=torch.device("cuda")))
    assert defers_outputs(cuda) and not defers_outputs(core.runner)
