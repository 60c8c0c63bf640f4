"""Target-side verification: the runner's logits rows -> p -> rejection sampling -> tokens.

The model runner lays out one group of rows per sampled sequence: a verifying sequence with k
drafts owns k + 1 consecutive rows (its last sampled token's position, then one per draft),
every other sequence (and each fork child) one row. Row i of a group is described by a
sampling row whose output position is base + i and whose penalty history is outputs +
drafts[:i]: exactly what the non-speculative sampler would see at that position. So greedy
output is token-for-token the non-speculative output and sampled output has exactly its
distribution; groups without drafts reduce to one ordinary draw with the same seeded noise as
`Sampler.draw`.

Drafts without a distribution (n-gram: q is a point mass on the draft) are verified by drawing
every row as the plain sampler would (`Sampler.draw`, the row's own seeded noise) and accepting
drafts while they equal the draws, then the first draw that differs (or the bonus). That is
rejection sampling with a point-mass q: draft x survives with probability p(x) = min(1, p(x) /
q(x)), and a draw that is not x is a sample of p without x, renormalized: normalize(max(0, p -
q)). It is also the plain engine's own draw at each position, so a seeded request emits exactly
the tokens it emits without speculation. Greedy rows are the special case (the draw is the
argmax). These draws are enqueued with their copy of [N] ids to the host when the step launches
(`launch_draws`, the runner's pinned copy and end event), and the acceptance decided on the host:
a Python prefix match for up to MAX_LISTED_GROUPS groups (fewer calls than numpy), else numpy
(`matched_tokens`). Drafts with a distribution q (a draft model's, sampled) take the
rejection sampler.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import chain

import numpy as np
import torch

from pagedinfer.engine.core.scheduler_output import ModelRunnerOutput, SampledTokens, TokenLogprobs
from pagedinfer.engine.sample.metadata import SamplingMetadata
from pagedinfer.engine.sample.rejection_sampler import (
    RejectionInputs,
    RejectionSampler,
    greedy_num_accepted,
)
from pagedinfer.engine.sample.sampler import Sampler, is_plain_greedy
from pagedinfer.engine.worker.step_types import HostTokenIds, VerifyGroup
from pagedinfer.kernels.argmax import argmax_rows

# Up to this many groups an all-greedy step decides acceptance in Python lists: ~1 us a group
# against ~25 us of numpy calls (plus the group arrays) on the CPU machine.
MAX_LISTED_GROUPS = 16


class SpecVerifier:
    """Samples a step that contains verification groups (vectorized over all groups)."""

    def __init__(self, sampler: Sampler, rejection_sampler: RejectionSampler | None = None) -> None:
        self.sampler = sampler
        self.rejection_sampler = rejection_sampler or RejectionSampler()

    def launch_draws(
        self, logits: torch.Tensor, meta: SamplingMetadata, point_mass: bool = True
    ) -> torch.Tensor | None:
        """[N] the plain sampler's draw per row, enqueued: for an all-greedy step, or one whose
        drafts have no distribution (`point_mass`); None: the rejection sampler decides."""
        if meta.all_greedy:
            # Penalties or bans edit the logits first; otherwise the raw argmax is the token.
            processed = logits if is_plain_greedy(meta) else self.sampler.process(logits, meta)  # [N, V]
            return argmax_rows(processed)
        if not point_mass:
            return None
        return self.sampler.draw(self.sampler.process(logits, meta), meta)

    def sample(
        self,
        logits: torch.Tensor,  # [N, V] raw target logits, rows laid out by `groups`
        meta: SamplingMetadata,  # one entry per row
        groups: Sequence[VerifyGroup],
        draft_probs: Mapping[int, torch.Tensor] | None = None,  # seq_id -> [>= k, V] q; else point mass
        draws: HostTokenIds | None = None,  # launch_draws' ids on the host; None: computed here
    ) -> ModelRunnerOutput:
        draft_probs = draft_probs or {}
        if draws is None and (meta.all_greedy or not has_draft_probs(groups, draft_probs)):
            draws = HostTokenIds(self.launch_draws(logits, meta).cpu())
        if draws is not None:  # draws matched against the drafts (greedy, or q a point mass)
            if len(groups) <= MAX_LISTED_GROUPS:
                return self._matched_listed(logits, meta, groups, draws)
            arrays = _GroupArrays.of(groups)  # built before waiting for the device
            token_lists = matched_tokens(draws.numpy(), arrays)  # the step's one device sync
        else:
            arrays = _GroupArrays.of(groups)
            processed = self.sampler.process(logits, meta)  # [N, V]
            inputs = _rejection_inputs(processed, meta, arrays, groups, draft_probs)
            token_lists = self.rejection_sampler(inputs).to_lists()  # the step's one device sync
        logprobs = _logprobs(logits, meta, groups, token_lists)
        sampled = [
            SampledTokens(g.seq_id, tokens, lp)
            for g, tokens, lp in zip(groups, token_lists, logprobs, strict=True)
        ]
        num_drafts = int(arrays.num_drafts.sum())
        num_accepted = sum(len(t) for t in token_lists) - len(token_lists)
        num_verified = int(np.count_nonzero(arrays.num_drafts))
        return ModelRunnerOutput(sampled, num_drafts, num_accepted, num_verified_seqs=num_verified)

    def row_tokens(
        self,
        processed: torch.Tensor,  # [N, V] the rows' processed logits
        meta: SamplingMetadata,  # one entry per row (seeded rows at their output positions)
        first_rows: Sequence[int],  # [B] host: each group's first row
        num_drafts: Sequence[int],  # [B] host: each group's drafts (its rows: num_drafts + 1)
        drafts: torch.Tensor,  # [B, K] int64 on the device, 0-padded
        draft_probs: torch.Tensor,  # [B, K, V] their q, 0-padded
    ) -> torch.Tensor:
        """[N] the rejection sampler's tokens laid over the rows, on the device: group b's rows
        hold its accepted drafts, then the corrected or bonus token (rows past it: 0). Matching
        the drafts against these rows gives back exactly the sampler's tokens (a corrected token
        never equals the draft it replaces: max(0, p - q) is 0 there), which is how a chained
        step's accept kernel reads them (device_chain.py)."""
        device = processed.device
        num_groups, k = drafts.shape
        firsts = np.asarray(first_rows, dtype=np.int64)
        counts = np.asarray(num_drafts, dtype=np.int64)
        index = _group_index(firsts, counts, k)  # [B, K + 1]
        valid = np.flatnonzero(np.arange(k + 1)[None, :] <= counts[:, None])  # group rows, flat
        staged = torch.from_numpy(np.concatenate([index.reshape(-1), counts, firsts, valid]))
        if device.type == "cuda":
            staged = staged.pin_memory()
        staged = staged.to(device, non_blocking=True)
        size = num_groups * (k + 1)
        index_d = staged[:size].view(num_groups, k + 1)
        counts_d = staged[size : size + num_groups]
        firsts_d = staged[size + num_groups : size + 2 * num_groups]
        valid_d = staged[size + 2 * num_groups :]
        out = self.rejection_sampler(
            _inputs_at(processed, meta, index_d, firsts_d, drafts, counts_d, draft_probs)
        )
        tokens = torch.zeros(processed.shape[0], dtype=torch.int64, device=device)
        tokens[index_d.reshape(-1)[valid_d]] = out.token_ids.reshape(-1)[valid_d]
        return tokens

    @staticmethod
    def _matched_listed(
        logits: torch.Tensor, meta: SamplingMetadata, groups: Sequence[VerifyGroup], draws: HostTokenIds
    ) -> ModelRunnerOutput:
        """`sample` of matched draws for few groups, in Python lists."""
        num_drafts = sum(len(g.draft_token_ids) for g in groups)
        num_verified = sum(1 for g in groups if g.draft_token_ids)
        token_lists = matched_token_lists(draws.numpy().tolist(), groups)  # the step's one device sync
        num_accepted = sum(len(t) for t in token_lists) - len(token_lists)
        if meta.max_num_logprobs < 0:
            sampled = [SampledTokens(g.seq_id, t) for g, t in zip(groups, token_lists, strict=True)]
        else:
            logprobs = _logprobs(logits, meta, groups, token_lists)
            sampled = [
                SampledTokens(g.seq_id, t, lp) for g, t, lp in zip(groups, token_lists, logprobs, strict=True)
            ]
        return ModelRunnerOutput(sampled, num_drafts, num_accepted, num_verified_seqs=num_verified)


