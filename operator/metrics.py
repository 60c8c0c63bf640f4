"""The operator's own Prometheus metrics and its /metrics + /healthz HTTP server."""

from __future__ import annotations

import time

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)


class OperatorMetrics:
    """Every collector declared once, on a private registry (no process-global state)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.reconciles = Counter(
            "pagedinfer_operator_reconcile_total",
            "Reconciles by trigger and result",
            ["trigger", "result"],
            registry=self.registry,
        )
        self.errors = Counter(
            "pagedinfer_operator_reconcile_errors_total",
            "Failed reconciles by reason",
            ["reason"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "pagedinfer_operator_reconcile_duration_seconds",
            "Reconcile wall time",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.writes = Counter(
            "pagedinfer_operator_object_writes_total",
            "Owned-object writes by kind and action",
            ["kind", "action"],
            registry=self.registry,
        )
        self.engines = Gauge(
            "pagedinfer_operator_engines", "InferenceEngines being managed", registry=self.registry
        )
        self.last_reconcile = Gauge(
            "pagedinfer_operator_last_reconcile_timestamp_seconds",
            "Unix time of the last reconcile",
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsServer:
    """Serves /metrics and /healthz; healthz fails when the event loop has not ticked recently."""

    def __init__(self, metrics: OperatorMetrics, port: int, host: str = "0.0.0.0") -> None:
        self._metrics = metrics
        self._port = port
        self._host = host
        self._runner: web.AppRunner | None = None
        self.started_at = time.time()

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._serve_metrics)
        app.router.add_get("/healthz", self._serve_health)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self._host, self._port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _serve_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self._metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _serve_health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "uptimeSeconds": round(time.time() - self.started_at, 1)})
