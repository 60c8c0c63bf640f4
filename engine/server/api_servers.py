"""`pagedinfer serve --api-server-count N` (N > 1): N API-server processes in front of one core.

One API server parses, tokenizes and encodes every request on one event loop; with many
simultaneous streams that loop, not the engine, sets the pace (bench/NOTES.md, Serving). Here
the process `serve` started in becomes a launcher that serves nothing itself:

- it binds one HTTP listening socket per API server, all on --http-port with SO_REUSEPORT, and
  hands each its own (uvicorn's `serve(sockets=...)`): the kernel spreads new connections
  over the sockets by their address hash. One socket shared by all was tried first: uvloop
  (and asyncio) accept every queued connection per wake-up, so one process took a whole burst
  (16 of 16 measured). Binding in the launcher shows a bind error once, before anything
  starts, and connections wait in the backlog while the API servers start. A probe bind
  without SO_REUSEPORT first makes sure nothing listens there already (a SO_REUSEPORT listener
  of the same user, such as another launcher, would otherwise be joined silently);
- it reserves the gRPC port (`reserve_grpc_port`: a bound SO_REUSEPORT socket that never
  listens, held until the launcher exits): a port another program holds fails there, once,
  before anything starts, and --grpc-port 0 becomes one port. Every API server's gRPC server
  joins it (grpc.so_reuseport 1), so the kernel spreads gRPC connections over the processes as
  it does HTTP's. One channel is one connection, served by one process: a single client with
  one channel stays on one API server. Until the API servers bind, gRPC connections are refused;
- it makes the Prometheus multiprocess folder (PROMETHEUS_MULTIPROC_DIR, inherited by the API
  servers, which import prometheus_client after it is set) and removes it at exit;
- it spawns the engine core with one pipe per API server (shared_core.start_shared_core),
  then the N API servers (spawn context: fresh interpreters, no inherited threads or CUDA),
  each a whole `ServerProcess` (FastAPI app, metrics, AsyncEngine over a RemoteCore on its pipe).

Per-process behaviour: readiness, /startup, liveness and gRPC health (and reflection) answer
for the process that takes the probe or the connection; all follow the same core, so they agree
but for the moment each takes to hear of it. The waiting queue (--max-waiting-requests, 429 /
RESOURCE_EXHAUSTED beyond) is split: each API server admits up to max_waiting // N of its own
requests waiting in the core, so the core's own limit is never hit late, but one server may
refuse while another still has room. API keys are checked by every process alike.

SIGTERM/SIGINT to the launcher: forwarded once as SIGTERM to every API server, which drain as a
lone server does (readiness false, 503 for new requests, in-flight streams finish within
--drain-timeout) and exit; their pipes close, the core exits; the launcher exits 0 when every
API server did. A second signal is forwarded too (the API servers then exit without draining).
An API server that exits on its own stops the others (exit 1). If the launcher dies, the API
servers exit (they watch it) and so does the core.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import wait

from pagedinfer.engine.config import SERVER_LOG_FORMAT, EngineConfig, ServerConfig

logger = logging.getLogger("pagedinfer.server")
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # read by prometheus_client when it is imported


@dataclass(frozen=True)
class ApiServerSpec:
    """What one API-server process needs besides the configs."""

    index: int
    count: int


def bind_http_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` listening sockets on one port (SO_REUSEPORT), one per API server; port 0 takes
    a free port for the first and the rest join it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets: list[socket.socket] = []
    try:
        _check_port_free(family, host, port)
        for _ in range(count):
            sock = _reuseport_socket(family, host, port)
            sockets.append(sock)
            port = sock.getsockname()[1]
            sock.listen(2048)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise SystemExit(f"cannot bind HTTP to {host}:{port}: {exc}") from exc
    return sockets


def reserve_grpc_port(host: str, port: int) -> socket.socket:
    """A bound, never listening SO_REUSEPORT socket on the gRPC port, which the launcher holds
    while the API servers run: a port another program holds fails here, once, before anything
    starts, and port 0 becomes one port that every API server's gRPC server joins
    (grpc.so_reuseport 1). It takes no connections: only listening sockets are in the group the
    kernel picks from. Seen on Linux 6.18: a connection to the port with only this socket bound
    is refused (ECONNREFUSED); with two listeners beside it, 200 connections went 101 / 99 to
    the listeners (test_api_servers checks this on the machine it runs on)."""
    try:
        if host not in ("", "0.0.0.0", "::"):
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            _check_port_free(family, host, port)
            return _reuseport_socket(family, host, port, reuse_addr=False)
        # gRPC binds a wildcard host as one dual-stack [::] socket (0.0.0.0 without IPv6): so does
        # the reservation, which then fails wherever gRPC's own bind would.
        if _has_ipv6():
            _check_port_free(socket.AF_INET6, "::", port, is_dual_stack=True)
            return _reuseport_socket(socket.AF_INET6, "::", port, is_dual_stack=True, reuse_addr=False)
        _check_port_free(socket.AF_INET, "0.0.0.0", port)
        return _reuseport_socket(socket.AF_INET, "0.0.0.0", port, reuse_addr=False)
    except OSError as exc:
        raise SystemExit(f"cannot bind gRPC to {host}:{port}: {exc}") from exc


def _check_port_free(family: socket.AddressFamily, host: str, port: int, is_dual_stack: bool = False) -> None:
    """Raise OSError if anything listens on the port, SO_REUSEPORT listeners of this user included:
    our own SO_REUSEPORT bind would silently join those (another launcher, any grpcio server,
    which sets SO_REUSEPORT by default) and split the traffic with them. A socket without
    SO_REUSEPORT cannot join them; SO_REUSEADDR lets it pass a previous run's TIME_WAIT."""
    if port == 0:
        return
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if is_dual_stack:
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        probe.bind((host, port))


