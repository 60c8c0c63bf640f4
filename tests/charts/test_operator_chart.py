"""charts/pagedinfer-operator: lint, render, validate every object, RBAC scope, CLI/env contract."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pagedinfer-operator"
MONITORING_ON = {
    "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
    "engineMonitor": {"enabled": True},
    "dashboard": {"enabled": True, "annotations": {"grafana_folder": "LLM"}},
    "prometheusRule": {"enabled": True, "additionalAlertLabels": {"team": "ml"}},
}
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "monitoring": MONITORING_ON,
    "namespaced": {
        "operator": {"allNamespaces": False, "watchNamespaces": ["team-a", "team-b"]},
        **MONITORING_ON,
    },
    "namespaced-release-ns": {"operator": {"allNamespaces": False}},
    "pinned": {
        "image": {"digest": "sha256:" + "ab" * 32},
        "imagePullSecrets": [{"name": "regcred"}],
        "engineImages": {"cpu": "registry.local/engine-cpu:0.1.0", "gpu": "registry.local/engine:0.1.0"},
        "serviceAccount": {"create": True, "name": "pi-op", "annotations": {"a": "b"}},
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "infra", "operator": "Exists", "effect": "NoSchedule"}],
        "priorityClassName": "system-cluster-critical",
        "operator": {"extraArgs": ["--verbose"], "extraEnv": [{"name": "X", "value": "1"}]},
    },
    "no-rbac": {"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "existing"}},
    "only-operator-alerts": {
        "prometheusRule": {
            "enabled": True,
            "rules": {
                name: {"enabled": False}
                for name in ("engineDown", "ttftHigh", "kvCacheFull", "preemptionRateHigh", "errorRateHigh")
            },
        }
    },
    "ha": {"replicaCount": 3, **MONITORING_ON},
    "ha-namespaced": {"replicaCount": 2, "operator": {"allNamespaces": False, "watchNamespaces": ["ml"]}},
    "only-engine-alerts": {
        "prometheusRule": {"enabled": True, "rules": {"operatorReconcileErrors": {"enabled": False}}}
    },
}
# Each breaks one rule of values.schema.json; helm must refuse to render it.
BAD_VALUES: dict[str, dict[str, Any]] = {
    "unknown-key": {"replicas": 2},
    "too-many-replicas": {"replicaCount": 9},
    "latest-tag": {"image": {"tag": "latest"}},
    "bad-digest": {"image": {"digest": "sha256:xyz"}},
    "latest-engine-image": {"engineImages": {"cpu": "ghcr.io/x/engine-cpu:latest"}},
    "privileged": {"securityContext": {"privileged": True}},
    "writable-root": {"securityContext": {"readOnlyRootFilesystem": False}},
    "root-user": {"podSecurityContext": {"runAsUser": 0}},
    "root-allowed": {"podSecurityContext": {"runAsNonRoot": False}},
    "no-limits": {"resources": {"limits": None}},
    "kv-threshold": {"prometheusRule": {"rules": {"kvCacheFull": {"threshold": 1.5}}}},
    "bad-duration": {"prometheusRule": {"rules": {"ttftHigh": {"for": "ten minutes"}}}},
    "bad-namespace": {"operator": {"allNamespaces": False, "watchNamespaces": ["Team_A"]}},
    "bad-port": {"metrics": {"port": 70000}},
    "bad-severity": {"prometheusRule": {"rules": {"engineDown": {"severity": "page"}}}},
}


@pytest.fixture(scope="module")
def rendered(helm) -> dict[str, list[dict[str, Any]]]:
    return {name: helm.template(CHART, values) for name, values in VALUE_SETS.items()}


@pytest.mark.parametrize("name", VALUE_SETS)
def test_helm_lint_strict(helm, name):
    helm.lint(CHART, VALUE_SETS[name])


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_rendered_object_is_valid(rendered, validate, name):
    objs = rendered[name]
    assert objs
    for obj in objs:
        validate(obj)
    names = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objs]
    assert len(names) == len(set(names)), "duplicate objects"


@pytest.mark.parametrize("name", BAD_VALUES)
def test_schema_rejects_bad_values(helm, name):
    with pytest.raises(RuntimeError, match="values don't meet the specifications of the schema"):
        helm.template(CHART, BAD_VALUES[name])


def test_crds_identical_to_manifests():
    sources = sorted((ROOT / "manifests" / "crd").glob("*.yaml"))
    copies = sorted((CHART / "crds").glob("*.yaml"))
    assert sources, "the operator's CRD is missing from manifests/crd"
    assert [p.name for p in sources] == [p.name for p in copies]
    for src, copy in zip(sources, copies, strict=True):
        assert src.read_bytes() == copy.read_bytes(), f"{copy} differs: run scripts/sync_crds.sh"
    subprocess.run([str(ROOT / "scripts" / "sync_crds.sh"), "--check"], check=True, cwd=ROOT)


def test_crds_are_valid_custom_resource_definitions(validate):
    crds = [
        d for p in sorted((CHART / "crds").glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d
    ]
    assert {c["spec"]["names"]["kind"] for c in crds} >= {
        "InferenceEngine",
        "KopfPeering",
        "ClusterKopfPeering",
    }
    for crd in crds:
        validate(crd)


def _rules(objs, kind):
    return [r for o in objs if o["kind"] == kind for r in o["rules"]]


def _grants(rules) -> set[tuple[str, str, str]]:
    return {(g, res, v) for r in rules for g in r["apiGroups"] for res in r["resources"] for v in r["verbs"]}


def _required_grants() -> set[tuple[str, str, str]]:
    """What the operator's code touches: every owned kind in full, its CR, pods read-only."""
    from pagedinfer.operator import resources as res

    full = ("get", "list", "watch", "create", "patch", "delete")
    need = {(r.group, r.plural, v) for r in res.OWNED for v in full}
    ie = res.INFERENCE_ENGINE
    need |= {(ie.group, ie.plural, v) for v in ("get", "list", "watch", "patch")}
    need |= {(ie.group, f"{ie.plural}/status", "patch")}
    need |= {(res.POD.group, res.POD.plural, v) for v in ("get", "list")}
    return need


