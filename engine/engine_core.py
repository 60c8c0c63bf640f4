"""The engine's inner loop: step() = schedule -> execute -> update -> outputs. Single-threaded.

`AsyncEngine` (async_engine.py) and `LLM` (llm.py) drive this from their own threads; nothing
here knows about asyncio. Requests are validated at the door (`validate`) so a bad one raises
`InvalidRequestError` before it is queued.
"""

from __future__ import annotations

import atexit
import gc
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagedinfer.engine.core.lookahead import drop_lookahead, plan_lookahead, resolve_lookahead
from pagedinfer.engine.core.scheduler import Scheduler
from pagedinfer.engine.core.scheduler_output import (
    ModelRunnerOutput,
    SchedulerOutput,
    SequenceUpdate,
    StepStats,
)
from pagedinfer.engine.core.spec_lookahead import plan_spec_lookahead, resolve_spec_lookahead
from pagedinfer.engine.core.verification_counts import attribute_verifications, per_position_counts
from pagedinfer.engine.errors import EngineOverloadedError, InvalidRequestError
from pagedinfer.engine.output_processor import OutputProcessor
from pagedinfer.engine.outputs import RequestOutput
from pagedinfer.engine.request import Request
from pagedinfer.engine.request_checks import RequestLimits, check_request
from pagedinfer.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

StepListener = Callable[[StepStats], None]


@dataclass(slots=True)
class StepPhases:
    """Host wall time of the last step's phases, seconds (benchmarks read it to attribute the
    time the GPU waits for: everything but `outputs`, `collect` and a deferred sampling's launch,
    which its forward overlaps, runs while it idles)."""

    schedule: float = 0.0
    launch_forward: float = 0.0  # input staging + graph replay / eager forward enqueue
    outputs: float = 0.0  # the previous step's outputs (overlaps the forward)
    launch_sampling: float = 0.0  # LM head + sampler enqueue
    collect: float = 0.0  # waiting for the samples (GPU time left) + their host copy
    update: float = 0.0  # scheduler update + speculative after_step
    lookahead: float = 0.0  # planning + launching the next step (async scheduling), overlaps this one


@dataclass
class _Pending:
    """A finished step whose outputs and stats are produced during the next step's forward."""

    sched: SchedulerOutput
    result: ModelRunnerOutput
    updates: list[SequenceUpdate]
    finished: list[Request]
    snapshot: StepStats  # gauges taken at the end of the step
    num_cut: int = 0  # tokens a stop string cut from the updates an abort output early


def _freeze_startup_objects() -> None:
    """Move the objects alive now (model, torch, tokenizer: 10^5-10^6 of them, never garbage)
    out of the cyclic GC's reach, once per process. Otherwise every full collection, triggered
    every ~100 decode steps at batch 256 by the step messages that survive a step, walks them
    all: ~180 ms each, 1.6-2.7 ms per step amortized on the CPU machine."""
    if gc.get_freeze_count() == 0:
        gc.collect()
        gc.freeze()
        atexit.register(gc.unfreeze)  # let shutdown collect them (extensions check for leaks)


def defers_outputs(runner) -> bool:
    """Whether a step's outputs wait for the next step's forward to be launched: only where that
    forward runs asynchronously (CUDA); elsewhere (the CPU computes a forward as it is launched)
    waiting would hand every token to its client one step late."""
    device = getattr(getattr(runner, "config", None), "device", None)
    return getattr(device, "type", None) == "cuda"


