"""manifests/: samples valid against the CRD (schema + CEL + pydantic) and renderable; built-in
objects valid offline; RBAC grants what the operator does and nothing it does not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from operator_crd_tools import apply_defaults, cel_violations, schema_errors

from pagedinfer.operator import resources as res
from pagedinfer.operator.builders.deployment import RenderInput
from pagedinfer.operator.builders.desired import desired_state
from pagedinfer.operator.builders.meta import EngineRef
from pagedinfer.operator.config import OperatorConfig
from pagedinfer.operator.crd import build_crd
from pagedinfer.operator.main import build_parser
from pagedinfer.operator.spec import InferenceEngineSpec

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"
SCHEMA = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
SAMPLES = sorted((MANIFESTS / "samples").glob("*.yaml"))


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_samples_cover_the_issue():
    assert {p.stem for p in SAMPLES} >= {"smollm2-cpu", "llama3-8b-gpu", "speculative", "autoscaled"}


@pytest.mark.parametrize("path", SAMPLES, ids=[p.stem for p in SAMPLES])
def test_sample_is_valid_and_renders(path: Path):
    (cr,) = docs(path)
    assert schema_errors(SCHEMA, cr) == []
    assert cel_violations(SCHEMA, apply_defaults(SCHEMA, cr)) == []
    spec = InferenceEngineSpec.model_validate(cr["spec"])
    ref = EngineRef(cr["metadata"]["name"], cr["metadata"].get("namespace", "default"), "uid")
    for item in desired_state(RenderInput(ref, spec, OperatorConfig())):
        if item.body is not None and item.resource is not res.SERVICE_MONITOR:
            assert kubernetes_validate.validate(item.body, "1.30.0", strict=True)


def test_cpu_sample_needs_no_gpu():
    (cr,) = docs(MANIFESTS / "samples" / "smollm2-cpu.yaml")
    spec = InferenceEngineSpec.model_validate(cr["spec"])
    assert spec.resources.gpus == 0 and spec.model.uri.startswith("builtin://")


def test_operator_deployment_is_valid_and_its_args_parse():
    dep = next(d for d in docs(MANIFESTS / "operator" / "deployment.yaml") if d["kind"] == "Deployment")
    for doc in docs(MANIFESTS / "operator" / "deployment.yaml"):
        assert kubernetes_validate.validate(doc, "1.30.0", strict=True)
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["pagedinfer"] and container["args"][0] == "operator"
    args = build_parser().parse_args(container["args"][1:])
    assert args.all_namespaces and args.peering == "pagedinfer-operator"
    sc = container["securityContext"]
    assert (
        sc["readOnlyRootFilesystem"]
        and not sc["allowPrivilegeEscalation"]
        and sc["capabilities"]["drop"] == ["ALL"]
    )
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "pagedinfer-operator"


def _rules(path: Path) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for doc in docs(path):
        for rule in doc.get("rules", []):
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


NEEDED = {
    **{(r.group, r.plural): {"get", "list", "watch", "create", "patch", "delete"} for r in res.OWNED},
    ("serving.pagedinfer.io", "inferenceengines"): {"get", "list", "watch", "patch"},
    ("serving.pagedinfer.io", "inferenceengines/status"): {"patch"},
    ("", "pods"): {"list"},
    ("", "events"): {"create"},
}
CLUSTER_ONLY = {
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"},
    ("", "namespaces"): {"list", "watch"},
}


def test_cluster_role_grants_what_the_operator_uses_and_no_wildcards():
    rules = _rules(MANIFESTS / "rbac" / "cluster-role.yaml")
    for key, verbs in {**NEEDED, **CLUSTER_ONLY}.items():
        assert verbs <= rules.get(key, set()), key
    for (group, resource), verbs in rules.items():
        assert "*" not in verbs and resource != "*" and group != "*"
        assert not verbs & {"escalate", "bind", "impersonate"}
    assert "update" not in rules[("serving.pagedinfer.io", "inferenceengines")]  # patch is enough
    assert "secrets" not in {r for _, r in rules}  # the pods read secrets, never the operator


def test_namespaced_rbac_splits_the_same_rules():
    role = _rules(MANIFESTS / "rbac" / "namespaced" / "role.yaml")
    discovery = _rules(MANIFESTS / "rbac" / "namespaced" / "cluster-discovery.yaml")
    for key, verbs in NEEDED.items():
        assert verbs <= role.get(key, set()), key
    for key, verbs in CLUSTER_ONLY.items():
        assert verbs <= discovery.get(key, set()), key
    binding = docs(MANIFESTS / "rbac" / "namespaced" / "role-binding.yaml")[0]
    assert binding["roleRef"]["kind"] == "Role"


def test_bindings_point_at_the_service_account():
    (sa,) = docs(MANIFESTS / "rbac" / "service-account.yaml")
    (binding,) = docs(MANIFESTS / "rbac" / "cluster-role-binding.yaml")
    subject = binding["subjects"][0]
    assert (subject["name"], subject["namespace"]) == (sa["metadata"]["name"], sa["metadata"]["namespace"])
    for path in (MANIFESTS / "rbac").rglob("*.yaml"):
        for doc in docs(path):
            assert kubernetes_validate.validate(doc, "1.30.0", strict=True)


def test_kustomization_lists_existing_files():
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    for resource in kustomization["resources"]:
        assert (MANIFESTS / resource).is_file(), resource
    assert "crd/inferenceengines.serving.pagedinfer.io.yaml" in kustomization["resources"]
