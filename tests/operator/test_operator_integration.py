"""The operator end to end against an API server: kmock always, a real cluster when KUBECONFIG is set.

kmock-only cases (injecting a Deployment's status, installing the ServiceMonitor CRD, fake pods)
say so in their skip reason on a real cluster; everything else runs against both.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web
from kubernetes_asyncio.client import Configuration

from pagedinfer.operator import resources as res
from pagedinfer.operator.builders.meta import CONFIG_HASH_ANNOTATION
from pagedinfer.operator.config import OperatorConfig
from pagedinfer.operator.crd import build_crd
from pagedinfer.operator.errors import ApiError
from pagedinfer.operator.events import EVENT
from pagedinfer.operator.k8s import KubeClient, load_configuration
from pagedinfer.operator.reconcile import reconcile
from pagedinfer.operator.testing import (
    Emulator,
    add_service_monitor_crd,
    declare_resources,
    mock_server,
    running_operator,
)
from pagedinfer.operator.testing import test_config as make_config

pytestmark = pytest.mark.timeout(60)
SMOL = {"model": {"uri": "builtin://smollm2-135m", "servedName": "smollm2"}, "replicas": 2}


@dataclass
class Api:
    """One API server for a test: a client, a namespace, and kmock's emulator (None on a cluster)."""

    client: KubeClient
    configuration: Configuration
    namespace: str
    server: Emulator | None

    @property
    def is_kmock(self) -> bool:
        return self.server is not None

    def require_kmock(self, why: str) -> None:
        if not self.is_kmock:
            pytest.skip(f"kmock only: {why}")

    async def create_engine(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        body = {
            "apiVersion": "serving.pagedinfer.io/v1alpha1",
            "kind": "InferenceEngine",
            "metadata": {"name": name, "namespace": self.namespace},
            "spec": spec,
        }
        return await self.client.create(res.INFERENCE_ENGINE, body)

    async def get(self, resource: res.Resource, name: str) -> dict[str, Any] | None:
        return await self.client.get(resource, self.namespace, name)

    async def patch(
        self, resource: res.Resource, name: str, patch: dict[str, Any], sub: str | None = None
    ) -> None:
        await self.client.patch(resource, self.namespace, name, patch, subresource=sub)

    async def status(self, name: str) -> dict[str, Any]:
        return ((await self.get(res.INFERENCE_ENGINE, name)) or {}).get("status") or {}

    async def events(self, name: str) -> list[dict[str, Any]]:
        items = await self.client.list(EVENT, self.namespace, "")
        return [e for e in items if e.get("involvedObject", {}).get("name") == name]


async def eventually(check: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05) -> Any:
    """Poll an async predicate until it returns a truthy value."""
    deadline = time.monotonic() + timeout
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s (last: {result!r})")
        await asyncio.sleep(interval)


def _backends() -> list[Any]:
    reason = "needs KUBECONFIG pointing at a cluster with the CRD installed"
    return [
        "kmock",
        pytest.param(
            "cluster",
            marks=[pytest.mark.cluster, pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason=reason)],
        ),
    ]


