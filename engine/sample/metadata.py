"""Per-step sampling parameters as device tensors, built once from the scheduler's rows."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedinfer.engine.core.scheduler_output import SamplingRow
from pagedinfer.engine.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """Everything the sampler reads, one entry per logits row (N rows)."""

    temperature: torch.Tensor  # [N] fp32; greedy rows hold 1.0 (unused)
    is_greedy: torch.Tensor  # [N] bool
    top_k: torch.Tensor  # [N] int64; vocab size when disabled
    top_p: torch.Tensor  # [N] fp32
    min_p: torch.Tensor  # [N] fp32
    seeded_rows: torch.Tensor | None  # [S] int64 rows with a per-request seed; None: none
    seeds: torch.Tensor | None  # [S] int64 their seeds
    positions: torch.Tensor | None  # [S] int64 output position of their sampled token
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    max_num_logprobs: int  # -1: no row wants logprobs
    num_logprobs: list[int | None]  # per row
    penalties: PenaltyTensors | None = None
    ban_rows: torch.Tensor | None = None  # [M] int64 (min_tokens bans)
    ban_token_ids: torch.Tensor | None = None  # [M] int64
    any_greedy: bool = True  # False: every row samples (no argmax row to merge in)
    # [N, ceil(V / 32)] int32 allowed-token bits of grammar rows (-1: unconstrained), set by the
    # runner (engine/structured/masks.py); None: no row has a grammar
    grammar_bitmask: torch.Tensor | None = None
    bias_rows: torch.Tensor | None = None  # [M] int64 (logit_bias entries: row, token, bias)
    bias_token_ids: torch.Tensor | None = None  # [M] int64
    bias_values: torch.Tensor | None = None  # [M] fp32

    @property
    def num_rows(self) -> int:
        return int(self.temperature.shape[0])


@dataclass
class PenaltyTensors:
    prompt_ids: torch.Tensor  # [N, Lp] int64, -1 padded
    output_ids: torch.Tensor  # [N, Lo] int64, -1 padded
    repetition: torch.Tensor  # [N] fp32
    presence: torch.Tensor  # [N] fp32
    frequency: torch.Tensor  # [N] fp32


def build_sampling_metadata(
    rows: Sequence[SamplingRow],
    vocab_size: int,
    device: torch.device,
    eos_token_ids: Sequence[Sequence[int]] | None = None,
) -> SamplingMetadata:
    """Gather the rows' parameters into tensors (one host->device copy per field)."""
    params = [r.sampling_params for r in rows]
    return _with_row_state(_param_tensors(params, vocab_size, device), rows, eos_token_ids, device)


class SamplingMetadataBuilder:
    """`build_sampling_metadata` that reuses the parameter tensors while the batch's parameters
    are unchanged (steady decode: same sequences in the same order), so a step rebuilds only
    what moves with the rows' positions (seeds, penalties, min_tokens bans)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._params: list[SamplingParams] | None = None  # held: equal by identity, then value
        self._tensors: _ParamTensors | None = None

    def build(
        self, rows: Sequence[SamplingRow], eos_token_ids: Sequence[Sequence[int]] | None = None
    ) -> SamplingMetadata:
        params = [r.sampling_params for r in rows]
        if self._tensors is None or params != self._params:  # list == checks identity first, in C
            self._params = params
            self._tensors = _param_tensors(params, self.vocab_size, self.device)
        return _with_row_state(self._tensors, rows, eos_token_ids, self.device)


@dataclass
class _ParamTensors:
    """The part of the metadata that depends only on the rows' SamplingParams."""

    meta: SamplingMetadata  # seeds, penalties and bans unset
    greedy: list[bool]
    any_penalty: bool
    any_min_tokens: bool


def _param_tensors(params: list[SamplingParams], vocab_size: int, device: torch.device) -> _ParamTensors:
    greedy = [p.temperature == 0.0 for p in params]
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    logprobs = [p.logprobs for p in params]

    def dev(values: list, dtype: torch.dtype) -> torch.Tensor:
        return _to_device(torch.tensor(values, dtype=dtype), device)

    meta = SamplingMetadata(
        temperature=dev(
            [1.0 if g else p.temperature for g, p in zip(greedy, params, strict=False)], torch.float32
        ),
        is_greedy=dev(greedy, torch.bool),
        top_k=dev(top_k, torch.int64),
        top_p=dev([p.top_p for p in params], torch.float32),
        min_p=dev([p.min_p for p in params], torch.float32),
        seeded_rows=None,
        seeds=None,
        positions=None,
        all_greedy=all(greedy),
        any_greedy=any(greedy),
        any_top_k=any(k < vocab_size for k, g in zip(top_k, greedy, strict=False) if not g),
        any_top_p=any(p.top_p < 1.0 for p, g in zip(params, greedy, strict=False) if not g),
        any_min_p=any(p.min_p > 0.0 for p, g in zip(params, greedy, strict=False) if not g),
        max_num_logprobs=max((n for n in logprobs if n is not None), default=-1),
        num_logprobs=logprobs,
    )
    _add_logit_bias(meta, params, device)
    return _ParamTensors(
        meta,
        greedy,
        any_penalty=any(p.has_penalties for p in params),
        any_min_tokens=any(p.min_tokens > 0 for p in params),
    )


