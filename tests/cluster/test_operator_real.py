"""The operator against a real API server, running with the token of its chart's ServiceAccount.

The chart is installed namespaced (a Role in one namespace, the least it can be given); the
operator runs in-process under that token, so every call it makes meets real RBAC, admission,
CEL, the scale subresource and the garbage collector. No pods (a zero-pod quota, conftest.py).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster_tools import ROOT, Cli, CommandError, engine

from pagedinfer.operator import apply as applier
from pagedinfer.operator import reconcile as reconcile_module
from pagedinfer.operator import resources as res
from pagedinfer.operator.k8s import load_configuration
from pagedinfer.operator.testing import running_operator
from pagedinfer.operator.testing import test_config as make_config

pytestmark = pytest.mark.timeout(180)
SPEC = {
    "model": {"uri": "builtin://smollm2-135m", "servedName": "smollm2"},
    "replicas": 2,
    "routing": {"inferencePool": {"endpointPicker": {"name": "smollm2-epp"}}},
}
KINDS = ("deployment", "service", "poddisruptionbudget", "inferencepool")


@contextlib.asynccontextmanager
async def _operator_as(cli: Cli, namespace: str, tmp_path: Path, monkeypatch) -> AsyncIterator[Any]:
    """The operator chart installed for `namespace`, the operator running with its SA token."""
    release = f"op{uuid.uuid4().hex[:5]}"
    values = {"operator": {"allNamespaces": False, "watchNamespaces": [namespace]}}
    cli.helm("install", release, str(ROOT / "charts" / "pagedinfer-operator"), "-n", namespace, values=values)
    account = f"{release}-pagedinfer-operator"
    token = cli.kubectl("create", "token", account, "-n", namespace, "--duration=1h").strip()
    admin = yaml.safe_load(Path(cli.env["KUBECONFIG"]).read_text())
    cluster = admin["clusters"][0]["cluster"]
    ca = cluster.get("certificate-authority-data")
    ca_file = tmp_path / "ca.crt"
    if ca:
        ca_file.write_bytes(base64.b64decode(ca))
    else:
        ca_file.write_text(Path(cluster["certificate-authority"]).read_text())
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "real", "cluster": {"server": cluster["server"], "certificate-authority": str(ca_file)}}
        ],
        "users": [{"name": account, "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "real", "user": account, "namespace": namespace}}],
        "current-context": "sa",
    }
    path = tmp_path / "sa.kubeconfig"
    path.write_text(yaml.safe_dump(kubeconfig))
    monkeypatch.setenv("KUBECONFIG", str(path))
    configuration = await load_configuration()
    config = make_config(namespaces=(namespace,), resync_seconds=3600)
    try:
        async with running_operator(
            configuration, config, namespaces=(namespace,), use_kubeconfig=True
        ) as memo:
            yield memo
    finally:
        monkeypatch.setenv("KUBECONFIG", cli.env["KUBECONFIG"])
        cli.helm("uninstall", release, "-n", namespace)


async def until(check, timeout: float = 20.0) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = await asyncio.to_thread(check)
        if result:
            return result
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not met within {timeout} s (last: {result!r})")
        await asyncio.sleep(0.2)


def _forbidden(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if "403" in r.getMessage() or "Forbidden" in r.getMessage()
    ]


async def test_engine_lifecycle_as_the_charts_service_account(
    cli: Cli, crds: None, namespace: str, tmp_path: Path, monkeypatch, caplog
):
    caplog.set_level(logging.INFO)
    async with _operator_as(cli, namespace, tmp_path, monkeypatch) as memo:
        cli.apply(engine("smol", namespace, SPEC))
        owned = await until(
            lambda: (
                all(cli.get(k, "smol", namespace) for k in KINDS)
                and {k: cli.get(k, "smol", namespace) for k in KINDS}
            )
        )
        uid = cli.get("inferenceengine", "smol", namespace)["metadata"]["uid"]
        for kind, obj in owned.items():
            refs = obj["metadata"].get("ownerReferences") or []
            assert [r["uid"] for r in refs] == [uid], kind
        pool = owned["inferencepool"]["spec"]
        assert pool["selector"]["matchLabels"] == owned["deployment"]["spec"]["selector"]["matchLabels"]
        assert pool["targetPorts"] == [{"number": 8000}]
        assert pool["endpointPickerRef"]["name"] == "smollm2-epp"

        # Status while no pod can be created (the namespace's zero-pod quota, conftest.py):
        # truthful, in the printer columns too.
        status = await until(
            lambda: (
                (cli.get("inferenceengine", "smol", namespace) or {}).get("status", {}).get("inferencePool")
                and cli.get("inferenceengine", "smol", namespace)["status"].get("phase") == "Failed"
                and cli.get("inferenceengine", "smol", namespace)["status"]
            )
        )
        assert status["ready"] == "0/2"
        conds = {c["type"]: c for c in status["conditions"]}
        assert conds["Available"]["status"] == "False"
        assert conds["Degraded"]["reason"] == "ReplicaFailure" and "quota" in conds["Degraded"]["message"]
        assert conds["RoutingConfigured"]["status"] == "True"
        columns = cli.kubectl("get", "ie", "smol", "-n", namespace, "--no-headers").split()
        assert columns[1] == "0/2" and columns[2] == status["phase"] and columns[4] == "smollm2"

        # Drift: a deleted Service and an edited Deployment come back within seconds.
        cli.kubectl("delete", "service", "smol", "-n", namespace)
        cli.kubectl(
            "patch", "deployment", "smol", "-n", namespace, "--type=merge", "-p", '{"spec":{"replicas":5}}'
        )
        await until(lambda: cli.get("service", "smol", namespace))
        await until(lambda: cli.get("deployment", "smol", namespace)["spec"]["replicas"] == 2)

        # The scale subresource: kubectl scale drives the Deployment.
        cli.kubectl("scale", "ie/smol", "--replicas=3", "-n", namespace)
        await until(lambda: cli.get("deployment", "smol", namespace)["spec"]["replicas"] == 3)
        await until(lambda: cli.get("inferenceengine", "smol", namespace)["status"].get("ready") == "0/3")

        # A no-op resync makes no write at all (counted on the operator's own client).
        ctx = memo.ctx
        body = cli.get("inferenceengine", "smol", namespace)
        before = ctx.client.num_writes
        outcome = await reconcile_module.reconcile(ctx, body, "resync")
        assert outcome.num_writes == 0 and ctx.client.num_writes == before

        # Removing the routing block removes the pool and its status.
        cli.kubectl(
            "patch",
            "ie",
            "smol",
            "-n",
            namespace,
            "--type=json",
            "-p",
            '[{"op":"remove","path":"/spec/routing/inferencePool"}]',
        )
        await until(lambda: cli.get("inferencepool", "smol", namespace) is None)
        status = await until(
            lambda: (
                "inferencePool" not in cli.get("inferenceengine", "smol", namespace)["status"]
                and cli.get("inferenceengine", "smol", namespace)["status"]
            )
        )
        assert "RoutingConfigured" not in {c["type"] for c in status["conditions"]}

        # Deleting the CR: the garbage collector removes every owned object.
        cli.kubectl("delete", "ie", "smol", "-n", namespace, "--wait=false")
        await until(
            lambda: (
                not any(
                    cli.get(k, "smol", namespace) for k in ("deployment", "service", "poddisruptionbudget")
                )
            ),
            timeout=60,
        )
    assert not _forbidden(caplog), _forbidden(caplog)


def test_service_account_cannot_do_what_it_must_not(cli: Cli, crds: None, namespace: str):
    release = f"op{uuid.uuid4().hex[:5]}"
    values = {"operator": {"allNamespaces": False, "watchNamespaces": [namespace]}}
    cli.helm("install", release, str(ROOT / "charts" / "pagedinfer-operator"), "-n", namespace, values=values)
    account = f"system:serviceaccount:{namespace}:{release}-pagedinfer-operator"

    def can(verb: str, resource: str, ns: str | None = namespace) -> bool:
        args = ["auth", "can-i", verb, resource, f"--as={account}"]
        args += ["-n", ns] if ns else ["--all-namespaces"]
        try:
            return cli.kubectl(*args).strip() == "yes"
        except CommandError as exc:  # kubectl exits 1 when the answer is no
            assert exc.stdout.strip() == "no", exc
            return False

    allowed = [
        ("patch", "inferenceengines.serving.pagedinfer.io"),
        ("patch", "inferenceengines.serving.pagedinfer.io/status"),
        ("create", "deployments.apps"),
        ("delete", "services"),
        ("create", "inferencepools.inference.networking.k8s.io"),
        ("create", "events"),
        ("list", "pods"),
    ]
    denied = [
        ("get", "secrets"),
        ("list", "secrets"),
        ("create", "configmaps"),
        ("create", "pods"),
        ("delete", "pods"),
        ("create", "inferenceengines.serving.pagedinfer.io"),
        ("delete", "inferenceengines.serving.pagedinfer.io"),
        ("create", "roles.rbac.authorization.k8s.io"),
        ("create", "serviceaccounts"),
        ("patch", "nodes"),
    ]
    for verb, resource in allowed:
        assert can(verb, resource), f"should {verb} {resource}"
    for verb, resource in denied:
        assert not can(verb, resource), f"must not {verb} {resource}"
    assert not can("create", "deployments.apps", "default"), "namespaced mode stays in its namespace"
    assert not can("delete", "namespaces", None)
    assert not can("create", "clusterroles.rbac.authorization.k8s.io", None)
    cli.helm("uninstall", release, "-n", namespace)


async def test_restart_mid_reconcile_converges_without_duplicates(
    cli: Cli, crds: None, namespace: str, tmp_path: Path, monkeypatch
):
    """The first operator stops for good right after creating the Service (as if killed between
    writes); a second one finishes the job: one object of each kind, nothing duplicated."""
    real_apply = applier.apply
    stuck = asyncio.Event()

    async def apply_then_hang(client, item, *args, **kwargs):
        action, live = await real_apply(client, item, *args, **kwargs)
        if item.resource is res.SERVICE:
            stuck.set()
            await asyncio.Event().wait()  # never returns: the operator dies here
        return action, live

    monkeypatch.setattr(reconcile_module.applier, "apply", apply_then_hang)
    async with _operator_as(cli, namespace, tmp_path, monkeypatch):
        cli.apply(engine("smol", namespace, SPEC))
        await asyncio.wait_for(stuck.wait(), 30)
    assert cli.get("service", "smol", namespace) is not None
    assert cli.get("deployment", "smol", namespace) is None

    monkeypatch.setattr(reconcile_module.applier, "apply", real_apply)
    async with _operator_as(cli, namespace, tmp_path, monkeypatch):
        await until(lambda: all(cli.get(k, "smol", namespace) for k in KINDS), timeout=30)
        selector = "app.kubernetes.io/instance=smol"
        for kind in KINDS:
            assert len(cli.items(kind, namespace, selector)) == 1, kind
        cli.kubectl("delete", "ie", "smol", "-n", namespace, "--wait=false")
        await until(lambda: cli.get("inferenceengine", "smol", namespace) is None, timeout=30)


async def test_unrealisable_spec_degrades_with_an_event_and_leaves_nothing(
    cli: Cli, crds: None, namespace: str, tmp_path: Path, monkeypatch
):
    """A model cache PVC the namespace's quota forbids: Degraded + Event, no partial objects."""
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "no-pvcs", "namespace": namespace},
        "spec": {"hard": {"persistentvolumeclaims": "0"}},
    }
    cli.apply(quota)
    await until(lambda: (cli.get("resourcequota", "no-pvcs", namespace) or {}).get("status", {}).get("hard"))
    async with _operator_as(cli, namespace, tmp_path, monkeypatch) as memo:
        cli.apply(engine("cached", namespace, {**SPEC, "modelCache": {"size": "1Gi"}}))
        status = await until(
            lambda: (
                (cli.get("inferenceengine", "cached", namespace) or {}).get("status", {}).get("conditions")
                and cli.get("inferenceengine", "cached", namespace)["status"]
            )
        )
        conds = {c["type"]: c for c in status["conditions"]}
        assert conds["Degraded"]["status"] == "True" and conds["Degraded"]["reason"] == "ApplyRejected"
        assert (
            "PersistentVolumeClaim" in conds["Degraded"]["message"]
            and "quota" in conds["Degraded"]["message"]
        )
        assert status["phase"] == "Failed"
        events = await until(
            lambda: [
                e
                for e in cli.items("events", namespace)
                if e["involvedObject"]["name"] == "cached" and e["reason"] == "ApplyRejected"
            ]
        )
        assert events[0]["type"] == "Warning"
        for kind in (
            "deployment",
            "service",
            "persistentvolumeclaim",
            "inferencepool",
            "poddisruptionbudget",
        ):
            assert not cli.items(kind, namespace, "app.kubernetes.io/instance=cached"), kind
        # Not a crash loop: a further reconcile (the resync timer's) tries the PVC once more,
        # rewrites no status and creates nothing.
        calls = dict(memo.ctx.client.calls)
        body = cli.get("inferenceengine", "cached", namespace)
        outcome = await reconcile_module.reconcile(memo.ctx, body, "resync")
        assert outcome.error is not None and not outcome.status_written
        assert memo.ctx.client.calls.get("PATCH", 0) == calls.get("PATCH", 0)
        assert memo.ctx.client.calls.get("POST", 0) == calls.get("POST", 0) + 1
        cli.kubectl("delete", "ie", "cached", "-n", namespace, "--wait=false")
        await until(lambda: cli.get("inferenceengine", "cached", namespace) is None, timeout=30)
