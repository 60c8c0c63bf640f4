"""Repetition / presence / frequency penalties and the min_tokens ban, batched on the device."""

from __future__ import annotations

import torch


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Occurrences per vocabulary entry: token_ids [N, L] int64 padded with -1 -> [N, V] int32."""
    n = token_ids.shape[0]
    counts = torch.zeros(n, vocab_size + 1, dtype=torch.int32, device=token_ids.device)
    index = torch.where(token_ids < 0, vocab_size, token_ids)  # padding goes to a spare column
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,  # [N, V] fp32, modified in place
    prompt_ids: torch.Tensor,  # [N, Lp] int64, -1 padded
    output_ids: torch.Tensor,  # [N, Lo] int64, -1 padded
    repetition: torch.Tensor,  # [N] fp32, 1.0 = off
    presence: torch.Tensor,  # [N] fp32, 0.0 = off
    frequency: torch.Tensor,  # [N] fp32, 0.0 = off
) -> torch.Tensor:
    """OpenAI presence/frequency penalties on outputs; CTRL repetition penalty on all tokens."""
    vocab = logits.shape[1]
    out_counts = token_counts(output_ids, vocab)  # [N, V]
    seen = (token_counts(prompt_ids, vocab) > 0) | (out_counts > 0)  # [N, V]
    rep = repetition[:, None].expand_as(logits)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits -= frequency[:, None] * out_counts.to(logits.dtype)
    logits -= presence[:, None] * (out_counts > 0).to(logits.dtype)
    return logits


def ban_tokens(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Set logits[rows[i], token_ids[i]] to -inf (min_tokens: no EOS / stop id yet)."""
    if rows.numel():
        logits[rows, token_ids] = float("-inf")
    return logits
