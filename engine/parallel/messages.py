"""The step broadcast: what rank 0 sends its workers for each model call, and how.

One message per model step. The header (a small frozen dataclass: sizes, host ints, the
backend) goes down each worker's pipe; the tensors of the call follow as ONE collective
broadcast: a forward packs every index tensor (ids, positions, slots, block tables, query
starts, sequence lengths, the rows it samples, the step's block copies) into one int64 buffer,
and every rank runs the LM head at the sampled rows right after the forward (the residual
stream is the same on every rank: nothing else needs sending). Any other LM-head call (prompt
logprobs) is a message of its own that broadcasts the hidden rows it needs. On CUDA the payload
is built and sent on the device (no host sync: lookahead steps' ids are still being computed
when they are sent).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedinfer.engine.worker.attn_metadata import AttentionMetadata


@dataclass(frozen=True)
class ForwardCall:
    """model(input_ids, positions, kv_caches, attn_metadata), after the block copies, then the
    LM head at its `num_logit_rows` sampled rows (attn_metadata.logits_indices)."""

    num_tokens: int  # T
    num_seqs: int  # B
    num_logit_rows: int  # N
    max_blocks: int  # block_tables' width
    num_copies: int  # block copies [C, 2] (src, dst) applied to the KV caches first
    max_query_len: int
    max_seq_len: int
    is_pure_decode: bool
    max_seq_len_exact: bool
    backend: str | None

    @property
    def payload_size(self) -> int:
        t, b = self.num_tokens, self.num_seqs
        return 3 * t + b * self.max_blocks + (b + 1) + b + self.num_logit_rows + 2 * self.num_copies


@dataclass(frozen=True)
class LogitsCall:
    """model.compute_logits(hidden rows) for `num_rows` rows broadcast from rank 0 (rows other
    than a forward's sampled ones: prompt logprobs)."""

    num_rows: int
    backend: str | None


@dataclass(frozen=True)
class SizeKVCall:
    """Size the KV cache with every rank (rank.agree_num_blocks) and allocate the agreed count."""

    backend: str | None


@dataclass(frozen=True)
class StopCall:
    """The engine is shutting down: leave the loop and exit 0."""


@dataclass
class ForwardInputs:
    """A forward call's tensors on one rank."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata
    block_copies: torch.Tensor | None  # [C, 2] int64


def forward_call(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    md: AttentionMetadata,
    block_copies: torch.Tensor | None,
) -> tuple[ForwardCall, torch.Tensor]:
    """Rank 0: the header and the packed int64 payload of one forward."""
    num_seqs, max_blocks = int(md.block_tables.shape[0]), int(md.block_tables.shape[1])
    copies = block_copies if block_copies is not None else input_ids.new_zeros((0, 2))
    header = ForwardCall(
        num_tokens=int(input_ids.shape[0]),
        num_seqs=num_seqs,
        num_logit_rows=int(md.logits_indices.shape[0]),
        max_blocks=max_blocks,
        num_copies=int(copies.shape[0]),
        max_query_len=int(md.max_query_len),
        max_seq_len=int(md.max_seq_len),
        is_pure_decode=bool(md.is_pure_decode),
        max_seq_len_exact=bool(md.max_seq_len_exact),
        backend=md.backend,
    )
    parts = [
        input_ids,
        positions,
        md.slot_mapping,
        md.block_tables,
        md.query_start_loc,
        md.seq_lens,
        md.logits_indices,
        copies,
    ]
    payload = torch.cat([p.reshape(-1).to(torch.int64) for p in parts])  # [payload_size]
    assert payload.shape[0] == header.payload_size, (payload.shape, header)
    return header, payload


def unpack_forward(header: ForwardCall, payload: torch.Tensor) -> ForwardInputs:
    """A worker: the tensors of a forward from its received payload."""
    t, b, m, c = header.num_tokens, header.num_seqs, header.max_blocks, header.num_copies
    sizes = [t, t, t, b * m, b + 1, b, header.num_logit_rows, 2 * c]
    ids, pos, slots, tables, qsl, seq_lens, logits_indices, copies = torch.split(payload, sizes)
    md = AttentionMetadata(
        slot_mapping=slots,
        positions=pos,
        block_tables=tables.reshape(b, m).to(torch.int32),
        query_start_loc=qsl.to(torch.int32),
        seq_lens=seq_lens.to(torch.int32),
        logits_indices=logits_indices,
        max_query_len=header.max_query_len,
        max_seq_len=header.max_seq_len,
        is_pure_decode=header.is_pure_decode,
        backend=header.backend,
        max_seq_len_exact=header.max_seq_len_exact,
    )
    return ForwardInputs(ids, pos, md, copies.reshape(c, 2) if c else None)
