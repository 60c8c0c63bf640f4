"""Plain greedy verification on half-precision logits (tiny random Llama in bf16 on the CPU).

For a plain greedy step the runner keeps the LM head's output in the model dtype
(`compute_logits(upcast=False)` when `is_plain_greedy`) and the verifier takes its argmax on the
host path. Greedy speculative output must still be token for token plain decoding on fp32
logits, and that fast path must really run: bf16 logits reach the verifier, which neither
processes them nor calls the rejection sampler. Penalized and sampled steps get fp32 logits;
seeded sampling with n-gram drafts is token for token plain decoding too.
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
    out = {
        "greedy": generate(llm, GREEDY),
        "penalized": generate(llm, PENALIZED),
        "sampled": generate(llm, SAMPLED),
    }
    assert out["greedy"] != out["penalized"]  # penalties change tokens: skipping them would show
    return out


def spy_on_verification(llm: LLM, monkeypatch) -> list[tuple[torch.dtype, frozenset[str]]]:
    """Per verification step: the logits' dtype and which verifier stages ran, from its launch
    (launch_draws, "draws" when it enqueued them) to its collect (sample, "launched" when it got
    those draws; "host" for the acceptance by matching on the host)."""
    spec = llm.core.runner.spec_decoder
    verifier = spec.verifier
    steps: list[tuple[torch.dtype, frozenset[str]]] = []
    ran: set[str] = set()

    def tracing(name: str, fn: Callable) -> Callable:
        return lambda *args: ran.add(name) or fn(*args)

    for fn in ("matched_tokens", "matched_token_lists"):
        monkeypatch.setattr(verifier_module, fn, tracing("host", getattr(verifier_module, fn)))
    monkeypatch.setattr(verifier, "rejection_sampler", tracing("rejection", verifier.rejection_sampler))
    monkeypatch.setattr(verifier.sampler, "process", tracing("process", verifier.sampler.process))
    launch_draws, sample = spec.launch_draws, spec.sample

    def launch_spy(logits, meta):
        ran.clear()
        draws = launch_draws(logits, meta)
        if draws is not None:
            ran.add("draws")
        return draws

    def sample_spy(logits, meta, groups, draws=None):
        if draws is not None:
            ran.add("launched")
        out = sample(logits, meta, groups, draws)
        steps.append((logits.dtype, frozenset(ran)))
        return out

    monkeypatch.setattr(spec, "launch_draws", launch_spy)
    monkeypatch.setattr(spec, "sample", sample_spy)
    return steps


# Per run: the verification steps' logits dtype and verifier stages (one kind for every step).
HOST = frozenset({"draws", "launched", "host"})  # draws enqueued at launch, matched on the host
CASES = [
    ("greedy", GREEDY, (torch.bfloat16, HOST)),  # the fast path
    ("penalized", PENALIZED, (torch.float32, HOST | {"process"})),
    # n-gram drafts (point masses): each row drawn as plain decoding draws it, then matched
    ("sampled", SAMPLED, (torch.float32, HOST | {"process"})),
]
# A draft model's drafts come with q: the rejection sampler (its seeded tokens are not plain decoding's)
DRAFT_SAMPLED = (torch.float32, frozenset({"process", "rejection"}))


@pytest.mark.parametrize("build", [ngram, target_as_draft], ids=["ngram", "target-draft"])
@pytest.mark.parametrize(("name", "params", "path"), CASES, ids=[c[0] for c in CASES])
def test_greedy_verification_skips_the_upcast_and_equals_fp32_plain_decoding(
    tiny_llama_dir, fp32_logits_baseline, build, name, params, path, monkeypatch
):
    llm = build(tiny_llama_dir)
    steps = spy_on_verification(llm, monkeypatch)
    got = generate(llm, params)
    if name == "sampled" and build is target_as_draft:
        path = DRAFT_SAMPLED
        assert all(len(t) == params.max_tokens for t in got)
    else:
        assert got == fp32_logits_baseline[name]
    assert llm.core.spec_decoder.stats.num_accepted_tokens > 0
    assert steps and set(steps) == {path}
    kv = llm.core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
