"""docs/kubernetes-quickstart.md, run as written against the real API server.

Each `bash` block's commands run in order from the repository root with .tools/bin on PATH.
Lines marked `# needs a node` need running pods (the node suite runs those). The operator pod
cannot run without a node either, so the operator runs in-process for the walk, watching the
page's namespace with the admin kubeconfig; what it creates is asserted along the way.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import time

import pytest
from cluster_tools import ROOT, TOOLS, Cli

from pagedinfer.operator.k8s import load_configuration
from pagedinfer.operator.testing import running_operator
from pagedinfer.operator.testing import test_config as make_config

pytestmark = pytest.mark.timeout(240)
PAGE = ROOT / "docs" / "kubernetes-quickstart.md"
NEEDS_NODE = "# needs a node"
NAMESPACES = ("demo", "pagedinfer-system")


def _sections() -> list[tuple[str, list[str]]]:
    """(heading, commands) for every `## ` section with bash blocks."""
    out = []
    for part in PAGE.read_text().split("\n## ")[1:]:
        heading = part.splitlines()[0]
        blocks = re.findall(r"```bash\n(.*?)```", part, re.S)
        commands = [line for block in blocks for line in block.splitlines() if line.strip()]
        out.append((heading, commands))
    return out


def _run(cli: Cli, command: str, timeout_s: float = 90.0) -> str:
    """One line of the page; read-only commands are retried while the operator catches up (on
    2 busy cores its first reconcile has taken over 25 s)."""
    env = {**cli.env, "PATH": f"{TOOLS}:{os.environ['PATH']}"}
    deadline = time.monotonic() + timeout_s
    while True:
        proc = subprocess.run(
            ["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )
        if proc.returncode == 0 and proc.stdout.strip() != "":
            return proc.stdout
        if proc.returncode == 0 or " get " in command:
            if proc.returncode == 0 and not command.startswith("kubectl get"):
                return proc.stdout
            if time.monotonic() > deadline:
                raise AssertionError(f"{command} gave nothing in {timeout_s} s: {proc.stdout}\n{proc.stderr}")
            time.sleep(0.2)
            continue
        raise AssertionError(f"{command}\n-> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")


def test_every_runnable_command_is_checked():
    sections = _sections()
    commands = [c for _, cs in sections for c in cs]
    assert sum(NEEDS_NODE in c for c in commands) == 3
    assert any(c.startswith("helm install pagedinfer-operator") for c in commands)
    assert any("kubectl scale ie" in c for c in commands)


async def test_quickstart_page_runs_on_a_real_api_server(cli: Cli, crds: None):
    for ns in NAMESPACES:  # another test's install may still be terminating
        await asyncio.to_thread(_wait_for, lambda ns=ns: cli.get("namespace", ns) is None, 90)
    sections = _sections()
    outputs: dict[str, str] = {}
    try:
        first, rest = sections[0], sections[1:]
        for command in first[1]:
            outputs[command] = await asyncio.to_thread(_run, cli, command)
        configuration = await load_configuration()
        config = make_config(namespaces=("demo",))
        async with running_operator(configuration, config, namespaces=("demo",), use_kubeconfig=True):
            for _, commands in rest:
                for command in commands:
                    if NEEDS_NODE in command:
                        continue
                    outputs[command] = await asyncio.to_thread(_run, cli, command)
                    if command.startswith("kubectl apply -n demo"):
                        try:
                            await asyncio.to_thread(_run, cli, "kubectl get deployment smollm2 -n demo")
                        except AssertionError as exc:  # what the operator made of it, for the log
                            state = cli.kubectl("get", "ie,events", "-n", "demo", "-o", "yaml")
                            raise AssertionError(f"{exc}\n{state}") from None
                    if command.startswith("kubectl scale ie"):
                        await asyncio.to_thread(
                            _run,
                            cli,
                            "kubectl get deployment smollm2 -n demo -o jsonpath='{.spec.replicas}' | grep -x 2",
                        )
            await asyncio.to_thread(_wait_for, lambda: not cli.items("inferenceengines", "demo"), 30)
    finally:
        # the page's operator release owns cluster-scoped objects a namespace deletion leaves behind
        cli.helm("uninstall", "pagedinfer-operator", "-n", "pagedinfer-system", "--ignore-not-found")
        for ns in NAMESPACES:
            cli.kubectl("delete", "namespace", ns, "--wait=false", "--ignore-not-found")
    explain = next(v for k, v in outputs.items() if k.startswith("kubectl explain"))
    assert "uri" in explain and "builtin://" in explain
    listed = next(v for k, v in outputs.items() if k == "kubectl get ie -n demo")
    assert "smollm2" in listed
    port = next(v for k, v in outputs.items() if "httpPort" in k)
    assert port.strip() == "8000"


def _wait_for(check, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not met in time"
        time.sleep(0.2)
