"""Fixtures for the suites that run against a real Kubernetes API server.

scripts/test.sh starts ../shared/k8s (etcd + kube-apiserver + kube-controller-manager v1.36, no
node: pods stay Pending; each namespace here gets a zero-pod quota for runs with a node) and
exports KUBECONFIG; without KUBECONFIG every test here is skipped
with one reason. Each test gets its own namespace; cluster-scoped objects carry unique names.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

# Helpers next to the tests import as plain modules under --import-mode=importlib.
sys.path.insert(0, str(Path(__file__).parent))

from cluster_tools import ROOT, Cli  # noqa: E402

NO_CLUSTER = "no KUBECONFIG: scripts/test.sh starts ../shared/k8s when it exists"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.cluster)
            if not os.environ.get("KUBECONFIG"):
                item.add_marker(pytest.mark.skip(reason=NO_CLUSTER))


@pytest.fixture(scope="session")
def cli(tmp_path_factory: pytest.TempPathFactory) -> Cli:
    return Cli(tmp_path_factory.mktemp("k8s-cli"))


@pytest.fixture
def namespace(cli: Cli) -> Iterator[str]:
    name = f"pi-{uuid.uuid4().hex[:8]}"
    cli.kubectl("create", "namespace", name)
    # These suites check API objects. Where the cluster has a node (tests/e2e's), the pods of their
    # Deployments would start, fail to pull their image and change status under the tests: a
    # zero-pod quota keeps every run the same (the ReplicaSets report the quota instead).
    quota = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "no-pods", "namespace": name}}
    quota["spec"] = {"hard": {"pods": "0"}}
    cli.apply(quota)
    try:
        yield name
    finally:
        cli.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found")


@pytest.fixture(scope="session")
def crds(cli: Cli) -> None:
    """The project's CRDs, applied server-side as a user would."""
    cli.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "manifests" / "crd"))
    for name in ("inferenceengines.serving.pagedinfer.io", "kopfpeerings.kopf.dev"):
        cli.kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=30s")
