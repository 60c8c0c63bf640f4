"""Plain greedy verification on half-precision logits (tiny random Llama in bf16 on the CPU).

For a plain greedy step the runner keeps the LM head's output in the model dtype
(`compute_logits(upcast=False)` when `is_plain_greedy`) and the verifier takes its argmax on the
host path. Greedy speculative output must still be token for token plain decoding on fp32
logits, and that fast path must really run: bf16 logits reach the verifier, which neither
processes them nor calls the rejection sampler. Penalized and sampled steps get fp32 logits.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from pagedinfer.engine.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagedinfer.engine.core.kv_cache_manager import KVCacheManager
from pagedinfer.engine.llm import LLM
from pagedinfer.engine.sampling_params import SamplingParams
from pagedinfer.engine.spec_decode import verifier as verifier_module
from pagedinfer.engine.spec_decode.controller import SpeculativeDecoder
from pagedinfer.engine.spec_decode.draft_model import DraftModelProposer
from pagedinfer.engine.worker.kv_cache import allocate_kv_caches

MAX_MODEL_LEN = 128
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# Mild: under strong penalties the outputs stop repeating and n-gram drafts are never accepted.
PENALIZED = SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.1, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=24, temperature=0.8, top_k=20, seed=5, ignore_eos=True)


def make_llm(folder, spec: SpeculativeConfig | None = None) -> LLM:
    config = EngineConfig(
        model=str(folder),
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(max_model_len=MAX_MODEL_LEN),
        device=DeviceConfig(device="cpu", dtype="bfloat16"),
        speculative=spec or SpeculativeConfig(),
    )
    return LLM(config)


def ngram(folder) -> LLM:
    return make_llm(folder, SpeculativeConfig(method="ngram", num_speculative_tokens=4))


def target_as_draft(folder, k: int = 3) -> LLM:
    """The target drafts for itself (bf16 draft caches): long accepted runs, full acceptance."""
    llm = make_llm(folder)
    model = llm.core.runner.model
    kv = KVCacheManager(128, 4)
    caches = allocate_kv_caches(model.config, 128, 4, "cpu", model.dtype)
    proposer = DraftModelProposer(model, kv, caches, k, llm.model_config.vocab_size, "reference")
    spec = SpeculativeDecoder(
        SpeculativeConfig(method="draft", num_speculative_tokens=k), proposer, MAX_MODEL_LEN
    )
    llm.core.spec_decoder = llm.core.runner.spec_decoder = spec
    return llm


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    out = [[rng.randrange(3, 256) for _ in range(rng.randint(3, 24))] for _ in range(5)]
    return out + [[5, 6, 7, 8, 9] * 4, [11, 12] * 8]  # repetitive: the n-gram proposer matches


def generate(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompt_token_ids=prompts(), sampling_params=params)]


@pytest.fixture(scope="module")
def fp32_logits_baseline(tiny_llama_dir) -> dict[str, list[list[int]]]:
    """Plain decoding of the bf16 model with the LM head always upcast (no fast path)."""
    llm = make_llm(tiny_llama_dir)
    model = llm.core.runner.model
    compute_logits = model.compute_logits
    model.compute_logits = lambda hidden, upcast=True, backend=None: compute_logits(hidden, True, backend)
    assert model.dtype == torch.bfloat16
    out = {"greedy": generate(llm, GREEDY), "penalized": generate(llm, PENALIZED)}
    assert out["greedy"] != out["penalized"]  # penalties change tokens: skipping them would show
    return out


def spy_on_verification(llm: LLM, monkeypatch) -> list[tuple[torch.dtype, frozenset[str]]]:
    """Per verification step: the logits' dtype and which verifier stages ran, from its launch
    (launch_greedy, "argmax" when it enqueued one) to its collect (sample, "launched" when it got
    that argmax; "host" for the host acceptance)."""
    spec = llm.core.runner.spec_decoder
    verifier = spec.verifier
    steps: list[tuple[torch.dtype, frozenset[str]]] = []
    ran: set[str] = set()

    def tracing(name: str, fn: Callable) -> Callable:
        return lambda *args: ran.add(name) or fn(*args)

    for fn in ("greedy_tokens", "greedy_token_lists"):
        monkeypatch.setattr(verifier_module, fn, tracing("host", getattr(verifier_module, fn)))
    monkeypatch.setattr(verifier, "rejection_sampler", tracing("rejection", verifier.rejection_sampler))
    monkeypatch.setattr(verifier.sampler, "process", tracing("process", verifier.sampler.process))
    launch_greedy, sample = spec.launch_greedy, spec.sample

    def launch_spy(logits, meta):
        ran.clear()
        argmax = launch_greedy(logits, meta)
        if argmax is not None:
            ran.add("argmax")
        return argmax

    def sample_spy(logits, meta, groups, argmax=None):
        if argmax is not None:
            ran.add("launched")
        out = sample(logits, meta, groups, argmax)
        steps.append((logits.dtype, frozenset(ran)))
        return out

    monkeypatch.setattr(spec, "launch_greedy", launch_spy)
    monkeypatch.setattr(spec, "sample", sample_spy)
    return steps


# Per run: the verification steps' logits dtype and verifier stages (one kind for every step).
HOST = frozenset({"argmax", "launched", "host"})  # argmax enqueued at launch, acceptance on the host
CASES = [
    ("greedy", GREEDY, (torch.bfloat16, HOST)),  # the fast path
    ("penalized", PENALIZED, (torch.float32, HOST | {"process"})),
    ("sampled", SAMPLED, (torch.float32, frozenset({"process", "rejection"}))),
]


@pytest.mark.parametrize("build", [ngram, target_as_draft], ids=["ngram", "target-draft"])
@pytest.mark.parametrize(("name", "params", "path"), CASES, ids=[c[0] for c in CASES])
def test_greedy_verification_skips_the_upcast_and_equals_fp32_plain_decoding(
    tiny_llama_dir, fp32_logits_baseline, build, name, params, path, monkeypatch
):
    llm = build(tiny_llama_dir)
    steps = spy_on_verification(llm, monkeypatch)
    got = generate(llm, params)
    if name in fp32_logits_baseline:
        assert got == fp32_logits_baseline[name]
    else:
        assert all(len(t) == params.max_tokens for t in got)
    assert llm.core.spec_decoder.stats.num_accepted_tokens > 0
    assert steps and set(steps) == {path}
    kv = llm.core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