def _manifest_grants(*names: str) -> set[tuple[str, str, str]]:
    docs = [d for n in names for d in yaml.safe_load_all((ROOT / "manifests" / "rbac" / n).read_text()) if d]
    return _grants([r for d in docs if d["kind"] in ("ClusterRole", "Role") for r in d["rules"]])


PEERING = {"kopf.dev"}


def test_cluster_wide_rbac_is_the_operators_manifest(rendered):
    """Same grants as manifests/rbac/cluster-role.yaml (whose every verb tests/operator checks
    against the operator's calls); Kopf peering only when there is more than one replica."""
    manifest = _manifest_grants("cluster-role.yaml")
    ha = _grants(_rules(rendered["ha"], "ClusterRole"))
    assert ha == manifest
    single = _grants(_rules(rendered["defaults"], "ClusterRole"))
    assert single == {g for g in manifest if g[0] not in PEERING}
    assert not _rules(rendered["defaults"], "Role")
    missing = _required_grants() - single
    assert not missing, f"ClusterRole lacks {sorted(missing)}"


def test_namespaced_rbac_is_the_operators_manifest(rendered):
    objs = rendered["ha-namespaced"]
    assert _grants(_rules(objs, "Role")) == _manifest_grants("namespaced/role.yaml")
    assert _grants(_rules(objs, "ClusterRole")) == _manifest_grants("namespaced/cluster-discovery.yaml")
    single = _grants(_rules(rendered["namespaced"], "Role"))
    assert single == {g for g in _manifest_grants("namespaced/role.yaml") if g[0] not in PEERING}