def _reuseport_socket(
    family: socket.AddressFamily, host: str, port: int, is_dual_stack: bool = False, reuse_addr: bool = True
) -> socket.socket:
    """reuse_addr False for the gRPC reservation: it never listens, and a bound non-listening
    socket with SO_REUSEADDR lets any user's SO_REUSEADDR socket bind and listen beside it."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if reuse_addr:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if is_dual_stack:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _has_ipv6() -> bool:
    try:
        socket.socket(socket.AF_INET6, socket.SOCK_STREAM).close()
    except OSError:
        return False
    return True


def api_server_engine_config(config: EngineConfig, count: int) -> EngineConfig:
    """Each API server's share of the waiting queue: max_waiting // count, at least 1 (so a tiny
    limit still admits; the shares then add up to count, above a limit below count)."""
    scheduler = config.scheduler
    share = max(1, scheduler.max_waiting_requests // count)
    return dataclasses.replace(config, scheduler=dataclasses.replace(scheduler, max_waiting_requests=share))


def run_api_servers(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """The launcher: start the core and the API servers, forward signals, reap; the exit code."""
    from pagedinfer.engine.shared_core import start_shared_core

    logging.basicConfig(level=logging.INFO, format=SERVER_LOG_FORMAT)
    count = server_config.api_server_count
    assert count > 1, "one API server runs without a launcher (serve.run_server)"
    sockets = bind_http_sockets(server_config.host, server_config.http_port, count)
    try:
        grpc_reservation = reserve_grpc_port(server_config.host, server_config.grpc_port)
    except SystemExit:
        for sock in sockets:
            sock.close()
        raise
    # --grpc-port 0: the port the reservation took, for every API server to join.
    server_config = dataclasses.replace(server_config, grpc_port=grpc_reservation.getsockname()[1])
    signals, metrics_dir = None, None
    ctx = multiprocessing.get_context("spawn")
    try:
        signals = _SignalLatch()
        metrics_dir = tempfile.mkdtemp(prefix="pagedinfer-metrics-")
        os.environ[MULTIPROC_DIR_ENV] = metrics_dir  # before spawning: the children inherit it
        pipes = [ctx.Pipe(duplex=True) for _ in range(count)]
        core = start_shared_core(engine_config, [core_end for _, core_end in pipes])
        servers = []
        for index, ((conn, core_end), sock) in enumerate(zip(pipes, sockets, strict=True)):
            core_end.close()  # the core holds it: its exit must end the API server's pipe
            spec = ApiServerSpec(index, count)
            process = ctx.Process(
                target=api_server_main,
                args=(engine_config, server_config, spec, conn, sock),
                name=f"pagedinfer-api-server-{index}",
                daemon=True,
            )
            process.start()
            conn.close()  # the API server holds it: its exit must end the core's pipe
            sock.close()  # the API server holds it: its exit takes it out of the port's group
            servers.append(process)
        logger.info(
            "launcher (pid %d): engine core pid %d, API servers %s",
            os.getpid(),
            core.pid,
            [p.pid for p in servers],
        )
        code = _supervise(servers, signals, server_config.drain_timeout_seconds)
        core.join(30)  # every pipe closed: it leaves its loop
        if core.is_alive():
            logger.warning("engine core still running after every API server exited: killing it")
            core.kill()
            core.join(5)
        return code
    finally:
        if signals is not None:
            signals.restore()
        grpc_reservation.close()
        for sock in sockets:
            sock.close()  # (a no-op for those already handed over and closed)
        os.environ.pop(MULTIPROC_DIR_ENV, None)
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)


class _SignalLatch:
    """SIGTERM/SIGINT counted on the launcher's main thread (the supervise loop forwards them)."""

    def __init__(self) -> None:
        self.count = 0
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _on_signal(self, signum: int, _frame) -> None:
        self.count += 1
        logger.info("launcher: %s", signal.Signals(signum).name)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _supervise(servers: list, signals: _SignalLatch, drain_timeout: float) -> int:
    """Wait for the API servers to exit; forward each signal to them once; stop them all when
    one exits on its own. Returns 0 when every API server exited 0 after a stop signal."""
    num_forwarded, is_failed, deadline = 0, False, None
    while alive := [p for p in servers if p.exitcode is None]:
        if not is_failed and signals.count == 0 and len(alive) < len(servers):
            gone = [(p.name, p.exitcode) for p in servers if p.exitcode is not None]
            logger.error("API server exited on its own %s: stopping the others", gone)
            is_failed = True
        wanted = max(signals.count, 1 if is_failed else 0)
        if wanted > num_forwarded:
            for process in alive:
                _send_signal(process, signal.SIGTERM)
            num_forwarded = wanted
            deadline = deadline or time.monotonic() + drain_timeout + 30
        if deadline is not None and time.monotonic() > deadline:
            logger.error("API servers %s did not exit in time: killing them", [p.name for p in alive])
            for process in alive:
                process.kill()
            deadline = time.monotonic() + 5
        wait([p.sentinel for p in alive], timeout=0.2)  # a signal shows within one timeout
    codes = [p.exitcode for p in servers]
    logger.info("API servers exited with %s", codes)
    return 0 if not is_failed and all(code == 0 for code in codes) else 1


