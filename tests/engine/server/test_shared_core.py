"""One engine core behind several API servers (shared_core._SharedCoreLoop and RemoteCore's
shared mode), in process: the core loop on a thread, a fake core, one pipe per API server."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections import Counter
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace

import pytest

from pagedinfer.engine.config import EngineConfig, SchedulerConfig
from pagedinfer.engine.core.scheduler_output import StepStats
from pagedinfer.engine.core_process import AddRequest, CoreInfo
from pagedinfer.engine.outputs import FinishReason
from pagedinfer.engine.remote_core import CoreStepError, RemoteCore
from pagedinfer.engine.sampling_params import SamplingParams
from pagedinfer.engine.server.api_servers import api_server_engine_config
from pagedinfer.engine.shared_core import STATS_INTERVAL_S, _SharedCoreLoop
from tests.engine.test_core_process import _FakeCore

pytestmark = pytest.mark.timeout(60)
LONG = SamplingParams(max_tokens=10**6)


class _Core(_FakeCore):
    """The fake core with the scheduler's waiting queue (the loop counts each server's), a step
    count in its stats (mirrored by every API server) and one StepStats per step."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.step_stats: list[StepStats] = []  # the loop's listener list: it takes them per step

    def step(self):
        outputs = super().step()
        self.step_stats.append(StepStats(self.num_steps, len(self.left), 0, 1, 0, 1, 0, 0, 0, 0, 0.0))
        return outputs

    @property
    def scheduler(self) -> SimpleNamespace:
        waiting = list(self.left)[self.max_running :]
        return SimpleNamespace(waiting=[SimpleNamespace(request_id=r) for r in waiting])

    def stats(self) -> dict[str, float]:
        return {**super().stats(), "num_steps": float(self.num_steps)}


class _CountingLoop(_SharedCoreLoop):
    """Counts the step messages sent to each pipe."""

    def __init__(self, conns: list) -> None:
        super().__init__(conns)
        self.num_step_msgs: Counter = Counter()

    def _send(self, conn, msg: tuple) -> None:
        if msg[0] == "step":
            self.num_step_msgs[conn] += 1
        super()._send(conn, msg)


class _Shared:
    """`num_servers` RemoteCores on one `_SharedCoreLoop` running on a thread."""

    def __init__(self, core: _Core, num_servers: int) -> None:
        self.core = core
        pipes = [multiprocessing.Pipe(duplex=True) for _ in range(num_servers)]
        self.core_ends = [core_end for _, core_end in pipes]
        self.loop = _CountingLoop(self.core_ends)
        self.thread = threading.Thread(target=self.loop.serve, args=(core, core.step_stats), daemon=True)
        self.thread.start()
        info = CoreInfo(None, None, 8192, None, 100_000, 4, 8, core.stats())
        process = SimpleNamespace(
            sentinel=None, exitcode=None, kill=lambda: None, join=lambda timeout=None: None
        )
        self.remotes = [RemoteCore(process, conn, info, is_shared=True) for conn, _ in pipes]

    def close(self) -> None:
        for remote in self.remotes:
            remote.close()
        self.thread.join(10)
        assert not self.thread.is_alive(), "the core loop must end once every API server stopped"


def _run(remote: RemoteCore, timeout: float = 20) -> list:
    outputs = []
    deadline = time.monotonic() + timeout
    while remote.has_unfinished():
        assert time.monotonic() < deadline
        outputs += remote.step()
    return outputs


