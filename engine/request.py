"""One sequence the scheduler runs, and its status. No I/O, no torch.

A client request with `n > 1` becomes n `Request`s that share a `request_id` and differ in
`index`. Index 0 (the leader) is queued; the others wait in `leader.pending_children` and are
forked from the leader's prompt blocks (copy-on-write) in the step that finishes its prompt.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property

from pagedinfer.engine.outputs import FinishReason
from pagedinfer.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; waits to be recomputed from scratch
    PENDING_FORK = "pending_fork"  # an n > 1 child waiting for its leader's prompt
    FINISHED = "finished"

    @property
    def is_finished(self) -> bool:
        return self is RequestStatus.FINISHED


@dataclass(eq=False)
class Request:
    """A sequence: prompt tokens plus the output tokens sampled so far.

    Invariant: `num_computed_tokens <= num_tokens`; the KV manager holds blocks for exactly
    the tokens scheduled so far (computed, or being computed in the current step).
    """

    seq_id: int  # the KV manager's handle; unique per engine
    request_id: str  # the client's id, shared by the n siblings
    index: int  # which of the n completions
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    seed: int | None = None  # per-sequence sampling seed (from params.seed and index); None: random
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens to verify next step
    num_computed_tokens: int = 0
    num_kv_tokens: int = 0  # tokens holding KV slots (== the KV manager's num_tokens(seq_id))
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculation: draft tokens verified for this sequence so far
    num_accepted_tokens: int = 0  # ... and accepted among its output tokens
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    admit_order: int = -1  # increasing each time the request is (re)admitted
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    pending_children: list[Request] = field(default_factory=list)
    # prompt_logprobs: logprobs of prompt tokens 1.. computed so far (a TokenLogprobs each)
    prompt_logprobs: list | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_range(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output + speculative tokens, copying only those."""
        num_prompt = len(self.prompt_token_ids)
        num_out = len(self.output_token_ids)
        out: list[int] = []
        if start < num_prompt:
            out.extend(self.prompt_token_ids[start : min(end, num_prompt)])
        lo, hi = max(start - num_prompt, 0), end - num_prompt
        if hi > lo:
            out.extend(self.output_token_ids[lo : min(hi, num_out)])
            if hi > num_out:
                out.extend(self.spec_token_ids[max(lo - num_out, 0) : hi - num_out])
        return out

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @cached_property
    def stop_token_set(self) -> frozenset[int]:
        """Token ids that may stop this sequence (EOS unless ignored, stop_token_ids); the exact
        rules, min_tokens included, are in stop_checker.check_token_stop."""
        params = self.sampling_params
        eos = () if params.ignore_eos else self.eos_token_ids
        return frozenset((*eos, *params.stop_token_ids))
