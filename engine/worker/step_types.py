"""The model runner's step records and settings: what a launched step carries from its forward
pass to its samples, and how a speculative group's rows are laid out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from pagedinfer.engine.core.scheduler_output import PromptLogprobs, SamplingRow, TokenLogprobs
from pagedinfer.engine.sample.metadata import SamplingMetadata
from pagedinfer.engine.sample.sampler import SamplerOutput
from pagedinfer.engine.spec_decode.device_chain import ChainStep
from pagedinfer.engine.worker.cuda_graphs import GraphKey
from pagedinfer.engine.worker.input_batch import StepInputs


@dataclass(frozen=True)
class RunnerConfig:
    block_size: int
    num_blocks: int  # blocks the scheduler manages; the cache holds one more (scratch)
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    device: torch.device
    attention_backend: str | None = None
    enable_cuda_graphs: bool = True
    eos_token_ids: tuple[int, ...] = ()
    num_speculative_tokens: int = 0  # > 0: also capture verification graphs (q = 1 + K)
    max_verify_seqs: int | None = None  # speculation is off above this batch size: no graphs there


@dataclass(slots=True)  # not frozen: one per sequence per step, and a frozen __init__ costs 3x
class VerifyGroup:
    """Rows [first_row, first_row + 1 + len(draft_token_ids)) belong to one sequence."""

    seq_id: int
    first_row: int
    draft_token_ids: list[int]


class Verifier(Protocol):
    def verify(self, sampled: list[int], groups: Sequence[VerifyGroup]) -> list[list[int]]: ...


class PrefixMatchVerifier:
    """Accept drafts while they equal the token sampled at their position; then one more."""

    def verify(self, sampled: list[int], groups: Sequence[VerifyGroup]) -> list[list[int]]:
        out = []
        for g in groups:
            tokens = [sampled[g.first_row]]
            for j, draft in enumerate(g.draft_token_ids):
                if tokens[-1] != draft:
                    break
                tokens.append(sampled[g.first_row + j + 1])
            out.append(tokens)
        return out


@dataclass
class LaunchedForward:
    """A step whose forward pass is enqueued; logits and sampling are not yet."""

    start: torch.cuda.Event | None  # recorded just before the forward
    rows: list[SamplingRow]
    groups: list[VerifyGroup]
    hidden: torch.Tensor  # [num_tokens (or the graph's rows), H]
    logits_indices: torch.Tensor  # [N] rows of `hidden` that are sampled
    fed_chain: ChainStep | None = None  # a chained speculative step: the step its inputs came from
    # A chained step's device steps (SchedulerOutput.num_device_steps); the later ones rerun the
    # forward on the same input buffers (`inputs`, `graph`), fed by the one before.
    num_device_steps: int = 1
    inputs: StepInputs | None = None
    graph: GraphKey | None = None
    # A chained step's draft-model drafts' q [B, K, V] where some row samples (None: greedy)
    draft_probs: torch.Tensor | None = None
    prompt_logprobs: list[DevicePromptLogprobs] | None = None  # prompts that asked for them
    # After the forward, where its sampling is launched later (SchedulerOutput.defers_sampling):
    # the GPU may idle from here until then.
    forward_end: torch.cuda.Event | None = None


@dataclass
class PendingStep:
    """A launched step whose samples are still on the device."""

    start: torch.cuda.Event | None  # recorded just before the forward
    rows: list[SamplingRow]
    groups: list[VerifyGroup]
    meta: SamplingMetadata | None
    logits: torch.Tensor | None  # [N, V]
    sampled: SamplerOutput | None  # None: speculative rows, verified in collect()
    end: torch.cuda.Event | None = None  # after the last enqueued kernel; None: recorded in collect()
    # Pinned copy of sampled.token_ids (or, speculative, of draws), valid after `end`
    host_token_ids: torch.Tensor | None = None
    draws: torch.Tensor | None = None  # [N] a verification's draw per row, its drafts matched against them
    chain: ChainStep | None = None  # acceptance + next drafts decided on the device (device_chain.py)
    chain_steps: list[ChainStep] | None = None  # several device steps: each one's (`chain`: the last)
    prompt_logprobs: list[DevicePromptLogprobs] | None = None
    # (forward end, sampling start) of a deferred sampling: GPU time idle, not busy
    idle_gap: tuple[torch.cuda.Event, torch.cuda.Event] | None = None


@dataclass(slots=True)
class DevicePromptLogprobs:
    """One prompt chunk's prompt_logprobs, still on the device."""

    seq_id: int
    start: int  # input position of the first row (its target is the next prompt token)
    target_ids: list[int]  # [n]
    logprobs: torch.Tensor  # [n] fp32 logprob of each target
    top_token_ids: torch.Tensor  # [n, k] int64
    top_logprobs: torch.Tensor  # [n, k] fp32

    def to_host(self) -> PromptLogprobs:
        lps, ids, tops = self.logprobs.tolist(), self.top_token_ids.tolist(), self.top_logprobs.tolist()
        entries = [
            TokenLogprobs(t, lp, tuple(i), tuple(v))
            for t, lp, i, v in zip(self.target_ids, lps, ids, tops, strict=True)
        ]
        return PromptLogprobs(self.seq_id, self.start, entries)


@dataclass(slots=True)
class HostTokenIds:
    """[N] token ids on the host, readable once `ready` has completed (None: readable now)."""

    ids: torch.Tensor  # [N] int64 on the CPU
    ready: torch.cuda.Event | None = None

    def numpy(self) -> np.ndarray:
        if self.ready is not None:
            self.ready.synchronize()
        return self.ids.numpy()
