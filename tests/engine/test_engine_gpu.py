"""CUDA-only engine checks (bench/run_gpu.sh runs them): graph replay == eager, bf16 paths.

CPU counterparts: tests/engine/test_engine_core.py (the same invariances, eager on the CPU).
"""

from __future__ import annotations

import pytest
import torch

from pagedinfer.engine.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagedinfer.engine.llm import LLM
from pagedinfer.engine.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def make_llm(
    folder, graphs: bool, dtype: str = "float32", spec: SpeculativeConfig | None = None, **sched
) -> LLM:
    return LLM(
        EngineConfig(
            model=str(folder),
            cache=CacheConfig(block_size=16, num_blocks=128),
            scheduler=SchedulerConfig(**{"max_model_len": 256, "max_num_seqs": 16, **sched}),
            device=DeviceConfig(device="cuda", dtype=dtype, enable_cuda_graphs=graphs),
            speculative=spec or SpeculativeConfig(),
        )
    )


def prompts(n: int = 11) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(3, 256, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def one_layer_draft(**config) -> SpeculativeConfig:
    """The pair of these tests: the model's own first layer as its draft, K 3 unless given."""
    return SpeculativeConfig(
        **{"method": "draft", "draft_model": "self:first=1", "num_speculative_tokens": 3, **config}
    )


def test_cuda_graph_decode_matches_eager(tiny_llama_dir):
    eager = make_llm(tiny_llama_dir, graphs=False)
    graphed = make_llm(tiny_llama_dir, graphs=True)
    assert graphed.core.runner.graphs is not None
    ps = prompts()
    a = [o.token_ids for o in eager.generate(prompt_token_ids=ps, sampling_params=GREEDY)]
    b = [o.token_ids for o in graphed.generate(prompt_token_ids=ps, sampling_params=GREEDY)]
    assert a == b
    # Odd batch sizes hit padded buckets; one request alone uses bucket 1.
    c = graphed.generate(prompt_token_ids=ps[:1], sampling_params=GREEDY)[0].token_ids
    assert c == a[0]


def test_bf16_seeded_sampling_and_preemption_on_gpu(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, graphs=True, dtype="bfloat16")
    params = SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=3, ignore_eos=True)
    ps = prompts()
    alone = llm.generate(prompt_token_ids=ps[:1], sampling_params=params)[0].token_ids
    together = llm.generate(prompt_token_ids=ps, sampling_params=params)[0].token_ids
    assert len(alone) == 12 and len(together) == 12
    kv = llm.core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize(
    "spec",
    [
        SpeculativeConfig(method="ngram", num_speculative_tokens=3),
        SpeculativeConfig(method="draft", num_speculative_tokens=3, draft_model="self:layers=0"),
    ],
    ids=["ngram", "self-draft"],
)
def test_speculative_verification_graphs_keep_greedy_output(tiny_llama_dir, spec):
    """Verification steps replay (B, 1 + K) graphs; greedy output equals the same engine run
    eagerly (same kernels: exact) and plain decoding (decode vs extend kernel, fp32)."""
    ps = [*prompts(5), [5, 6, 7, 8, 9] * 4, [11, 12] * 8]
    plain = make_llm(tiny_llama_dir, graphs=True)
    expected = [o.token_ids for o in plain.generate(prompt_token_ids=ps, sampling_params=GREEDY)]
    eager = make_llm(tiny_llama_dir, graphs=False, spec=spec)
    eager_out = [o.token_ids for o in eager.generate(prompt_token_ids=ps, sampling_params=GREEDY)]
    llm = make_llm(tiny_llama_dir, graphs=True, spec=spec)
    graphs = llm.core.runner.graphs
    assert any(key.query_len == 4 for key in graphs.captured)
    replayed = []
    replay = graphs.replay
    graphs.replay = lambda key: replayed.append(key) or replay(key)
    got = [o.token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=GREEDY)]
    assert got == eager_out, "verification graphs differ from the same steps run eagerly"
    assert got == expected, "speculative output differs from plain decoding"
    assert any(key.query_len == 4 for key in replayed)
    assert llm.core.spec_decoder.stats.num_draft_tokens > 0
    proposer = llm.core.spec_decoder.proposer
    if spec.method == "draft":
        assert proposer.graphs is not None and proposer.graphs.captured
        assert proposer.kv.num_free_blocks == proposer.kv.num_blocks
    kv = llm.core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("graphs", [True, False])
