"""One reconcile of one `InferenceEngine`: parse, render, apply, and write status if it changed.

Level-triggered and idempotent: the CR's handlers, its timer and every watch event of an owned
object call `reconcile`; with nothing to change it makes no writes at all.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import pydantic

from pagedinfer.operator import apply as applier
from pagedinfer.operator import resources as res
from pagedinfer.operator.builders import meta
from pagedinfer.operator.builders.deployment import RenderInput, initial_replicas
from pagedinfer.operator.builders.desired import Desired, desired_state
from pagedinfer.operator.builders.service import endpoints
from pagedinfer.operator.conditions import (
    FALSE,
    TRUE,
    Cond,
    ReplicaCounts,
    merge_conditions,
    now_iso,
    spec_error_conditions,
    transitions,
    workload_conditions,
)
from pagedinfer.operator.config import OperatorConfig
from pagedinfer.operator.errors import ApiError, SpecError
from pagedinfer.operator.events import post_event
from pagedinfer.operator.k8s import KubeClient
from pagedinfer.operator.metrics import OperatorMetrics
from pagedinfer.operator.pod_health import failed_startup, loading_pod_urls, pod_problem
from pagedinfer.operator.spec import InferenceEngineSpec
from pagedinfer.operator.stats import Scraper, aggregate, scrape_targets
from pagedinfer.operator.status import ConditionType, Phase

logger = logging.getLogger(__name__)


@dataclass
class EngineState:
    """Per-CR memory: a lock serialising its reconciles and the status last written."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_status: dict[str, Any] | None = None


@dataclass
class OperatorContext:
    """Everything handlers share (kept in Kopf's memo, never in module globals)."""

    config: OperatorConfig
    client: KubeClient
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    scraper: Scraper = field(default_factory=Scraper)
    engines: dict[tuple[str, str], EngineState] = field(default_factory=dict)
    # resourceVersion of each owned object as our last write left it: its watch event is our own
    # echo and needs no reconcile (a later version is someone else's change: drift or status).
    own_versions: dict[tuple[str, str, str], str] = field(default_factory=dict)
    workers: asyncio.Semaphore | None = None  # max_concurrent_reconciles, made on first use

    def slot(self) -> asyncio.Semaphore:
        if self.workers is None:
            self.workers = asyncio.Semaphore(self.config.max_concurrent_reconciles)
        return self.workers

    def is_own_echo(self, kind: str, body: Any) -> bool:
        meta_ = body.get("metadata") or {}
        key = (kind, meta_.get("namespace", ""), meta_.get("name", ""))
        version = meta_.get("resourceVersion")
        return version is not None and self.own_versions.get(key) == version

    def state(self, ref: meta.EngineRef) -> EngineState:
        return self.engines.setdefault((ref.namespace, ref.name), EngineState())

    def forget(self, namespace: str, name: str) -> None:
        self.engines.pop((namespace, name), None)
        owned_names = {name, meta.model_cache_name(meta.EngineRef(name, namespace, ""))}
        for key in [k for k in self.own_versions if k[1] == namespace and k[2] in owned_names]:
            del self.own_versions[key]


@dataclass(frozen=True)
class Outcome:
    """What one reconcile did."""

    actions: dict[str, applier.Action]
    status_written: bool
    error: SpecError | None = None

    @property
    def num_writes(self) -> int:
        return sum(a is not applier.Action.NONE for a in self.actions.values()) + int(self.status_written)


def parse_spec(body: Any) -> InferenceEngineSpec:
    """The CR's spec through the schema models; raises SpecError("InvalidSpec")."""
    try:
        return InferenceEngineSpec.model_validate(dict(body.get("spec") or {}))
    except pydantic.ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'spec'}: {e['msg']}" for e in exc.errors()[:5]
        )
        raise SpecError("InvalidSpec", problems) from exc


async def reconcile(ctx: OperatorContext, body: Any, trigger: str) -> Outcome:
    """Bring the owned objects and status of one CR in line with its spec (serialised per CR)."""
    ref = meta.EngineRef.from_body(body)
    if body["metadata"].get("deletionTimestamp"):
        # Being deleted: garbage collection removes the owned objects; recreating them would race it.
        return Outcome({}, False)
    state = ctx.state(ref)
    async with state.lock, ctx.slot():
        started = time.perf_counter()  # the work itself, not the wait for a slot
        try:
            outcome = await _reconcile(ctx, ref, body, state)
        except Exception as exc:
            ctx.metrics.reconciles.labels(trigger, "error").inc()
            ctx.metrics.errors.labels(type(exc).__name__).inc()
            raise
        finally:
            ctx.metrics.duration.observe(time.perf_counter() - started)
            ctx.metrics.last_reconcile.set(time.time())
    ctx.metrics.reconciles.labels(trigger, "degraded" if outcome.error else "ok").inc()
    return outcome