def has_draft_probs(groups: Sequence[VerifyGroup], draft_probs: Mapping[int, torch.Tensor]) -> bool:
    """Whether some group's drafts come with a distribution q (else each q is a point mass)."""
    return bool(draft_probs) and any(g.seq_id in draft_probs for g in groups if g.draft_token_ids)


def matched_tokens(draws: np.ndarray, arrays: _GroupArrays) -> list[list[int]]:
    """Emitted tokens per group: the draws [N] up to the first one that differs from its draft."""
    target = draws[arrays.index]  # [B, K + 1]
    num_tokens = greedy_num_accepted(target, arrays.draft_token_ids, arrays.num_drafts) + 1  # [B]
    return [row[:n] for row, n in zip(target.tolist(), num_tokens.tolist(), strict=True)]


def matched_token_lists(draws: list[int], groups: Sequence[VerifyGroup]) -> list[list[int]]:
    """`matched_tokens` in plain Python: each group's draws while its drafts equal them."""
    out = []
    for g in groups:
        row = g.first_row
        tokens = [draws[row]]
        for draft in g.draft_token_ids:
            if draft != tokens[-1]:
                break
            row += 1
            tokens.append(draws[row])
        out.append(tokens)
    return out


class _GroupArrays:
    """The groups as host arrays: first rows [B], draft counts [B], drafts [B, K] (0-padded) and
    the padded row index [B, K + 1] (position i of group b -> row first_b + min(i, k_b))."""

    __slots__ = ("first_rows", "num_drafts", "draft_token_ids", "index")

    def __init__(self, first_rows: np.ndarray, num_drafts: np.ndarray, draft_token_ids: np.ndarray) -> None:
        self.first_rows = first_rows
        self.num_drafts = num_drafts
        self.draft_token_ids = draft_token_ids
        self.index = _group_index(first_rows, num_drafts, draft_token_ids.shape[1])

    @classmethod
    def of(cls, groups: Sequence[VerifyGroup]) -> _GroupArrays:
        num_groups = len(groups)
        first_rows = np.fromiter((g.first_row for g in groups), np.int64, num_groups)  # [B]
        ks = np.fromiter((len(g.draft_token_ids) for g in groups), np.int64, num_groups)  # [B]
        max_k = int(ks.max()) if num_groups else 0
        if max_k and bool((ks == max_k).all()):  # uniform K: the lists stack as they are
            drafts = np.array([g.draft_token_ids for g in groups], dtype=np.int64)  # [B, K]
        else:
            drafts = np.zeros((num_groups, max_k), dtype=np.int64)  # [B, K]
            flat = np.fromiter(
                chain.from_iterable(g.draft_token_ids for g in groups), np.int64, int(ks.sum())
            )
            drafts[np.arange(max_k)[None, :] < ks[:, None]] = flat  # row-major: group by group
        return cls(first_rows, ks, drafts)


