"""The whole path on a real node: images built here, the operator and the engine as pods.

Needs the control plane and the node of ../shared/k8s (scripts/test.sh starts both when the
node's apt packages and podman are installed) and KUBECONFIG; otherwise every test here is
skipped with one reason. Images come from docker/build_local_images.sh (tagged by a hash of
their inputs, so a second run of the same checkout builds nothing) and are imported into the
node's containerd.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))

from cluster_tools import ROOT, Cli  # noqa: E402

K8S = ROOT.parent / "shared" / "k8s"


def _why_not() -> str | None:
    if not os.environ.get("KUBECONFIG"):
        return "no KUBECONFIG: scripts/test.sh starts ../shared/k8s and its node when they can run"
    for tool in ("podman", "containerd", "debootstrap"):
        if shutil.which(tool) is None:
            return f"no {tool}: the node suite needs podman, debootstrap and the node's apt packages"
    if not (K8S / "images.sh").exists():
        return f"no {K8S}/images.sh"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    reason = _why_not()
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.node)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def cli(tmp_path_factory: pytest.TempPathFactory) -> Cli:
    cli = Cli(tmp_path_factory.mktemp("e2e-cli"))
    nodes = json.loads(cli.kubectl("get", "nodes", "-o", "json"))["items"]
    ready = [
        n
        for n in nodes
        if any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"]["conditions"])
    ]
    assert ready, "no Ready node: run ../shared/k8s/node-up.sh (scripts/test.sh does)"
    return cli


@pytest.fixture(scope="session")
def images(cli: Cli) -> dict[str, str]:
    """ENGINE_IMAGE and OPERATOR_IMAGE, built (or found) and imported into the node."""
    started = time.monotonic()
    proc = subprocess.run(
        [str(ROOT / "docker" / "build_local_images.sh")], capture_output=True, text=True, timeout=1800
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = dict(line.split("=", 1) for line in proc.stdout.split() if "=" in line)
    built = [
        line
        for line in proc.stderr.splitlines()
        if "not rebuilt" in line or " built in " in line or " made in " in line
    ]
    print(f"build_local_images.sh: {time.monotonic() - started:.0f} s ({'; '.join(built)})")
    listed = subprocess.run(
        [str(K8S / "images.sh"), "ls"], cwd=ROOT, capture_output=True, text=True, timeout=60
    ).stdout
    for image in found.values():
        if image not in listed:
            imported = subprocess.run(
                [str(K8S / "images.sh"), "import", image],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert imported.returncode == 0, imported.stderr[-2000:]
    return found
