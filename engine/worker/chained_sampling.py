"""Chained speculative steps in the model runner: a step whose acceptance and next drafts are
decided on the device (spec_decode/device_chain.py), so that the steps after it can be planned
and launched before the host has seen its tokens (core/spec_lookahead.py).

A mixin of ModelRunner: its methods use the runner's model, sampler, buffers and config.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagedinfer.engine.core.scheduler_output import (
    ModelRunnerOutput,
    SampledTokens,
    SamplingRow,
    SchedulerOutput,
)
from pagedinfer.engine.sample.metadata import SamplingMetadata
from pagedinfer.engine.sample.sampler import is_plain_greedy
from pagedinfer.engine.spec_decode.device_chain import HostChainStep
from pagedinfer.engine.worker.step_types import LaunchedForward, PendingStep, VerifyGroup
from pagedinfer.kernels.argmax import argmax_rows


class ChainedSampling:
    """ModelRunner's device-decided sampling (`launch_sampling(..., chain=True)` and chained steps)."""

    def _launch_chained(self, fwd: LaunchedForward, meta: SamplingMetadata | None) -> PendingStep | None:
        """`launch_sampling` deciding on the device: every row's draw (the argmax when all are
        plain greedy), acceptance by matching the drafts, the next drafts
        (spec_decode/device_chain.py). None when the step does not allow it; `meta` None: a
        chained step (its sampling was checked when its chain started, or the prompts it admitted
        joined)."""
        chain = getattr(self.spec_decoder, "device_chain", None)
        rows, groups = fwd.rows, fwd.groups
        if meta is not None and (
            chain is None or not self._chain_may_decide(meta) or len(groups) > chain.max_seqs
        ):
            return None
        draw_meta, seeded, first_drafts = meta, None, None
        if fwd.fed_chain is not None:
            draw_meta, seeded = self._chained_metadata(fwd, chain.k + 1)
        else:  # a first step's drafts, where a draft model left them on the device (else None)
            first_drafts = self._device_drafts_of(groups, chain.k)
        if self.spec_decoder.chain_drafter is not None and draw_meta is not None and not draw_meta.all_greedy:
            logits, argmax = self._chain_rejection(fwd, draw_meta, seeded, chain, first_drafts)
        else:
            logits, argmax = self._chain_draws(fwd.hidden, fwd.logits_indices, draw_meta, seeded, chain)
        first_rows = [g.first_row for g in groups]
        if fwd.fed_chain is None:  # a chain's first step: the histories are the host's tokens
            chain.start(
                [
                    [*rows[i].prompt_token_ids, *rows[i].output_token_ids[: rows[i].output_position]]
                    for i in first_rows
                ]
            )
            step = chain.accept(
                argmax,
                first_rows,
                [g.draft_token_ids for g in groups],
                None,
                device_drafts=first_drafts,
            )
        else:
            several = fwd.num_device_steps > 1
            step = chain.accept(argmax, first_rows, None, fwd.fed_chain, copy=not several)
        steps = [step]
        for _ in range(1, fwd.num_device_steps):  # each fed by the one before, on the device
            b = self.batch
            chain.feed(step, b.ids, b.pos, b.slots, b.seq_lens, b.block_tables, self.config.block_size)
            hidden = self._run_model(fwd.inputs, fwd.graph)
            _, argmax = self._chain_draws(hidden, fwd.logits_indices, draw_meta, seeded, chain)
            step = chain.accept(argmax, first_rows, None, step, copy=False)
            steps.append(step)
        if len(steps) > 1:
            chain.copy_to_host(steps)
        pending = PendingStep(fwd.start, rows, groups, meta, logits, None, self._gpu_event(), chain=step)
        if len(steps) > 1:
            pending.chain_steps = steps
        return pending

    def _device_drafts_of(self, groups: Sequence[VerifyGroup], k: int) -> torch.Tensor | None:
        """[B, K] the groups' drafts where a draft model left them on the device (0-padded), or
        None: the groups hold their drafts' ids."""
        drafts = getattr(self.spec_decoder, "device_drafts", None)
        if drafts is None:
            return None
        index = [drafts.rows.get(g.seq_id, 0) for g in groups]
        index = torch.tensor(index, dtype=torch.int64, pin_memory=drafts.tokens.is_cuda)
        tokens = drafts.tokens.index_select(0, index.to(drafts.tokens.device, non_blocking=True))
        return torch.nn.functional.pad(tokens, (0, k - tokens.shape[1]))

    def _chain_may_decide(self, meta: SamplingMetadata) -> bool:
        """Whether a step's sampling can be decided on the device and its chain go on without the
        host: no logprobs, nothing that reads earlier tokens (penalties, bans), and greedy unless
        the chain samples (SpeculativeDecoder.chain_samples)."""
        edits = meta.penalties is not None or meta.ban_rows is not None or meta.bias_rows is not None
        if edits or meta.max_num_logprobs >= 0:
            return False
        if meta.grammar_bitmask is not None:  # the next step's masks need this step's tokens
            return False
        return meta.all_greedy or self.spec_decoder.chain_samples

    def _chained_metadata(
        self, fwd: LaunchedForward, q: int
    ) -> tuple[SamplingMetadata | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """A chained step's sampling metadata, one entry per logits row (each chained sequence's
        row K + 1 times, then the admitted prompts'), or None when every row is plain greedy; and
        for seeded rows, their chain row and offset [S] each: a seeded row's output position is
        its chain row's history length on the device (not yet on the host) - its prompt + j."""
        rows = fwd.rows
        if all(r.sampling_params.is_greedy for r in rows):
            return None, None
        num_fed = int(fwd.fed_chain.packed.shape[0])
        expanded = [r for r in rows[:num_fed] for _ in range(q)] + list(rows[num_fed:])
        meta = self.sampling_metadata.build(expanded, [self.config.eos_token_ids] * len(expanded))
        chain_rows: list[int] = []
        offsets: list[int] = []
        for i, r in enumerate(expanded):  # the builder's seeded rows, in its order
            if r.seed is None or r.sampling_params.is_greedy:
                continue
            b, j = divmod(i, q) if i < num_fed * q else (i - num_fed * q + num_fed, 0)
            chain_rows.append(b)
            offsets.append(j - len(r.prompt_token_ids))
        if not chain_rows:
            return meta, None
        pin = self.config.device.type == "cuda"
        staged = torch.tensor([chain_rows, offsets], dtype=torch.int64, pin_memory=pin)
        staged = staged.to(self.config.device, non_blocking=True)
        return meta, (staged[0], staged[1])

    def _chain_rejection(
        self,
        fwd: LaunchedForward,
        meta: SamplingMetadata,
        seeded: tuple[torch.Tensor, torch.Tensor] | None,
        chain,
        first_drafts: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`_chain_draws` for a draft model's drafts, which come with q (`first_drafts`: a chain's
        first step's drafts on the device, None where the host holds them): the rejection sampler
        decides each group's tokens on the device, as the synchronous step's verifier does (the
        same noise: seeded groups give the same tokens), and each of the group's rows gets its
        token there - its accepted drafts, then the corrected or bonus token, which never equals
        the draft it replaces (a rejected draft x had p(x) < q(x): max(0, p - q) is 0 at x) - so
        the accept kernel's matching keeps exactly the sampler's tokens."""
        logits = self.sampled_logits(fwd.hidden, fwd.logits_indices, upcast=False)
        groups, k = fwd.groups, chain.k
        device = logits.device
        if fwd.fed_chain is None:  # a chain's first step: the proposal's drafts and q
            num_drafts = [len(g.draft_token_ids) for g in groups]
            drafts = first_drafts
            if drafts is None:  # (pinned: a pageable copy would wait for the forward pass)
                padded = [[*g.draft_token_ids, *[0] * (k - len(g.draft_token_ids))] for g in groups]
                staged = torch.tensor(padded, dtype=torch.int64, pin_memory=device.type == "cuda")
                drafts = staged.to(device, non_blocking=True)
            probs = self.spec_decoder.draft_probs_of(groups, drafts, self.vocab_size)
        else:  # chained: the drafts the draft model drew on the device, then admitted prompts' rows
            num_fed = int(fwd.fed_chain.packed.shape[0])
            num_admitted = len(groups) - num_fed
            num_drafts = [k] * num_fed + [0] * num_admitted
            drafts = fwd.fed_chain.next_drafts
            probs = fwd.draft_probs  # None: every chained row greedy (q plays no part)
            if probs is None:
                probs = torch.zeros((num_fed, k, self.vocab_size), dtype=torch.float32, device=device)
            if num_admitted:
                drafts = torch.cat([drafts, drafts.new_zeros((num_admitted, k))])
                probs = torch.cat([probs, probs.new_zeros((num_admitted, *probs.shape[1:]))])
            _set_seeded_positions(meta, seeded, chain)
        ids = self.spec_decoder.verifier.row_tokens(
            self.sampler.process(logits, meta),
            meta,
            [g.first_row for g in groups],
            num_drafts,
            drafts,
            probs,
        )
        return logits, ids

    def _chain_draws(
        self,
        hidden: torch.Tensor,
        logits_indices: torch.Tensor,
        meta: SamplingMetadata | None,
        seeded: tuple[torch.Tensor, torch.Tensor] | None,
        chain,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [N, V] (the GEMM's dtype) at the sampled rows and each row's draw [N]: the
        argmax when every row is plain greedy (`meta` None or so), else the plain sampler's
        draw, seeded rows at output positions read from the chain's histories."""
        logits = self.sampled_logits(hidden, logits_indices, upcast=False)
        if meta is None or is_plain_greedy(meta):
            return logits, argmax_rows(logits, self.config.attention_backend)
        _set_seeded_positions(meta, seeded, chain)  # (each device step's: its histories grew)
        return logits, self.sampler.draw(self.sampler.process(logits, meta), meta)

    @staticmethod
    def _chained_sampling_plan(
        sched: SchedulerOutput,
    ) -> tuple[np.ndarray, list[SamplingRow], list[VerifyGroup]]:
        """A chained step's plan: every chained sequence's K + 1 rows, then the last row of each
        prompt admitted behind them that samples, decided on the device (the drafts are not on
        the host yet, and no per-row sampling parameters are needed)."""
        qsl = sched.layout.query_start_loc
        q = int(qsl[1])  # K + 1 (token_ids: every device step's)
        fed = sched.sequences[: sched.num_fed]
        rows = [s.sample for s in fed]
        groups = [VerifyGroup(s.seq_id, b * q, []) for b, s in enumerate(fed)]
        logits_rows = list(range(len(fed) * q))
        for b, s in enumerate(sched.sequences[sched.num_fed :], start=len(fed)):
            if s.sample is not None:  # (a chunk that does not end its prompt samples nothing)
                groups.append(VerifyGroup(s.seq_id, len(logits_rows), []))
                rows.append(s.sample)
                logits_rows.append(int(qsl[b + 1]) - 1)
        return np.asarray(logits_rows, dtype=np.int64), rows, groups


def _set_seeded_positions(
    meta: SamplingMetadata, seeded: tuple[torch.Tensor, torch.Tensor] | None, chain
) -> None:
    """A chained step's seeded rows' output positions, from the chain's history lengths on the
    device now (`_chained_metadata` gave each seeded row its chain row and offset)."""
    if seeded is not None:
        chain_rows, offsets = seeded
        meta.positions = chain.history_len.index_select(0, chain_rows).to(torch.int64) + offsets


def chain_output(hosts: Sequence[HostChainStep], groups: Sequence[VerifyGroup]) -> ModelRunnerOutput:
    """A device-decided step's tokens per group (over its device steps, in order), and the drafts
    its chained successor verifies."""
    last = hosts[-1]
    if len(hosts) == 1:
        emitted, verified, device_steps = last.emitted, last.num_drafts, None
    else:
        emitted = [[t for h in hosts for t in h.emitted[b]] for b in range(len(groups))]
        verified = [sum(h.num_drafts[b] for h in hosts) for b in range(len(groups))]
        device_steps = [[(h.num_drafts[b], len(h.emitted[b])) for h in hosts] for b in range(len(groups))]
    sampled = [SampledTokens(g.seq_id, tokens) for g, tokens in zip(groups, emitted, strict=True)]
    num_accepted = sum(len(h.emitted[b]) - 1 for h in hosts for b in range(len(groups)))
    num_verified = sum(1 for h in hosts for n in h.num_drafts if n)
    return ModelRunnerOutput(
        sampled,
        sum(verified),
        num_accepted,
        num_verified_seqs=num_verified,
        next_drafts=last.next_drafts,
        verified_drafts=verified,
        device_steps=device_steps,
    )
