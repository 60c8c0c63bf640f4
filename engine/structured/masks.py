"""Per-step token masks for the rows whose request has a grammar, and their application.

The model runner asks `GrammarMasker.bitmask(rows, groups)` for each step: one int32 bitmask row
[ceil(V / 32)] per logits row (-1 everywhere for rows without a grammar), on the logits' device;
`Sampler.process` applies it (`apply_token_bitmask`) before temperature and filtering, so greedy,
sampled, n > 1 and speculative verification all draw from the masked logits.

Each sequence's matcher follows the tokens the host knows: before a step it consumes the
sequence's outputs it has not seen (`output_token_ids[:output_position]`), so a matcher is
always rebuilt correctly from the tokens alone (after a preemption, a fork, or when dropped).
A verification group's draft rows get the mask after its drafts so far: the matcher accepts
each draft, fills the next row, and rolls them back; a draft the grammar forbids can never
equal its row's draw, so it and everything after it are rejected. Stop (EOS) tokens are allowed
only where the grammar accepts the output as complete; once complete, only they are allowed.

Grammar rows never ride a device chain (SamplingParams.is_history_free is False for them): their
masks need the previous step's tokens on the host. They do ride a lookahead step, whose sampling
is launched only after the step before's tokens are applied (core/lookahead.py). A row there whose
sequence stopped at that step on a stop token is computed and dropped; its grammar has terminated
(xgrammar fills no mask after a stop) and the row gets stop tokens only. A row whose sequence a
stop string finished after the step was planned, cutting tokens of a multi-token step, gets no
mask and no matcher work: its draw is dropped too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedinfer.engine.core.scheduler_output import SamplingRow
from pagedinfer.engine.structured.compiler import GrammarCompiler
from pagedinfer.engine.structured.spec import StructuredOutput

logger = logging.getLogger(__name__)


_BYTE_BITS: dict[torch.device, torch.Tensor] = {}  # [256, 8] bool: bit k of byte value b


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [N, V] with the tokens whose bit is 0 in bitmask [N, ceil(V / 32)] int32 set to -inf
    (out of place; bit j of word w is token 32 w + j)."""
    num_rows, vocab = logits.shape
    bits = _BYTE_BITS.get(bitmask.device)
    if bits is None:
        bits = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool().to(bitmask.device)
        _BYTE_BITS[bitmask.device] = bits
    # One lookup per byte instead of 32 shifts per word: the words' bytes in memory order
    # (little-endian) are tokens 8 i .. 8 i + 7, low bit first.
    allowed = bits[bitmask.view(torch.uint8).long()].view(num_rows, -1)[:, :vocab]  # [N, V]
    return torch.where(allowed, logits, float("-inf"))


@dataclass
class _SeqMatcher:
    spec: StructuredOutput
    matcher: object  # xgrammar.GrammarMatcher
    num_tokens: int = 0  # output tokens consumed
    is_broken: bool = False  # consumed a token its grammar forbids (never expected): stop it


class GrammarMasker:
    """Owns one matcher per constrained sequence and builds each step's bitmask."""

    def __init__(self, compiler: GrammarCompiler, device: torch.device) -> None:
        self.compiler = compiler
        self.device = device
        self.num_words = (compiler.vocab_size + 31) // 32
        self._matchers: dict[int, _SeqMatcher] = {}
        self._stop_ids = torch.tensor(sorted(set(compiler.stop_token_ids)), dtype=torch.int64)

    def check(self, spec: StructuredOutput) -> None:
        """Compile (cached): InvalidRequestError for an invalid schema, regex or grammar."""
        self.compiler.compile(spec)

    def bitmask(self, rows: Sequence[SamplingRow], groups: Sequence) -> torch.Tensor | None:
        """[N, ceil(V / 32)] int32 on the device for the step's rows (laid out by `groups`: each
        group's first row, then one per draft), or None when no row has a grammar."""
        if not any(r.sampling_params.structured_output is not None for r in rows):
            self._matchers.clear()
            return None
        import xgrammar

        host = torch.full((len(rows), self.num_words), -1, dtype=torch.int32)  # [N, W]
        live: dict[int, _SeqMatcher] = {}
        for g in groups:
            row = rows[g.first_row]
            spec = row.sampling_params.structured_output
            if spec is None or row.output_position > len(row.output_token_ids):
                continue  # (the latter: its sequence just stopped on a string that cut tokens)
            state = self._sync(row, spec, xgrammar)
            live[row.seq_id] = state
            if state.is_broken or state.matcher.is_terminated():  # (terminated: a dropped lookahead row)
                self._only_stops(host, g.first_row, len(g.draft_token_ids) + 1)
                continue
            self._fill_group(state.matcher, host, g.first_row, g.draft_token_ids)
        self._matchers = live  # sequences not sampled this step are rebuilt when they come back
        if self.device.type == "cuda":
            return host.pin_memory().to(self.device, non_blocking=True)
        return host

    def _fill_group(self, matcher, host: torch.Tensor, first_row: int, drafts: Sequence[int]) -> None:
        """The group's first row at the matcher's state, each draft row after the drafts before it."""
        matcher.fill_next_token_bitmask(host, first_row)
        num_accepted = 0
        for j, draft in enumerate(drafts):
            if matcher.is_terminated() or not matcher.accept_token(draft):
                # Row j's draw cannot be this draft: the rows after it are never emitted.
                host[first_row + j + 1 : first_row + len(drafts) + 1] = host[first_row + j]
                break
            num_accepted += 1
            if matcher.is_terminated():  # accepted a stop token: the sequence ends there
                host[first_row + j + 1 : first_row + len(drafts) + 1] = host[first_row + j]
                break
            matcher.fill_next_token_bitmask(host, first_row + j + 1)
        if num_accepted:
            matcher.rollback(num_accepted)

    def _sync(self, row: SamplingRow, spec: StructuredOutput, xgrammar) -> _SeqMatcher:
        """The sequence's matcher after its first `output_position` output tokens."""
        position = row.output_position
        assert position <= len(row.output_token_ids), "a grammar row's earlier tokens must be on the host"
        state = self._matchers.get(row.seq_id)
        if state is None or state.spec != spec or state.num_tokens > position:
            state = _SeqMatcher(spec, xgrammar.GrammarMatcher(self.compiler.compile(spec)))
        if state.num_tokens < position and not state.is_broken:
            for token_id in row.output_token_ids[state.num_tokens : position]:
                if not state.matcher.accept_token(token_id):
                    logger.warning(
                        "sequence %d: token %d breaks its grammar; only a stop token is allowed now",
                        row.seq_id,
                        token_id,
                    )
                    state.is_broken = True
                    break
        state.num_tokens = position
        return state

    def _only_stops(self, host: torch.Tensor, first_row: int, num_rows: int) -> None:
        block = host[first_row : first_row + num_rows]
        block.zero_()
        for token_id in self._stop_ids.tolist():
            block[:, token_id // 32] |= _bit(token_id % 32)


def _bit(j: int) -> int:
    """Bit j of an int32 word, as the signed value torch stores."""
    return -(1 << 31) if j == 31 else 1 << j
