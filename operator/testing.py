"""Run the operator in-process against kmock (tests and bench/operator.py; needs the dev extras).

kmock emulates the API as an in-memory JSON store; `Emulator` adds what a real API server
does and the operator relies on: uid/resourceVersion/generation/creationTimestamp, JSON-patch
(with 422 on a failed `test`), the status subresource, generateName and garbage collection of
dependents through owner references.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import functools
import itertools
import json
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

import aiohttp.test_utils
import aiohttp.web
import attrs
import kmock
import kopf
from kmock._internal import enums
from kubernetes_asyncio.client import Configuration

from pagedinfer.operator import resources as res
from pagedinfer.operator.config import OperatorConfig
from pagedinfer.operator.handlers import register
from pagedinfer.operator.spec import GROUP, KIND, PLURAL, VERSION

_WITH_STATUS = {(GROUP, VERSION, PLURAL)}


def _merge_diff(old: Any, new: Any) -> Any:
    """A merge patch turning `old` into `new` (None removes a key)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return copy.deepcopy(new)
    out: dict[str, Any] = {k: None for k in old if k not in new}
    for key, value in new.items():
        if key not in old:
            out[key] = copy.deepcopy(value)
        elif old[key] != value:
            out[key] = _merge_diff(old[key], value)
    return out