class EngineCore:
    """Owns the scheduler, the model runner and the output processor."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner,
        tokenizer,
        *,
        eos_token_ids: tuple[int, ...] = (),
        vocab_size: int | None = None,
        seed: int = 0,
        spec_decoder=None,
        async_scheduling: bool = False,
    ) -> None:
        self.scheduler = scheduler
        self.async_scheduling = async_scheduling  # lookahead steps (core/lookahead.py)
        # A lookahead step and its PendingStep (its LaunchedForward while its sampling waits,
        # `defers_sampling`; None while it is being launched).
        self._inflight: tuple[SchedulerOutput, object] | None = None
        self.num_lookahead_steps = 0
        self.num_lookahead_admissions = 0  # requests admitted by lookahead steps
        self.num_deferred_sampling_steps = 0  # lookahead steps sampled a call later (grammars)
        self.num_chained_steps = 0  # device steps verifying drafts made on the device (lookaheads)
        # forward passes whose results a step applied (the runner counts them at launch; an async
        # step applies the passes the step before launched, so per step the two differ)
        self.num_applied_device_steps = 0
        self.runner = runner
        _freeze_startup_objects()
        self.spec_decoder = spec_decoder  # spec_decode.SpeculativeDecoder, or None
        if spec_decoder is not None:
            runner.spec_decoder = spec_decoder
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.max_model_len = scheduler.max_model_len
        self.outputs = OutputProcessor(tokenizer, scheduler)
        self._listeners: list[StepListener] = []
        self._pending: _Pending | None = None  # the last step, awaiting outputs and accounting
        # Emit a step's outputs during the next step's forward only where that forward runs
        # asynchronously (CUDA); on the CPU launch_forward computes it, and waiting for it would
        # hand every token to its client one step late (issue 46: TTFT one step behind).
        self.defers_outputs = defers_outputs(runner)
        self.last_step_phases = StepPhases()
        self._rng = random.Random(seed)
        self._next_seq_id = 0
        self._step = 0
        self.num_generation_tokens_total = 0
        self.num_prompt_tokens_total = 0
        self._recent: list[tuple[float, int]] = []  # (time, generation tokens) for a rate

    # ---- requests -----------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError for a request this engine can never serve."""
        kv = self.scheduler.kv
        limits = RequestLimits(
            self.max_model_len,
            self.vocab_size,
            kv.block_size,
            kv.num_blocks,
            self.scheduler.config.max_num_seqs,
        )
        check_request(prompt_token_ids, params, limits)
        if params.structured_output is not None:  # compiled once (cached): a bad grammar is a 400
            grammar = getattr(self.runner, "grammar", None)
            if grammar is None:
                raise InvalidRequestError(
                    "structured outputs need the model's tokenizer; this model has none"
                )
            grammar.check(params.structured_output)

    def check_capacity(self) -> None:
        if self.scheduler.num_waiting >= self.scheduler.config.max_waiting_requests:
            raise EngineOverloadedError(
                f"{self.scheduler.num_waiting} requests already waiting "
                f"(max_waiting_requests={self.scheduler.config.max_waiting_requests})"
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        """Validate and queue; raises InvalidRequestError / EngineOverloadedError."""
        self.validate(prompt_token_ids, params)
        self.check_capacity()
        arrival = time.monotonic() if arrival_time is None else arrival_time
        sequences = [
            self._sequence(request_id, i, prompt_token_ids, params, priority, arrival)
            for i in range(params.n)
        ]
        self.scheduler.add_request(sequences[0], sequences[1:])
        self.outputs.add(sequences)

    def _sequence(self, request_id, index, prompt, params, priority, arrival) -> Request:
        seed = None
        if params.seed is not None:
            seed = (params.seed * 1_000_003 + index) & ((1 << 63) - 1)
        self._next_seq_id += 1
        return Request(
            seq_id=self._next_seq_id,
            request_id=request_id,
            index=index,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            arrival_time=arrival,
            priority=priority,
            seed=seed,
            eos_token_ids=self.eos_token_ids,
            # the leader computes the prompt; its children are forked after it
            prompt_logprobs=[] if params.prompt_logprobs is not None and index == 0 else None,
        )

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Finish the request now (its blocks are freed); returns its final output, if any. It
        carries the request's tokens of the last step, whose outputs are still pending: its usage
        counts them, and the flush after the abort would drop them with the request's state."""
        aborted = self.scheduler.abort_request(request_id)
        if not aborted:
            return []
        if self.spec_decoder is not None and self._inflight is None:
            # No launched step reads their draft cache: its blocks go back now (a chain's
            # draft state is otherwise freed by the step after, which a failed launch never ran).
            for seq in aborted:
                self.spec_decoder.free(seq.seq_id)
        pending = self._pending
        mine = [u for u in pending.updates if u.request_id == request_id] if pending is not None else []
        cut = self.outputs.num_cut_tokens
        outputs = self.outputs.process(mine, aborted)  # (the flush then skips them: no state)
        if pending is not None:  # the step is accounted at its flush, these cut tokens with it
            pending.num_cut += self.outputs.num_cut_tokens - cut
        return outputs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._pending is not None or self._inflight is not None

    # ---- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        try:
            return self._step_once()
        except BaseException:
            if self._inflight is not None:  # not continued: its KV slots go back
                inflight, self._inflight = self._inflight, None
                drop_lookahead(self.scheduler, inflight[0])
            # Steps already enqueued may still read their pinned input staging, which the next
            # step would overwrite: let them finish first.
            self.runner.quiesce()
            raise

    def _step_once(self) -> list[RequestOutput]:
        """One iteration: schedule, launch the model, emit the previous step's outputs while the
        GPU runs, collect the samples, apply them.

        On CUDA, outputs and step stats therefore trail the scheduler by one step (flushed at once
        when the engine goes idle); a stop string found then finishes its sequence before its next
        token is applied. Nothing that decides the next batch waits for them. Elsewhere (the CPU
        computes the forward as it is launched) they are emitted at the end of their own step.

        With async scheduling the step also plans and launches the next step (a lookahead, see
        core/lookahead.py) before collecting this one; the next call starts from it, so the
        device runs step after step while the host updates, schedules and stages in between.
        """
        clock = time.perf_counter
        start = clock()
        inflight = self._inflight
        if inflight is None:
            sched = self.scheduler.schedule()
            t_sched = clock()
            forward = self.runner.launch_forward(sched)
            t_forward = clock()
            outputs = self._flush_pending()  # CPU work that overlaps the GPU's forward pass
            t_outputs = clock()
            pending = self.runner.launch_sampling(forward, chain=self._may_chain(sched))
            t_sampling = clock()
            phases = [t_sched - start, t_forward - t_sched, t_outputs - t_forward, t_sampling - t_outputs]
        else:  # launched by the previous call
            sched, pending = inflight
            if sched.defers_sampling:  # its grammar masks needed the tokens the last call applied
                pending = self.runner.launch_sampling(pending)  # (failing: step() drops it)
            self._inflight = None
            t_launched = clock()
            outputs = self._flush_pending()
            t_sampling = clock()
            phases = [0.0, 0.0, t_sampling - t_launched, t_launched - start]
        if self.async_scheduling and pending is not None:
            self._launch_lookahead(sched, pending)
        t_lookahead = clock()
        result = self.runner.collect(pending)
        t_collect = clock()
        if pending is not None:
            self.num_applied_device_steps += sched.num_device_steps
        ahead = self._inflight[0] if self._inflight is not None else None
        if getattr(self.spec_decoder, "device_drafts", None) is not None:
            self.spec_decoder.record_device_drafts(sched, self.scheduler)
        if ahead is not None and ahead.feeds_drafts:
            updates = self.scheduler.update(sched, result, frozenset(s.seq_id for s in ahead.sequences))
            resolve_spec_lookahead(self.scheduler, ahead, result)
            self.spec_decoder.resolve_chained_drafts(sched, ahead, self.scheduler)
        else:
            updates = self.scheduler.update(sched, result)
            if ahead is not None:
                resolve_lookahead(self.scheduler, ahead)
        per_position = None
        if self.spec_decoder is not None:
            # Tokens applied per sequence: rows of sequences that stopped the step before, device
            # steps past a stop and tokens past max_tokens / EOS / a stop id count no acceptance.
            applied = {u.seq_id: len(u.new_token_ids) for u in updates}
            if self._inflight is None:  # learn acceptance, draft the next step's tokens
                checks = self.spec_decoder.after_step(sched, result, self.scheduler.running, applied)
            else:  # the next step is already launched: only learn
                checks = self.spec_decoder.observe(sched, result, applied)
                if not ahead.feeds_drafts:  # planned without drafts: count why, as propose() does
                    self.spec_decoder.count_undrafted(self.scheduler.running)
            verified = [c for c in checks if c[1]]
            # the step's totals (metrics) from the same verifications as the decoder's stats
            result.num_draft_tokens = sum(k for _, k, _ in verified)
            result.num_accepted_tokens = sum(a for _, _, a in verified)
            result.num_verified_seqs = len(verified)
            if verified:
                attribute_verifications(updates, checks)
                per_position = per_position_counts(verified)
        self.last_step_phases = StepPhases(
            *phases,
            t_collect - t_lookahead,
            clock() - t_collect,
            t_lookahead - t_sampling,
        )
        self._step += 1
        self._pending = _Pending(sched, result, updates, self.scheduler.take_finished(), self._snapshot())
        if per_position is not None:
            stats = self._pending.snapshot
            stats.draft_tokens_per_position, stats.accepted_tokens_per_position = per_position
        self._pending.snapshot.step_time_s = time.perf_counter() - start
        if not self.defers_outputs or not self.scheduler.has_unfinished():
            outputs += self._flush_pending()  # (an in-flight lookahead only has dropped rows)
            if self.spec_decoder is not None and self._inflight is None:
                # a stop string found just now finished its sequence after this step's drafting:
                # its draft blocks go back now, not whenever a next step runs
                self.spec_decoder.forget_gone(self.scheduler.running)
        return outputs

    def _launch_lookahead(self, sched: SchedulerOutput, pending) -> None:
        """Plan step N+1 from the launched step N and enqueue it behind N on the device."""
        # Drafts are proposed after update(): a batch that may draft next step stays synchronous,
        # unless this step decided its acceptance and next drafts on the device (a chain).
        spec, running = self.spec_decoder, self.scheduler.running
        if spec is not None and pending.chain is not None and spec.may_chain(running):
            k, steps = spec.config.num_speculative_tokens, spec.config.device_chain_steps
            drafter = spec.reserve_chained_drafts if spec.chain_drafter is not None else None
            nxt = plan_spec_lookahead(
                self.scheduler,
                sched,
                k,
                steps,
                drafter,
                spec.may_chain,
                spec.may_ride_chain,
                spec.tokens_per_step,
                spec.tokens_to_stop,
            )
        elif pending.chain is not None or (spec is not None and spec.may_draft(running)):
            return  # (a step decided on the device has no samples a plain lookahead could take)
        else:
            nxt = plan_lookahead(self.scheduler, sched)
        if nxt is not None:
            # In flight from the moment its slots are reserved: if launching it fails, step()
            # gives them back like any dropped lookahead's.
            self._inflight = (nxt, None)
            forward = self.runner.launch_forward(nxt, feed=pending)
            if nxt.defers_sampling:  # sampled by the next call, once this step's tokens are applied
                self._inflight = (nxt, forward)
            else:
                self._inflight = (nxt, self.runner.launch_sampling(forward))
            self.num_lookahead_steps += 1
            self.num_deferred_sampling_steps += nxt.defers_sampling
            self.num_chained_steps += nxt.num_device_steps if nxt.feeds_drafts else 0
            self.num_lookahead_admissions += len(nxt.sequences) - nxt.num_fed

    def _may_chain(self, sched: SchedulerOutput) -> bool:
        """Whether a synchronous step should decide its acceptance and next drafts on the device,
        to start a chain of speculative steps planned ahead (core/spec_lookahead.py)."""
        spec = self.spec_decoder
        return (
            self.async_scheduling
            and spec is not None
            and spec.may_chain(self.scheduler.running)
            and len(sched.sequences) == len(self.scheduler.running)
        )

    def _flush_pending(self) -> list[RequestOutput]:
        """Outputs and step accounting of the last step: nothing here decides the next batch."""
        if self._pending is None:
            return []
        pending, self._pending = self._pending, None
        cut, stopped = self.outputs.num_cut_tokens, self.outputs.num_stopped
        outputs = self.outputs.process(pending.updates, pending.finished)
        # (tokens past a stop string are not generated output; its sequence finished here)
        num_cut = self.outputs.num_cut_tokens - cut + pending.num_cut
        self._account(pending, num_cut, self.outputs.num_stopped - stopped)
        return outputs

    def _snapshot(self) -> StepStats:
        """The step's gauges now; its per-sequence counts are filled in by `_account` later."""
        # Taken, not read (the only reset): every preemption lands in exactly one step's stats,
        # also around steps planned ahead, which run no schedule().
        preempted, self.scheduler.num_preemptions_step = self.scheduler.num_preemptions_step, 0
        return StepStats(
            step=self._step,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_scheduled_tokens=0,
            num_prompt_tokens=0,
            num_generation_tokens=0,
            num_preemptions=preempted,
            num_finished=0,
            num_draft_tokens=0,
            num_accepted_tokens=0,
            kv_cache_usage=self.scheduler.kv.usage,
        )

    def add_step_listener(self, callback: StepListener) -> None:
        self._listeners.append(callback)

    @property
    def step_failure_is_fatal(self) -> bool:
        """Whether a failed step must end the engine instead of aborting its requests and going
        on: a runner whose other processes run each step in lockstep (tensor parallel) may have
        left them inside a collective this process never joins."""
        return bool(getattr(self.runner, "runs_in_lockstep", False))

    def add_death_listener(self, callback: Callable[[str], None]) -> None:
        """`callback(reason)` once if the runner's other processes die (tensor-parallel workers,
        engine/parallel/workers.py); a runner of this process alone has none and never calls it."""
        add = getattr(self.runner, "add_death_listener", None)
        if add is not None:
            add(callback)

    def close(self) -> None:
        """Stop the runner's other processes, if it has any (tensor-parallel workers)."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def _account(self, pending: _Pending, num_cut: int, num_stopped: int) -> None:
        """The step's counts; num_cut tokens of its updates fell past a stop string, which
        finished num_stopped sequences (found by the output processor)."""
        sched, updates, stats = pending.sched, pending.updates, pending.snapshot
        num_gen = sum(len(u.new_token_ids) for u in updates) - num_cut
        # Decodes (computed >= prompt) add no prompt tokens.
        num_prompt = sum(
            max(min(s.num_computed_tokens + len(s.token_ids), s.num_prompt_tokens) - s.num_computed_tokens, 0)
            for s in sched.sequences
            if s.num_computed_tokens < s.num_prompt_tokens
        )
        self.num_generation_tokens_total += num_gen
        self.num_prompt_tokens_total += num_prompt
        now = time.monotonic()
        self._recent.append((now, num_gen))
        while self._recent and now - self._recent[0][0] > 10.0:
            self._recent.pop(0)
        if not self._listeners:
            return
        stats.num_scheduled_tokens = sched.num_scheduled_tokens
        stats.num_prompt_tokens = num_prompt
        stats.num_generation_tokens = num_gen
        stats.num_finished = sum(1 for u in updates if u.is_finished) + num_stopped
        stats.num_draft_tokens = pending.result.num_draft_tokens
        stats.num_accepted_tokens = pending.result.num_accepted_tokens
        stats.num_verified_seqs = pending.result.num_verified_seqs
        stats.batch_size = len(sched.sequences)
        for callback in self._listeners:
            try:
                callback(stats)
            except Exception:  # a metrics bug must not kill the step loop
                logger.exception("step listener failed")

    def stats(self) -> dict[str, float]:
        kv = self.scheduler.kv.stats()
        window = [n for _, n in self._recent]
        span = (self._recent[-1][0] - self._recent[0][0]) if len(self._recent) > 1 else 0.0
        return {
            "num_running": float(self.scheduler.num_running),
            "num_waiting": float(self.scheduler.num_waiting),
            "kv_cache_usage": kv.get("kv_cache_usage", 0.0),
            "fragmentation": kv.get("fragmentation_ratio", 0.0),
            "prefix_cache_hit_rate": kv.get("prefix_cache_hit_rate", 0.0),
            "generation_tokens_per_second": (sum(window[1:]) / span) if span > 0 else 0.0,
            "preemptions_total": float(self.scheduler.num_preemptions_total),
            "generation_tokens_total": float(self.num_generation_tokens_total),
            "prompt_tokens_total": float(self.num_prompt_tokens_total),
            "num_steps": float(self._step),
            "gpu_idle_seconds_total": float(getattr(self.runner, "gpu_idle_s_total", 0.0)),
            "kv_free_blocks": float(self.scheduler.kv.num_free_blocks),
            "kv_total_blocks": float(self.scheduler.kv.num_blocks),
        }
