"""Speculative decoding through the whole engine (tiny random Llama on the CPU).

Greedy output must be token-for-token the non-speculative output for every proposer, with
n > 1 forks, chunked prefill, preemption and penalties; no KV block may leak (target or draft);
and a draft identical to the target must have every draft accepted, also when sampling with
temperature / top-k / penalties: that proves p and q are processed identically.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedinfer.engine.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagedinfer.engine.core.kv_cache_manager import KVCacheManager
from pagedinfer.engine.llm import LLM
from pagedinfer.engine.models.llama import LlamaForCausalLM
from pagedinfer.engine.outputs import FinishReason
from pagedinfer.engine.sampling_params import SamplingParams
from pagedinfer.engine.spec_decode.controller import SpeculativeDecoder
from pagedinfer.engine.spec_decode.draft_model import DraftModelProposer
from pagedinfer.engine.worker.kv_cache import allocate_kv_caches

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
MAX_MODEL_LEN = 128
# Seeded sampled requests (temperature, top-k / top-p, min-p) with a greedy one: tokens that a
# speculative engine must reproduce exactly where its draws are plain decoding's
SEEDED_MIX = [
    SamplingParams(max_tokens=28, temperature=0.4, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=0.8, top_k=5, top_p=0.9, seed=12, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=16, temperature=0.3, min_p=0.1, seed=13, ignore_eos=True),
]


def make_llm(folder, spec: SpeculativeConfig | None = None, num_blocks=256, **sched) -> LLM:
    config = EngineConfig(
        model=str(folder),
        cache=CacheConfig(block_size=4, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_model_len=MAX_MODEL_LEN, **sched),
        device=DeviceConfig(device="cpu", dtype="float32"),
        speculative=spec or SpeculativeConfig(),
    )
    return LLM(config)


def prompts(n=5, seed=0):
    rng = random.Random(seed)
    out = [[rng.randrange(3, 256) for _ in range(rng.randint(3, 24))] for _ in range(n)]
    return out + [[5, 6, 7, 8, 9] * 4, [11, 12] * 8]  # repetitive: the n-gram proposer matches


def greedy_workload(
    rng: random.Random, n: int, seed: int, max_tokens: tuple[int, int], stop_every: int, num_stops: int = 1
):
    """`prompts(n, seed)` with greedy params of random lengths; every `stop_every`-th request
    (from the first) also stops at one of `num_stops` random ids."""
    ps = prompts(n, seed)
    params = [
        SamplingParams(
            max_tokens=rng.randint(*max_tokens),
            temperature=0.0,
            ignore_eos=True,
            stop_token_ids=[rng.randrange(3, 256) for _ in range(num_stops)] if i % stop_every == 0 else [],
        )
        for i in range(len(ps))
    ]
    return ps, params


def generate(llm, params=GREEDY, ps=None):
    return [o.token_ids for o in llm.generate(prompt_token_ids=ps or prompts(), sampling_params=params)]


def both_methods(k: int) -> list[SpeculativeConfig]:
    """The n-gram proposer and a draft model (the target's first layer), K drafts each."""
    return [
        SpeculativeConfig(method="ngram", num_speculative_tokens=k),
        SpeculativeConfig(method="draft", draft_model="self:first=1", num_speculative_tokens=k),
    ]


def attach_draft(llm: LLM, draft_model, k: int = 3, num_blocks: int = 128) -> SpeculativeDecoder:
    """Give an engine a draft-model decoder built by hand (any model, no tokenizer check)."""
    kv = KVCacheManager(num_blocks, 4)
    caches = allocate_kv_caches(draft_model.config, num_blocks, 4, "cpu", torch.float32)
    proposer = DraftModelProposer(draft_model, kv, caches, k, llm.model_config.vocab_size, "reference")
    spec = SpeculativeDecoder(
        SpeculativeConfig(method="draft", num_speculative_tokens=k), proposer, MAX_MODEL_LEN
    )
    llm.core.spec_decoder = spec
    llm.core.runner.spec_decoder = spec
    return spec


def assert_no_leak(llm: LLM) -> None:
    kv = llm.core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
    proposer = llm.core.spec_decoder.proposer
    if isinstance(proposer, DraftModelProposer):
        assert proposer.kv.num_free_blocks == proposer.kv.num_blocks


def step_through(core, ps: list[list[int]], params: SamplingParams):
    """Add the prompts as requests r0, r1, ... and step the engine core until all are done,
    yielding after every step (for checks between steps)."""
    for i, p in enumerate(ps):
        core.add_request(f"r{i}", p, params)
    while core.has_unfinished():
        core.step()
        yield


def run_requests(core, ps: list[list[int]], params: list[SamplingParams], each_step=None) -> dict:
    """Add the prompts as requests r0, r1, ... (one params each) and step the engine core until
    all are done, calling `each_step()` after every step; output ids by (request id, index)."""
    for i, (p, sp) in enumerate(zip(ps, params, strict=True)):
        core.add_request(f"r{i}", p, sp)
    outs: dict[tuple[str, int], list[int]] = {}
    while core.has_unfinished():
        for out in core.step():
            for d in out.deltas:
                outs.setdefault((out.request_id, d.index), []).extend(d.token_ids)
        if each_step is not None:
            each_step()
    return outs


def trace_admissions(core) -> list[tuple[bool, bool]]:
    """Per launched step, filled as the engine runs: (it admits a prompt, it is chained)."""
    log: list[tuple[bool, bool]] = []
    launch = core.runner.launch_forward

    def traced(sched, *args, **kwargs):
        admits = any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.sequences)
        log.append((admits, sched.feeds_drafts))
        return launch(sched, *args, **kwargs)

    core.runner.launch_forward = traced
    return log


