"""charts/pagedinfer-engine: one InferenceEngine from values, valid against the CRD and the operator."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pagedinfer-engine"
VALUE_SETS: dict[str, dict[str, Any]] = {
    "cpu-sample": {},
    "gpu": {
        "name": "llama3-8b",
        "model": {"uri": "hf://meta-llama/Meta-Llama-3-8B-Instruct", "servedName": "llama3"},
        "image": "ghcr.io/pagedinfer/engine:0.1.0",
        "resources": {"gpus": 1, "cpu": 8, "memory": "48Gi"},
        "engine": {"dtype": "bfloat16", "maxNumSeqs": 256, "gpuMemoryUtilization": 0.9, "maxModelLen": 8192},
        "scheduling": {
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "runtimeClassName": "nvidia",
        },
        "monitoring": {"serviceMonitor": {"enabled": True, "interval": "15s"}},
    },
    "speculative-autoscaled": {
        "engine": {"speculative": {"method": "ngram", "numTokens": 4}},
        "autoscaling": {
            "enabled": True,
            "minReplicas": 1,
            "maxReplicas": 3,
            "metric": "kvCacheUsage",
            "target": 0.8,
        },
        "auth": {"apiKeySecretRef": {"name": "engine-api-key"}},
        "lifecycle": {"drainTimeoutSeconds": 20, "preStopSeconds": 5, "terminationGracePeriodSeconds": 60},
        "labels": {"team": "ml"},
        "annotations": {"owner": "ml-platform"},
    },
}
# Each violates the CRD (through the generated values.schema.json): helm refuses it.
BAD_VALUES: dict[str, dict[str, Any]] = {
    "unknown-field": {"engine": {"maxBatch": 4}},
    "too-many-gpus": {"resources": {"gpus": 17}},
    "bad-dtype": {"engine": {"dtype": "int4"}},
    "bad-block-size": {"engine": {"blockSize": 24}},
    "name-too-long": {"name": "a" * 51},
    "name-not-dns": {"name": "Llama_3"},
    "empty-model-uri": {"model": {"uri": ""}},
    "bad-service-type": {"service": {"type": "ExternalName"}},
}


@pytest.fixture(scope="module")
def rendered(helm) -> dict[str, list[dict[str, Any]]]:
    return {name: helm.template(CHART, values, release="smollm2") for name, values in VALUE_SETS.items()}


@pytest.mark.parametrize("name", VALUE_SETS)
def test_lint_and_render_one_valid_inference_engine(helm, rendered, validate, name):
    helm.lint(CHART, VALUE_SETS[name])
    objs = rendered[name]
    assert [o["kind"] for o in objs] == ["InferenceEngine"]
    validate(objs[0])  # CRD openAPIV3Schema (strict) + the operator's pydantic spec


@pytest.mark.parametrize("name", BAD_VALUES)
def test_schema_rejects_what_the_crd_rejects(helm, name):
    with pytest.raises(RuntimeError, match="values don't meet the specifications of the schema"):
        helm.template(CHART, BAD_VALUES[name])


def test_values_become_the_spec(rendered):
    ie = rendered["gpu"][0]
    assert ie["metadata"]["name"] == "llama3-8b"
    assert ie["metadata"]["namespace"] == "serving"
    spec = ie["spec"]
    assert spec["resources"] == {"gpus": 1, "cpu": 8, "memory": "48Gi"}
    assert spec["engine"]["dtype"] == "bfloat16"
    assert spec["scheduling"]["runtimeClassName"] == "nvidia"
    assert not {"name", "labels", "annotations"} & set(spec)
    extra = rendered["speculative-autoscaled"][0]
    assert extra["metadata"]["name"] == "smollm2"  # the release name by default
    assert extra["metadata"]["labels"]["team"] == "ml"
    assert extra["metadata"]["annotations"] == {"owner": "ml-platform"}
    assert extra["spec"]["auth"] == {"apiKeySecretRef": {"name": "engine-api-key"}}


def test_a_model_uri_takes_nothing_from_the_sample(helm):
    (ie,) = helm.template(CHART, {"model": {"uri": "hf://org/model"}, "resources": {"gpus": 1}})
    assert ie["spec"] == {"model": {"uri": "hf://org/model"}, "resources": {"gpus": 1}}


def test_values_without_a_model_go_on_top_of_the_sample(helm):
    (ie,) = helm.template(CHART, {"resources": {"gpus": 1}, "engine": {"dtype": "bfloat16"}})
    sample = yaml.safe_load((ROOT / "manifests" / "samples" / "smollm2-cpu.yaml").read_text())["spec"]
    assert ie["spec"]["model"] == sample["model"]
    assert ie["spec"]["resources"] == {**sample["resources"], "gpus": 1}
    assert ie["spec"]["engine"] == {**sample["engine"], "dtype": "bfloat16"}


def test_default_is_the_cpu_smollm2_sample(rendered):
    """`helm install NAME charts/pagedinfer-engine` creates exactly manifests/samples/smollm2-cpu.yaml."""
    from pagedinfer.engine.config import DEFAULT_MODEL_URI

    sample = yaml.safe_load((ROOT / "manifests" / "samples" / "smollm2-cpu.yaml").read_text())
    spec = rendered["cpu-sample"][0]["spec"]
    assert spec == sample["spec"]
    assert spec["model"]["uri"] == DEFAULT_MODEL_URI and spec["resources"]["gpus"] == 0


def test_the_operator_renders_the_engine_deployment(rendered, validate):
    """The operator's own builders accept the chart's CR, produce valid objects, and run the
    engine CLI with flags it parses."""
    from pagedinfer.engine.cli import build_parser
    from pagedinfer.operator.builders.deployment import RenderInput
    from pagedinfer.operator.builders.desired import desired_state
    from pagedinfer.operator.builders.meta import EngineRef
    from pagedinfer.operator.config import OperatorConfig
    from pagedinfer.operator.spec import InferenceEngineSpec

    for objs in rendered.values():
        body = {**objs[0], "metadata": {**objs[0]["metadata"], "uid": "uid-1", "generation": 1}}
        inp = RenderInput(
            EngineRef.from_body(body), InferenceEngineSpec.model_validate(body["spec"]), OperatorConfig()
        )
        desired = [d.body for d in desired_state(inp) if d.body is not None]
        for obj in desired:
            validate(obj)
        deployment = next(o for o in desired if o["kind"] == "Deployment")
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert container["command"] == ["pagedinfer"]
        build_parser().parse_args(container["args"])


def test_notes_show_how_to_reach_it(helm):
    from pagedinfer.operator.spec import ServiceSpec

    ports = ServiceSpec()
    notes = helm.notes(CHART, {"service": {"httpPort": 9000, "grpcPort": 9001}})
    assert "port-forward svc/pi 9000:9000 9001:9001" in notes and "localhost:9000/v1/chat" in notes
    notes = helm.notes(CHART)  # no service values: the CRD's default ports
    assert (
        f"port-forward svc/pi {ports.http_port}:{ports.http_port} {ports.grpc_port}:{ports.grpc_port}"
        in notes
    )
    notes = helm.notes(CHART, {"name": "tiny"}, namespace="demo")
    assert "kubectl -n demo port-forward svc/tiny 8000:8000 50051:50051" in notes
    assert '"model": "smollm2-135m"' in notes
    assert "CPU only" in notes


@pytest.mark.parametrize("sample", sorted(p.name for p in (ROOT / "manifests" / "samples").glob("*.yaml")))
def test_every_sample_can_be_installed_through_the_chart(helm, validate, sample):
    """The generated values schema is no stricter than the CRD: each operator sample, given as
    values, renders back to the same InferenceEngine."""
    (ie,) = [d for d in yaml.safe_load_all((ROOT / "manifests" / "samples" / sample).read_text()) if d]
    values = {**ie["spec"], "name": ie["metadata"]["name"]}
    (rendered,) = helm.template(CHART, values, release="r")
    assert rendered["spec"] == ie["spec"] and rendered["metadata"]["name"] == ie["metadata"]["name"]
    validate(rendered)