@pytest.fixture(params=_backends())
async def api(request: pytest.FixtureRequest) -> AsyncIterator[Api]:
    if request.param == "kmock":
        async with Emulator() as server, mock_server(server):
            declare_resources(server, with_service_monitor=False)
            configuration = Configuration(host=str(server.url).rstrip("/"))
            # No keep-alive: a connection left open is a server task Kopf would wait 5 s for on exit.
            async with KubeClient(configuration, keepalive=False) as client:
                await client.request("GET", "/version")  # kmock starts its internal tasks now
                yield Api(client, configuration, "default", server)
        return
    configuration = await load_configuration()
    namespace = f"pagedinfer-test-{uuid.uuid4().hex[:6]}"
    async with KubeClient(configuration) as client:
        ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
        await client.request("POST", "/api/v1/namespaces", body=ns)
        # These tests drive the operator through API objects alone. Where the cluster has a node
        # (tests/e2e), engine pods would start, fail to pull their image and change the status
        # under the test: a zero-pod quota keeps them from being created, as on a bare control plane.
        quota = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "no-pods"}}
        quota["spec"] = {"hard": {"pods": "0"}}
        await client.request("POST", f"/api/v1/namespaces/{namespace}/resourcequotas", body=quota)
        try:
            await client.request(
                "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", body=build_crd()
            )
        except ApiError as exc:
            if exc.status != 409:  # already installed is fine
                raise
        await eventually(lambda: _crd_served(client, namespace), timeout=30)
        try:
            yield Api(client, configuration, namespace, None)
        finally:
            # The in-process operators are gone by now; their finalizers would keep the namespace
            # Terminating (and its engines visible to every later operator) forever.
            for engine in await client.list(res.INFERENCE_ENGINE, namespace, ""):
                patch = {"metadata": {"finalizers": None}}
                with contextlib.suppress(ApiError):
                    await client.patch(res.INFERENCE_ENGINE, namespace, engine["metadata"]["name"], patch)
            await client.request("DELETE", f"/api/v1/namespaces/{namespace}")


def operator(api: Api, config: OperatorConfig | None = None, **kwargs: Any) -> Any:
    if not api.is_kmock:  # a shared cluster: other tests' engines are not this operator's business
        kwargs.setdefault("namespaces", (api.namespace,))
    return running_operator(
        api.configuration,
        config or make_config(),
        use_kubeconfig=not api.is_kmock,
        server=api.server,
        **kwargs,
    )


async def owned(api: Api, name: str) -> dict[str, bool]:
    kinds = {
        "pvc": (res.PVC, f"{name}-model-cache"),
        "svc": (res.SERVICE, name),
        "deploy": (res.DEPLOYMENT, name),
    }
    kinds |= {"pdb": (res.PDB, name), "hpa": (res.HPA, name)}
    return {k: (await api.get(r, n)) is not None for k, (r, n) in kinds.items()}


async def test_create_renders_owned_objects_and_status(api: Api):
    spec = SMOL | {"modelCache": {"size": "1Gi"}}
    async with operator(api):
        cr = await api.create_engine("smol", spec)
        await eventually(lambda: _all(owned(api, "smol"), ["pvc", "svc", "deploy", "pdb"]))
        assert not (await owned(api, "smol"))["hpa"]
        for resource, name in [
            (res.DEPLOYMENT, "smol"),
            (res.SERVICE, "smol"),
            (res.PVC, "smol-model-cache"),
        ]:
            obj = await api.get(resource, name)
            assert obj["metadata"]["ownerReferences"][0]["uid"] == cr["metadata"]["uid"]
        status = await eventually(lambda: _status_with(api, "smol", "endpoints"))
        assert status["observedGeneration"] == 1
        assert (
            status["selector"] == "app.kubernetes.io/instance=smol,app.kubernetes.io/name=pagedinfer-engine"
        )
        assert status["servedModelName"] == "smollm2"
        assert status["endpoints"]["grpc"].endswith(":50051")
        assert status["phase"] in ("Pending", "Loading")


async def test_noop_reconcile_makes_no_writes(api: Api):
    async with operator(api, make_config(resync_seconds=0.3)) as memo:
        await api.create_engine("smol", SMOL)
        await eventually(lambda: _all(owned(api, "smol"), ["svc", "deploy", "pdb"]))
        if not api.is_kmock:  # the world must stop changing first: the quota refusing the pods
            # (the api fixture's zero-pod quota) reaches the Deployment, then the status (phase Failed)
            await eventually(lambda: _status_where(api, "smol", lambda s: s.get("phase") == "Failed"), 30)
        await asyncio.sleep(1.0)  # let the watch events of our own writes settle
        before = memo.ctx.client.num_writes
        outcome = await reconcile(memo.ctx, await api.get(res.INFERENCE_ENGINE, "smol"), "test")
        assert (
            outcome.num_writes == 0
            and outcome.actions
            and set(outcome.actions.values()) == {outcome.actions["Service"]}
        )
        if api.is_kmock:
            kmock_writes = api.server.num_writes
        await asyncio.sleep(1.5)  # several resync timer ticks
        assert memo.ctx.client.num_writes == before
        if api.is_kmock:
            assert api.server.num_writes == kmock_writes  # Kopf's own writes included