def trace_chained_requests(core) -> set[str]:
    """Filled as the engine runs: the request ids that had rows in a chained step."""
    in_chains: set[str] = set()
    launch = core.runner.launch_forward

    def traced(sched, *args, **kwargs):
        if sched.feeds_drafts:
            by_seq_id = core.scheduler.by_seq_id
            in_chains.update(by_seq_id[s.seq_id].request_id for s in sched.sequences if s.seq_id in by_seq_id)
        return launch(sched, *args, **kwargs)

    core.runner.launch_forward = traced
    return in_chains


def trace_wasted_device_steps(core) -> list[int]:
    """Filled as the engine runs: per chained launch, its device steps that no sequence used (they
    started after every sequence's tokens had ended, e.g. at max_tokens)."""
    spec = core.spec_decoder
    observe = spec.observe
    wasted: list[int] = []

    def traced(sched, result, applied=None):
        if sched.feeds_drafts and result.device_steps is not None:
            used: dict[int, int] = {}
            for seq_id, *_ in result.verifications(applied):
                used[seq_id] = used.get(seq_id, 0) + 1
            wasted.append(sched.num_device_steps - max(used.values(), default=0))
        return observe(sched, result, applied)

    spec.observe = traced
    return wasted


def kv_record(kv: KVCacheManager, seq_id: int) -> list[int]:
    """The token ids a KV cache manager records for a sequence, read block by block."""
    record = [t for b in kv.block_table(seq_id) for t in kv._blocks.block_tokens(b)]
    return record[: kv.num_tokens(seq_id)]


def follow_up_reuse(llm: LLM, plain, prompt: list[int], output: list[int], params) -> list[int]:
    """Prompt-cache reuse after a generation: `prompt` + `output` (its real ids), then `prompt` +
    as many 0s (the ids a placeholder would leave); each decodes like `plain(ps, params)` (token
    ids per prompt). Returns their cached prompt tokens, in that order."""
    cached = []
    for follow in (prompt + output, prompt + [0] * len(output)):
        got = llm.generate(prompt_token_ids=[follow], sampling_params=params)[0]
        assert got.token_ids == plain([follow], params)[0]
        cached.append(got.usage.cached_prompt_tokens)
    return cached


@pytest.fixture(scope="module")
def baseline_llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir)


@pytest.fixture(scope="module")
def baseline(baseline_llm):
    return generate(baseline_llm)