async def _reconcile(ctx: OperatorContext, ref: meta.EngineRef, body: Any, state: EngineState) -> Outcome:
    previous = _previous_status(body, state)
    try:
        inp = RenderInput(ref, parse_spec(body), ctx.config)
        items = desired_state(inp)
        actions, deployment, extra = await _apply_all(ctx, inp, items)
    except SpecError as exc:
        conds = spec_error_conditions(exc.reason, exc.message)
        status = _status(previous, Phase.FAILED, ref, conds, extra={})
        written = await _write_status(ctx, ref, state, previous, status)
        return Outcome({}, written, error=exc)
    counts = ReplicaCounts.of(deployment, initial_replicas(inp.spec))
    phase, conds = workload_conditions(deployment, counts)
    if deployment is not None and counts.ready < counts.desired:
        stuck = await _stuck_pods(ctx, inp)
        if stuck is not None:
            conds = [c for c in conds if c.type != stuck.type] + [stuck]
    extra_fields = {
        "replicas": counts.current,
        "readyReplicas": counts.ready,
        "updatedReplicas": counts.updated,
        "ready": f"{counts.ready}/{counts.desired}",
        "selector": meta.selector_string(ref),
        "servedModelName": inp.served_name,
        "endpoints": endpoints(inp),
    }
    if any(c.reason == f"{res.INFERENCE_POOL.kind}Ready" for c in extra):
        extra_fields["inferencePool"] = inp.ref.name
    status = _status(previous, phase, ref, conds + extra, extra=extra_fields)
    written = await _write_status(ctx, ref, state, previous, status)
    return Outcome(actions, written)


async def _stuck_pods(ctx: OperatorContext, inp: RenderInput) -> Cond | None:
    """Why pods that should serve do not: the Deployment only counts them, the pods say why
    (a missing image, a crash loop), and a running engine's /startup says a load failed."""
    pods = await ctx.client.list(res.POD, inp.ref.namespace, meta.selector_string(inp.ref))
    stuck = pod_problem(pods)
    if stuck is not None:
        return stuck
    urls = loading_pod_urls(pods, inp.spec.service.http_port)
    if not urls:
        return None
    reports = await asyncio.gather(*(ctx.scraper.startup_report(u) for u in urls.values()))
    return failed_startup(dict(zip(urls, reports, strict=True)))


async def _apply_all(
    ctx: OperatorContext, inp: RenderInput, items: list[Desired]
) -> tuple[dict[str, applier.Action], dict[str, Any] | None, list[Cond]]:
    actions: dict[str, applier.Action] = {}
    deployment: dict[str, Any] | None = None
    extra: list[Cond] = []
    for item in items:
        if item.resource in res.OPTIONAL_CRDS:
            item, cond = await _optional_kind(ctx, item)
            if cond is not None:
                extra.append(cond)
            if item is None:
                continue
        create_extra = None
        if item.resource is res.DEPLOYMENT and inp.spec.autoscaling.enabled:
            create_extra = {"spec": {"replicas": initial_replicas(inp.spec)}}
        try:
            action, live = await applier.apply(ctx.client, item, inp.ref.namespace, inp.ref.uid, create_extra)
        except ApiError as exc:
            if exc.is_retryable:
                raise
            await _undo_created(ctx, inp, actions, items)
            raise SpecError(
                "ApplyRejected", f"the API server refused {item.resource.kind} {item.name}: {exc.message}"
            ) from exc
        actions[item.resource.kind] = action
        if action is not applier.Action.NONE:
            ctx.metrics.writes.labels(item.resource.kind, action.value).inc()
            key = (item.resource.kind, inp.ref.namespace, item.name)
            version = ((live or {}).get("metadata") or {}).get("resourceVersion")
            if version is None:
                ctx.own_versions.pop(key, None)
            else:
                ctx.own_versions[key] = version
        if item.resource is res.DEPLOYMENT:
            deployment = live
    return actions, deployment, extra


async def _undo_created(
    ctx: OperatorContext, inp: RenderInput, actions: dict[str, applier.Action], items: list[Desired]
) -> None:
    """A refused write leaves no half-built engine: delete what this pass created before it."""
    for item in items:
        if actions.get(item.resource.kind) is applier.Action.CREATED:
            await ctx.client.delete(item.resource, inp.ref.namespace, item.name)
            ctx.metrics.writes.labels(item.resource.kind, applier.Action.DELETED.value).inc()


@dataclass(frozen=True)
class _OptionalKind:
    condition: ConditionType
    feature: str  # the spec field that asks for it
    provider: str  # who ships its CRD


_OPTIONAL = {
    res.SERVICE_MONITOR: _OptionalKind(
        ConditionType.MONITORING, "monitoring.serviceMonitor.enabled", "prometheus-operator"
    ),
    res.INFERENCE_POOL: _OptionalKind(
        ConditionType.ROUTING, "routing.inferencePool", "the Gateway API Inference Extension"
    ),
}


