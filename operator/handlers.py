"""Kopf handlers: thin adapters from Kopf's causes to `reconcile` and `refresh_stats`.

- the CR's create/update/resume handlers reconcile with Kopf's retries (TemporaryError with
  exponential backoff on API errors; an unrealisable spec is reported and not retried);
- an event handler per owned kind reconciles the owner on every change or deletion, so drift is
  repaired within seconds and status follows the Deployment;
- a timer resyncs everything at a slow interval, another refreshes live stats.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from pagedinfer.operator import resources as res
from pagedinfer.operator.builders.meta import ENGINE_LABEL, MANAGED_BY
from pagedinfer.operator.config import OperatorConfig
from pagedinfer.operator.errors import ApiError
from pagedinfer.operator.k8s import KubeClient, load_configuration
from pagedinfer.operator.metrics import MetricsServer
from pagedinfer.operator.reconcile import OperatorContext, reconcile, refresh_stats
from pagedinfer.operator.spec import GROUP, PLURAL, VERSION

CR = (GROUP, VERSION, PLURAL)
MANAGED = {"app.kubernetes.io/managed-by": MANAGED_BY}


def configure_settings(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    """Kopf's bookkeeping in annotations of our own group; only warnings become Events."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{GROUP}/finalizer"  # timers need one to stop cleanly
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = MANAGED_BY
    settings.peering.name = MANAGED_BY
    settings.networking.error_backoffs = (1, 2, 4, 8, 16, 30)
    for kind in res.OWNED:
        settings.watching.label_selectors[selector(kind)] = f"app.kubernetes.io/managed-by={MANAGED_BY}"


def selector(kind: res.Resource) -> tuple[str, ...]:
    """Kopf's resource selector: (group, version, plural), or (version, plural) for the core API."""
    return (kind.group, kind.version, kind.plural) if kind.group else (kind.version, kind.plural)


def backoff(retry: int, config: OperatorConfig) -> float:
    return float(min(config.max_backoff_seconds, 2 ** min(retry, 10)))


def _ctx(memo: Any) -> OperatorContext:
    return memo.ctx


async def _reconcile_with_retries(memo: Any, body: Any, trigger: str, retry: int, logger: Any) -> None:
    ctx = _ctx(memo)
    try:
        outcome = await reconcile(ctx, body, trigger)
    except ApiError as exc:
        if exc.is_retryable:
            raise kopf.TemporaryError(
                f"API error, retrying: {exc}", delay=backoff(retry, ctx.config)
            ) from exc
        raise kopf.PermanentError(f"API rejected a request: {exc}") from exc
    if outcome.error is not None:
        # Reported in status and an Event; a spec change (or the resync timer) tries again.
        logger.warning("spec cannot be realised: %s: %s", outcome.error.reason, outcome.error.message)


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    """Declare every handler on `registry` (the default one for `kopf run`, a fresh one in tests)."""

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
        configure_settings(settings, config)
        configuration = getattr(memo, "kube_configuration", None) or await load_configuration()
        memo.ctx = OperatorContext(config=config, client=KubeClient(configuration))
        memo.metrics_server = None
        if config.metrics_port:
            memo.metrics_server = MetricsServer(memo.ctx.metrics, config.metrics_port)
            await memo.metrics_server.start()

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: Any, **_: Any) -> None:
        if getattr(memo, "metrics_server", None) is not None:
            await memo.metrics_server.stop()
        if getattr(memo, "ctx", None) is not None:
            await memo.ctx.client.close()
            await memo.ctx.scraper.close()

    @kopf.index(*CR, id="engine_index", registry=registry)
    def engine_index(namespace: str, name: str, body: Any, **_: Any) -> dict[tuple[str, str], Any]:
        return {(namespace, name): _snapshot(body)}

    @kopf.on.resume(*CR, id="reconcile", registry=registry)
    @kopf.on.create(*CR, id="reconcile", registry=registry)
    @kopf.on.update(*CR, field="spec", id="reconcile", registry=registry)
    async def engine_changed(body: Any, retry: int, memo: Any, logger: Any, **_: Any) -> None:
        await _reconcile_with_retries(memo, body, "spec", retry, logger)

    @kopf.on.delete(*CR, id="forget", optional=True, registry=registry)
    async def engine_deleted(namespace: str, name: str, memo: Any, **_: Any) -> None:
        # Owned objects go with the CR through their owner references (garbage collection).
        _ctx(memo).forget(namespace, name)

    @kopf.timer(
        *CR,
        interval=config.resync_seconds,
        initial_delay=config.resync_seconds,
        id="resync",
        registry=registry,
    )
    async def resync(body: Any, retry: int, memo: Any, logger: Any, **_: Any) -> None:
        await _reconcile_with_retries(memo, body, "resync", retry, logger)

    if config.enable_stats:

        @kopf.timer(*CR, interval=config.stats_seconds, id="stats", registry=registry)
        async def stats(body: Any, memo: Any, **_: Any) -> None:
            await refresh_stats(_ctx(memo), body)

    for kind in res.OWNED:
        _register_owned(registry, kind)


def _register_owned(registry: kopf.OperatorRegistry, kind: res.Resource) -> None:
    @kopf.on.event(*selector(kind), labels=MANAGED, id=f"owned-{kind.plural}", registry=registry)
    async def owned_changed(
        type: str | None, body: Any, namespace: str, memo: Any, logger: Any, engine_index: Any, **_: Any
    ) -> None:
        owner = (body.get("metadata", {}).get("labels") or {}).get(ENGINE_LABEL)
        found = list(engine_index.get((namespace, owner), [])) if owner else []
        if not found:
            return  # its CR is gone: garbage collection removes it, nothing to repair
        ctx = _ctx(memo)
        if type != "DELETED" and ctx.is_own_echo(kind.kind, body):
            return  # the watch echo of our own write: nothing changed since
        engine = found[-1]
        if type == "DELETED":
            engine = await ctx.client.get(res.INFERENCE_ENGINE, namespace, owner)
            if engine is None or engine["metadata"].get("deletionTimestamp"):
                return
        try:
            await reconcile(ctx, engine, f"{kind.kind}/{type or 'LISTED'}")
        except ApiError as exc:
            # No retries for watch events: the next event or the resync timer repairs it.
            logger.warning("reconcile of %s/%s after a %s event failed: %s", namespace, owner, kind.kind, exc)


def _snapshot(body: Any) -> dict[str, Any]:
    import copy

    return copy.deepcopy(dict(body))
