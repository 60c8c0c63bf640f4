"""manifests/ and its samples on a real API server: they apply, and `kubectl explain` documents them."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml
from cluster_tools import ROOT, Cli

from pagedinfer.operator.crd import openapi_schema

SAMPLES = sorted((ROOT / "manifests" / "samples").glob("*.yaml"))


def test_kustomization_applies_server_side(cli: Cli, crds: None):
    out = cli.kubectl("apply", "--server-side", "--force-conflicts", "-k", str(ROOT / "manifests"))
    assert "deployment.apps/pagedinfer-operator serverside-applied" in out
    # A second apply changes nothing and is accepted as well (idempotent install).
    again = cli.kubectl("apply", "--server-side", "--force-conflicts", "-k", str(ROOT / "manifests"))
    assert "serverside-applied" in again
    role = cli.get("clusterrole", "pagedinfer-operator")
    assert role is not None and any("inferencepools" in r.get("resources", []) for r in role["rules"])
    # Remove what it installed except the CRDs, which the other tests share.
    cli.kubectl("delete", "namespace", "pagedinfer-system", "--wait=false")
    for kind in ("clusterrole", "clusterrolebinding"):
        for name in ("pagedinfer-operator", "pagedinfer-operator-discovery"):
            cli.kubectl("delete", kind, name, "--ignore-not-found")
    cli.kubectl("delete", "clusterkopfpeering", "pagedinfer-operator", "--ignore-not-found")


def test_namespaced_rbac_applies(cli: Cli, crds: None, namespace: str):
    folder = ROOT / "manifests" / "rbac" / "namespaced"
    docs = [d for path in sorted(folder.glob("*.yaml")) for d in yaml.safe_load_all(path.read_text()) if d]
    for doc in docs:
        if doc["kind"] in ("Role", "RoleBinding"):
            doc["metadata"]["namespace"] = namespace
    cli.apply([d for d in docs if d["kind"] in ("Role", "RoleBinding")])
    assert cli.get("role", "pagedinfer-operator", namespace) is not None


@pytest.mark.parametrize("path", SAMPLES, ids=[p.stem for p in SAMPLES])
def test_sample_applies_and_gets_defaults(cli: Cli, crds: None, namespace: str, path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    for doc in docs:
        doc["metadata"]["namespace"] = namespace
    cli.apply(docs)
    for doc in docs:
        if doc["kind"] != "InferenceEngine":
            continue
        live = cli.get("inferenceengine", doc["metadata"]["name"], namespace)
        assert live is not None
        # The server filled every default the schema declares (nested objects included).
        assert live["spec"]["lifecycle"]["drainTimeoutSeconds"] >= 0
        assert live["spec"]["service"]["httpPort"] != live["spec"]["service"]["grpcPort"]
        assert "maxReplicas" in live["spec"]["autoscaling"]


def _fields(node: dict[str, Any], path: str) -> list[tuple[str, str]]:
    out = []
    for name, sub in node.get("properties", {}).items():
        out.append((f"{path}.{name}", sub.get("description", "")))
        out += _fields(sub, f"{path}.{name}")
    return out


def test_kubectl_explain_describes_every_field(cli: Cli, crds: None):
    spec = openapi_schema()["properties"]["spec"]
    fields = _fields(spec, "spec")
    assert len(fields) > 50
    recursive = cli.kubectl("explain", "inferenceengine.spec", "--recursive")
    for path, description in fields:
        assert description, f"{path} has no description"
        leaf = path.rsplit(".", 1)[1]
        assert re.search(rf"^\s+{leaf}\s", recursive, re.M), f"{path} missing from kubectl explain"
    # Spot-check that the description reaches the user for nested fields.
    for path, description in fields:
        if path.count(".") == 2:
            out = cli.kubectl("explain", f"inferenceengine.{path}")
            assert " ".join(description.split()[:4]) in " ".join(out.split()), path
