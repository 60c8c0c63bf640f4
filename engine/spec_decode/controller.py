"""The engine's one collaborator for speculative decoding.

Two one-line call sites:
  engine, after `scheduler.update`:     spec.after_step(sched, result, scheduler.running)
      (learns the step's acceptance, then sets `spec_token_ids` of the sequences that draft)
  runner, when a step carries drafts:   draws = spec.launch_draws(logits, meta)  (launch)
                                        result = spec.sample(logits, meta, groups, draws)  (collect)
The scheduler schedules each draft as one more new token of its sequence and rolls the KV
cache back (`KVCacheManager.truncate`) past the first rejected draft; the runner lays out
k + 1 logits rows per verifying sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedinfer.engine.config import SpeculativeConfig
from pagedinfer.engine.core.scheduler_output import (
    ModelRunnerOutput,
    SamplingRow,
    SchedulerOutput,
    verification_within_end,
)
from pagedinfer.engine.request import Request, RequestStatus
from pagedinfer.engine.sample.metadata import SamplingMetadata
from pagedinfer.engine.sample.sampler import Sampler
from pagedinfer.engine.sampling_params import SamplingParams
from pagedinfer.engine.spec_decode.device_chain import DeviceNgramChain
from pagedinfer.engine.spec_decode.policy import SpeculationPolicy, SpeculationStats
from pagedinfer.engine.spec_decode.proposer import DeviceDrafts, DraftRequest, Proposer
from pagedinfer.engine.spec_decode.verifier import SpecVerifier, stack_draft_probs
from pagedinfer.engine.worker.step_types import HostTokenIds, VerifyGroup


class SpeculativeDecoder:
    """Drafts for running sequences, verifies them in the target's step, keeps the statistics."""

    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer,
        max_model_len: int,
        sampler: Sampler | None = None,
        device_chain: DeviceNgramChain | None = None,
    ) -> None:
        if config.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {config.num_speculative_tokens}")
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.policy = SpeculationPolicy(config)
        self.verifier = SpecVerifier(sampler or Sampler())
        self.stats = SpeculationStats()
        self._draft_probs: dict[int, torch.Tensor] = {}  # seq_id -> [k, V] q of its pending drafts
        self._known: set[int] = set()  # seq ids the proposer may hold state for
        self.device_chain: DeviceNgramChain | None = device_chain  # steps chained on the device
        # A draft model that drafts chained steps on the device (None: the chain's own n-gram
        # drafts); set when the proposer can (`launch_chained`) and a device chain exists.
        self.chain_drafter = (
            proposer if device_chain is not None and hasattr(proposer, "launch_chained") else None
        )
        self.device_drafts: DeviceDrafts | None = None  # the last proposal's, when left on the device

    def capture_cuda_graphs(self, max_num_seqs: int) -> None:
        """CUDA graphs for the proposer's own model steps, when it runs a model (CUDA only)."""
        capture = getattr(self.proposer, "capture_cuda_graphs", None)
        if capture is not None:
            capture(min(max_num_seqs, self.config.max_batch_size), self.max_model_len)

    def may_draft(self, running: Sequence[Request]) -> bool:
        """Whether a step over `running` could carry drafts (else it may be planned ahead, before
        this step's tokens are known: async scheduling)"""
        return self.policy.is_step_enabled(len(running)) and any(
            seq.sampling_params.use_speculation for seq in running
        )

    def may_chain(self, running: Sequence[Request]) -> bool:
        """Whether steps over `running` may be chained on the device (spec_decode/device_chain.py):
        every sequence speculates and not all are paused. Paused sequences ride along, as in a
        synchronous step where others draft (`propose`): the device drafts for every row anyway,
        and their rows cost a memory-bound step nothing; when all are paused, no step drafts.
        The runner checks the sampling of a chain's first step (ModelRunner._chain_may_decide);
        prompts joining one are `may_ride_chain`'s."""
        return (
            self.device_chain is not None
            and len(running) <= self.device_chain.max_seqs
            and self.policy.is_step_enabled(len(running))
            and all(seq.sampling_params.use_speculation for seq in running)
            and not all(self.policy.is_paused(seq.seq_id) for seq in running)
        )

    def tokens_per_step(self, seq_id: int) -> float:
        """Expected tokens a chained device step emits for a sequence (the planner's estimate of
        the device steps it still needs before max_tokens)."""
        return self.policy.tokens_per_step(seq_id, self.config.num_speculative_tokens)

    def tokens_to_stop(self, seq: Request, row: SamplingRow, horizon: int) -> int | None:
        """Tokens the sequence is expected to emit from `row`'s output position up to and
        including a stop token (EOS unless ignored, stop_token_ids), as far as its proposer can
        see (`horizon` tokens past those known; the n-gram proposer's lookup), or None: the
        planner's other bound, beside max_tokens, on the device steps a chain still needs."""
        predict = getattr(self.proposer, "tokens_to_stop", None)
        stops = seq.stop_token_set
        if predict is None or not stops:
            return None
        unknown = row.output_position - seq.num_output_tokens  # (emitted but not yet applied)
        self._known.add(seq.seq_id)  # (the proposer caches its tokens: freed with the sequence)
        found = predict(row, stops, horizon)
        if found is None or row.output_position + found - unknown <= seq.sampling_params.min_tokens:
            return None  # (none ahead, or before min_tokens lets a stop count)
        return found - unknown

    @property
    def chain_samples(self) -> bool:
        """Whether chained steps may sample (history-free sampling; see `may_ride_chain`): n-gram
        drafts are point masses, verified by matching the rows' draws; a draft model's are drawn
        with the request's parameters and their q kept for the rejection sampler, on the device
        (`device_drafts`; with it off, chains ride greedy requests only)."""
        if self.device_chain is None:
            return False
        return self.chain_drafter is None or self.chain_drafter.device_drafts

    def may_ride_chain(self, params: SamplingParams) -> bool:
        """Whether a request's sampling can be decided on the device in a chained step (logprobs
        and `use_speculation` are checked apart)."""
        return params.is_history_free if self.chain_samples else params.is_plain_greedy

    def count_undrafted(self, running: Sequence[Request]) -> None:
        """A step over `running` planned ahead without drafts (async scheduling, `may_draft`
        False) never reaches `propose`: count its decoding sequences as disabled when the batch
        is above max_batch_size, as `propose` would (else none of them wants speculation)."""
        if not self.policy.is_step_enabled(len(running)):
            self.stats.num_disabled_sequence_steps += sum(map(_is_decoding, running))

    def propose(self, running: Sequence[Request]) -> int:
        """Set `spec_token_ids` of the running sequences that should speculate; returns #drafts."""
        self._draft_probs.clear()
        if self.chain_drafter is not None and self.chain_drafter.has_chains:  # a chain just ended
            self.chain_drafter.end_chains(
                {s.seq_id: (s.prompt_token_ids, s.output_token_ids) for s in running}
            )
        if self.device_drafts is not None:  # placeholders of drafts never verified: gone with them
            rows = self.device_drafts.rows
            for seq in running:
                if seq.spec_token_ids and seq.seq_id in rows:
                    seq.spec_token_ids = []
            self.device_drafts = None
        self.forget_gone(running)
        if not self.policy.is_step_enabled(len(running)):
            self.stats.num_disabled_sequence_steps += sum(map(_is_decoding, running))
            return 0
        candidates: list[Request] = []
        requests: list[DraftRequest] = []
        paused: list[tuple[Request, int]] = []
        for seq in running:  # one pass: the policy is asked only for sequences that may draft
            if not _is_decoding(seq):
                continue
            max_drafts = self._max_drafts(seq)
            if max_drafts <= 0:
                self.stats.num_capped_sequence_steps += 1
                continue
            if self.policy.should_speculate(seq.seq_id):
                candidates.append(seq)
                requests.append(DraftRequest(_row(seq), max_drafts, seq.eos_token_ids))
            else:
                paused.append((seq, max_drafts))
        if candidates:
            # A pause saves only what a sequence's own drafts cost. With others drafting, the draft
            # model steps anyway and, below max_batch_size, K more verification rows leave the
            # memory-bound step's time unchanged: paused sequences ride along. Pausing them there
            # would make them the batch's slowest for nothing (bench/NOTES.md, speculative b8).
            for seq, max_drafts in paused:
                candidates.append(seq)
                requests.append(DraftRequest(_row(seq), max_drafts, seq.eos_token_ids))
        else:
            self.stats.num_paused_sequence_steps += len(paused)
            return 0
        proposals = self.proposer.propose(requests)
        self.device_drafts = proposals.device
        self._known.update(seq.seq_id for seq in candidates)
        num_drafts = 0
        probs = proposals.probs
        for b, (seq, drafts) in enumerate(zip(candidates, proposals.token_ids, strict=True)):
            seq.spec_token_ids = list(drafts)
            num_drafts += len(drafts)
            self.stats.num_unmatched_sequence_steps += not drafts
            if probs is not None and drafts:
                self._draft_probs[seq.seq_id] = probs[b, : len(drafts)]
        return num_drafts

    def _max_drafts(self, seq: Request) -> int:
        """Drafts a decoding sequence that wants speculation may take (0: no room left)."""
        params = seq.sampling_params
        limit = self.config.num_speculative_tokens
        # One step emits up to k + 1 tokens: stay within max_tokens and the context. Except for a
        # seeded request whose drafts are draws (a draft model's): a chained step, which cannot
        # see max_tokens, verifies all k there, and an accepted draw is another token than the
        # target's own; drafting k here too gives the same tokens near max_tokens whichever kind
        # of step decides them (the tokens past max_tokens are dropped). (Elsewhere the two
        # still differ where a chained step verifies drafts of a sequence the policy paused and a
        # synchronous step would not draft: both exact samples, other draws.)
        keep_k = (
            seq.seed is not None and not params.is_greedy and getattr(self.proposer, "draws_drafts", False)
        )
        if params.max_tokens is not None and not keep_k:
            limit = min(limit, params.max_tokens - seq.num_output_tokens - 1)
        return max(min(limit, self.max_model_len - seq.num_tokens - 1), 0)

    def forget_gone(self, running: Sequence[Request]) -> None:
        """Free the draft state of every known sequence that is no longer running."""
        if not self._known:
            return
        for seq_id in self._known.difference([seq.seq_id for seq in running]):
            self.free(seq_id)

    def free(self, seq_id: int) -> None:
        """Forget a finished / aborted / preempted sequence (its draft KV blocks too)."""
        self.proposer.free(seq_id)
        self.policy.forget(seq_id)
        self._draft_probs.pop(seq_id, None)
        self._known.discard(seq_id)

    # ---- runner: a step with verification groups ----------------------------------------------
    def launch_draws(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor | None:
        """[N] a draw per row, enqueued at launch, where acceptance is matching drafts against
        them: all greedy, or drafts without a distribution (n-gram); None: rejection sampling."""
        return self.verifier.launch_draws(logits, meta, point_mass=not self._draft_probs)

    def draft_probs_of(
        self, groups: Sequence[VerifyGroup], drafts: torch.Tensor, vocab_size: int
    ) -> torch.Tensor:
        """[B, K, V] the q of each group's drafts [B, K] of this step's proposal, as the
        synchronous verifier takes them (`stack_draft_probs`)."""
        return stack_draft_probs(groups, drafts, self._draft_probs, vocab_size)

    def feed_device_drafts(self, sched: SchedulerOutput, input_ids: torch.Tensor) -> None:
        """Write drafts left on the device into a step's input ids [T] (their rows hold
        placeholders): each verifying sequence's trailing num_spec_tokens rows."""
        drafts = self.device_drafts
        if drafts is None:
            return
        dst: list[int] = []
        src: list[int] = []
        width = drafts.tokens.shape[1]
        ends = sched.layout.query_start_loc
        for b, s in enumerate(sched.sequences):
            k = s.num_spec_tokens
            row = drafts.rows.get(s.seq_id) if k else None
            if row is None:
                continue
            end = int(ends[b + 1])
            dst.extend(range(end - k, end))
            src.extend(range(row * width, row * width + k))
        if not dst:
            return
        index = torch.tensor([dst, src], dtype=torch.int64, pin_memory=input_ids.is_cuda)
        index = index.to(input_ids.device, non_blocking=True)
        input_ids[index[0]] = drafts.tokens.view(-1)[index[1]]

    def record_device_drafts(self, sched: SchedulerOutput, scheduler) -> None:
        """Before a step's update: its verified drafts' ids replace the placeholders in the step's
        inputs and in the KV record (which the update's prefix-cache hashes read). A chained
        step's come with its emitted tokens instead (`record_device_inputs`)."""
        drafts = self.device_drafts
        if drafts is None or sched.feeds_drafts:
            return
        lists = drafts.to_host()
        for s in sched.sequences:
            k = s.num_spec_tokens
            if not k or s.seq_id not in lists:
                continue
            seq = scheduler.get_sequence(s.seq_id)
            if seq is None or seq.status is not RequestStatus.RUNNING:
                continue  # finished meanwhile (a stop string, an abort): its KV is gone
            real = lists[s.seq_id][:k]
            s.token_ids[len(s.token_ids) - k :] = real
            scheduler.kv.set_tokens(s.seq_id, s.num_computed_tokens + len(s.token_ids) - k, real)

    def sample(
        self,
        logits: torch.Tensor,
        meta: SamplingMetadata,
        groups: Sequence[VerifyGroup],
        draws: HostTokenIds | None = None,  # launch_draws' result on the host
    ) -> ModelRunnerOutput:
        """Tokens for every group of the step: accepted drafts + one, or one ordinary draw."""
        if self.device_drafts is not None:  # the groups were laid out over placeholders
            lists = self.device_drafts.to_host()
            for g in groups:
                real = lists.get(g.seq_id)
                if real is not None and g.draft_token_ids:
                    g.draft_token_ids = real[: len(g.draft_token_ids)]
        return self.verifier.sample(logits, meta, groups, self._draft_probs, draws)

    # ---- engine: chained steps drafted by the draft model -----------------------------------------
    def reserve_chained_drafts(self, seq_ids, starts, ends, known=None):
        """Draft-cache room for a chained step (core/spec_lookahead.py); an undo, or None. The
        sequences a step admitted (`known` tokens) join a chain only where drafts stay on the
        device: with device_drafts off, no chain starts at all (drafts the host read would leave
        their ids in the draft cache's records)."""
        drafter = self.chain_drafter
        return drafter.reserve_chained(seq_ids, starts, ends, known if drafter.device_drafts else None)

    def resolve_chained_drafts(self, sched: SchedulerOutput, ahead: SchedulerOutput, scheduler) -> None:
        """After step `sched` was applied, with chained step `ahead` launched behind it: the draft
        cache learns the tokens its chained draft steps started from; sequences that stopped
        give their draft blocks back now (a chain may run for many steps)."""
        drafter = self.chain_drafter
        if drafter is None or not ahead.model_drafts:
            return
        tokens = {}
        for s in ahead.sequences:
            seq = scheduler.get_sequence(s.seq_id)
            if seq is not None and seq.status is RequestStatus.RUNNING:
                tokens[s.seq_id] = (seq.prompt_token_ids, seq.output_token_ids)
        drafter.resolve_chained(tokens)
        for s in sched.sequences:
            if s.seq_id not in tokens:
                seq = scheduler.get_sequence(s.seq_id)
                if seq is None or seq.status is not RequestStatus.RUNNING:
                    self.free(s.seq_id)

    # ---- engine: after scheduler.update ---------------------------------------------------------
    def after_step(
        self,
        sched: SchedulerOutput,
        result: ModelRunnerOutput,
        running: Sequence[Request],
        applied: dict[int, int] | None = None,
    ) -> list[tuple[int, int, int]]:
        """The engine's one call per step: learn from this step's verifications, draft the next.
        Returns the verifications (see `observe`)."""
        checks = self.observe(sched, result, applied)
        self.propose(running)
        return checks

    def observe(
        self, sched: SchedulerOutput, result: ModelRunnerOutput, applied: dict[int, int] | None = None
    ) -> list[tuple[int, int, int]]:
        """Feed acceptance per sequence to the policy and the totals; `applied`: tokens the step
        applied per sequence (a step also computes rows of sequences that stopped the step before,
        and a chained one device steps past a sequence's stop: not counted; accepted drafts count
        as far as they were applied). Returns the step's verifications as (seq_id, draft tokens,
        accepted) in the order their tokens were emitted, a chained step's no-draft device steps
        included (0 drafts)."""
        if result.verified_drafts is not None:  # decided on the device: filler drafts not verified
            checks = result.verifications(applied)
            self._known.update(c[0] for c in checks)  # forgotten by a later propose()
            if sched.feeds_drafts:  # its drafts came from the device proposer: 0 = no match
                fed = {s.seq_id for s in sched.sequences[: sched.num_fed]}  # (not prompts it admitted)
                self.stats.num_unmatched_sequence_steps += sum(
                    1 for seq_id, k, _, _ in checks if k == 0 and seq_id in fed
                )
        else:
            checks = []
            for s, st in _with_drafts(sched, result):
                kept = len(st.token_ids) if applied is None else applied.get(st.seq_id, 0)
                if kept:  # (0: it stopped the step before; its rows were computed for nothing)
                    checks.append(
                        (st.seq_id, *verification_within_end(s.num_spec_tokens, len(st.token_ids), kept))
                    )
        for seq_id, k, accepted, emitted in checks:
            self.policy.observe(seq_id, k, accepted)  # (k = 0: a step's tokens, no acceptance)
            if k == 0:
                continue
            self.stats.num_draft_tokens += k
            self.stats.num_accepted_tokens += accepted
            self.stats.num_verified_sequences += 1
            self.stats.num_emitted_tokens += emitted  # (accepted + 1 unless it ended inside them)
        return [(seq_id, k, accepted) for seq_id, k, accepted, _ in checks]


def _with_drafts(sched: SchedulerOutput, result: ModelRunnerOutput):
    """(scheduled, sampled) pairs of the sequences that verified host drafts this step."""
    drafted = {s.seq_id: s for s in sched.sequences if s.num_spec_tokens > 0}
    if not drafted:
        return []
    return [(drafted[st.seq_id], st) for st in result.sampled if st.seq_id in drafted]


def _is_decoding(seq: Request) -> bool:
    """Running, past its prefill, and speculation wanted: the sequences a draft is for."""
    return (
        seq.status is RequestStatus.RUNNING
        and seq.sampling_params.use_speculation
        and seq.num_computed_tokens == seq.num_tokens - 1  # not still prefilling
        and not seq.pending_children
    )


def _row(seq: Request) -> SamplingRow:
    return SamplingRow(
        seq_id=seq.seq_id,
        sampling_params=seq.sampling_params,
        seed=seq.seed,
        output_position=seq.num_output_tokens,
        prompt_token_ids=seq.prompt_token_ids,
        output_token_ids=seq.output_token_ids,
    )