def test_async_scheduling_matches_synchronous_steps(tiny_llama_dir, graphs):
    """Lookahead steps on the device (sampled ids fed on the GPU, pinned async host copies,
    double-buffered staging) give the synchronous engine's greedy and seeded tokens."""
    sync = make_llm(tiny_llama_dir, graphs=graphs, async_scheduling=False)
    asyn = make_llm(tiny_llama_dir, graphs=graphs, async_scheduling=True)
    assert asyn.core.async_scheduling and not sync.core.async_scheduling
    ps = prompts()
    params = [
        SamplingParams(max_tokens=8 + 3 * i, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True)
        for i in range(len(ps))
    ]
    a = [o.token_ids for o in sync.generate(prompt_token_ids=ps, sampling_params=params)]
    b = [o.token_ids for o in asyn.generate(prompt_token_ids=ps, sampling_params=params)]
    assert a == b
    assert asyn.core.num_lookahead_steps >= 20
    kv = asyn.core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize(("graphs", "device_steps"), [(True, 1), (False, 1), (True, 4), (False, 3)])
def test_chained_ngram_speculation_matches_plain_greedy(tiny_llama_dir, graphs, device_steps):
    """N-gram steps chained on the device (acceptance and drafts in the Triton kernel, inputs
    fed in the graphs' buffers, several device steps a launch, placeholders resolved later) give
    the plain greedy tokens."""
    plain = make_llm(tiny_llama_dir, graphs=graphs)
    spec = SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, ngram_max=3, device_chain_steps=device_steps
    )
    chained = make_llm(tiny_llama_dir, graphs=graphs, spec=spec, async_scheduling=True)
    ps = prompts() + [[5, 6, 7, 8, 9] * 6, [11, 12] * 12]  # repetitive: drafts get accepted
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(len(ps))]
    a = [o.token_ids for o in plain.generate(prompt_token_ids=ps, sampling_params=params)]
    b = [o.token_ids for o in chained.generate(prompt_token_ids=ps, sampling_params=params)]
    assert a == b
    alone = chained.generate(prompt_token_ids=ps[-2:], sampling_params=GREEDY)
    assert [o.token_ids for o in alone] == [
        o.token_ids for o in plain.generate(prompt_token_ids=ps[-2:], sampling_params=GREEDY)
    ]
    assert chained.core.num_chained_steps > 0
    assert chained.core.spec_decoder.stats.num_accepted_tokens > 0
    kv = chained.core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("graphs", [True, False])
def test_device_drafts_match_host_drafts(tiny_llama_dir, graphs):
    """A draft model's greedy drafts left on the device (fed to its next step and into the
    verification's inputs there, read by the host afterwards) give the plain greedy tokens and
    the same verifications as drafts the host reads step by step."""
    plain = make_llm(tiny_llama_dir, graphs=graphs)
    ps = prompts() + [[5, 6, 7, 8, 9] * 6]
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(len(ps))]
    want = [o.token_ids for o in plain.generate(prompt_token_ids=ps, sampling_params=params)]
    totals = []
    for device_drafts in (True, False):
        # every step synchronous: the two verify the same drafts
        spec = one_layer_draft(device_drafts=device_drafts, device_chain=False)
        llm = make_llm(tiny_llama_dir, graphs=graphs, spec=spec, async_scheduling=False)
        llm.core.spec_decoder.proposer.record_device_times = True
        assert [o.token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params)] == want
        stats = llm.core.spec_decoder.stats
        totals.append((stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_verified_sequences))
        assert bool(llm.core.spec_decoder.proposer.device_times_ms) is device_drafts
        kv = llm.core.scheduler.kv
        assert kv.num_free_blocks == kv.num_blocks
    assert totals[0] == totals[1] and totals[0][0] > 0