async def test_spec_update_in_place(api: Api):
    async with operator(api):
        await api.create_engine("smol", SMOL | {"scheduling": {"priorityClassName": "high"}})
        first = await eventually(lambda: api.get(res.DEPLOYMENT, "smol"))
        old_hash = first["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]
        new_spec = {"engine": {"maxNumSeqs": 64}, "replicas": 3, "scheduling": {"priorityClassName": None}}
        await api.patch(res.INFERENCE_ENGINE, "smol", {"spec": new_spec})

        async def rolled() -> dict[str, Any] | None:
            dep = await api.get(res.DEPLOYMENT, "smol")
            args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
            return dep if "64" in args and dep["spec"]["replicas"] == 3 else None

        dep = await eventually(rolled)
        assert dep["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION] != old_hash
        assert "priorityClassName" not in dep["spec"]["template"]["spec"]
        status = await eventually(
            lambda: _status_where(api, "smol", lambda s: s.get("observedGeneration") == 2)
        )
        assert status["ready"].endswith("/3")


async def test_drift_is_repaired_from_watch_events(api: Api):
    async with operator(api):  # resync timer at an hour: only watch events can repair
        await api.create_engine("smol", SMOL)
        dep = await eventually(lambda: api.get(res.DEPLOYMENT, "smol"))
        good_image = dep["spec"]["template"]["spec"]["containers"][0]["image"]
        await eventually(lambda: api.get(res.PDB, "smol"))
        container = dict(dep["spec"]["template"]["spec"]["containers"][0], image="evil:latest")
        await api.patch(res.DEPLOYMENT, "smol", {"spec": {"template": {"spec": {"containers": [container]}}}})
        await api.client.delete(res.SERVICE, api.namespace, "smol")
        await api.client.delete(res.PDB, api.namespace, "smol")

        async def repaired() -> bool:
            dep = await api.get(res.DEPLOYMENT, "smol")
            image = dep["spec"]["template"]["spec"]["containers"][0]["image"]
            found = await owned(api, "smol")
            return image == good_image and found["svc"] and found["pdb"]

        await eventually(repaired, timeout=10)


async def test_status_follows_the_deployment(api: Api):
    api.require_kmock("a real Deployment controller owns .status")
    async with operator(api):
        await api.create_engine("smol", SMOL)
        await eventually(lambda: api.get(res.DEPLOYMENT, "smol"))
        ready = {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2, "availableReplicas": 2}
        await api.patch(res.DEPLOYMENT, "smol", {"status": ready}, sub="status")
        status = await eventually(lambda: _status_where(api, "smol", lambda s: s.get("phase") == "Ready"))
        assert status["ready"] == "2/2" and status["readyReplicas"] == 2
        assert _cond(status, "Available")["status"] == "True"
        await api.patch(res.DEPLOYMENT, "smol", {"status": {"readyReplicas": 1}}, sub="status")
        status = await eventually(lambda: _status_where(api, "smol", lambda s: s.get("phase") == "Degraded"))
        assert {"status": "True", "reason": "ReplicasUnavailable"}.items() <= _cond(
            status, "Degraded"
        ).items()
        assert any(e["reason"] == "MinimumReplicasAvailable" for e in await api.events("smol"))


async def test_cr_deletion_collects_owned_objects(api: Api):
    async with operator(api):
        await api.create_engine("smol", SMOL)
        await eventually(lambda: _all(owned(api, "smol"), ["svc", "deploy", "pdb"]))
        await api.client.delete(res.INFERENCE_ENGINE, api.namespace, "smol")

        async def gone() -> bool:
            return not any((await owned(api, "smol")).values())

        await eventually(gone, timeout=30)
        await asyncio.sleep(0.5)
        assert await gone()  # and nothing resurrected them


async def test_service_monitor_absent_then_present(api: Api):
    api.require_kmock("installs the prometheus-operator CRD")
    spec = SMOL | {"monitoring": {"serviceMonitor": {"enabled": True}}}
    async with operator(api):
        await api.create_engine("smol", spec)
        status = await eventually(lambda: _status_with(api, "smol", "conditions"))
        status = await eventually(
            lambda: _status_where(api, "smol", lambda s: _cond(s, "MonitoringConfigured"))
        )
        assert _cond(status, "MonitoringConfigured")["reason"] == "ServiceMonitorCRDMissing"
        assert any(e["reason"] == "ServiceMonitorCRDMissing" for e in await api.events("smol"))
        assert await api.get(res.SERVICE_MONITOR, "smol") is None
        add_service_monitor_crd(api.server)
        spec["monitoring"]["serviceMonitor"]["labels"] = {"release": "prom"}
        await api.patch(res.INFERENCE_ENGINE, "smol", {"spec": spec})

        async def labelled() -> bool:
            sm = await api.get(res.SERVICE_MONITOR, "smol")
            return sm is not None and sm["metadata"]["labels"].get("release") == "prom"

        await eventually(labelled)
        status = await eventually(
            lambda: _status_where(
                api, "smol", lambda s: _cond(s, "MonitoringConfigured").get("status") == "True"
            )
        )


async def test_invalid_spec_degrades_without_spinning(api: Api):
    async with operator(api):
        await api.create_engine("bad", {"model": {"uri": "s3://bucket/model"}})
        status = await eventually(lambda: _status_where(api, "bad", lambda s: s.get("phase") == "Failed"))
        assert _cond(status, "Degraded")["reason"] == "UnsupportedModelURI"
        assert "s3://bucket/model" in _cond(status, "Degraded")["message"]
        events = await eventually(lambda: api.events("bad"))
        assert any(e["type"] == "Warning" and e["reason"] == "UnsupportedModelURI" for e in events)
        assert await api.get(res.DEPLOYMENT, "bad") is None
        if api.is_kmock:
            writes = api.server.num_writes
            await asyncio.sleep(1.5)
            assert api.server.num_writes == writes  # no retry loop, no repeated Events
        await api.patch(res.INFERENCE_ENGINE, "bad", {"spec": {"model": {"uri": "builtin://smollm2-135m"}}})
        await eventually(lambda: api.get(res.DEPLOYMENT, "bad"))
        status = await eventually(
            lambda: _status_where(api, "bad", lambda s: _cond(s, "Degraded").get("status") == "False")
        )
        assert status["phase"] != "Failed"


async def test_schema_invalid_spec_is_caught_without_cel(api: Api):
    api.require_kmock("a real API server rejects it with the CRD's CEL rule")
    async with operator(api):
        await api.create_engine(
            "tp", {"model": {"uri": "builtin://smollm2-135m"}, "engine": {"tensorParallelSize": 2}}
        )
        status = await eventually(lambda: _status_where(api, "tp", lambda s: s.get("phase") == "Failed"))
        assert _cond(status, "Degraded")["reason"] == "InvalidSpec"
        assert "tensorParallelSize" in _cond(status, "Degraded")["message"]


async def test_autoscaler_owns_the_replica_count(api: Api):
    spec = SMOL | {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6}}
    async with operator(api):
        await api.create_engine("auto", spec)
        hpa = await eventually(lambda: api.get(res.HPA, "auto"))
        assert hpa["spec"]["maxReplicas"] == 6
        dep = await eventually(lambda: api.get(res.DEPLOYMENT, "auto"))
        assert dep["spec"]["replicas"] == 2  # started at the HPA's floor
        await api.patch(res.DEPLOYMENT, "auto", {"spec": {"replicas": 5}})  # what the HPA does
        await api.patch(res.INFERENCE_ENGINE, "auto", {"spec": {"engine": {"maxNumSeqs": 32}}})

        async def rolled() -> dict[str, Any] | None:
            dep = await api.get(res.DEPLOYMENT, "auto")
            return dep if "32" in dep["spec"]["template"]["spec"]["containers"][0]["args"] else None

        dep = await eventually(rolled)
        assert dep["spec"]["replicas"] == 5
        await api.patch(
            res.INFERENCE_ENGINE, "auto", {"spec": {"autoscaling": {"enabled": False}, "replicas": 1}}
        )
        await eventually(lambda: _gone(api, res.HPA, "auto"))
        await eventually(lambda: _deployment_replicas(api, "auto", 1))
        await eventually(lambda: _gone(api, res.PDB, "auto"))


async def test_watches_only_its_namespaces(api: Api):
    team = f"{api.namespace}-team-a"
    if api.is_kmock:
        api.server.namespaces.add(team)
    else:
        ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": team}}
        await api.client.request("POST", "/api/v1/namespaces", body=ns)
    try:
        async with operator(api, namespaces=(team,)):
            other = Api(api.client, api.configuration, team, api.server)
            await api.create_engine("ignored", SMOL)
            await other.create_engine("mine", SMOL)
            await eventually(lambda: other.get(res.DEPLOYMENT, "mine"))
            assert await api.get(res.DEPLOYMENT, "ignored") is None
            await api.client.delete(res.INFERENCE_ENGINE, team, "mine")  # its finalizer goes while we run
            await eventually(lambda: _gone(other, res.INFERENCE_ENGINE, "mine"))
    finally:
        if not api.is_kmock:
            await api.client.request("DELETE", f"/api/v1/namespaces/{team}")


async def test_live_stats_from_pod_metrics(api: Api, unused_tcp_port: int):
    api.require_kmock("fakes a ready pod on 127.0.0.1")
    exposition = (
        'pagedinfer_generation_tokens_per_second{model="smollm2"} 42.5\n'
        'pagedinfer_kv_cache_usage_ratio{model="smollm2"} 0.5\n'
        'pagedinfer_num_requests_waiting{model="smollm2"} 3\n'
        'pagedinfer_num_requests_running{model="smollm2"} 7\n'
    )

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=exposition)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", unused_tcp_port).start()
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "smol-abc",
            "namespace": api.namespace,
            "labels": {"app.kubernetes.io/name": "pagedinfer-engine", "app.kubernetes.io/instance": "smol"},
        },
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    try:
        await api.client.create(res.POD, pod)
        config = make_config(enable_stats=True, stats_seconds=0.3)
        async with operator(api, config):
            await api.create_engine("smol", SMOL | {"service": {"httpPort": unused_tcp_port}})
            status = await eventually(lambda: _status_with(api, "smol", "stats"))
            assert status["stats"] == {
                "tokensPerSecond": 42.5,
                "kvCacheUsagePercent": 50,
                "numRequestsWaiting": 3,
                "numRequestsRunning": 7,
                "numPodsScraped": 1,
            }
    finally:
        await runner.cleanup()


async def _crd_served(client: KubeClient, namespace: str) -> bool:
    try:
        await client.list(res.INFERENCE_ENGINE, namespace, "")
    except ApiError:
        return False
    return True


def _cond(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


async def _all(found: Any, keys: list[str]) -> bool:
    got = await found
    return all(got[k] for k in keys)


async def _status_with(api: Api, name: str, key: str) -> dict[str, Any] | None:
    status = await api.status(name)
    return status if status.get(key) else None


async def _status_where(
    api: Api, name: str, predicate: Callable[[dict[str, Any]], Any]
) -> dict[str, Any] | None:
    status = await api.status(name)
    return status if predicate(status) else None


async def _gone(api: Api, resource: res.Resource, name: str) -> bool:
    return await api.get(resource, name) is None


async def _deployment_replicas(api: Api, name: str, replicas: int) -> bool:
    dep = await api.get(res.DEPLOYMENT, name)
    return dep is not None and dep["spec"].get("replicas") == replicas
