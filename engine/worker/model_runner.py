"""Runs one scheduled step on the model: inputs -> forward (graph or eager) -> logits -> tokens.

Speculative verification needs no special path: a sequence's drafts are extra new tokens,
the runner takes logits at all of its last 1 + k positions, samples each with the sequence's
parameters, and the `verifier` keeps the longest prefix of drafts the samples agree with
(exact for greedy and for sampling: every emitted token is a sample from the target).
A rejection sampler with draft probabilities can replace `verifier`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import numpy as np
import torch

from pagedinfer.engine.core.scheduler_output import (
    ModelRunnerOutput,
    SampledTokens,
    SamplingRow,
    SchedulerOutput,
    TokenLogprobs,
)
from pagedinfer.engine.sample.metadata import SamplingMetadataBuilder
from pagedinfer.engine.sample.sampler import Sampler, SamplerOutput, is_plain_greedy
from pagedinfer.engine.structured.masks import GrammarMasker
from pagedinfer.engine.worker.chained_sampling import ChainedSampling, chain_output
from pagedinfer.engine.worker.cuda_graphs import CudaGraphRunner, GraphKey, default_buckets, graph_keys
from pagedinfer.engine.worker.input_batch import InputBatch, StepInputs
from pagedinfer.engine.worker.step_types import (
    DevicePromptLogprobs,
    HostTokenIds,
    LaunchedForward,
    PendingStep,
    PrefixMatchVerifier,
    RunnerConfig,
    Verifier,
    VerifyGroup,
)
from pagedinfer.kernels import ops

logger = logging.getLogger(__name__)
_PROMPT_LOGPROB_ROWS = 256  # prompt_logprobs: logits rows per [rows, V] fp32 block


class ModelRunner(ChainedSampling):
    """Owns the input buffers, the CUDA graphs and the sampler for one model + KV cache."""

    def __init__(
        self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], config: RunnerConfig
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.config = config
        self.vocab_size = int(model.config.vocab_size)
        max_blocks = -(-config.max_model_len // config.block_size)
        self.batch = InputBatch(
            max_num_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_blocks_per_seq=max_blocks,
            scratch_block=config.num_blocks,
            block_size=config.block_size,
            device=config.device,
            backend=config.attention_backend,
        )
        self.sampler = Sampler()
        self.sampling_metadata = SamplingMetadataBuilder(self.vocab_size, config.device)
        self.verifier: Verifier = PrefixMatchVerifier()
        self.grammar: GrammarMasker | None = None  # structured outputs (None: no tokenizer)
        self.spec_decoder = None  # spec_decode.SpeculativeDecoder: samples steps that carry drafts
        self.graphs: CudaGraphRunner | None = None
        self._prev_end: torch.cuda.Event | None = None
        self.gpu_idle_s_total = 0.0
        self.gpu_busy_s_total = 0.0
        self.num_device_steps = 0  # forward passes launched (a chained step counts each of its)

    def capture_cuda_graphs(self) -> None:
        if not (self.config.enable_cuda_graphs and self.config.device.type == "cuda"):
            return
        cfg = self.config
        query_lens = (1, 1 + cfg.num_speculative_tokens) if cfg.num_speculative_tokens > 0 else (1,)
        keys = graph_keys(
            default_buckets(cfg.max_num_seqs), query_lens, self.batch.max_num_tokens, cfg.max_verify_seqs
        )
        graphs = CudaGraphRunner(self.model, self.kv_caches, self.batch, keys)
        try:
            graphs.capture()
        except RuntimeError:  # e.g. a backend that syncs the host: decode runs eagerly instead
            logger.exception("CUDA graph capture failed; decode steps run eagerly")
            torch.cuda.synchronize()
            return
        self.graphs = graphs

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """One forward + sampling for the scheduled batch (launch, then wait for it)."""
        return self.collect(self.launch(sched))

    def launch(self, sched: SchedulerOutput) -> PendingStep | None:
        """Enqueue the step's GPU work (forward, logits, sampling) without waiting for it."""
        return self.launch_sampling(self.launch_forward(sched))

    @torch.inference_mode()
    def launch_forward(
        self, sched: SchedulerOutput, feed: PendingStep | None = None
    ) -> LaunchedForward | None:
        """Enqueue the forward pass only; `launch_sampling()` then enqueues logits and sampling.

        The engine runs its CPU work (the previous step's outputs) between the two: that work
        then overlaps the forward even if enqueueing the LM head has to wait for the GPU.
        A lookahead step (`sched.feeds_previous`) takes its input ids from `feed`, the launched
        step before it, on the device: row i's sample is sequence i's next input.
        """
        if sched.is_empty:
            return None
        self.num_device_steps += sched.num_device_steps
        if sched.block_copies:
            copies = torch.tensor(sched.block_copies, dtype=torch.int64, device=self.config.device)
            ops.copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], copies)
        logits_rows, rows, groups = self._sampling_plan(sched)
        key = self._graph_key(sched)
        inputs = self.batch.prepare(sched, logits_rows, key)
        fed_chain = draft_probs = None
        if sched.feeds_drafts:
            if feed is None or feed.chain is None:
                raise ValueError("a chained speculative step needs the launched step it continues")
            chain = self.spec_decoder.device_chain
            fed_chain = feed.chain
            if sched.feed_rows is not None:  # sequences stopped since that step: their rows go
                fed_chain = chain.select_rows(fed_chain, sched.feed_rows)
            if sched.model_drafts:  # the draft model drafts from the histories N's acceptance left
                seqs = sched.sequences[: sched.num_fed]
                drafts, draft_probs = self.spec_decoder.chain_drafter.launch_chained(
                    [s.seq_id for s in seqs],
                    [s.num_computed_tokens for s in seqs],
                    chain.history,
                    chain.history_len,
                    [s.sample for s in seqs],
                )
                fed_chain = chain.with_drafts(fed_chain, drafts)
            b = self.batch
            chain.feed(fed_chain, b.ids, b.pos, b.slots, b.seq_lens, b.block_tables, self.config.block_size)
            admitted = rows[sched.num_fed :]  # (rows: one per group, in the groups' order)
            if admitted:  # their token histories join the chain's, behind the chained rows
                chain.add_rows(
                    sched.num_fed,
                    [[*r.prompt_token_ids, *r.output_token_ids[: r.output_position]] for r in admitted],
                )
        elif sched.feeds_previous:
            self._feed_previous(sched, feed, inputs.input_ids)
        elif getattr(self.spec_decoder, "device_drafts", None) is not None:
            self.spec_decoder.feed_device_drafts(sched, self.batch.ids)  # a draft model's device drafts
        # Idle time is GPU time between one step's last kernel and the next step's forward: the
        # host work in between (update, schedule, prepare) is what the GPU waits for.
        start = self._gpu_event()
        hidden = self._run_model(inputs, key)
        logits_indices = inputs.attn_metadata.logits_indices
        if fed_chain is None:
            launched = LaunchedForward(start, rows, groups, hidden, logits_indices)
            launched.prompt_logprobs = self._prompt_logprobs(sched, hidden)
            if sched.defers_sampling:
                launched.forward_end = self._gpu_event()
            return launched
        launched = LaunchedForward(
            start,
            rows,
            groups,
            hidden,
            logits_indices,
            fed_chain,
            sched.num_device_steps,
            inputs,
            key,
            draft_probs,
        )
        launched.prompt_logprobs = self._prompt_logprobs(sched, hidden)
        return launched

    def _prompt_logprobs(
        self, sched: SchedulerOutput, hidden: torch.Tensor
    ) -> list[DevicePromptLogprobs] | None:
        """Logprobs of the prompt tokens that this step's prompt chunks predict, for sequences
        that asked (prompt_logprobs): fp32 log-softmax of each input position's logits, the next
        prompt token's entry and the top k. Enqueued now; read in collect()."""
        if not any(s.prompt_targets for s in sched.sequences):
            return None
        qsl = sched.layout.query_start_loc
        device = hidden.device
        out = []
        for b, s in enumerate(sched.sequences):
            if not s.prompt_targets:
                continue
            first = int(qsl[b])
            targets = torch.tensor(s.prompt_targets, dtype=torch.int64).to(device)  # [n]
            parts = []
            for lo in range(0, len(s.prompt_targets), _PROMPT_LOGPROB_ROWS):  # bounded [rows, V]
                hi = min(lo + _PROMPT_LOGPROB_ROWS, len(s.prompt_targets))
                logits = self.model.compute_logits(
                    hidden[first + lo : first + hi], upcast=True, backend=self.config.attention_backend
                )
                lp = logits.float().log_softmax(dim=-1)  # [rows, V]
                top_lp, top_ids = lp.topk(s.num_prompt_logprobs, dim=-1)  # [rows, k]
                parts.append((lp.gather(1, targets[lo:hi, None]).squeeze(1), top_ids, top_lp))
            lps, ids, tops = (torch.cat(x) for x in zip(*parts, strict=True))
            out.append(
                DevicePromptLogprobs(s.seq_id, s.num_computed_tokens, s.prompt_targets, lps, ids, tops)
            )
        return out

    def _run_model(self, inputs: StepInputs, key: GraphKey | None) -> torch.Tensor:
        """The forward over the staged input buffers: a graph replay, or eager."""
        if key is not None:
            return self.graphs.replay(key)  # [B * q, H]
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata)

    def _feed_previous(
        self, sched: SchedulerOutput, feed: PendingStep | None, input_ids: torch.Tensor
    ) -> None:
        """A lookahead's inputs are the launched step's samples, copied on the device: one token for
        each of its leading `num_fed` sequences (prefill chunks it admitted follow them)."""
        n = sched.num_fed
        if feed is None or feed.sampled is None:
            raise ValueError("a lookahead step needs the launched step it continues")
        sampled = feed.sampled.token_ids
        if sched.feed_rows is not None:  # rows that finish in that step take no input
            index = torch.tensor(sched.feed_rows, dtype=torch.int64, pin_memory=sampled.is_cuda)
            sampled = sampled.index_select(0, index.to(sampled.device, non_blocking=True))
        if sampled.shape[0] != n:
            raise ValueError(f"a lookahead of {n} sequences fed {sampled.shape[0]} samples")
        input_ids[:n].copy_(sampled, non_blocking=True)

    def launch_sampling(self, fwd: LaunchedForward | None, chain: bool = False) -> PendingStep | None:
        """Enqueue logits and sampling for a launched forward; `collect()` gets the tokens.

        `chain`: decide acceptance and the next step's drafts on the device, if the step allows it
        (`PendingStep.chain` says whether it did; a chained step always does).
        """
        resumed = self._gpu_event() if fwd is not None and fwd.forward_end is not None else None
        pending = self._launch_sampling(fwd, chain)
        if pending is not None and fwd is not None and fwd.prompt_logprobs:
            pending.prompt_logprobs = fwd.prompt_logprobs
        if pending is not None and resumed is not None:
            pending.idle_gap = (fwd.forward_end, resumed)
        return pending

    @torch.inference_mode()
    def _launch_sampling(self, fwd: LaunchedForward | None, chain: bool) -> PendingStep | None:
        if fwd is None:
            return None
        start, rows, groups = fwd.start, fwd.rows, fwd.groups
        if not rows:
            return PendingStep(start, rows, groups, None, None, None)
        if fwd.fed_chain is not None:  # sampling its chain's first step allowed (may_ride_chain)
            return self._launch_chained(fwd, None)
        # Sampling metadata is built on the CPU (pinned, async copies) while the GPU runs the forward.
        eos = [self.config.eos_token_ids] * len(rows)
        meta = self.sampling_metadata.build(rows, eos)
        if self.grammar is not None:
            meta.grammar_bitmask = self.grammar.bitmask(rows, groups)
        if chain:
            pending = self._launch_chained(fwd, meta)
            if pending is not None:
                return pending
        speculative = self.spec_decoder is not None and any(g.draft_token_ids for g in groups)
        # A plain greedy batch samples (or verifies, see SpecVerifier) the argmax of the GEMM's own
        # output: no fp32 copy of [N, V].
        logits = self.sampled_logits(
            fwd.hidden, fwd.logits_indices, upcast=not is_plain_greedy(meta)
        )  # [N, V]
        if speculative:
            # All greedy or point-mass drafts (n-gram): each row's draw and its host copy are
            # enqueued now, like a plain step's samples, so collect() only waits for them and
            # matches the drafts; otherwise rejection sampling in collect().
            draws = self.spec_decoder.launch_draws(logits, meta)  # [N] or None
            if draws is None:
                return PendingStep(start, rows, groups, meta, logits, None)
            host_ids = self._to_host(draws)
            return PendingStep(start, rows, groups, meta, logits, None, self._gpu_event(), host_ids, draws)
        sampled = self.sampler(logits, meta)
        host_ids = self._to_host(sampled.token_ids)
        return PendingStep(start, rows, groups, meta, logits, sampled, self._gpu_event(), host_ids)

    def sampled_logits(
        self, hidden: torch.Tensor, logits_indices: torch.Tensor, upcast: bool
    ) -> torch.Tensor:
        """The LM head at the rows a forward samples (`hidden` and `logits_indices` as the
        forward returned and took them): logits [N, V]."""
        return self.model.compute_logits(
            hidden[logits_indices], upcast=upcast, backend=self.config.attention_backend
        )

    def _to_host(self, token_ids: torch.Tensor) -> torch.Tensor | None:
        """On CUDA a non-blocking copy into pinned memory, ordered before the step's end event:
        collect() waits for this step's kernels only, not for a lookahead step enqueued behind
        them (on the CPU the ids are already there: None)."""
        if self.config.device.type != "cuda":
            return None
        return token_ids.to("cpu", non_blocking=True)

    @torch.inference_mode()
    def collect(self, pending: PendingStep | None) -> ModelRunnerOutput:
        """Wait for a launched step and turn its samples into per-sequence tokens."""
        if pending is None:
            return ModelRunnerOutput([])
        if pending.chain is not None:
            steps = pending.chain_steps or [pending.chain]
            result = chain_output([step.to_host() for step in steps], pending.groups)
        elif pending.meta is None:
            result = ModelRunnerOutput([])
        elif pending.sampled is None:
            draws = None
            if pending.draws is not None:
                if pending.host_token_ids is None:
                    draws = HostTokenIds(pending.draws)
                else:
                    draws = HostTokenIds(pending.host_token_ids, pending.end)
            result = self.spec_decoder.sample(pending.logits, pending.meta, pending.groups, draws)
            if pending.end is not None and pending.meta.max_num_logprobs >= 0:
                # The end event was recorded at launch; logprob kernels ran since: busy, not idle.
                pending.end = None
        else:
            token_ids = pending.sampled.token_ids
            if pending.host_token_ids is not None:
                pending.end.synchronize()
                token_ids = pending.host_token_ids
            result = self._collect(
                pending.sampled, token_ids.tolist(), pending.rows, pending.groups, pending.meta.num_logprobs
            )
        if pending.prompt_logprobs:
            result.prompt_logprobs = [chunk.to_host() for chunk in pending.prompt_logprobs]
        self._gpu_mark_end(pending.start, pending.end, pending.idle_gap)
        return result

    def _graph_key(self, sched: SchedulerOutput) -> GraphKey | None:
        """The captured graph for this step: decode steps, and steps whose every query is at most
        1 + K tokens (verification; a short prefill chunk may ride along), else None (eager)."""
        if self.graphs is None or any(s.prompt_targets for s in sched.sequences):
            return None  # (prompt_logprobs read each input's hidden row: the eager layout)
        max_query_len = int(np.diff(sched.layout.query_start_loc).max())
        return self.graphs.select(len(sched.sequences), max_query_len)

    def _sampling_plan(
        self, sched: SchedulerOutput
    ) -> tuple[np.ndarray, list[SamplingRow], list[VerifyGroup]]:
        qsl = sched.layout.query_start_loc
        if sched.feeds_drafts:
            return self._chained_sampling_plan(sched)
        if not any(s.num_spec_tokens or s.fork_rows for s in sched.sequences):
            return self._decode_sampling_plan(sched)
        if not any(s.fork_rows for s in sched.sequences):
            return self._spec_sampling_plan(sched)
        logits_rows: list[int] = []
        rows: list[SamplingRow] = []
        groups: list[VerifyGroup] = []
        for b, s in enumerate(sched.sequences):
            if s.sample is None:
                continue
            end = int(qsl[b + 1])
            k = s.num_spec_tokens
            groups.append(VerifyGroup(s.seq_id, len(rows), s.token_ids[len(s.token_ids) - k :] if k else []))
            # Row j sees the drafts before it as outputs (penalty history), like a plain decode would.
            drafts = groups[-1].draft_token_ids
            history = [*s.sample.output_token_ids[: s.sample.output_position], *drafts] if k else []
            for j in range(k + 1):
                logits_rows.append(end - 1 - k + j)
                pos = s.sample.output_position + j
                row = s.sample
                if j:
                    row = dataclasses.replace(row, output_position=pos, output_token_ids=history)
                rows.append(row)
            for fork in s.fork_rows:
                groups.append(VerifyGroup(fork.seq_id, len(rows), []))
                logits_rows.append(end - 1)
                rows.append(fork)
        return np.asarray(logits_rows, dtype=np.int64), rows, groups

    @staticmethod
    def _spec_sampling_plan(
        sched: SchedulerOutput,
    ) -> tuple[np.ndarray, list[SamplingRow], list[VerifyGroup]]:
        """`_sampling_plan` with drafts and no forks, in one Python pass over the sequences (as
        cheap as numpy at B 64, ~3x cheaper at B 1 on the CPU machine): row objects built
        positionally, and the penalty history (outputs + drafts) only when a row has penalties
        (nothing else reads a row's output ids)."""
        seqs = sched.sequences
        ends = sched.layout.query_start_loc.tolist()  # [B + 1]
        history = any(s.sample is not None and s.sample.sampling_params.has_penalties for s in seqs)
        logits_rows: list[int] = []
        rows: list[SamplingRow] = []
        groups: list[VerifyGroup] = []
        for s, end in zip(seqs, ends[1:], strict=True):
            row = s.sample
            if row is None:
                continue
            k = s.num_spec_tokens
            # Group rows: the inputs of the last sampled token and of each draft.
            logits_rows.extend(range(end - 1 - k, end))
            drafts = s.token_ids[len(s.token_ids) - k :] if k else []
            groups.append(VerifyGroup(s.seq_id, len(rows), drafts))
            rows.append(row)
            if not k:
                continue
            pos = row.output_position
            # Row j sees the drafts before it as outputs (penalty history), like a plain decode would.
            outs = [*row.output_token_ids[:pos], *drafts] if history else row.output_token_ids
            params, seed, prompt = row.sampling_params, row.seed, row.prompt_token_ids
            rows += [SamplingRow(row.seq_id, params, seed, pos + j, prompt, outs) for j in range(1, k + 1)]
        return np.array(logits_rows, dtype=np.int64), rows, groups

    @staticmethod
    def _decode_sampling_plan(
        sched: SchedulerOutput,
    ) -> tuple[np.ndarray, list[SamplingRow], list[VerifyGroup]]:
        """`_sampling_plan` without drafts or forks: one row per sampling sequence, its last token."""
        last = sched.layout.query_start_loc[1:].astype(np.int64) - 1  # [B]
        rows = [s.sample for s in sched.sequences if s.sample is not None]
        if len(rows) < len(sched.sequences):
            last = last[np.fromiter((s.sample is not None for s in sched.sequences), bool, len(last))]
        return last, rows, [VerifyGroup(r.seq_id, i, []) for i, r in enumerate(rows)]

    def _collect(
        self,
        out: SamplerOutput,
        sampled: list[int],
        rows: list[SamplingRow],
        groups: list[VerifyGroup],
        num_logprobs: list,
    ) -> ModelRunnerOutput:
        if out.logprobs is None and len(sampled) == len(groups):  # no drafts (one row per group)
            return ModelRunnerOutput(
                [SampledTokens(g.seq_id, [t]) for g, t in zip(groups, sampled, strict=True)]
            )
        accepted = self.verifier.verify(sampled, groups)
        lp = None
        if out.logprobs is not None:
            lp = (out.logprobs.tolist(), out.top_token_ids.tolist(), out.top_logprobs.tolist())
        results = []
        num_draft = num_accepted = num_verified = 0
        for g, tokens in zip(groups, accepted, strict=True):
            num_draft += len(g.draft_token_ids)
            num_verified += bool(g.draft_token_ids)
            num_accepted += len(tokens) - 1
            logprobs = None
            want = num_logprobs[g.first_row]
            if lp is not None and want is not None:
                logprobs = [
                    TokenLogprobs(
                        tokens[j],
                        lp[0][g.first_row + j],
                        tuple(lp[1][g.first_row + j][:want]),
                        tuple(lp[2][g.first_row + j][:want]),
                    )
                    for j in range(len(tokens))
                ]
            results.append(SampledTokens(g.seq_id, tokens, logprobs))
        return ModelRunnerOutput(results, num_draft, num_accepted, num_verified_seqs=num_verified)

    def quiesce(self) -> None:
        """After a failed step: wait until the work already enqueued on the device has run (its
        host-to-device copies read pinned staging that the next step reuses). A device error
        raised here again is left to the caller's next step."""
        if self.config.device.type == "cuda":
            with contextlib.suppress(Exception):
                torch.cuda.current_stream(self.config.device).synchronize()

    # ---- GPU idle-time accounting (CUDA only) --------------------------------------------------
    def _gpu_event(self) -> torch.cuda.Event | None:
        if self.config.device.type != "cuda":
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _gpu_mark_end(
        self,
        start: torch.cuda.Event | None,
        end: torch.cuda.Event | None,
        idle_gap: tuple[torch.cuda.Event, torch.cuda.Event] | None = None,
    ) -> None:
        if start is None:
            return
        if end is None:
            end = self._gpu_event()
        end.synchronize()
        if self._prev_end is not None:
            self.gpu_idle_s_total += self._prev_end.elapsed_time(start) / 1e3
        gap_s = idle_gap[0].elapsed_time(idle_gap[1]) / 1e3 if idle_gap is not None else 0.0
        self.gpu_idle_s_total += gap_s
        self.gpu_busy_s_total += start.elapsed_time(end) / 1e3 - gap_s
        self._prev_end = end
