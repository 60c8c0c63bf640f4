"""Helpers of the real-cluster suites: kubectl and helm runners, polling, manifests."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / ".tools" / "bin"


class CommandError(RuntimeError):
    """kubectl or helm exited non-zero; the message carries stdout and stderr."""

    def __init__(self, cmd: list[str], proc: subprocess.CompletedProcess[str]) -> None:
        super().__init__(f"{' '.join(cmd)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
        self.stdout = proc.stdout
        self.stderr = proc.stderr


def _binary(name: str) -> str:
    local = TOOLS / name
    found = str(local) if local.is_file() else shutil.which(name)
    assert found, f"{name} not found: run scripts/install_k8s_tools.sh (scripts/setup.sh --dev does)"
    return found


class Cli:
    """kubectl and helm against the cluster of KUBECONFIG, helm's state kept in a temp folder."""

    def __init__(self, home: Path) -> None:
        self.kubectl_bin = _binary("kubectl")
        self.helm_bin = _binary("helm")
        self.env = {
            **os.environ,
            "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_CONFIG_HOME": str(home / "config"),
            "HELM_DATA_HOME": str(home / "data"),
        }
        self._files = home / "files"
        self._files.mkdir(parents=True, exist_ok=True)

    def _run(self, cmd: list[str], stdin: str | None, timeout: float) -> str:
        proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True, env=self.env, timeout=timeout)
        if proc.returncode != 0:
            raise CommandError(cmd, proc)
        return proc.stdout

    def kubectl(self, *args: str, stdin: str | None = None, timeout: float = 60) -> str:
        return self._run([self.kubectl_bin, *args], stdin, timeout)

    def helm(self, *args: str, values: dict[str, Any] | None = None, timeout: float = 120) -> str:
        cmd = [self.helm_bin, *args]
        if values is not None:
            path = self._files / f"values-{uuid.uuid4().hex[:8]}.json"
            path.write_text(json.dumps(values))
            cmd += ["-f", str(path)]
        return self._run(cmd, None, timeout)

    def apply(self, objs: dict[str, Any] | list[dict[str, Any]], *extra: str) -> str:
        docs = objs if isinstance(objs, list) else [objs]
        text = yaml.safe_dump_all(docs)
        return self.kubectl("apply", "--server-side", "--field-manager=tests", "-f", "-", *extra, stdin=text)

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        args = ["get", kind, name, "-o", "json", "--ignore-not-found"]
        if namespace:
            args += ["-n", namespace]
        out = self.kubectl(*args)
        return json.loads(out) if out.strip() else None

    def items(self, kind: str, namespace: str, selector: str | None = None) -> list[dict[str, Any]]:
        args = ["get", kind, "-n", namespace, "-o", "json"]
        if selector:
            args += ["-l", selector]
        return json.loads(self.kubectl(*args))["items"]


def wait_for(check: Callable[[], Any], timeout: float = 20.0, interval: float = 0.2) -> Any:
    """Poll `check` until it returns something truthy; fail with its last answer."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not met within {timeout} s (last: {result!r})")
        time.sleep(interval)


def engine(name: str, namespace: str, spec: dict[str, Any]) -> dict[str, Any]:
    """An InferenceEngine manifest."""
    return {
        "apiVersion": "serving.pagedinfer.io/v1alpha1",
        "kind": "InferenceEngine",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }
