"""The reference block manager's plain pieces: errors, the chained block hash, per-sequence and
per-cached-block records, the step's arrays. Shared by block_pool_ref.py and its check."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

ROOT_HASH = 0x243F6A8885A308D3
INT32_RANGE = (-(2**31), 2**31 - 1)


class OutOfBlocksError(RuntimeError):
    """Not enough free + evictable blocks; the manager's state is unchanged."""


class UnknownSequenceError(KeyError, ValueError):
    """A sequence id that is not registered (also a double free)."""


class DuplicateSequenceError(ValueError):
    """add_sequence / fork with an id that already exists."""


class InvariantError(AssertionError):
    """check_invariants() found an inconsistent internal state."""


@dataclass(frozen=True)
class BatchArrays:
    """Inputs of one engine step, all int32."""

    block_tables: np.ndarray  # [batch, max_blocks], padding 0
    slot_mapping: np.ndarray  # [num_new_tokens]
    positions: np.ndarray  # [num_new_tokens]
    context_lens: np.ndarray  # [batch]
    query_start_loc: np.ndarray  # [batch + 1]


@dataclass
class SequenceBlocks:
    tokens: list[int]
    blocks: list[int] = field(default_factory=list)  # logical block -> physical block
    num_hashed_blocks: int = 0  # leading blocks already offered to the prefix cache


@dataclass(frozen=True)
class Registration:
    hash: int
    parent: int  # -1: the root
    parent_generation: int
    generation: int


def chain_hash(parent_hash: int, tokens: Sequence[int]) -> int:
    return hash((parent_hash, tuple(tokens)))


def int_list(values: Sequence[int] | np.ndarray, name: str) -> list[int]:
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise ValueError(f"{name} must be 1-D")
        if values.size and values.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers")
        out = values.tolist()
    else:
        out = [operator.index(v) for v in values]
    if out and (min(out) < INT32_RANGE[0] or max(out) > INT32_RANGE[1]):
        raise ValueError(f"{name} value out of int32 range")
    return out
