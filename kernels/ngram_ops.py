"""Launcher of the n-gram accept + propose step: argument checks, then backend dispatch.

Backends as in ops.py: "triton" (ngram_propose.py; on CUDA, or on the CPU under
TRITON_INTERPRET=1) and "reference" (ngram_reference.py: vectorized PyTorch, the CPU production
path). `backend=None` (or "auto") picks ops.select_backend(argmax.device). Shapes, dtypes and
devices are always checked; values (row ranges, room in the history) only for CPU tensors, so a
CUDA launch never synchronizes to validate. On the device, out-of-range values are clamped
(nothing is read or written out of bounds; emitted tokens that do not fit are dropped).
"""

from __future__ import annotations

import torch

from pagedinfer.kernels import ngram_reference
from pagedinfer.kernels.ngram_reference import MAX_TIES_LIMIT, AcceptProposeOutput
from pagedinfer.kernels.ops import select_backend, triton_available

__all__ = [
    "AcceptProposeOutput",
    "accept_and_propose",
    "launch_chain_feed",
    "launch_packed",
    "select_backend",
    "triton_available",
]


def _fail(msg: str) -> None:
    raise ValueError(msg)


def _check_tensor(name: str, t: torch.Tensor, ndim: int, dtype: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != ndim or t.dtype != dtype:
        _fail(f"{name} must be a {ndim}-dim {dtype} tensor, got {getattr(t, 'dtype', type(t).__name__)} "
              f"{tuple(getattr(t, 'shape', ()))}")  # fmt: skip
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        _fail(f"{name} must be contiguous in its last dim")


def _check_ints(ngram_min: int, ngram_max: int, num_next: int) -> None:
    for name, v in (("ngram_min", ngram_min), ("ngram_max", ngram_max), ("num_next", num_next)):
        if isinstance(v, bool) or not isinstance(v, int):
            _fail(f"{name} must be an int, got {v!r}")
    if not 1 <= ngram_min <= ngram_max:
        _fail(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
    if num_next < 1:
        _fail(f"num_next must be >= 1, got {num_next}")


def check_accept_and_propose(
    argmax, first_rows, drafts, num_drafts, history, history_len, ngram_min, ngram_max, num_next
) -> None:
    """ValueError unless the arguments follow accept_and_propose's contract."""
    _check_ints(ngram_min, ngram_max, num_next)
    _check_tensor("argmax", argmax, 1, torch.int64)
    _check_tensor("first_rows", first_rows, 1, torch.int64)
    _check_tensor("drafts", drafts, 2, torch.int64)
    _check_tensor("num_drafts", num_drafts, 1, torch.int64)
    _check_tensor("history", history, 2, torch.int32)
    _check_tensor("history_len", history_len, 1, torch.int32)
    tensors = (argmax, first_rows, drafts, num_drafts, history, history_len)
    if len({t.device for t in tensors}) > 1:
        _fail(f"tensors must share one device, got {[str(t.device) for t in tensors]}")
    num_seqs, max_drafts = drafts.shape
    if {first_rows.shape[0], num_drafts.shape[0], history.shape[0], history_len.shape[0]} != {num_seqs}:
        _fail(f"first_rows, num_drafts, history and history_len must have B={num_seqs} rows")
    if argmax.shape[0] < num_seqs:
        _fail(f"argmax has {argmax.shape[0]} rows, fewer than one per sequence ({num_seqs})")
    if history.shape[1] < 1:
        _fail("history must have at least one column")
    if argmax.device.type == "cpu" and num_seqs:
        _check_values(argmax.shape[0], first_rows, num_drafts, max_drafts, history.shape[1], history_len)


def _check_values(num_rows, first_rows, num_drafts, max_drafts, hist_cap, history_len) -> None:
    if int(num_drafts.min()) < 0 or int(num_drafts.max()) > max_drafts:
        _fail(f"num_drafts must lie in [0, {max_drafts}]")
    if int(first_rows.min()) < 0 or int((first_rows + num_drafts).max()) >= num_rows:
        _fail(f"each group first_rows[b] .. first_rows[b] + num_drafts[b] must lie in [0, {num_rows})")
    if int(history_len.min()) < 0 or int((history_len + num_drafts).max()) + 1 > hist_cap:
        _fail(f"history needs room for num_drafts + 1 more tokens per row (L = {hist_cap})")


def accept_and_propose(
    argmax: torch.Tensor,
    first_rows: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    history: torch.Tensor,
    history_len: torch.Tensor,
    ngram_min: int,
    ngram_max: int,
    num_next: int,
    backend: str | None = None,
    context_window: int = 0,
    max_ties: int = 32,
    search: bool = True,
    match_keys: torch.Tensor | None = None,
) -> AcceptProposeOutput:
    """Greedy acceptance of step N's drafts, then step N + 1's n-gram drafts, on the device.

    argmax [R] int64: the target's greedy token per logits row, rows grouped per sequence
    (group b: rows first_rows[b] .. first_rows[b] + num_drafts[b]); first_rows [B] int64;
    drafts [B, K] int64 (the first num_drafts[b] valid); num_drafts [B] int64 in 0..K;
    history [B, L] int32 and history_len [B] int32: each sequence's tokens so far, updated in
    place (emitted tokens appended). Next drafts follow
    engine.spec_decode.ngram.find_ngram_draft(context_window=0) on the updated history.
    Returns AcceptProposeOutput(num_emitted [B] int64, emitted [B, K + 1] int64 0-padded,
    next_drafts [B, num_next] int64, has_match [B] bool). No host synchronization.
    search False: acceptance only, no match looked for (next drafts: the last emitted token), for a
    chain whose next drafts come from a draft model. match_keys [V] int32 (optional, on the same
    device): each token id's key (engine.spec_decode.ngram_keys), matched where the ids match nowhere.
    """
    check_accept_and_propose(
        argmax, first_rows, drafts, num_drafts, history, history_len, ngram_min, ngram_max, num_next
    )
    if context_window < 0 or not 1 <= max_ties <= MAX_TIES_LIMIT:
        _fail(
            f"need context_window >= 0 and 1 <= max_ties <= {MAX_TIES_LIMIT}, got {context_window}, {max_ties}"
        )
    if match_keys is not None:
        _check_tensor("match_keys", match_keys, 1, torch.int32)
        if match_keys.shape[0] == 0 or match_keys.device != argmax.device:
            _fail("match_keys must be a non-empty [V] table on argmax's device")
    args = (argmax, first_rows, drafts, num_drafts, history, history_len, ngram_min, ngram_max, num_next)
    rank = {"search": search, "match_keys": match_keys}
    if select_backend(argmax.device, backend) == "triton":
        from pagedinfer.kernels import ngram_propose

        return ngram_propose.accept_and_propose(*args, context_window, max_ties, **rank)
    return ngram_reference.accept_and_propose(*args, context_window, max_ties, **rank)


def launch_packed(*args, **kwargs) -> torch.Tensor:
    """The Triton kernel with one packed output (ngram_propose.launch_packed; CUDA only, no checks:
    the chained engine steps call it with tensors they built themselves)."""
    from pagedinfer.kernels import ngram_propose

    return ngram_propose.launch_packed(*args, **kwargs)


def launch_chain_feed(*args, **kwargs) -> None:
    """A chained step's inputs from the previous step's packed output (chain_feed.py; CUDA)."""
    from pagedinfer.kernels import chain_feed

    chain_feed.launch_chain_feed(*args, **kwargs)
