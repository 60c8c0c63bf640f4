"""Offline batch inference: `LLM(model).generate(prompts, params)` drives the engine inline."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedinfer.engine.config import EngineConfig
from pagedinfer.engine.outputs import FinishReason, RequestOutput, RequestTiming, SampleLogprobs, Usage
from pagedinfer.engine.sampling_params import SamplingParams


@dataclass
class Completion:
    """One of a prompt's n completions."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    logprobs: list[SampleLogprobs] | None = None
    error: str | None = None


@dataclass
class FinalOutput:
    """Everything a prompt produced, once finished."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[Completion]
    usage: Usage | None = None
    timing: RequestTiming | None = None
    prompt_logprobs: list[SampleLogprobs] | None = None  # prompt tokens 1.. (SamplingParams.prompt_logprobs)

    @property
    def text(self) -> str:
        return self.completions[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.completions[0].token_ids

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.completions[0].finish_reason


def accumulate(final: FinalOutput, out: RequestOutput) -> None:
    """Merge one streamed RequestOutput into the final result."""
    for delta in out.deltas:
        c = final.completions[delta.index]
        c.text += delta.text
        c.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            c.logprobs = (c.logprobs or []) + list(delta.logprobs)
        if delta.prompt_logprobs is not None:
            final.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            c.finish_reason, c.stop_reason, c.error = delta.finish_reason, delta.stop_reason, delta.error
    if out.finished:
        final.usage, final.timing = out.usage, out.timing


class LLM:
    """Synchronous offline engine (no threads): add every prompt, step until all finish."""

    def __init__(self, model: str | EngineConfig | None = None, *, builder=None, **config_kwargs) -> None:
        from pagedinfer.engine.engine_builder import build_engine

        if isinstance(model, EngineConfig):
            config = model
        else:
            config = EngineConfig(**({"model": model} if model else {}), **config_kwargs)
        self.config = config
        self._built = (builder or build_engine)(config)
        self.core = self._built.core
        self.tokenizer = self._built.tokenizer
        self.model_config = self._built.model_config
        self.max_model_len = self._built.max_model_len

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        priorities: Sequence[int] | None = None,
    ) -> list[FinalOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order."""
        texts, id_lists = self._inputs(prompts, prompt_token_ids)
        params = sampling_params or SamplingParams()
        params_list = [params] * len(id_lists) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(id_lists):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        finals: dict[str, FinalOutput] = {}
        order = []
        for i, (text, ids, p) in enumerate(zip(texts, id_lists, params_list, strict=True)):
            request_id = f"llm-{uuid.uuid4().hex[:12]}-{i}"
            prio = priorities[i] if priorities is not None else 0
            self.core.add_request(request_id, ids, p, prio)
            finals[request_id] = FinalOutput(request_id, text, ids, [Completion(k) for k in range(p.n)])
            order.append(request_id)
        while self.core.has_unfinished():
            for out in self.core.step():
                accumulate(finals[out.request_id], out)
        return [finals[r] for r in order]

    def _inputs(self, prompts, prompt_token_ids) -> tuple[list[str | None], list[list[int]]]:
        if prompt_token_ids is not None:
            return [None] * len(prompt_token_ids), [list(map(int, p)) for p in prompt_token_ids]
        if prompts is None:
            raise ValueError("pass prompts or prompt_token_ids")
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        return texts, [self.tokenizer.encode(t) for t in texts]
