"""docker/engine-cpu.Dockerfile built for real with podman (docker/build_local_images.sh) and run
the way a pod runs it: its own non-root user, a read-only root file system with only /tmp
writable, no capabilities. The embedded model serves: /ready answers 200 and a chat completion
comes back. Heavy (a cold build takes minutes on 2 cores), so it runs only where podman is
installed and PAGEDINFER_IMAGE_TESTS=1."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PODMAN = shutil.which("podman")
if PODMAN is None:
    pytest.skip("image tests: podman is not installed (see docker/README.md)", allow_module_level=True)
if os.environ.get("PAGEDINFER_IMAGE_TESTS") != "1":
    pytest.skip(
        "image tests: set PAGEDINFER_IMAGE_TESTS=1 to build and run the CPU image", allow_module_level=True
    )

SHARED_CONF = ROOT.parent / "shared" / "k8s" / "etc" / "podman" / "containers.conf"
ENV = {**os.environ}
if "CONTAINERS_CONF" not in ENV and SHARED_CONF.is_file():
    ENV["CONTAINERS_CONF"] = str(SHARED_CONF)
RUNTIME = ["--runtime", "runc"] if shutil.which("runc") else []
READY_TIMEOUT_S = 180
# What a pod with readOnlyRootFilesystem, runAsNonRoot and a /tmp emptyDir gets.
LOCKED_DOWN = ["--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]


def podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PODMAN, *RUNTIME, *args], capture_output=True, text=True, env=ENV, timeout=timeout)


def run_in_image(image: str, *command: str) -> subprocess.CompletedProcess:
    """A one-off command in the image, as its default user, without network."""
    return podman(
        "run", "--rm", "--network", "none", *LOCKED_DOWN, "--entrypoint", command[0], image, *command[1:]
    )


@pytest.fixture(scope="module")
def image() -> str:
    proc = subprocess.run(
        [str(ROOT / "docker" / "build_local_images.sh"), "engine-cpu"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=1800,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    names = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    return names["ENGINE_IMAGE"]


@dataclass
class Server:
    container: str
    url: str
    seconds_to_ready: float


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:  # not listening yet
        return 0


@pytest.fixture(scope="module")
def server(image: str) -> Iterator[Server]:
    """The image's own entrypoint and command, published on a free loopback port."""
    start = time.monotonic()
    proc = podman("run", "-d", "--rm", *LOCKED_DOWN, "-p", "127.0.0.1::8000", image)
    assert proc.returncode == 0, proc.stderr
    container = proc.stdout.strip()
    try:
        port = podman("port", container, "8000/tcp").stdout.strip().rsplit(":", 1)[1]
        url = f"http://127.0.0.1:{port}"
        while _get(url + "/ready") != 200:
            running = podman("container", "exists", container).returncode == 0
            if not running or time.monotonic() - start > READY_TIMEOUT_S:
                logs = podman("logs", container).stderr[-4000:]
                pytest.fail(f"/ready not 200 after {time.monotonic() - start:.0f} s:\n{logs}")
            time.sleep(0.25)
        yield Server(container, url, time.monotonic() - start)
    finally:
        podman("rm", "-f", "-t", "5", container)


def test_default_user_is_the_non_root_one_pods_run_as(image):
    from pagedinfer.operator.config import OperatorConfig

    config = json.loads(podman("image", "inspect", "--format", "{{json .Config}}", image).stdout)
    assert config["User"] == "1000:1000" and config["Entrypoint"] == ["pagedinfer"]
    proc = run_in_image(image, "id", "-u")
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) == OperatorConfig().run_as_user


def test_model_is_embedded_and_no_compiler_shipped(image):
    script = (
        "from pagedinfer.engine.models.builtin import builtin_path; "
        "import shutil; p = builtin_path('smollm2-135m'); "
        "print(p.stat().st_size, [c for c in ('gcc', 'g++', 'cc', 'c++', 'cmake', 'ninja') if shutil.which(c)])"
    )
    proc = run_in_image(image, "python", "-c", script)
    assert proc.returncode == 0, proc.stderr
    size, compilers = proc.stdout.split(" ", 1)
    assert int(size) > 50_000_000 and compilers.strip() == "[]"


def test_ready_on_a_read_only_root(server):
    print(f"cold start (podman run -> /ready 200): {server.seconds_to_ready:.1f} s")
    assert _get(server.url + "/startup") == 200
    probe = (
        "import errno, pathlib\n"
        "pathlib.Path('/tmp/probe').write_text('ok')\n"
        "try:\n    pathlib.Path('/opt/venv/probe').write_text('no')\n"
        "except OSError as e:\n    print(errno.errorcode[e.errno])\n"
    )
    proc = podman("exec", server.container, "python", "-c", probe)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "EROFS"


def test_chat_completion(server):
    body = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 16,
        "temperature": 0,
    }
    request = urllib.request.Request(
        server.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        reply = json.load(resp)
    assert "Paris" in reply["choices"][0]["message"]["content"]
