"""docker/cluster/*.sh: shellcheck clean, and each script's whole flow run against stand-in
docker/kind/minikube/kubectl/helm/nvidia-smi binaries that record their command lines (no
cluster here): create the cluster, build and load images, install the monitoring CRDs and the
operator chart, apply the sample, wait for Ready, port-forward and send the smoke requests."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "docker" / "cluster"
SCRIPTS = sorted(CLUSTER.glob("*.sh")) + [ROOT / "scripts" / "sync_crds.sh"]
ENGINE = "inferenceengine.serving.pagedinfer.io/smollm2"

# One stand-in for every tool, dispatching on its name; every call is appended to $STUB_LOG.
STUB = r"""#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "$STUB_LOG"
tool=$(basename "$0")
case "$tool $*" in
  "kind get clusters"*) exit 0 ;;
  "minikube status"*) exit 1 ;;
  "kubectl apply"*) echo "$STUB_ENGINE" ;;
  "kubectl wait"*) exit "${STUB_WAIT_RC:-0}" ;;
  "kubectl get nodes"*) echo "1" ;;
  *"servedModelName"*) echo "smollm2-135m" ;;
  *"httpPort"*) echo "8000" ;;
  *"grpcPort"*) echo "50051" ;;
  "kubectl port-forward"*) exec sleep 30 ;;
  "nvidia-smi"*) echo "GPU 0: NVIDIA H200" ;;
esac
exit 0
"""
# The smoke client's stand-in: like smoke.py it waits (up to 10 s) for the port-forward.
SMOKE_STUB = r"""#!/usr/bin/env bash
echo "stub $*" >> "$STUB_LOG"
for _ in $(seq 100); do
  grep -q "^kubectl port-forward" "$STUB_LOG" && exit 0
  sleep 0.1