@pytest.mark.parametrize("graphs", [True, False])
def test_chained_pair_matches_plain_greedy(tiny_llama_dir, graphs):
    """Draft-model steps chained on the device (acceptance in the Triton kernel, the draft's
    steps fed from the device histories in its graphs' buffers, the verification fed from them)
    give the plain greedy tokens, and every KV block comes back (target and draft)."""
    plain = make_llm(tiny_llama_dir, graphs=graphs)
    ps = prompts() + [[5, 6, 7, 8, 9] * 6]
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(len(ps))]
    want = [o.token_ids for o in plain.generate(prompt_token_ids=ps, sampling_params=params)]
    # The 1-layer draft of this random model agrees ~9% of the time: the policy would pause most
    # sequences, and a batch paused whole ends a chain (on the CPU, 2026-12-05: 6 chained steps when
    # any pause ended one, 30 without pauses).
    spec = one_layer_draft(min_acceptance_rate=0.0)
    llm = make_llm(tiny_llama_dir, graphs=graphs, spec=spec, async_scheduling=True)
    proposer = llm.core.spec_decoder.proposer
    proposer.record_device_times = True
    assert [o.token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params)] == want
    assert llm.core.num_chained_steps > 10
    assert len(proposer.device_times_ms) > 10  # chained draft launches timed on the device
    assert (proposer.graphs is not None) is graphs
    kv = llm.core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
    assert proposer.kv.num_free_blocks == proposer.kv.num_blocks


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_a_queue_admitted_into_chained_steps_matches_plain_greedy(tiny_llama_dir, graphs, method):
    """Three seats for 13 requests: chained steps admit the waiting prompts behind their chained
    rows (histories and first rows staged apart, the accept kernel over groups of K + 1 rows and
    one-row prompts), and the pair's draft cache is prefilled for them the step after. Plain
    greedy tokens; every KV block back."""
    plain = make_llm(tiny_llama_dir, graphs=graphs)
    ps = prompts() + [[5, 6, 7, 8, 9] * 6, [11, 12] * 12]
    params = [
        SamplingParams(max_tokens=6 + 5 * (i % 4), temperature=0.0, ignore_eos=True) for i in range(len(ps))
    ]
    want = [o.token_ids for o in plain.generate(prompt_token_ids=ps, sampling_params=params)]
    extra = {"draft_model": "self:first=1"} if method == "draft" else {"ngram_max": 3}
    spec = SpeculativeConfig(method=method, num_speculative_tokens=3, min_acceptance_rate=0.0, **extra)
    llm = make_llm(tiny_llama_dir, graphs=graphs, spec=spec, async_scheduling=True, max_num_seqs=3)
    assert [o.token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params)] == want
    assert llm.core.num_chained_steps > 10 and llm.core.num_lookahead_admissions >= 5
    kv = llm.core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
    if method == "draft":
        draft_kv = llm.core.spec_decoder.proposer.kv
        assert draft_kv.num_free_blocks == draft_kv.num_blocks


