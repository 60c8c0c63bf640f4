"""Workloads of bench/speculative.py: one engine each, its prompts and a speculative config per K.

(a) ngram / (c) selfdraft: SmolLM2 on editing tasks (rewrite a text with one substitution,
    or fix its typos), answers ending at the model's EOS;
(b) pair: a Llama-3-8B-shaped random target with a draft of its own first L layers
    (bench/spec_pair.py builds it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import spec_pair  # bench/ is on sys.path (bench/speculative.py puts it there)
import torch
from editing_tasks import tasks

from pagedinfer.engine.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagedinfer.engine.llm import LLM


@dataclass
class Workload:
    """One engine and how to feed it: prompts per batch size and a speculative config per K."""

    name: str
    llm: LLM
    prompts: Callable[[int], list[list[int]]]
    spec_config: Callable[[int], SpeculativeConfig]
    info: dict
    # False: requests end at the model's EOS, as a real answer does (capped by --max-tokens);
    # True: exactly --max-tokens each (a random model's EOS means nothing)
    ignore_eos: bool = True


def _engine_config(args, model: str, dtype: str, spec: SpeculativeConfig) -> EngineConfig:
    return EngineConfig(
        model=model,
        # No prefix caching: every run here repeats the previous run's prompts, and cached prompt
        # blocks would make the later run's prefills (the refilled batch's admissions) cheaper.
        cache=CacheConfig(block_size=16, num_blocks=args.num_blocks, enable_prefix_caching=False),
        scheduler=SchedulerConfig(
            max_model_len=args.max_model_len,
            max_num_seqs=16,
            # (auto: the engine's default, on with CUDA; on: also on the CPU, for a check of the
            # chained paths there)
            async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling],
        ),
        device=DeviceConfig(device=args.device, dtype=dtype),
        speculative=spec,
    )


def _policy(args) -> dict:
    """--min-acceptance-rate 0 turns the per-sequence pause off (the formula assumes none)."""
    return {} if args.min_acceptance_rate is None else {"min_acceptance_rate": args.min_acceptance_rate}


def smollm2_workload(args, ks: list[int], method: str) -> Workload:
    """(a) n-gram, or (c) a self-draft of SmolLM2's own layers, on the editing task."""

    def spec_config(k: int) -> SpeculativeConfig:
        if method == "ngram":
            return SpeculativeConfig(
                method="ngram",
                num_speculative_tokens=k,
                ngram_min=1,
                ngram_max=3,
                ngram_match=args.ngram_match,
                device_chain=args.device_chain == "on",
                device_chain_steps=args.device_chain_steps,
                **_policy(args),
            )
        return SpeculativeConfig(
            method="draft",
            num_speculative_tokens=k,
            draft_model=args.draft,
            device_drafts=args.device_drafts == "on",
            device_chain=args.device_chain == "on",
            **_policy(args),
        )

    llm = LLM(_engine_config(args, args.model, args.dtype, spec_config(ks[0])))
    encode = lambda text: llm.tokenizer.encode_chat([{"role": "user", "content": text}])  # noqa: E731
    info = {
        "model": args.model,
        "draft": args.draft if method == "draft" else None,
        "task": "rewrite with a replacement / fix typos, 4 texts; answers end at EOS",
        "ngram_match": args.ngram_match if method == "ngram" else None,
    }
    return Workload(
        method if method == "ngram" else "selfdraft",
        llm,
        lambda b: [encode(t) for t in tasks(b)],
        spec_config,
        info,
        ignore_eos=False,
    )


def pair_workload(args, ks: list[int]) -> Workload:
    """(b) the 8B-shaped target and its first-L-layers draft (see bench/spec_pair.py)."""
    from pagedinfer.engine.engine_builder import assemble_engine
    from pagedinfer.kernels import ops

    shape = spec_pair.SMOKE if args.smoke else spec_pair.LLAMA3_8B
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    backend = ops.select_backend(torch.device(args.device), "auto")
    model, construction = spec_pair.build_pair(
        shape, args.draft_layers, args.target_agreement, args.device, dtype, backend
    )
    print("pair:", construction, flush=True)

    def spec_config(k: int) -> SpeculativeConfig:
        return SpeculativeConfig(
            method="draft",
            num_speculative_tokens=k,
            draft_model=construction.draft,
            device_drafts=args.device_drafts == "on",
            device_chain=args.device_chain == "on",
            **_policy(args),
        )

    config = _engine_config(
        args, "random-llama-3-8b-shape", str(dtype).removeprefix("torch."), spec_config(ks[0])
    )
    llm = LLM(config, builder=lambda cfg: assemble_engine(cfg, model, None))
    gen = torch.Generator().manual_seed(7)

    def prompts(batch: int) -> list[list[int]]:
        return [
            torch.randint(0, shape.vocab_size, (args.prompt_len,), generator=gen).tolist()
            for _ in range(batch)
        ]

    cached: dict[int, list[list[int]]] = {}

    def prompts_of(batch: int) -> list[list[int]]:  # the same prompts for a size, every call
        if batch not in cached:
            cached[batch] = prompts(batch)
        return cached[batch]

    for b in sorted({1, *[int(x) for x in args.batches.split(",")]}):
        prompts_of(b)
    return Workload("pair", llm, prompts_of, spec_config, {"construction": asdict(construction)})