done
exit 1
"""


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_shellcheck(path):
    proc = subprocess.run(
        [
            shutil.which("shellcheck", path=f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}")
            or "shellcheck",
            "-x",
            "--severity=style",
            str(path),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _run(
    script: str, tmp_path: Path, with_sample: bool = True, **env: str
) -> tuple[subprocess.CompletedProcess, list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "stub"
    stub.write_text(STUB)
    stub.chmod(0o755)
    for tool in ("docker", "kind", "minikube", "kubectl", "helm", "nvidia-smi"):
        (bin_dir / tool).symlink_to(stub)
    smoke = bin_dir / "smoke-stub"
    smoke.write_text(SMOKE_STUB)
    smoke.chmod(0o755)
    sample = tmp_path / "sample.yaml"
    sample.write_text("apiVersion: serving.pagedinfer.io/v1alpha1\nkind: InferenceEngine\n")
    log = tmp_path / "calls.log"
    full_env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "STUB_LOG": str(log),
        "STUB_ENGINE": ENGINE,
        "PYTHON": str(smoke),  # records the smoke client's arguments
        **({"SAMPLE": str(sample)} if with_sample else {}),
        **env,
    }
    proc = subprocess.run(
        ["bash", str(CLUSTER / script)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=60,
        cwd=tmp_path,
    )
    calls = log.read_text().splitlines() if log.exists() else []
    return proc, calls


def _index(calls: list[str], prefix: str) -> int:
    for i, call in enumerate(calls):
        if call.startswith(prefix):
            return i
    raise AssertionError(f"no call starting with {prefix!r} in:\n" + "\n".join(calls))


MONITORING_AND_OPERATOR = [
    "helm repo add prometheus-community",
    "helm upgrade --install prometheus-operator-crds prometheus-community/prometheus-operator-crds",
    "helm upgrade --install pagedinfer-operator " + str(ROOT / "charts" / "pagedinfer-operator"),
]


def _serve_flow(engine: str) -> list[str]:
    return [
        f"kubectl wait --namespace default --for=jsonpath={{.status.phase}}=Ready {engine}",
        "stub " + str(CLUSTER / "smoke.py"),
    ]


# The port-forward starts in the background, so its log line may land before or after the
# smoke client's; the smoke stand-in waits for it, as smoke.py retries until it is up.
def _port_forward(name: str) -> str:
    return f"kubectl port-forward --namespace default svc/{name} 18000:8000 15051:50051"


GPU_ENGINE = "inferenceengine.serving.pagedinfer.io/smollm2-gpu"
ENGINE_CHART = "helm upgrade --install smollm2-gpu " + str(ROOT / "charts" / "pagedinfer-engine")
CASES = {
    # script: (SAMPLE set, steps before the operator, how the engine is created, its resource)
    "kind-cpu.sh": (
        True,
        [
            "kind create cluster --name pagedinfer",
            "docker build -f " + str(ROOT / "docker" / "engine-cpu.Dockerfile"),
            "docker build -f " + str(ROOT / "docker" / "operator.Dockerfile"),
            "kind load docker-image --name pagedinfer ghcr.io/pagedinfer/engine-cpu:dev ghcr.io/pagedinfer/operator:dev",
        ],
        "kubectl apply --namespace default -f",
        ENGINE,
    ),
    "kind-gpu.sh": (
        False,
        [
            "nvidia-smi -L",
            "kind create cluster --name pagedinfer-gpu",
            "helm upgrade --install gpu-operator nvidia/gpu-operator",
            "kubectl get nodes",
            "docker build -f " + str(ROOT / "docker" / "engine-cuda.Dockerfile"),
            "kind load docker-image --name pagedinfer-gpu ghcr.io/pagedinfer/engine:dev ghcr.io/pagedinfer/operator:dev",
        ],
        ENGINE_CHART,
        GPU_ENGINE,
    ),
    "minikube-gpu.sh": (
        False,
        [
            "nvidia-smi -L",
            "minikube start --profile pagedinfer --driver docker --container-runtime docker --gpus all",
            "kubectl get nodes",
            "docker build -f " + str(ROOT / "docker" / "engine-cuda.Dockerfile"),
            "minikube image load --profile pagedinfer ghcr.io/pagedinfer/engine:dev",
        ],
        ENGINE_CHART,
        GPU_ENGINE,
    ),
}


@pytest.mark.parametrize("script", sorted(CASES))
def test_script_runs_the_whole_flow_in_order(script, tmp_path):
    with_sample, setup, create, engine = CASES[script]
    proc, calls = _run(script, tmp_path, with_sample=with_sample)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = setup + MONITORING_AND_OPERATOR + [create] + _serve_flow(engine)
    order = [_index(calls, prefix) for prefix in steps]
    assert order == sorted(order), "\n".join(calls)
    assert _index(calls, _port_forward(engine.rsplit("/", 1)[1])) > _index(calls, "kubectl wait")
    model = "smollm2-135m"
    smoke = calls[_index(calls, "stub " + str(CLUSTER / "smoke.py"))]
    assert f"--http http://127.0.0.1:18000 --grpc 127.0.0.1:15051 --model {model}" in smoke
    install = calls[_index(calls, "helm upgrade --install pagedinfer-operator ")]
    for flag in (
        "--set image.repository=ghcr.io/pagedinfer/operator --set image.tag=dev",
        "--set serviceMonitor.enabled=true",
        "--set prometheusRule.enabled=true",
        "--set dashboard.enabled=true",
    ):
        assert flag in install, install


def test_gpu_scripts_install_a_valid_one_gpu_engine(tmp_path):
    """The --set values the GPU scripts give the engine chart pass its CRD-derived schema."""
    proc, calls = _run("kind-gpu.sh", tmp_path, with_sample=False)
    assert proc.returncode == 0, proc.stderr
    words = calls[_index(calls, ENGINE_CHART)].split()
    sets = dict(words[i + 1].split("=", 1) for i, w in enumerate(words) if w == "--set")
    assert sets["resources.gpus"] == "1"
    values: dict = {}
    for key, value in sets.items():
        node = values
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = int(value) if value.isdigit() else value
    values_file = tmp_path / "values.json"
    values_file.write_text(json.dumps(values))
    helm = ROOT / ".tools" / "bin" / "helm"
    args = [
        str(helm),
        "template",
        "smollm2-gpu",
        str(ROOT / "charts" / "pagedinfer-engine"),
        "-f",
        str(values_file),
    ]
    env = {**os.environ, "HELM_CACHE_HOME": str(tmp_path / "c"), "HELM_CONFIG_HOME": str(tmp_path / "f")}
    out = subprocess.run(args, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    (ie,) = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert ie["spec"]["resources"]["gpus"] == 1 and ie["metadata"]["name"] == "smollm2-gpu"


def test_values_the_scripts_set_exist_in_the_chart(tmp_path):
    """Every --set key the scripts pass to the operator chart is a real value (the chart's
    schema forbids unknown keys, so helm template with them must succeed)."""
    proc, calls = _run("kind-cpu.sh", tmp_path)
    assert proc.returncode == 0, proc.stderr
    install = calls[_index(calls, "helm upgrade --install pagedinfer-operator ")].split()
    sets = [install[i + 1] for i, word in enumerate(install) if word == "--set"]
    assert len(sets) >= 8
    helm = ROOT / ".tools" / "bin" / "helm"
    args = [str(helm), "template", "x", str(ROOT / "charts" / "pagedinfer-operator")]
    for item in sets:
        args += ["--set", item]
    env = {**os.environ, "HELM_CACHE_HOME": str(tmp_path / "c"), "HELM_CONFIG_HOME": str(tmp_path / "f")}
    out = subprocess.run(args, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert 'image: "ghcr.io/pagedinfer/operator:dev"' in out.stdout


def test_not_ready_fails_with_diagnostics(tmp_path):
    proc, calls = _run("kind-cpu.sh", tmp_path, STUB_WAIT_RC="1")
    assert proc.returncode != 0
    assert "did not become Ready" in proc.stderr
    assert any(c.startswith(f"kubectl describe --namespace default {ENGINE}") for c in calls)
    assert not any("smoke.py" in c for c in calls)


def test_missing_tool_is_a_clear_error(tmp_path):
    proc, calls = _run("kind-cpu.sh", tmp_path, PATH="/usr/bin:/bin")
    assert proc.returncode != 0
    assert "is not installed" in proc.stderr
    assert calls == []


def test_monitoring_modes(tmp_path):
    (tmp_path / "none").mkdir()
    proc, calls = _run("kind-cpu.sh", tmp_path / "none", MONITORING="none", BUILD_IMAGES="0")
    assert proc.returncode == 0, proc.stderr
    assert not any(c.startswith("helm repo add prometheus-community") for c in calls)
    assert not any(c.startswith("docker build") for c in calls)
    install = calls[_index(calls, "helm upgrade --install pagedinfer-operator ")]
    assert "--set serviceMonitor.enabled=false" in install
    (tmp_path / "stack").mkdir()
    proc, calls = _run("kind-cpu.sh", tmp_path / "stack", MONITORING="stack")
    assert proc.returncode == 0, proc.stderr
    stack = calls[_index(calls, "helm upgrade --install kube-prometheus-stack")]
    assert "--set grafana.sidecar.dashboards.enabled=true" in stack
    (tmp_path / "bad").mkdir()
    proc, _ = _run("kind-cpu.sh", tmp_path / "bad", MONITORING="grafana")
    assert proc.returncode != 0 and "MONITORING must be" in proc.stderr


def test_a_sample_without_an_inference_engine_is_a_clear_error(tmp_path):
    proc, calls = _run("kind-cpu.sh", tmp_path, STUB_ENGINE="service/not-an-engine")
    assert proc.returncode != 0
    assert "holds no InferenceEngine" in proc.stderr
    assert not any(c.startswith("kubectl wait") for c in calls)
