"""Security and hygiene policy on every pod the charts create, directly (the operator) or through
the operator (the engine Deployments it builds from the engine chart's InferenceEngines):
non-root, not privileged, no host namespaces or host paths, resources set, read-only root
filesystem, pinned images (no `latest`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
OPERATOR_CHART = ROOT / "charts" / "pagedinfer-operator"
ENGINE_CHART = ROOT / "charts" / "pagedinfer-engine"
OPERATOR_VALUES = {
    "defaults": {},
    "namespaced-monitoring": {
        "operator": {"allNamespaces": False, "watchNamespaces": ["a"]},
        "serviceMonitor": {"enabled": True},
        "engineMonitor": {"enabled": True},
        "prometheusRule": {"enabled": True},
        "dashboard": {"enabled": True},
    },
    "digest": {"image": {"digest": "sha256:" + "0" * 64}},
}
ENGINE_VALUES = {
    "cpu": {},
    "gpu": {"resources": {"gpus": 2}, "engine": {"tensorParallelSize": 2, "dtype": "bfloat16"}},
    "hf-cached": {
        "model": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"},
        "modelCache": {"size": "5Gi"},
    },
}
POD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"}


def policy_violations(pod: dict[str, Any], where: str) -> list[str]:
    """Every rule a pod spec breaks, as readable strings (empty: compliant)."""
    bad = [f"{where}: {k}" for k in ("hostNetwork", "hostPID", "hostIPC") if pod.get(k)]
    bad += [f"{where}: hostPath volume {v['name']}" for v in pod.get("volumes", []) if "hostPath" in v]
    pod_sc = pod.get("securityContext", {})
    for c in pod.get("initContainers", []) + pod["containers"]:
        at = f"{where}/{c['name']}"
        sc = {**pod_sc, **c.get("securityContext", {})}
        if sc.get("runAsNonRoot") is not True or sc.get("runAsUser", 1) == 0:
            bad.append(f"{at}: may run as root")
        if sc.get("privileged"):
            bad.append(f"{at}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{at}: allowPrivilegeEscalation not false")
        if sc.get("readOnlyRootFilesystem") is not True:
            bad.append(f"{at}: root filesystem writable")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []) or caps.get("add"):
            bad.append(f"{at}: capabilities not dropped")
        res = c.get("resources", {})
        for key in ("requests.cpu", "requests.memory", "limits.memory"):
            section, name = key.split(".")
            if name not in res.get(section, {}):
                bad.append(f"{at}: no {key}")
        bad += [f"{at}: hostPort" for p in c.get("ports", []) if p.get("hostPort")]
        bad += [f"{at}: {msg}" for msg in image_violations(c.get("image", ""))]
    return bad


def image_violations(image: str) -> list[str]:
    if "@sha256:" in image:
        return []
    name = image.rsplit("/", 1)[-1]
    if ":" not in name:
        return [f"image {image!r} has no tag"]
    if name.rsplit(":", 1)[1] == "latest":
        return [f"image {image!r} uses latest"]
    return []


def pods_of(objs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"]["spec"])
        for o in objs
        if o["kind"] in POD_KINDS
    ]


def _engine_deployments(ie: dict[str, Any]) -> list[dict[str, Any]]:
    from pagedinfer.operator.builders.deployment import RenderInput
    from pagedinfer.operator.builders.desired import desired_state
    from pagedinfer.operator.builders.meta import EngineRef
    from pagedinfer.operator.config import OperatorConfig
    from pagedinfer.operator.spec import InferenceEngineSpec

    body = {**ie, "metadata": {**ie["metadata"], "uid": "u", "generation": 1}}
    inp = RenderInput(
        EngineRef.from_body(body), InferenceEngineSpec.model_validate(ie["spec"]), OperatorConfig()
    )
    return [d.body for d in desired_state(inp) if d.body is not None]


@pytest.mark.parametrize("name", OPERATOR_VALUES)
def test_operator_chart_pods_follow_policy(helm, name):
    pods = pods_of(helm.template(OPERATOR_CHART, OPERATOR_VALUES[name]))
    assert pods
    for where, pod in pods:
        assert policy_violations(pod, where) == []
        # A read-only root needs a writable scratch dir for Python.
        mounts = {m["mountPath"] for c in pod["containers"] for m in c.get("volumeMounts", [])}
        assert "/tmp" in mounts


@pytest.mark.parametrize("name", ENGINE_VALUES)
def test_engine_pods_the_operator_builds_follow_policy(helm, name):
    (ie,) = helm.template(ENGINE_CHART, ENGINE_VALUES[name])
    pods = pods_of(_engine_deployments(ie))
    assert pods
    for where, pod in pods:
        assert policy_violations(pod, where) == []


def test_engine_chart_rejects_latest_images(helm):
    (ie,) = helm.template(ENGINE_CHART, {"image": "ghcr.io/pagedinfer/engine-cpu:0.1.0"})
    assert image_violations(ie["spec"]["image"]) == []
    assert image_violations("ghcr.io/pagedinfer/engine-cpu:latest")
    assert image_violations("ghcr.io/pagedinfer/engine-cpu")


def test_policy_catches_each_violation():
    """The checker itself: a hardened pod passes, each single weakening is reported."""
    good = {
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000},
        "containers": [
            {
                "name": "c",
                "image": "r/x:1.0",
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"]},
                },
                "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "1Gi"}},
            }
        ],
    }
    assert policy_violations(good, "p") == []
    weakenings = [
        lambda p: p.update(hostNetwork=True),
        lambda p: p.update(volumes=[{"name": "h", "hostPath": {"path": "/"}}]),
        lambda p: p["securityContext"].update(runAsUser=0),
        lambda p: p["containers"][0]["securityContext"].update(privileged=True),
        lambda p: p["containers"][0]["securityContext"].update(allowPrivilegeEscalation=True),
        lambda p: p["containers"][0]["securityContext"].update(readOnlyRootFilesystem=False),
        lambda p: p["containers"][0]["securityContext"]["capabilities"].update(add=["NET_ADMIN"]),
        lambda p: p["containers"][0]["resources"].pop("limits"),
        lambda p: p["containers"][0].update(image="r/x:latest"),
        lambda p: p["containers"][0].update(ports=[{"containerPort": 80, "hostPort": 80}]),
    ]
    for weaken in weakenings:
        pod = _deepcopy(good)
        weaken(pod)
        assert policy_violations(pod, "p"), pod


def _deepcopy(obj: Any) -> Any:
    import copy

    return copy.deepcopy(obj)


def test_no_latest_anywhere_in_chart_sources():
    for path in list(OPERATOR_CHART.rglob("*.yaml")) + list(ENGINE_CHART.rglob("*.yaml")):
        assert not re.search(r"image:.*:latest\b", path.read_text()), path


def test_validator_is_strict_about_built_in_kinds(validate):
    """The offline validator rejects a misspelt field and a wrong type, as the API server would."""
    import jsonschema

    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "x"},
        "spec": {
            "selector": {"matchLabels": {"a": "b"}},
            "template": {
                "metadata": {"labels": {"a": "b"}},
                "spec": {"containers": [{"name": "c", "image": "i:1"}]},
            },
        },
    }
    validate(deployment)
    typo = _deepcopy(deployment)
    typo["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    wrong_type = _deepcopy(deployment)
    wrong_type["spec"]["replicas"] = "two"
    for bad in (typo, wrong_type):
        with pytest.raises(jsonschema.ValidationError):
            validate(bad)
