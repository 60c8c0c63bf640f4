"""The engine core in a process of its own (`pagedinfer serve --engine-process`), vLLM V1 style:
the pipe messages and the core's loop for one server.

The server process keeps the asyncio front (AsyncEngine: streams, aborts, merging) and a copy of
the tokenizer for prompts and chat templates; the core process owns the model, the scheduler and
the detokenizer and runs its step loop on its own GIL, so encoding responses for many streams
never delays a step. One duplex pipe (pickled messages) joins them:

    server -> core   ("add", AddRequest) | ("abort", request_id) | ("stop",)
    core -> server   ("phase", name) | ("ready", CoreInfo) | ("failed", message)
                     ("step", outputs, [StepStats], stats dict, number of adds received)
                     ("step_failed", message, aborted request ids)

The server side of the pipe is remote_core.RemoteCore; one core serving several API servers
(`--api-server-count N`) is shared_core.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from pagedinfer.engine.config import EngineConfig
from pagedinfer.engine.core.scheduler_output import StepStats
from pagedinfer.engine.errors import EngineOverloadedError, InvalidRequestError
from pagedinfer.engine.outputs import CompletionDelta, FinishReason, RequestOutput, Usage
from pagedinfer.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoreInfo:
    """What the server side needs to validate requests and describe the model."""

    model_config: Any
    tokenizer: _TokenizerRecipe | None
    max_model_len: int
    vocab_size: int | None
    num_blocks: int
    block_size: int
    max_num_seqs: int
    stats: dict[str, float]  # core.stats() at startup (until the first step message)
    core_pid: int = 0  # API servers that did not start the core watch it by pid


@dataclass(frozen=True)
class _TokenizerRecipe:
    """A Tokenizer's constructor arguments: the compiled chat template inside it does not pickle
    (a Tokenizer.__reduce__ would make this unnecessary)."""

    backend: Any
    bos_token: str | None
    eos_token: str | None
    chat_template: str | None
    stop_token_ids: tuple[int, ...]
    special_tokens: dict[str, str]

    @classmethod
    def of(cls, tok) -> _TokenizerRecipe | None:
        if tok is None:
            return None
        special = {k: v for k, v in tok._special_tokens.items() if k not in ("bos_token", "eos_token")}
        return cls(tok.backend, tok.bos_token, tok.eos_token, tok.chat_template, tok.stop_token_ids, special)

    def build(self):
        from pagedinfer.engine.tokenizer import Tokenizer

        return Tokenizer(
            self.backend,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            chat_template=self.chat_template,
            extra_stop_token_ids=self.stop_token_ids,
            special_tokens=self.special_tokens,
        )


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float


# ---- the core process -------------------------------------------------------------------------
def core_main(config: EngineConfig, conn) -> None:
    """Entry point of the spawned process: build, then step whenever there is work."""
    from pagedinfer.engine.engine_builder import build_engine

    try:
        built = build_engine(config, lambda phase: conn.send(("phase", phase)))
    except Exception as exc:  # reported to the server, which marks startup failed
        logger.exception("engine core startup failed")
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    core = built.core
    step_stats: list[StepStats] = []
    core.add_step_listener(step_stats.append)
    conn.send(("ready", core_info(built)))
    _serve(core, conn, step_stats)


def core_info(built) -> CoreInfo:
    core = built.core
    kv = core.scheduler.kv
    return CoreInfo(
        built.model_config,
        _TokenizerRecipe.of(built.tokenizer),
        built.max_model_len,
        core.vocab_size,
        kv.num_blocks,
        kv.block_size,
        core.scheduler.config.max_num_seqs,
        core.stats(),
        os.getpid(),
    )


def _serve(core, conn, step_stats: list[StepStats]) -> None:
    outputs: list[RequestOutput] = []
    in_flight: set[str] = set()  # admitted, not yet finished: what a failed step must end
    num_adds = 0  # adds received so far: the server counts the rest as waiting
    while True:
        while conn.poll(0) or not (core.has_unfinished() or outputs):  # block only when idle
            msg = conn.recv()
            if msg[0] == "stop":
                return
            if msg[0] == "abort":
                outputs += core.abort(msg[1])
            else:
                num_adds += 1
                outputs += admit_request(core, msg[1], in_flight)
        failure = None
        if core.has_unfinished():
            try:
                outputs += core.step()
            except Exception as exc:  # like AsyncEngine in process: end the in-flight requests, go on
                if getattr(core, "step_failure_is_fatal", False):  # tensor parallel: ranks out of step
                    raise  # this process ends; the server sees its core gone (503, exit)
                logger.exception("engine step failed; aborting in-flight requests")
                discard_finished(outputs, in_flight)  # ended before the step (aborts): not failed
                failure = ("step_failed", f"{type(exc).__name__}: {exc}", abort_all(core, in_flight))
        discard_finished(outputs, in_flight)
        conn.send(("step", outputs, step_stats[:], core.stats(), num_adds))
        if failure is not None:
            conn.send(failure)
        outputs, step_stats[:] = [], []


def discard_finished(outputs: list[RequestOutput], in_flight: set[str]) -> None:
    for out in outputs:
        if out.finished:
            in_flight.discard(out.request_id)


def abort_all(core, in_flight: set[str]) -> list[str]:
    """Abort every in-flight request after a failed step (their streams get the error instead)."""
    request_ids = sorted(in_flight)
    for request_id in request_ids:
        core.abort(request_id)  # raising here ends the process: the server then sees it dead
    in_flight.clear()
    return request_ids


def admit_request(core, add: AddRequest, in_flight: set[str]) -> list[RequestOutput]:
    """Add a request; a late rejection (the server validated with the same limits and counts
    unreported adds as waiting, so this should not happen) ends its stream with an error finish."""
    try:
        core.add_request(add.request_id, add.prompt_token_ids, add.params, add.priority, add.arrival_time)
        in_flight.add(add.request_id)
        return []
    except (InvalidRequestError, EngineOverloadedError) as exc:
        return [error_output(add, str(exc))]


def error_output(add: AddRequest, message: str) -> RequestOutput:
    deltas = [
        CompletionDelta(i, finish_reason=FinishReason.ERROR, error=message) for i in range(add.params.n)
    ]
    usage = Usage(prompt_tokens=len(add.prompt_token_ids), completion_tokens=0)
    return RequestOutput(add.request_id, deltas, finished=True, usage=usage)