def _with_row_state(
    tensors: _ParamTensors,
    rows: Sequence[SamplingRow],
    eos_token_ids: Sequence[Sequence[int]] | None,
    device: torch.device,
) -> SamplingMetadata:
    """A fresh metadata object (the shared tensors are never written) plus per-row state."""
    meta = dataclasses.replace(tensors.meta)
    greedy = tensors.greedy
    seeded = [i for i, r in enumerate(rows) if r.seed is not None and not greedy[i]]
    if seeded:  # one staged copy for the three (rows, seeds, positions): views of it
        staged = torch.tensor(
            [
                seeded,
                [rows[i].seed & ((1 << 63) - 1) for i in seeded],
                [rows[i].output_position for i in seeded],
            ],
            dtype=torch.int64,
        )
        meta.seeded_rows, meta.seeds, meta.positions = _to_device(staged, device).unbind(0)
    if tensors.any_penalty:
        meta.penalties = _penalty_tensors(rows, device)
    if tensors.any_min_tokens:  # otherwise no row is below its min_tokens
        _add_min_token_bans(meta, rows, eos_token_ids, device)
    return meta


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Pinned + non-blocking on CUDA: a pageable copy would wait for the running forward pass."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def _pad(lists: list[list[int]]) -> torch.Tensor:
    width = max((len(x) for x in lists), default=0)
    out = torch.full((len(lists), max(width, 1)), -1, dtype=torch.int64)
    for i, ids in enumerate(lists):
        if ids:
            out[i, : len(ids)] = torch.as_tensor(ids, dtype=torch.int64)
    return out


def _penalty_tensors(rows: Sequence[SamplingRow], device: torch.device) -> PenaltyTensors:
    params = [r.sampling_params for r in rows]
    # Rows without a repetition penalty need no prompt history: keep the padded width small.
    prompts = [r.prompt_token_ids if r.sampling_params.repetition_penalty != 1.0 else [] for r in rows]
    outputs = [r.output_token_ids[: r.output_position] for r in rows]
    return PenaltyTensors(
        prompt_ids=_to_device(_pad(prompts), device),
        output_ids=_to_device(_pad(outputs), device),
        repetition=_to_device(
            torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32), device
        ),
        presence=_to_device(torch.tensor([p.presence_penalty for p in params], dtype=torch.float32), device),
        frequency=_to_device(
            torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32), device
        ),
    )


def _add_min_token_bans(meta, rows, eos_token_ids, device) -> None:
    ban_rows: list[int] = []
    ban_ids: list[int] = []
    for i, r in enumerate(rows):
        p = r.sampling_params
        if r.output_position >= p.min_tokens:
            continue
        banned = set(p.stop_token_ids)
        if not p.ignore_eos and eos_token_ids is not None:
            banned.update(eos_token_ids[i])
        ban_rows.extend([i] * len(banned))
        ban_ids.extend(sorted(banned))
    if ban_rows:
        meta.ban_rows = _to_device(torch.tensor(ban_rows, dtype=torch.int64), device)
        meta.ban_token_ids = _to_device(torch.tensor(ban_ids, dtype=torch.int64), device)


def _add_logit_bias(meta: SamplingMetadata, params: list[SamplingParams], device: torch.device) -> None:
    """The rows' logit_bias entries as three flat [M] tensors (one index_put_ in the sampler)."""
    entries = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
    if not entries:
        return
    rows, token_ids, values = zip(*entries, strict=True)
    meta.bias_rows = _to_device(torch.tensor(rows, dtype=torch.int64), device)
    meta.bias_token_ids = _to_device(torch.tensor(token_ids, dtype=torch.int64), device)
    meta.bias_values = _to_device(torch.tensor(values, dtype=torch.float32), device)