async def _optional_kind(ctx: OperatorContext, item: Desired) -> tuple[Desired | None, Cond | None]:
    """An owned object whose CRD the cluster may lack: applied when wanted and its CRD exists;
    else a condition saying why not."""
    kind = item.resource.kind
    info = _OPTIONAL[item.resource]
    has_crd = await ctx.client.crd_exists(res.OPTIONAL_CRDS[item.resource])
    if item.body is None:
        # Not wanted: remove one left from an earlier spec, if the kind exists at all.
        return (item if has_crd else None), None
    if not has_crd:
        msg = f"{info.feature} is set but the {kind} CRD ({info.provider}) is not installed"
        return None, Cond(info.condition.value, FALSE, f"{kind}CRDMissing", msg)
    return item, Cond(info.condition.value, TRUE, f"{kind}Ready", f"{kind} {item.name} applied")


def _previous_status(body: Any, state: EngineState) -> dict[str, Any]:
    if state.last_status is not None:
        return state.last_status
    return dict(body.get("status") or {})


def _status(
    previous: dict[str, Any], phase: Phase, ref: meta.EngineRef, conds: list[Cond], extra: dict[str, Any]
) -> dict[str, Any]:
    status = {k: v for k, v in previous.items() if k == "stats"}
    status.update(extra)
    status["phase"] = phase.value
    status["observedGeneration"] = ref.generation
    # An optional kind's condition goes when its feature is switched off (no condition is sent).
    sent = {c.type for c in conds}
    optional = {o.condition.value for o in _OPTIONAL.values()}
    kept = [c for c in previous.get("conditions") or [] if c.get("type") not in optional - sent]
    status["conditions"] = merge_conditions(kept, conds, ref.generation, now_iso())
    if phase is Phase.FAILED:
        status.setdefault("selector", meta.selector_string(ref))
    return status


async def _write_status(
    ctx: OperatorContext,
    ref: meta.EngineRef,
    state: EngineState,
    previous: dict[str, Any],
    status: dict[str, Any],
) -> bool:
    if _same_status(previous, status):
        state.last_status = previous
        return False
    patch: dict[str, Any] = {k: None for k in previous if k not in status and k != "stats"}
    patch.update(status)
    await ctx.client.patch(
        res.INFERENCE_ENGINE, ref.namespace, ref.name, {"status": patch}, subresource="status"
    )
    state.last_status = status
    await _post_transitions(ctx, ref, previous.get("conditions") or [], status["conditions"])
    return True


def _same_status(a: dict[str, Any], b: dict[str, Any]) -> bool:
    strip = lambda s: {  # noqa: E731
        **{k: v for k, v in s.items() if k != "conditions"},
        "conditions": [
            {k: v for k, v in c.items() if k != "lastTransitionTime"} for c in s.get("conditions") or []
        ],
    }
    return strip(a) == strip(b)


async def _post_transitions(
    ctx: OperatorContext, ref: meta.EngineRef, before: list[dict[str, Any]], after: list[dict[str, Any]]
) -> None:
    """One Event per meaningful transition: degraded, monitoring skipped, available."""
    for cond in transitions(before, after):
        kind, value = cond["type"], cond["status"]
        if (kind == ConditionType.DEGRADED.value and value == TRUE) or (
            kind in (ConditionType.MONITORING.value, ConditionType.ROUTING.value) and value == FALSE
        ):
            event_type = "Warning"
        elif kind == ConditionType.AVAILABLE.value and value == TRUE:
            event_type = "Normal"
        else:
            continue
        try:
            await post_event(ctx.client, ref, event_type, cond["reason"], cond["message"])
        except ApiError as exc:  # an Event is best effort: never fail the reconcile for it
            ctx.metrics.errors.labels("EventPostFailed").inc()
            logger.warning(
                "could not post event %s for %s/%s: %s", cond["reason"], ref.namespace, ref.name, exc
            )


async def refresh_stats(ctx: OperatorContext, body: Any) -> bool:
    """Scrape the ready pods and patch status.stats when the numbers changed; True if written."""
    ref = meta.EngineRef.from_body(body)
    try:
        spec = parse_spec(body)
    except SpecError:
        return False
    pods = await ctx.client.list(res.POD, ref.namespace, meta.selector_string(ref))
    samples = await ctx.scraper.scrape(scrape_targets(pods, spec.service.http_port))
    stats = aggregate(samples)
    state = ctx.state(ref)
    async with state.lock:
        previous = _previous_status(body, state)
        if previous.get("stats") == stats:
            return False
        await ctx.client.patch(
            res.INFERENCE_ENGINE, ref.namespace, ref.name, {"status": {"stats": stats}}, subresource="status"
        )
        state.last_status = {**previous, "stats": stats}
    return True