def _rejection_inputs(
    processed: torch.Tensor,  # [N, V]
    meta: SamplingMetadata,
    arrays: _GroupArrays,
    groups: Sequence[VerifyGroup],
    draft_probs: Mapping[int, torch.Tensor],
) -> RejectionInputs:
    device = processed.device
    first_rows = torch.from_numpy(arrays.first_rows).to(device)  # [B]
    num_drafts = torch.from_numpy(arrays.num_drafts).to(device)  # [B]
    index = torch.from_numpy(arrays.index).to(device)  # [B, K + 1]
    drafts = torch.from_numpy(arrays.draft_token_ids).to(device)  # [B, K]
    probs = None  # (every q a point mass: the sampler's own path for it)
    if has_draft_probs(groups, draft_probs):
        probs = stack_draft_probs(groups, drafts, draft_probs, processed.shape[1])
    return _inputs_at(processed, meta, index, first_rows, drafts, num_drafts, probs, meta.all_greedy)


def stack_draft_probs(
    groups: Sequence[VerifyGroup],
    drafts: torch.Tensor,  # [B, K] int64, 0-padded
    draft_probs: Mapping[int, torch.Tensor],  # seq_id -> [>= k, V] q
    vocab_size: int,
) -> torch.Tensor:
    """[B, K, V] fp32 the q of each group's drafts (0-padded): the proposal's distribution, or a
    point mass on the draft where it has none (a proposer without one)."""
    probs = torch.zeros((len(groups), drafts.shape[1], vocab_size), dtype=torch.float32, device=drafts.device)
    for b, g in enumerate(groups):
        n = len(g.draft_token_ids)
        if not n:
            continue
        q = draft_probs.get(g.seq_id)
        if q is None:
            probs[b, :n].scatter_(1, drafts[b, :n, None], 1.0)
        else:
            probs[b, :n] = q[:n].to(device=drafts.device, dtype=torch.float32)
    return probs