def test_replicas_and_peering(rendered):
    single = _operator_container(rendered["defaults"])["args"]
    assert "--standalone" in single and not any(a.startswith("--peering") for a in single)
    deployment = next(o for o in rendered["ha"] if o["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    peering = next(o for o in rendered["ha"] if o["kind"] == "ClusterKopfPeering")
    assert f"--peering={peering['metadata']['name']}" in _operator_container(rendered["ha"])["args"]
    assert (
        next(o for o in rendered["ha"] if o["kind"] == "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
    )
    namespaced = [o for o in rendered["ha-namespaced"] if o["kind"] == "KopfPeering"]
    assert [o["metadata"]["namespace"] for o in namespaced] == ["ml"]
    defaults = next(o for o in rendered["defaults"] if o["kind"] == "Deployment")
    assert defaults["spec"]["strategy"] == {"type": "Recreate"}
    assert not {"ClusterKopfPeering", "KopfPeering", "PodDisruptionBudget"} & {
        o["kind"] for o in rendered["defaults"]
    }


def test_rbac_is_least_privilege(rendered):
    for objs in rendered.values():
        for rule in _rules(objs, "ClusterRole") + _rules(objs, "Role"):
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[field], rule
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"]), rule
            assert not {"secrets", "nodes", "clusterroles", "roles"} & set(rule["resources"]), rule
            if rule["apiGroups"] == ["apiextensions.k8s.io"]:
                assert set(rule["verbs"]) <= {"get", "list", "watch"}, (
                    "the chart, not the operator, owns CRDs"
                )


def test_namespaced_mode_uses_roles_in_each_namespace(rendered):
    objs = rendered["namespaced"]
    roles = [o for o in objs if o["kind"] == "Role"]
    bindings = [o for o in objs if o["kind"] == "RoleBinding"]
    assert sorted(o["metadata"]["namespace"] for o in roles) == ["team-a", "team-b"]
    assert sorted(o["metadata"]["namespace"] for o in bindings) == ["team-a", "team-b"]
    for binding in bindings:
        assert binding["subjects"][0]["namespace"] == "serving"
    assert _required_grants() <= _grants(_rules(objs, "Role"))
    cluster = _grants(_rules(objs, "ClusterRole"))
    assert {g[:2] for g in cluster} == {
        ("apiextensions.k8s.io", "customresourcedefinitions"),
        ("", "namespaces"),
    }
    args = _operator_container(objs)["args"]
    assert args[:3] == ["operator", "--namespace=team-a", "--namespace=team-b"]
    pod_monitor = next(o for o in objs if o["kind"] == "PodMonitor")
    assert pod_monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    default_ns = rendered["namespaced-release-ns"]
    assert [o["metadata"]["namespace"] for o in default_ns if o["kind"] == "Role"] == ["serving"]


def test_no_rbac_and_existing_service_account(rendered):
    objs = rendered["no-rbac"]
    kinds = {o["kind"] for o in objs}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ServiceAccount"}
    pod = next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "existing"


def _operator_container(objs) -> dict[str, Any]:
    deployment = next(o for o in objs if o["kind"] == "Deployment")
    return deployment["spec"]["template"]["spec"]["containers"][0]


def test_image_reference(rendered):
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert (
        _operator_container(rendered["defaults"])["image"]
        == f"ghcr.io/pagedinfer/operator:{chart['appVersion']}"
    )
    assert (
        _operator_container(rendered["pinned"])["image"] == "ghcr.io/pagedinfer/operator@sha256:" + "ab" * 32
    )


def test_operator_env_is_what_the_operator_reads(helm):
    """Every PAGEDINFER_OPERATOR_* variable the chart sets lands in OperatorConfig.from_env."""
    from pagedinfer.operator.config import OperatorConfig

    values = {
        "operator": {
            "resyncSeconds": 7,
            "statsSeconds": 11,
            "enableStats": False,
            "clusterDomain": "k.example",
        },
        "metrics": {"port": 9090},
        "engineImages": {"cpu": "r/cpu:1", "gpu": "r/gpu:1"},
    }
    container = _operator_container(helm.template(CHART, values))
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    config = OperatorConfig.from_env(env)
    assert (config.resync_seconds, config.stats_seconds, config.enable_stats) == (7.0, 11.0, False)
    assert (config.cluster_domain, config.metrics_port) == ("k.example", 9090)
    assert (config.image_cpu, config.image_gpu) == ("r/cpu:1", "r/gpu:1")
    assert container["ports"][0]["containerPort"] == 9090
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_operator_command_matches_the_cli(rendered):
    """The container runs the `pagedinfer` console script (pagedinfer.engine.cli:main)."""
    from pagedinfer.engine.cli import build_parser

    container = _operator_container(rendered["defaults"])
    assert container["command"] == ["pagedinfer"]
    args = build_parser().parse_args(container["args"])
    assert (args.command, args.all_namespaces, args.standalone) == ("operator", True, True)
    namespaced = build_parser().parse_args(_operator_container(rendered["namespaced"])["args"])
    assert namespaced.namespace == ["team-a", "team-b"] and not namespaced.all_namespaces
    ha = build_parser().parse_args(_operator_container(rendered["ha"])["args"])
    assert ha.peering and not ha.standalone
    assert build_parser().parse_args(_operator_container(rendered["pinned"])["args"]).verbose  # extraArgs


def test_metrics_service_and_service_monitor_agree(rendered):
    objs = rendered["monitoring"]
    service = next(o for o in objs if o["kind"] == "Service")
    monitor = next(o for o in objs if o["kind"] == "ServiceMonitor")
    deployment = next(o for o in objs if o["kind"] == "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_engine_pod_monitor_selects_the_operators_engine_pods(rendered):
    from pagedinfer.operator.builders import meta

    monitor = next(o for o in rendered["monitoring"] if o["kind"] == "PodMonitor")
    ref = meta.EngineRef(name="smollm2", namespace="default", uid="u")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= meta.common_labels(ref).items()
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "http"


def test_dashboard_configmap(rendered):
    cm = next(o for o in rendered["monitoring"] if o["kind"] == "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    shipped = json.loads((CHART / "dashboards" / "pagedinfer.json").read_text())
    assert json.loads(cm["data"]["pagedinfer.json"]) == shipped


def test_monitoring_objects_are_opt_in(rendered):
    kinds = {o["kind"] for o in rendered["defaults"]}
    assert not kinds & {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap"}


def test_notes_tell_the_next_steps(helm):
    notes = helm.notes(CHART, MONITORING_ON)
    assert "kubectl get crd inferenceengines.serving.pagedinfer.io" in notes
    assert "every namespace" in notes and "PrometheusRule" in notes and "grafana_dashboard=1" in notes
    namespaced = helm.notes(CHART, {"operator": {"allNamespaces": False, "watchNamespaces": ["a", "b"]}})
    assert "It watches InferenceEngines in: a,b" in namespaced


def _leaf_paths(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict) and node:
        return [p for k, v in node.items() for p in _leaf_paths(v, f"{prefix}.{k}" if prefix else k)]
    return [prefix]


def _documented(readme: str, path: str) -> bool:
    """`a.b.c` is documented as itself, as a parent (`a.b`) or in a group (`a.b.{c,d}`)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        head = ".".join(parts[:i])
        if f"`{head}`" in readme:
            return True
        if i < len(parts):
            m = re.search(rf"`{re.escape(head)}\.\{{([^}}]+)\}}`", readme)
            if m and parts[i] in m.group(1).split(","):
                return True
    return False


@pytest.mark.parametrize("chart", ["pagedinfer-operator", "pagedinfer-engine"])
def test_readme_values_table_covers_every_value(chart):
    path = ROOT / "charts" / chart
    values = yaml.safe_load((path / "values.yaml").read_text())
    readme = (path / "README.md").read_text()
    missing = [p for p in _leaf_paths(values) if not _documented(readme, p)]
    assert not missing, f"{chart}/README.md lacks {missing}"


def _strict_objects(schema: Any, where: str = "$") -> list[str]:
    """Paths of schema objects with named properties that still accept unknown keys."""
    loose = []
    if isinstance(schema, dict):
        if "properties" in schema and schema.get("additionalProperties") is not False:
            loose.append(where)
        for key, sub in schema.items():
            if key == "properties":
                loose += [p for name, s in sub.items() for p in _strict_objects(s, f"{where}.{name}")]
            elif isinstance(sub, dict | list):
                loose += _strict_objects(sub, where)
    elif isinstance(schema, list):
        loose += [p for s in schema for p in _strict_objects(s, where)]
    return loose


@pytest.mark.parametrize("chart", ["pagedinfer-operator", "pagedinfer-engine"])
def test_values_schema_rejects_unknown_keys_everywhere(chart):
    schema = json.loads((ROOT / "charts" / chart / "values.schema.json").read_text())
    loose = [
        p for p in _strict_objects(schema) if p != "$.operator.extraEnv"
    ]  # EnvVar objects, validated by the API
    assert loose == [], f"objects accepting unknown keys: {loose}"