def _json_patch(doc: Any, ops: list[dict[str, Any]]) -> Any:
    """RFC 6902 subset (add, replace, remove, test); raises ValueError on a failed test."""
    doc = copy.deepcopy(doc)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent = doc
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent.setdefault(part, {})
        last = parts[-1] if parts else None
        if op["op"] == "test":
            current = parent[int(last)] if isinstance(parent, list) else parent.get(last)
            if current != op.get("value"):
                raise ValueError(f"test failed at {op['path']}")
        elif op["op"] in ("add", "replace"):
            if isinstance(parent, list):
                index = len(parent) if last == "-" else int(last)
                parent.insert(index, op["value"]) if op["op"] == "add" else parent.__setitem__(
                    index, op["value"]
                )
            else:
                parent[last] = op["value"]
        elif op["op"] == "remove":
            del parent[int(last) if isinstance(parent, list) else last]
    return doc


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator plus the API-server behaviour listed in the module docstring."""

    _versions: Any = attrs.field(factory=lambda: itertools.count(1000), init=False)
    namespaces: set[str] = attrs.field(factory=lambda: {"default"})  # served at /api/v1/namespaces
    num_writes: int = attrs.field(default=0, init=False)  # object-modifying requests served
    watched: set[str] = attrs.field(factory=set, init=False)  # plurals with a watch-stream opened

    def is_watching(self, plural: str) -> bool:
        """Whether a watch-stream on this resource has been opened."""
        return plural in self.watched

    def _stamp(self) -> str:
        return str(next(self._versions))

    def _current(self, request: kmock.Request) -> dict[str, Any] | None:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return copy.deepcopy(dict(self.objects[key].raw))

    def _on_create(self, request: kmock.Request) -> kmock.Request:
        data = copy.deepcopy(request.data)
        meta = data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        meta.setdefault("namespace", request.namespace)
        meta["uid"] = str(uuid.uuid4())
        meta["resourceVersion"] = self._stamp()
        meta["generation"] = 1
        meta["creationTimestamp"] = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        if (request.resource.group, request.resource.version, request.resource.plural) in _WITH_STATUS:
            data.pop("status", None)
        object.__setattr__(request, "data", data)  # the request is frozen; kmock matches it by identity
        return request

    def _on_update(self, request: kmock.Request, current: dict[str, Any]) -> kmock.Request:
        data = request.data
        if isinstance(data, list):  # JSON patch: turn it into the equivalent merge patch
            data = _merge_diff(current, _json_patch(current, data))
        data = copy.deepcopy(data)
        has_status = (
            request.resource.group,
            request.resource.version,
            request.resource.plural,
        ) in _WITH_STATUS
        if request.subresource == "status":
            data = {"status": data.get("status")}
        elif has_status:
            data.pop("status", None)
        if "spec" in data and _apply_merge(current.get("spec"), data["spec"]) != current.get("spec"):
            data.setdefault("metadata", {})["generation"] = int(current["metadata"].get("generation", 1)) + 1
        data.setdefault("metadata", {})["resourceVersion"] = self._stamp()
        object.__setattr__(request, "data", data)  # the request is frozen; kmock matches it by identity
        return request

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # kmock 0.8 cannot parse the cluster-scoped /api/v1/namespaces that Kopf's namespace
        # observer lists and watches when it serves a set of namespaces.
        if raw_request.path.rstrip("/") == "/api/v1/namespaces" and raw_request.method == "GET":
            return await self._serve_namespaces(raw_request)
        # kmock matches each request against its whole request history (O(n) per request): keep
        # only a short tail so long runs (the benchmark) do not slow down quadratically.
        if len(self._requests) > 256:
            del self._requests[:-32]
        return await super().__call__(raw_request)

    async def _serve_namespaces(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        names = sorted(
            {ns for (_, ns, _), o in self.objects.items() if ns and not o.deleted} | self.namespaces
        )
        items = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}} for n in names]
        if raw_request.query.get("watch") != "true":
            return aiohttp.web.json_response(
                {"kind": "NamespaceList", "metadata": {"resourceVersion": "1"}, "items": items}
            )
        response = aiohttp.web.StreamResponse()
        await response.prepare(raw_request)
        for item in items:
            await response.write(json.dumps({"type": "ADDED", "object": item}).encode() + b"\n")
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await asyncio.sleep(3600)  # an idle watch; the client closes it
        return response

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if request.resource is not None and request.action == enums.action.WATCH:
            self.watched.add(request.resource.plural)
        if str(request.method.value).upper() in ("POST", "PUT", "PATCH", "DELETE"):
            self.num_writes += 1
        if request.resource is not None and isinstance(request.data, (dict, list)):
            if request.action == enums.action.CREATE and isinstance(request.data, dict):
                request = self._on_create(request)
            elif request.action == enums.action.UPDATE and request.name is not None:
                current = self._current(request)
                if current is not None:
                    try:
                        request = self._on_update(request, current)
                    except (ValueError, KeyError, IndexError) as exc:
                        return _status_response(422, "Invalid", str(exc))
        uid = None
        is_change = request.action in (enums.action.DELETE, enums.action.UPDATE)
        if request.resource is not None and is_change and request.name:
            uid = ((self._current(request) or {}).get("metadata") or {}).get("uid")
        response = await super()._handle(request)
        if request.action == enums.action.CREATE and isinstance(request.data, dict):
            await self._collect_orphan(request)
        # Deleted now (directly, or by a patch that released the last finalizer): collect dependents.
        if uid is not None and self._current(request) is None:
            await self._collect_garbage({uid})
        return response

    async def _collect_orphan(self, request: kmock.Request) -> None:
        """A new object whose owner is already gone is collected too (the API server's GC would)."""
        refs = (request.data.get("metadata") or {}).get("ownerReferences") or []
        if not refs:
            return
        alive = {(o.raw.get("metadata") or {}).get("uid") for _, o in self.objects.items() if not o.deleted}
        if not any(r.get("uid") in alive for r in refs):
            await self._collect_garbage({r.get("uid") for r in refs})

    async def _collect_garbage(self, uids: set[str]) -> None:
        """Delete dependents of deleted owners, transitively (background propagation)."""
        while uids:
            found: set[str] = set()
            for (resource, _ns, _name), obj in list(self.objects.items()):
                if obj.deleted:
                    continue
                refs = (obj.raw.get("metadata") or {}).get("ownerReferences") or []
                if any(r.get("uid") in uids for r in refs):
                    raw = copy.deepcopy(dict(obj.raw))
                    obj.delete()
                    await self._buses[resource].put({"type": "DELETED", "object": raw})
                    found.add(raw["metadata"].get("uid"))
            uids = found - {None}


def _apply_merge(base: Any, patch: Any) -> Any:
    if not isinstance(patch, dict) or not isinstance(base, dict):
        return patch
    out = dict(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _apply_merge(base.get(key), value)
    return out


def _status_response(code: int, reason: str, message: str) -> aiohttp.web.StreamResponse:
    body = {
        "apiVersion": "v1",
        "kind": "Status",
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }
    return aiohttp.web.json_response(body, status=code)


def mock_server(handler: Emulator) -> kmock.Server:
    """kmock's HTTP server, cancelling a request's handler when its client goes away (otherwise
    kmock's endless watch handlers outlive the operator, and Kopf waits 5 s for them on exit)."""
    factory = functools.partial(aiohttp.test_utils.RawTestServer, handler_cancellation=True)
    return kmock.Server(handler, server_cls=factory)


def declare_resources(server: Emulator, *, with_service_monitor: bool) -> None:
    """Discovery for the built-in kinds, the InferenceEngine CRD and, optionally, ServiceMonitors."""
    server.resources.load_bundled()
    server.resources[f"{GROUP}/{VERSION}/{PLURAL}"] = kmock.ResourceInfo(
        kind=KIND,
        singular=KIND.lower(),
        namespaced=True,
        shortnames={"ie"},
        verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
        subresources={"status", "scale"},
    )
    if with_service_monitor:
        add_service_monitor_crd(server)


def add_service_monitor_crd(server: Emulator) -> None:
    sm = res.SERVICE_MONITOR
    server.resources[f"{sm.group}/{sm.version}/{sm.plural}"] = kmock.ResourceInfo(
        kind=sm.kind,
        singular="servicemonitor",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "delete"},
    )
    crd = res.CRD
    key = (kmock.resource(crd.group, crd.version, crd.plural), None, res.SERVICE_MONITOR_CRD_NAME)
    server.objects[key] = {
        "apiVersion": crd.api_version,
        "kind": crd.kind,
        "metadata": {"name": res.SERVICE_MONITOR_CRD_NAME, "uid": str(uuid.uuid4())},
    }


def test_config(**overrides: Any) -> OperatorConfig:
    """Short timers for tests; the metrics server off."""
    base = OperatorConfig(resync_seconds=3600, stats_seconds=3600, enable_stats=False, metrics_port=0)
    return dataclasses.replace(base, **overrides)


async def _wait_for_watches(memo: kopf.Memo, server: Emulator | None) -> None:
    """Until the startup handler made the API client and, on kmock, every watch-stream is open.

    kmock replays existing objects at the start of a watch as well as in the list before it, so
    an object created in between would reach Kopf twice with a stale version."""
    plurals = [PLURAL] + [r.plural for r in res.OWNED if r not in res.OPTIONAL_CRDS]
    for _ in range(400):
        started = getattr(memo, "ctx", None) is not None
        if started and (server is None or all(server.is_watching(p) for p in plurals)):
            return
        await asyncio.sleep(0.05)
    raise TimeoutError("operator startup did not finish")


@contextlib.asynccontextmanager
async def running_operator(
    configuration: Configuration,
    config: OperatorConfig,
    *,
    namespaces: tuple[str, ...] = (),
    use_kubeconfig: bool = False,
    server: Emulator | None = None,
) -> AsyncIterator[kopf.Memo]:
    """The operator as an asyncio task against `configuration.host` (kmock), or the kubeconfig's
    cluster with `use_kubeconfig`; yields its memo once its API client exists."""
    registry = kopf.OperatorRegistry()
    register(registry, config)

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        if use_kubeconfig:
            return kopf.login_with_kubeconfig(**kwargs)
        return kopf.ConnectionInfo(server=configuration.host, insecure=True)

    settings = kopf.OperatorSettings()
    settings.watching.reconnect_backoff = 0.05
    settings.watching.server_timeout = 30
    settings.queueing.idle_timeout = 30.0
    settings.queueing.exit_timeout = 0.5  # on stop, do not linger for idle per-object workers
    settings.background.instant_exit_timeout = 0.5
    settings.posting.enabled = False
    memo = kopf.Memo(kube_configuration=configuration)
    ready, stop = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(
        kopf.operator(
            registry=registry,
            settings=settings,
            memo=memo,
            standalone=True,
            clusterwide=not namespaces,
            namespaces=list(namespaces),
            ready_flag=ready,
            stop_flag=stop,
        )
    )
    try:
        await asyncio.wait_for(ready.wait(), timeout=20)
        await _wait_for_watches(memo, server)
        yield memo
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
            await asyncio.wait_for(task, timeout=15)
