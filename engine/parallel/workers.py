"""Rank 0's view of its worker processes: start them, send them messages, notice their death.

A watcher thread waits on every worker's process sentinel. A worker that exits while the
engine runs takes the engine down: sending fails from then on (EngineDeadError), the death
listeners run (AsyncEngine fails every stream, health answers 503), and after
`exit_grace_s` this process exits with code 1 so that its supervisor (Kubernetes, the
launcher) restarts it, whether or not the engine thread is still blocked in a collective.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Listener, wait

from pagedinfer.engine.errors import EngineDeadError
from pagedinfer.engine.parallel.messages import StopCall
from pagedinfer.engine.parallel.worker import WorkerLaunch, WorkerSpec

logger = logging.getLogger(__name__)

EXIT_CODE_WORKER_DIED = 1


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# A worker connects back once its modules are imported, before it loads its shard: seconds, but a
# loaded host may take minutes.
CONNECT_TIMEOUT_S = 300.0


class WorkerStartError(RuntimeError):
    """A worker failed to join or to load its shard (the message says which rank and why)."""


class WorkerSet:
    """Ranks 1..tp-1 as child processes (`python -m pagedinfer.engine.parallel.worker`), one
    duplex connection each. Plain subprocesses rather than multiprocessing children: rank 0 may
    itself be a daemonic process (the engine-core process), which multiprocessing forbids to
    have children. Each child reads its spec and the connection's key from stdin, connects
    back, and exits when that connection closes."""

    def __init__(self, specs: list[WorkerSpec], exit_grace_s: float = 3.0) -> None:
        self.exit_grace_s = exit_grace_s
        authkey = os.urandom(32)
        self.procs: list[subprocess.Popen] = []
        self.conns = []
        with Listener(("127.0.0.1", 0), authkey=authkey) as listener:
            for spec in specs:
                proc = subprocess.Popen(
                    [sys.executable, "-P", "-m", "pagedinfer.engine.parallel.worker"], stdin=subprocess.PIPE
                )
                proc.stdin.write(pickle.dumps(WorkerLaunch(spec, listener.address, authkey)))
                proc.stdin.close()
                self.procs.append(proc)
            by_rank = {}
            deadline = time.monotonic() + CONNECT_TIMEOUT_S
            try:
                for _ in specs:
                    conn = self._accept(listener, deadline)
                    by_rank[conn.recv()] = conn  # the worker's first message: its rank
            except BaseException:  # one failed to join: the others must not linger
                for proc in self.procs:
                    proc.kill()
                    proc.wait()
                raise
            self.conns = [by_rank[spec.rank] for spec in specs]
        self.dead_reason: str | None = None
        self._is_closing = False
        atexit.register(self.close)  # an engine nobody closed: stop its workers with the process
        self._listeners: list[Callable[[str], None]] = []
        self._lock = threading.Lock()

    def _accept(self, listener: Listener, deadline: float):
        """The next worker's connection; WorkerStartError when a worker exits before connecting
        or none connects by `deadline`."""
        result: list = []
        thread = threading.Thread(target=lambda: result.append(listener.accept()), daemon=True)
        thread.start()
        while not result:
            thread.join(0.1)
            if not result and time.monotonic() > deadline:
                raise WorkerStartError(
                    f"tensor-parallel workers did not connect within {CONNECT_TIMEOUT_S:.0f} s"
                )
            gone = [p for p in self.procs if p.poll() is not None]
            if gone and not result:
                raise WorkerStartError(
                    f"tensor-parallel worker pid {gone[0].pid} exited with code {gone[0].returncode} before connecting"
                )
        return result[0]

    def wait_loaded(self, timeout_s: float) -> None:
        """Until every worker loaded its shard; WorkerStartError when one failed or exited."""
        deadline = time.monotonic() + timeout_s
        pending = dict(zip(self.conns, self.procs, strict=True))
        while pending:
            if time.monotonic() > deadline:
                raise WorkerStartError(
                    f"{len(pending)} tensor-parallel workers not loaded after {timeout_s:.0f} s"
                )
            for conn in wait(list(pending), timeout=0.5):
                proc = pending.pop(conn)
                try:
                    kind, detail = conn.recv()
                except EOFError:
                    kind, detail = "failed", f"pid {proc.pid} exited with code {proc.wait(5.0)}"
                if kind != "loaded":
                    raise WorkerStartError(f"tensor-parallel worker failed: {detail}")
        for proc in self.procs:
            threading.Thread(
                target=self._watch, args=(proc,), name="pagedinfer-tp-watcher", daemon=True
            ).start()

    def send(self, msg: object) -> None:
        """The same message to every worker; EngineDeadError once one is gone."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        try:
            for conn in self.conns:
                conn.send(msg)
        except OSError as exc:  # BrokenPipeError: the worker exited since the watcher last looked
            self._die(f"a tensor-parallel worker is gone ({exc})")
            raise EngineDeadError(self.dead_reason) from exc

    def add_death_listener(self, callback: Callable[[str], None]) -> None:
        with self._lock:
            dead = self.dead_reason
            if dead is None:
                self._listeners.append(callback)
        if dead is not None:
            callback(dead)

    def _watch(self, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self._is_closing:
            self._die(f"tensor-parallel worker pid {proc.pid} exited with code {code}")

    def _die(self, reason: str) -> None:
        with self._lock:
            if self.dead_reason is not None:
                return
            self.dead_reason = reason
            listeners, self._listeners = self._listeners, []
        logger.error(
            "%s: the engine is going down (exit %d in %.0f s)",
            reason,
            EXIT_CODE_WORKER_DIED,
            self.exit_grace_s,
        )
        for callback in listeners:
            callback(reason)
        threading.Thread(target=self._exit_later, name="pagedinfer-tp-exit", daemon=True).start()

    def _exit_later(self) -> None:
        # Long enough for health checks to see 503; then no collective can keep the process up.
        time.sleep(self.exit_grace_s)
        logging.shutdown()
        os._exit(EXIT_CODE_WORKER_DIED)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every worker (StopCall), then join; kill what does not exit in time. Idempotent."""
        if self._is_closing:
            return
        self._is_closing = True
        atexit.unregister(self.close)
        for conn in self.conns:
            try:
                conn.send(StopCall())
            except OSError:
                logger.info("worker pipe already closed at shutdown")
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel worker pid %d did not stop in time: killing it", proc.pid)
                proc.kill()
                proc.wait(5.0)
        for conn in self.conns:
            conn.close()