def _send_signal(process, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # exited meanwhile
        os.kill(process.pid, sig)


# ---- one API-server process ---------------------------------------------------------------------
def api_server_main(
    engine_config: EngineConfig, server_config: ServerConfig, spec: ApiServerSpec, conn, sock
) -> None:
    """Entry point of a spawned API server: one `ServerProcess` on the launcher's socket."""
    logging.basicConfig(
        level=logging.INFO, format=SERVER_LOG_FORMAT.replace("%(name)s", f"%(name)s[{spec.index}]")
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the launcher forwards it
    _exit_with_launcher()
    from pagedinfer.engine.server.engine_handle import shared_core_loader
    from pagedinfer.engine.server.serve import ServerProcess, event_loop_factory

    config = api_server_engine_config(engine_config, spec.count)

    async def main() -> int:  # grpc.aio and the events bind to the loop the runner makes
        server = ServerProcess(config, server_config, shared_core_loader(conn), spec.index, [sock])
        return await server.run()

    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        code = runner.run(main())
    sys.exit(code)


def _exit_with_launcher() -> None:
    """An API server never outlives its launcher (which may have been SIGKILLed)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        logger.error("the launcher process is gone: exiting")
        logging.shutdown()
        os._exit(1)

    threading.Thread(target=watch, name="pagedinfer-launcher-watch", daemon=True).start()