@pytest.mark.parametrize(("graphs", "device_steps"), [(True, 1), (False, 1), (True, 4)])
def test_seeded_sampling_in_ngram_chains_matches_plain(tiny_llama_dir, graphs, device_steps):
    """Seeded sampled requests (temperature, top-k / top-p) beside greedy ones, chained on the
    device and admitted into chained steps (3 seats): every row drawn with its seeded noise at the
    output position the device's histories give, so the tokens are the plain engine's."""
    plain = make_llm(tiny_llama_dir, graphs=graphs)
    ps = prompts() + [[5, 6, 7, 8, 9] * 6, [11, 12] * 12]
    mix = [
        SamplingParams(max_tokens=20, temperature=0.4, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=14, temperature=0.8, top_k=5, top_p=0.9, seed=12, ignore_eos=True),
        SamplingParams(max_tokens=18, temperature=0.0, ignore_eos=True),
    ]
    params = [mix[i % len(mix)] for i in range(len(ps))]
    want = [o.token_ids for o in plain.generate(prompt_token_ids=ps, sampling_params=params)]
    spec = SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=3,
        ngram_max=3,
        min_acceptance_rate=0.0,
        device_chain_steps=device_steps,
    )
    llm = make_llm(tiny_llama_dir, graphs=graphs, spec=spec, async_scheduling=True, max_num_seqs=3)
    assert [o.token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params)] == want
    assert llm.core.num_chained_steps > 10
    kv = llm.core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


def seeded_workload(min_tokens: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """The random prompts and a repetitive one (drafts get accepted), each request seeded (its own
    seed) at temperature 0.7 / top-k 8, max_tokens growing by 3 from `min_tokens`."""
    ps = prompts() + [[5, 6, 7, 8, 9] * 6]
    params = [
        SamplingParams(max_tokens=min_tokens + 3 * i, temperature=0.7, top_k=8, seed=i, ignore_eos=True)
        for i in range(len(ps))
    ]
    return ps, params


@pytest.mark.parametrize("graphs", [True, False])
def test_sampled_device_drafts_match_host_drafts(tiny_llama_dir, graphs):
    """Seeded sampled requests with a draft model: drafts drawn on the device (each step fed by
    the draw before, q kept there for the rejection sampler) are the drafts the host draws step
    by step, so the tokens and the verifications are the same."""
    ps, params = seeded_workload(min_tokens=8)
    results = []
    for device_drafts in (True, False):
        spec = one_layer_draft(device_drafts=device_drafts, device_chain=False)
        llm = make_llm(tiny_llama_dir, graphs=graphs, spec=spec, async_scheduling=False)
        outs = [o.token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params)]
        stats = llm.core.spec_decoder.stats
        results.append((outs, stats.num_draft_tokens, stats.num_accepted_tokens))
        kv = llm.core.scheduler.kv
        assert kv.num_free_blocks == kv.num_blocks
    assert results[0] == results[1] and results[0][2] > 0


@pytest.mark.parametrize("graphs", [True, False])
def test_chained_pair_with_seeded_sampling_matches_the_synchronous_pair(tiny_llama_dir, graphs):
    """Seeded sampled requests through the pair, chained on the device (drafts drawn there with
    each request's parameters, q kept, the rejection sampler deciding every group there, 3 seats
    so prompts are admitted into chained steps) against the synchronous pair: the same draws, so
    the same tokens up to K + 1 before max_tokens (where the synchronous pair drafts fewer)."""
    k = 3
    ps, params = seeded_workload(min_tokens=12)
    outs = []
    for chain in (True, False):
        spec = one_layer_draft(num_speculative_tokens=k, min_acceptance_rate=0.0, device_chain=chain)
        llm = make_llm(tiny_llama_dir, graphs=graphs, spec=spec, async_scheduling=True, max_num_seqs=3)
        outs.append([o.token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params)])
        assert (llm.core.num_chained_steps > 10) is chain
        kv, draft_kv = llm.core.scheduler.kv, llm.core.spec_decoder.proposer.kv
        assert kv.num_free_blocks == kv.num_blocks and draft_kv.num_free_blocks == draft_kv.num_blocks
    for chained, sync, p in zip(*outs, params, strict=True):
        assert len(chained) == len(sync) == p.max_tokens
        assert chained[: p.max_tokens - k - 1] == sync[: p.max_tokens - k - 1]