def _until(predicate, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_each_server_gets_only_its_requests_outputs_and_every_server_the_stats():
    shared = _Shared(_Core(min_adds=3), 3)
    a, b, idle = shared.remotes
    a.add_request("a1", [1], SamplingParams(max_tokens=3))
    a.add_request("a2", [1], SamplingParams(max_tokens=5))
    b.add_request("b1", [1], SamplingParams(max_tokens=4))
    got_a, got_b = _run(a), _run(b)
    assert {o.request_id for o in got_a} == {"a1", "a2"} and {o.request_id for o in got_b} == {"b1"}
    tokens = {
        rid: sum(len(d.token_ids) for o in got_a + got_b if o.request_id == rid for d in o.deltas)
        for rid in ("a1", "a2", "b1")
    }
    assert tokens == {"a1": 3, "a2": 5, "b1": 4}
    # The idle server never stepped, yet mirrors the core's stats (its /metrics reads them).
    _until(lambda: idle.stats().get("num_steps") == shared.core.num_steps == 5)
    assert not idle.has_unfinished() and not idle._received
    shared.close()


def test_an_idle_server_gets_fewer_step_messages_yet_every_step_stats_and_fresh_stats():
    # 300 steps of at least 2 ms: at least 0.6 s of streaming, so at least 6 STATS_INTERVAL_S.
    assert STATS_INTERVAL_S == 0.1
    shared = _Shared(_Core(delay=0.002, min_adds=2), 3)
    a, b, idle = shared.remotes
    seen: list[list[int]] = [[], [], []]  # step numbers each server's step listener saw
    for remote, steps in zip(shared.remotes, seen, strict=True):
        remote.add_step_listener(lambda s, steps=steps: steps.append(s.step))
    stats_while_streaming: set[float] = set()  # the idle mirror's step counts while a streams
    a.add_request("a", [1], SamplingParams(max_tokens=300))
    b.add_request("b", [1], SamplingParams(max_tokens=100))
    got_a: list = []
    start = time.monotonic()
    while a.has_unfinished():
        got_a += a.step()
        stats_while_streaming.add(idle.stats().get("num_steps", 0.0))
    got_b = _run(b)
    elapsed = time.monotonic() - start
    num_steps = shared.core.num_steps
    assert num_steps == 300
    # Outputs: all of each request's tokens, to its own server only; none to the idle one.
    assert {o.request_id for o in got_a} == {"a"} and {o.request_id for o in got_b} == {"b"}
    assert sum(len(d.token_ids) for o in got_a for d in o.deltas) == 300
    assert sum(len(d.token_ids) for o in got_b for d in o.deltas) == 100
    assert got_a[-1].finished and got_b[-1].finished
    # The idle server: its stats refreshed while a streamed, the final ones when the core went
    # idle, every step's StepStats once and in order, in far fewer messages than steps.
    _until(lambda: idle.stats().get("num_steps") == num_steps and min(map(len, seen)) == num_steps)
    assert len(stats_while_streaming - {0.0, float(num_steps)}) >= 3, sorted(stats_while_streaming)
    assert seen == [list(range(1, num_steps + 1))] * 3
    num_msgs = [shared.loop.num_step_msgs[conn] for conn in shared.core_ends]
    assert num_msgs[0] == num_steps  # a had a token in every step
    # ~ one per STATS_INTERVAL_S (plus the idle-core sends at the start and end), however slow the
    # steps ran on this machine; and fewer than the steps while they take well under 0.1 s each
    assert num_msgs[2] <= elapsed / STATS_INTERVAL_S + 4, (num_msgs, elapsed)
    assert num_msgs[2] < num_steps, num_msgs
    assert num_msgs[1] < num_steps, num_msgs  # b, idle for its last 200 steps
    assert not idle.has_unfinished() and not idle._received
    shared.close()


def test_an_id_in_flight_from_another_server_is_refused_and_only_its_owner_aborts_it():
    # x runs until its owner aborts it, so it is in flight whatever the machine's speed.
    shared = _Shared(_Core(delay=0.002), 2)
    a, b = shared.remotes
    a.add_request("x", [1], LONG)
    _until(lambda: shared.core.num_adds == 1)
    b.add_request("x", [1], SamplingParams(max_tokens=2))
    refused = _run(b)
    assert [o.finished for o in refused] == [True] and refused[0].deltas[
        0
    ].finish_reason is FinishReason.ERROR
    assert "already in flight" in refused[0].deltas[0].error
    b._outbox.put(ForkingPickler.dumps(("abort", "x")))  # b's abort of a's request: ignored
    b.add_request("y", [1], SamplingParams(max_tokens=2))  # after the abort on b's pipe: a sync point
    assert [o.request_id for o in _run(b)][-1] == "y"
    assert "x" not in shared.core.aborted and a.has_unfinished()
    a.abort("x")  # its owner's abort ends it
    outputs = _run(a)
    assert outputs[-1].finished and shared.core.aborted == ["x"]
    shared.close()


def test_a_server_that_leaves_has_its_requests_aborted_and_the_others_go_on():
    shared = _Shared(_Core(), 2)
    a, b = shared.remotes
    a.add_request("a", [1], LONG)
    b.add_request("b", [1], SamplingParams(max_tokens=50))
    raw, core_end = multiprocessing.Pipe(duplex=True)  # a third server that dies without a word
    shared.loop.live.append(core_end)
    shared.loop.num_adds[core_end] = 0
    raw.send(("add", AddRequest("raw", [1], LONG, 0, 0.0)))
    _until(lambda: shared.core.num_adds == 3)
    a.step()
    a.close()  # says stop
    raw.close()  # pipe ends
    _until(lambda: sorted(shared.core.aborted) == ["a", "raw"])
    outputs = _run(b)
    assert outputs[-1].finished and sum(len(d.token_ids) for o in outputs for d in o.deltas) == 50
    assert shared.loop.live == [shared.loop.live[0]] and not shared.loop.owner
    b.close()
    shared.thread.join(10)
    assert not shared.thread.is_alive()


def test_each_server_counts_only_its_own_waiting_requests():
    shared = _Shared(_Core(max_running=1, min_adds=4), 2)
    a, b = shared.remotes
    for rid in ("a1", "a2", "a3"):
        a.add_request(rid, [1], LONG)
    assert a.scheduler.num_waiting == 3  # not yet reported: all counted as waiting
    _until(lambda: shared.core.num_adds == 3)
    b.add_request("b1", [1], LONG)
    _until(lambda: a._waiting_report[0] == 3 and b._waiting_report[0] == 1)
    assert (a.scheduler.num_waiting, b.scheduler.num_waiting) == (2, 1)  # a1 runs; the core holds 3
    for remote, rids in ((a, ("a1", "a2", "a3")), (b, ("b1",))):
        for rid in rids:
            remote.abort(rid)
    _run(a), _run(b)
    shared.close()


def test_a_failed_step_fails_only_the_servers_whose_requests_it_aborted():
    shared = _Shared(_Core(fail_at={2}), 2)
    a, b = shared.remotes
    a.add_request("a", [1], LONG)
    with pytest.raises(CoreStepError, match="step exploded"):
        _run(a)
    assert shared.core.aborted == ["a"] and not a.has_unfinished()
    _until(lambda: b.stats().get("num_steps", 0) >= 2)
    assert not b.has_unfinished() and not b._received  # b had nothing in that step: no failure
    b.add_request("b", [1], SamplingParams(max_tokens=2))  # the core goes on
    assert _run(b)[-1].finished
    shared.close()


def test_each_api_server_admits_its_share_of_the_waiting_queue():
    config = EngineConfig(scheduler=SchedulerConfig(max_waiting_requests=1024))
    assert api_server_engine_config(config, 3).scheduler.max_waiting_requests == 341
    assert api_server_engine_config(config, 3).scheduler.max_num_seqs == config.scheduler.max_num_seqs
    tiny = EngineConfig(scheduler=SchedulerConfig(max_waiting_requests=1))
    assert api_server_engine_config(tiny, 4).scheduler.max_waiting_requests == 1
