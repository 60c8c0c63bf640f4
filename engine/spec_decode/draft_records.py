"""The draft proposer's plain pieces (draft_model.py, draft_chain.py): what its cache holds per
sequence, token spans, the next draft's sampling row, the draft's logits over the target's vocabulary."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedinfer.engine.core.scheduler_output import SamplingRow


@dataclass
class DraftSeq:
    """What the draft cache holds for one sequence."""

    cached_ids: list[int]  # tokens whose K/V are in the draft cache, in order
    num_known: int  # real (non-draft) tokens of the sequence at the last proposal


def position_row(row: SamplingRow, drafts: list[int]) -> SamplingRow:
    """The sampling row of the next draft: output position and penalty history past `drafts`."""
    if not drafts:
        return row
    history = [*row.output_token_ids[: row.output_position], *drafts]
    return dataclasses.replace(
        row, output_position=row.output_position + len(drafts), output_token_ids=history
    )


def token_span(prompt: Sequence[int], output: Sequence[int], start: int, stop: int) -> list[int]:
    """Tokens [start, stop) of prompt + output, without joining the two."""
    n = len(prompt)
    if start >= n:
        return list(output[start - n : stop - n])
    return [*prompt[start:stop], *output[: max(stop - n, 0)]]


def common_prefix(cached: list[int], tokens: list[int], start: int) -> int:
    """Length of the common prefix; positions before `start` are known to agree."""
    limit = min(len(cached), len(tokens))
    i = min(start, limit)
    while i < limit and cached[i] == tokens[i]:
        i += 1
    return i


def fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft logits [A, V_draft] -> [A, V_target]: ids beyond the shared tokenizer never win."""
    if logits.shape[1] == vocab_size:
        return logits
    if logits.shape[1] > vocab_size:
        return logits[:, :vocab_size]
    pad = logits.new_full((logits.shape[0], vocab_size - logits.shape[1]), float("-inf"))
    return torch.cat([logits, pad], dim=1)
