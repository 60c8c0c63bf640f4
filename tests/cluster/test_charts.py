"""Both Helm charts installed, upgraded and uninstalled by the real helm on a real API server."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import yaml
from cluster_tools import ROOT, Cli, CommandError

OPERATOR_CHART = str(ROOT / "charts" / "pagedinfer-operator")
ENGINE_CHART = str(ROOT / "charts" / "pagedinfer-engine")

# Value sets beyond the defaults: namespaced HA, monitoring on, tuned. (engineMonitor needs the
# PodMonitor CRD, which the test cluster does not have: helm refuses it, "ensure CRDs are installed".)
OPERATOR_VALUES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "namespaced-ha": {"replicaCount": 2, "operator": {"allNamespaces": False}},
    "monitoring": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
        "prometheusRule": {"enabled": True},
        "dashboard": {"enabled": True},
    },
    "tuned": {
        "operator": {"resyncSeconds": 30, "enableStats": False, "extraArgs": ["--verbose"]},
        "engineImages": {"cpu": "localhost/pagedinfer-engine-cpu:test"},
        "serviceAccount": {"annotations": {"example.com/role": "operator"}},
        "metrics": {"service": {"enabled": False}},
    },
}
ENGINE_VALUES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "gpu-autoscaled": {
        "model": {"uri": "hf://meta-llama/Meta-Llama-3-8B-Instruct", "servedName": "llama3"},
        "resources": {"gpus": 2, "cpu": "8", "memory": "48Gi"},
        "engine": {"dtype": "bfloat16", "tensorParallelSize": 2},
        "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 3},
    },
    "routed": {
        "name": "routed",
        "routing": {"inferencePool": {"endpointPicker": {"name": "epp"}}},
        "monitoring": {"serviceMonitor": {"enabled": True}},
    },
}


def _release() -> str:
    return f"r{uuid.uuid4().hex[:6]}"


def _manifest_objects(cli: Cli, release: str, namespace: str) -> list[tuple[str, str]]:
    text = cli.helm("get", "manifest", release, "-n", namespace)
    return [(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(text) if d]


def _exists(cli: Cli, kind: str, name: str, namespace: str) -> bool:
    cluster_scoped = kind in ("ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering")
    return cli.get(kind.lower(), name, None if cluster_scoped else namespace) is not None


@pytest.mark.parametrize("case", list(OPERATOR_VALUES))
def test_operator_chart_install_upgrade_uninstall(cli: Cli, crds: None, namespace: str, case: str):
    values = OPERATOR_VALUES[case]
    release = _release()
    rendered = cli.helm("template", release, OPERATOR_CHART, "-n", namespace, values=values)
    cli.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", stdin=rendered)

    cli.helm("install", release, OPERATOR_CHART, "-n", namespace, values=values)
    objects = _manifest_objects(cli, release, namespace)
    assert ("Deployment", f"{release}-pagedinfer-operator") in objects
    for kind, name in objects:
        assert _exists(cli, kind, name, namespace), (kind, name)

    upgraded = {**values, "operator": {**values.get("operator", {}), "resyncSeconds": 45}}
    cli.helm("upgrade", release, OPERATOR_CHART, "-n", namespace, values=upgraded)
    deployment = cli.get("deployment", f"{release}-pagedinfer-operator", namespace)
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "45" in env.values(), env

    cli.helm("uninstall", release, "-n", namespace, "--wait", "--timeout", "60s")
    for kind, name in objects:
        assert not _exists(cli, kind, name, namespace), (kind, name)
    # Helm keeps CRDs on uninstall.
    assert cli.get("crd", "inferenceengines.serving.pagedinfer.io") is not None


@pytest.mark.parametrize("case", list(ENGINE_VALUES))
def test_engine_chart_install_upgrade_uninstall(cli: Cli, crds: None, namespace: str, case: str):
    values = ENGINE_VALUES[case]
    release = _release()
    rendered = cli.helm("template", release, ENGINE_CHART, "-n", namespace, values=values)
    cli.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", stdin=rendered)

    cli.helm("install", release, ENGINE_CHART, "-n", namespace, values=values)
    name = values.get("name") or release
    live = cli.get("inferenceengine", name, namespace)
    assert live is not None and live["spec"]["model"]["uri"]

    cli.helm("upgrade", release, ENGINE_CHART, "-n", namespace, values={**values, "replicas": 3})
    live = cli.get("inferenceengine", name, namespace)
    assert live["spec"]["replicas"] == 3

    cli.helm("uninstall", release, "-n", namespace, "--wait", "--timeout", "60s")
    assert cli.get("inferenceengine", name, namespace) is None


BAD_VALUES = [
    (OPERATOR_CHART, {"replicaCount": "two"}, "replicaCount"),
    (OPERATOR_CHART, {"image": {"tag": "latest"}}, "image.tag"),
    (OPERATOR_CHART, {"operator": {"resyncSeconds": -5}}, "operator.resyncSeconds"),
    (OPERATOR_CHART, {"unknownKey": 1}, "unknownKey"),
    (ENGINE_CHART, {"replicas": -1}, "replicas"),
    (ENGINE_CHART, {"engine": {"dtype": "int4"}}, "engine.dtype"),
    (ENGINE_CHART, {"servce": {"httpPort": 9000}}, "servce"),
]


@pytest.mark.parametrize(
    ("chart", "values", "field"), BAD_VALUES, ids=[f"{c.rsplit('/', 1)[1]}-{f}" for c, _, f in BAD_VALUES]
)
def test_values_schema_rejects_bad_values(cli: Cli, namespace: str, chart: str, values: dict, field: str):
    with pytest.raises(CommandError) as err:
        cli.helm("install", _release(), chart, "-n", namespace, values=values)
    message = err.value.stderr
    assert "values don't meet the specifications of the schema" in message, message
    assert field.rsplit(".", 1)[-1] in message, message
    assert json.loads(cli.kubectl("get", "all", "-n", namespace, "-o", "json"))["items"] == []