def _group_index(first_rows: np.ndarray, num_drafts: np.ndarray, k: int) -> np.ndarray:
    """[B, K + 1] each group's rows, padded: position i of group b -> row first_b + min(i, k_b)."""
    steps = np.arange(k + 1)
    return first_rows[:, None] + np.minimum(steps[None, :], num_drafts[:, None])


def _inputs_at(
    processed: torch.Tensor,  # [N, V]
    meta: SamplingMetadata,
    index: torch.Tensor,  # [B, K + 1] rows of each group (`_group_index`), on the device
    first_rows: torch.Tensor,  # [B]
    drafts: torch.Tensor,  # [B, K]
    num_drafts: torch.Tensor,  # [B]
    probs: torch.Tensor | None,  # [B, K, V] or None (point masses)
    all_greedy: bool = False,
) -> RejectionInputs:
    """The rejection sampler's inputs for groups of rows: each group's logits, and its first
    row's greedy flag, seed and output position (the sampler steps positions past it)."""
    seeds, positions = _row_seeds(meta, processed.shape[0])
    return RejectionInputs(
        target_logits=processed[index],  # [B, K + 1, V]
        draft_token_ids=drafts,
        num_draft_tokens=num_drafts,
        is_greedy=meta.is_greedy[first_rows],
        draft_probs=probs,
        seeds=None if seeds is None else seeds[first_rows],
        positions=None if positions is None else positions[first_rows],
        all_greedy=all_greedy,
    )


def _row_seeds(meta: SamplingMetadata, num_rows: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Seeds and output positions per row [N] (-1: unseeded) from the metadata's seeded rows."""
    if meta.seeded_rows is None:
        return None, None
    device = meta.seeded_rows.device
    seeds = torch.full((num_rows,), -1, dtype=torch.int64, device=device)
    positions = torch.zeros(num_rows, dtype=torch.int64, device=device)
    seeds[meta.seeded_rows] = meta.seeds
    positions[meta.seeded_rows] = meta.positions
    return seeds, positions


def _logprobs(
    logits: torch.Tensor,
    meta: SamplingMetadata,
    groups: Sequence[VerifyGroup],
    token_lists: list[list[int]],
) -> list[list[TokenLogprobs] | None]:
    """Raw model logprobs of each emitted token plus top alternatives, as `Sampler.forward` gives."""
    if meta.max_num_logprobs < 0:
        return [None] * len(groups)
    rows = [
        g.first_row + j for g, tokens in zip(groups, token_lists, strict=True) for j in range(len(tokens))
    ]
    emitted = [t for tokens in token_lists for t in tokens]
    row_index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logprobs = logits[row_index].float().log_softmax(dim=-1)  # [M, V]
    ids = torch.tensor(emitted, dtype=torch.int64, device=logits.device)
    chosen = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()  # [M]
    top_lp, top_ids = logprobs.topk(meta.max_num_logprobs, dim=-1)  # [M, L]
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    out: list[list[TokenLogprobs] | None] = []
    m = 0
    for g, tokens in zip(groups, token_lists, strict=True):
        want = meta.num_logprobs[g.first_row]
        entries = [
            TokenLogprobs(
                t, chosen[m + j], tuple(top_ids[m + j][: want or 0]), tuple(top_lp[m + j][: want or 0])
            )
            for j, t in enumerate(tokens)
        ]
        out.append(entries if want is not None else None)
        m += len(tokens)
    return out