def test_ngram_greedy_is_token_for_token_identical(tiny_llama_dir, baseline):
    llm = make_llm(tiny_llama_dir, SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    assert generate(llm) == baseline
    stats = llm.core.spec_decoder.stats
    assert stats.num_accepted_tokens > 0 and stats.mean_accepted_length > 1.0
    assert_no_leak(llm)


def test_ngram_with_forks_chunked_prefill_and_preemption(tiny_llama_dir, baseline_llm):
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    params = SamplingParams(n=2, max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = [
        o.completions for o in baseline_llm.generate(prompt_token_ids=prompts(), sampling_params=params)
    ]
    llm = make_llm(tiny_llama_dir, spec, num_blocks=24, max_num_batched_tokens=7)
    outs = llm.generate(prompt_token_ids=prompts(), sampling_params=params)
    assert [[c.token_ids for c in o.completions] for o in outs] == [
        [c.token_ids for c in e] for e in expected
    ]
    assert llm.core.scheduler.num_preemptions_total > 0
    assert llm.core.spec_decoder.stats.num_draft_tokens > 0
    assert_no_leak(llm)


def test_penalties_see_the_drafts_as_history(tiny_llama_dir, baseline_llm):
    params = SamplingParams(
        max_tokens=20,
        temperature=0.0,
        frequency_penalty=2.0,
        presence_penalty=1.0,
        repetition_penalty=1.3,
        ignore_eos=True,
    )
    few = prompts()[-3:]
    expected = generate(baseline_llm, params, few)
    # The target as its own draft accepts long runs, so later rows must count earlier drafts.
    llm = make_llm(tiny_llama_dir)
    spec = attach_draft(llm, llm.core.runner.model, k=4)
    assert generate(llm, params, few) == expected
    assert spec.stats.mean_accepted_length > 2.0
    min_tokens = SamplingParams(max_tokens=12, min_tokens=6, temperature=0.0, stop_token_ids=(6, 63))
    assert generate(llm, min_tokens, few) == generate(baseline_llm, min_tokens, few)


def test_self_layer_subset_draft_greedy_is_identical(tiny_llama_dir, baseline):
    llm = make_llm(tiny_llama_dir, SpeculativeConfig(method="draft", draft_model="self:first=1"))
    assert generate(llm) == baseline
    assert llm.core.spec_decoder.stats.num_draft_tokens > 0
    assert_no_leak(llm)


def test_separately_initialized_small_draft_greedy_is_identical(tiny_llama_dir, baseline):
    llm = make_llm(tiny_llama_dir)
    config = ModelConfig("llama", 256, 32, 64, 1, 2, 1, 16, 256)
    draft = LlamaForCausalLM(config, torch.float32, "cpu")
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            param.normal_(1.0, 0.2) if "norm" in name else param.normal_(0.0, 0.3)
    spec = attach_draft(llm, draft)
    assert generate(llm) == baseline
    assert spec.stats.num_draft_tokens > 0
    assert_no_leak(llm)


def test_target_as_its_own_draft_accepts_everything(tiny_llama_dir, baseline):
    llm = make_llm(tiny_llama_dir)
    spec = attach_draft(llm, llm.core.runner.model, k=4)
    assert generate(llm) == baseline
    assert spec.stats.acceptance_rate == 1.0 and spec.stats.mean_accepted_length > 4.0
    # Sampling: p == q up to float rounding only if both see the same processing at every position.
    params = SamplingParams(
        max_tokens=24, temperature=0.8, top_k=20, top_p=0.9, frequency_penalty=2.0, seed=3
    )
    before = (spec.stats.num_draft_tokens, spec.stats.num_accepted_tokens)
    generate(llm, params)
    drafted = spec.stats.num_draft_tokens - before[0]
    accepted = spec.stats.num_accepted_tokens - before[1]
    assert drafted > 50 and accepted >= 0.99 * drafted
    assert_no_leak(llm)


def test_seeded_sampling_is_reproducible_alone_or_batched(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=11, ignore_eos=True)
    target = prompts()[-2]
    alone = generate(llm, params, [target])[0]
    batched = generate(llm, params, prompts())
    assert batched[-2] == alone


def test_per_request_opt_out_and_batch_size_cutoff(tiny_llama_dir, baseline):
    llm = make_llm(tiny_llama_dir, SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    off = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, use_speculation=False)
    assert generate(llm, off) == baseline
    assert llm.core.spec_decoder.stats.num_draft_tokens == 0
    big = make_llm(tiny_llama_dir, SpeculativeConfig(method="ngram", max_batch_size=2))
    assert generate(big) == baseline  # 7 running > 2: no step speculates until few are left
    stats = big.core.spec_decoder.stats
    assert stats.num_draft_tokens < llm_drafts(tiny_llama_dir)


def llm_drafts(folder) -> int:
    llm = make_llm(folder, SpeculativeConfig(method="ngram"))
    generate(llm)
    return llm.core.spec_decoder.stats.num_draft_tokens


def test_a_full_draft_cache_only_stops_drafting(tiny_llama_dir, baseline):
    llm = make_llm(tiny_llama_dir)
    spec = attach_draft(llm, llm.core.runner.model, k=3, num_blocks=8)  # 32 slots for 7 sequences
    assert generate(llm) == baseline
    assert spec.stats.num_draft_tokens > 0
    assert_no_leak(llm)


def test_step_stats_count_verified_sequences(tiny_llama_dir):
    """The serving metrics' mean accepted length comes from these per-step counts."""
    llm = make_llm(tiny_llama_dir, SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    steps = []
    llm.core.add_step_listener(steps.append)
    generate(llm)
    stats = llm.core.spec_decoder.stats
    assert sum(s.num_verified_seqs for s in steps) == stats.num_verified_sequences > 0
    assert sum(s.num_accepted_tokens for s in steps) == stats.num_accepted_tokens


def test_async_scheduling_runs_where_no_sequence_drafts(tiny_llama_dir, baseline):
    """A speculative engine plans steps ahead (lookahead) while nothing in the batch may draft:
    requests that opt out, or a batch above max_batch_size; steps that may draft stay
    synchronous. Outputs stay identical and no block leaks either way."""
    # device_chain off: drafting steps are host-planned (chained ones: test_device_chain.py)
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=3, device_chain=False)
    llm = make_llm(tiny_llama_dir, ngram, async_scheduling=True)
    assert llm.core.async_scheduling
    off = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, use_speculation=False)
    assert generate(llm, off) == baseline
    assert llm.core.num_lookahead_steps > 0
    assert llm.core.spec_decoder.stats.num_draft_tokens == 0
    assert_no_leak(llm)
    steps = llm.core.num_lookahead_steps
    assert generate(llm) == baseline  # every request drafts: no lookahead step
    assert llm.core.num_lookahead_steps == steps
    assert llm.core.spec_decoder.stats.num_draft_tokens > 0
    assert_no_leak(llm)
    # 7 running > max_batch_size 2: lookahead steps until only 2 are left, then drafts
    capped = SpeculativeConfig(method="ngram", num_speculative_tokens=3, max_batch_size=2, device_chain=False)
    big = make_llm(tiny_llama_dir, capped, async_scheduling=True)
    lengths = [SamplingParams(max_tokens=8 + 4 * i, temperature=0.0, ignore_eos=True) for i in range(7)]
    expected = [o.token_ids for o in baseline_llm_outputs(tiny_llama_dir, lengths)]
    assert [
        o.token_ids for o in big.generate(prompt_token_ids=prompts(), sampling_params=lengths)
    ] == expected
    assert big.core.num_lookahead_steps > 0 and big.core.spec_decoder.stats.num_draft_tokens > 0
    assert_no_leak(big)


def baseline_llm_outputs(folder, params):
    return make_llm(folder).generate(prompt_token_ids=prompts(), sampling_params=params)


@pytest.mark.parametrize(
    "spec",
    [None, *both_methods(4)],
    ids=["plain", "ngram", "draft"],
)
def test_an_aborted_request_streams_every_token_its_usage_counts(tiny_llama_dir, spec):
    """Outputs trail the scheduler by a step: the final output of an abort carries the request's
    tokens of the last step (up to K + 1 a sequence when speculating), and its usage counts
    exactly the tokens streamed. The other requests' tokens of that step come with the next step."""
    llm = make_llm(tiny_llama_dir, spec)
    core = llm.core
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    core.add_request("a", [7, 8, 9, 10] * 4, params)
    core.add_request("b", [5, 6] * 4, params)
    streamed: dict[str, list[int]] = {"a": [], "b": []}
    finals = {}

    def take(outputs):
        for out in outputs:
            streamed[out.request_id] += [t for d in out.deltas for t in d.token_ids]
            if out.finished:
                finals[out.request_id] = out

    for _ in range(4):
        take(core.step())
    final = core.abort("a")
    # only its own outputs: a caller may drop them (shared_core, when the client's server left)
    assert [o.request_id for o in final] == ["a"]
    take(final)
    assert "a" in finals and finals["a"].deltas[0].finish_reason is FinishReason.ABORT
    assert len(streamed["a"]) == finals["a"].usage.completion_tokens >= 4
    while core.has_unfinished():
        take(core.step())
    assert len(streamed["b"]) == finals["b"].usage.completion_tokens == 40
    assert streamed["b"] == generate(make_llm(tiny_llama_dir), params, [[5, 6] * 4])[0]
    if spec is not None:
        assert core.spec_decoder.stats.num_accepted_tokens > 0
        assert_no_leak(llm)


@pytest.mark.parametrize("spec", both_methods(4), ids=["ngram", "draft"])
def test_drafts_that_do_not_fit_the_pool_are_dropped_before_anything_is_preempted(tiny_llama_dir, spec):
    """A pool too small for a sequence's drafts: the drafts go unverified, and the sequence runs
    on as plain decoding does. A lone sequence ends (out of KV) exactly where plain decoding's
    does; with two, there are no more preemptions than without speculation."""
    unbounded = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    lone = [[7, 8, 9, 10] * 3 + [5, 6]]
    pair = [[7, 8, 9, 10] * 2, [11, 12] * 4]
    bounded = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    runs = {}
    for name, config in (("plain", None), ("spec", spec)):
        llm = make_llm(tiny_llama_dir, config, num_blocks=8)  # 28 slots (a block is held back)
        out = llm.generate(prompt_token_ids=lone, sampling_params=unbounded)[0]
        two = llm.generate(prompt_token_ids=pair, sampling_params=bounded)
        runs[name] = (out.token_ids, out.completions[0].error, [o.token_ids for o in two])
        runs[name + "_preemptions"] = llm.core.scheduler.num_preemptions_total
        if config is not None:
            assert llm.core.spec_decoder.stats.num_draft_tokens > 0
            assert_no_leak(llm)
    assert runs["spec"] == runs["plain"]
    assert runs["plain"][1] == "sequence does not fit in the KV cache"
    assert runs["spec_preemptions"] <= runs["plain_preemptions"]


@pytest.mark.parametrize("chunked,budget", [(False, 14), (False, 12), (True, 12), (True, 8)])
@pytest.mark.parametrize("spec", both_methods(5), ids=["ngram", "draft"])
def test_drafts_that_do_not_fit_the_token_budget_are_cut(tiny_llama_dir, spec, chunked, budget):
    """Drafts are optional: three decodes of 1 + 5 tokens against a budget below 3 x 6 all get
    tokens every step (the earlier ones' drafts leave a token for each later one), as without
    speculation, and the third prompt is admitted while the first two decode. (Before: without
    chunked prefill and a budget of 14 the third was skipped whole while the other two's drafts
    took the budget, until one of them finished; at 12, and with chunked prefill at any budget
    below 13, the first two's drafts left it 0 tokens; at 8 with chunked prefill the first two's
    drafts took the budget its admission needed, and it waited until one of them ended.)"""
    ps = [[5 + i, 6, 7] * 2 for i in range(3)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    llm = make_llm(tiny_llama_dir, spec, max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
    core = llm.core
    for i, p in enumerate(ps):
        core.add_request(f"r{i}", p, params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(ps))}
    starved = steps_all_running = 0
    history, done = [], set()
    while core.has_unfinished():
        got = dict.fromkeys(tokens, 0)
        for out in core.step():
            for d in out.deltas:
                got[out.request_id] += len(d.token_ids)
                tokens[out.request_id].extend(d.token_ids)
            if out.finished:
                done.add(out.request_id)
        history.append("".join(map(str, got.values())))
        if all(tokens.values()) and not done:  # all three decoding, none has ended
            steps_all_running += 1
            starved += sum(1 for n in got.values() if n == 0)
    assert steps_all_running > 3 and starved == 0, (steps_all_running, starved, " ".join(history))
    assert core.spec_decoder.stats.num_draft_tokens > 0
    plain = make_llm(tiny_llama_dir, None, max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
    expected = [o.token_ids for o in plain.generate(prompt_token_ids=ps, sampling_params=params)]
    assert [tokens[f"r{i}"] for i in range(len(ps))] == expected
    assert_no_leak(llm)
