"""The README's Helm and local-cluster sections only name files that exist, and the commands
they show match the charts (release names, flags, the sample's model)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("## Install on Kubernetes with Helm", "## Local clusters (kind/minikube)")
PATH_RE = re.compile(r"(?<![\w/.-])((?:charts|docker|manifests|scripts)/[\w./-]*[\w/])")


def _section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    assert title in text, f"README.md lacks {title!r}"
    body = text.split(title, 1)[1]
    return body.split("\n## ", 1)[0]


def test_every_path_in_the_sections_exists():
    for title in SECTIONS:
        for path in PATH_RE.findall(_section(title)):
            assert (ROOT / path).exists(), f"README ({title}) names {path}, which does not exist"


def test_the_documented_sample_is_the_cpu_smollm2_engine():
    from pagedinfer.engine.config import DEFAULT_MODEL_URI

    helm = _section(SECTIONS[0])
    (sample,) = re.findall(r"kubectl apply -f (manifests/samples/\S+)", helm)
    (ie,) = [
        d for d in yaml.safe_load_all((ROOT / sample).read_text()) if d and d["kind"] == "InferenceEngine"
    ]
    assert ie["spec"]["model"]["uri"] == DEFAULT_MODEL_URI
    assert ie["spec"].get("resources", {}).get("gpus", 0) == 0
    name = ie["metadata"]["name"]
    assert f"inferenceengine/{name}" in helm and f"svc/{name}" in helm
    served = ie["spec"]["model"].get("servedName", name)
    assert f'"model": "{served}"' in helm and f"--model {served}" in helm


def test_the_cpu_cluster_script_defaults_to_the_documented_sample():
    text = (ROOT / "docker" / "cluster" / "kind-cpu.sh").read_text()
    (default,) = re.findall(r"SAMPLE=\$\{SAMPLE:-\$REPO_ROOT/([^}]+)\}", text)
    (documented,) = re.findall(r"kubectl apply -f (manifests/samples/\S+)", _section(SECTIONS[0]))
    assert default == documented and (ROOT / default).is_file()
