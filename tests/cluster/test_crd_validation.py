"""The InferenceEngine CRD's schema and CEL rules as a real API server enforces them."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from cluster_tools import Cli, CommandError, engine

from pagedinfer.operator.spec import InferenceEngineSpec

MINIMAL = {"model": {"uri": "builtin://smollm2-135m"}}


def _with(path: str, value: Any) -> dict[str, Any]:
    spec = copy.deepcopy(MINIMAL)
    node = spec
    keys = path.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value
    return spec


# (id, spec, the field the error must name, words of the message)
INVALID = [
    ("no-model", {"replicas": 1}, "spec.model", "Required value"),
    ("empty-uri", {"model": {"uri": ""}}, "spec.model.uri", "at least 1"),
    ("negative-replicas", _with("replicas", -1), "spec.replicas", "greater than or equal to 0"),
    ("unknown-field", _with("replica", 2), ".spec.replica", "field not declared in schema"),
    ("bad-dtype", _with("engine.dtype", "int8"), "spec.engine.dtype", "Unsupported value"),
    ("bad-block-size", _with("engine.blockSize", 24), "spec.engine.blockSize", "Unsupported value"),
    (
        "memory-utilization",
        _with("engine.gpuMemoryUtilization", 1.5),
        "spec.engine.gpuMemoryUtilization",
        "0.99",
    ),
    (
        "same-ports",
        _with("service", {"httpPort": 9000, "grpcPort": 9000}),
        "spec.service.grpcPort",
        "ports must differ",
    ),
    ("low-port", _with("service.httpPort", 80), "spec.service.httpPort", "1024"),
    ("bad-service-type", _with("service.type", "Headless"), "spec.service.type", "Unsupported value"),
    (
        "min-above-max",
        _with("autoscaling", {"enabled": True, "minReplicas": 5, "maxReplicas": 2}),
        "spec.autoscaling.minReplicas",
        "minReplicas must be <= maxReplicas",
    ),
    (
        "kv-target-ratio",
        _with("autoscaling", {"metric": "kvCacheUsage", "target": 80}),
        "spec.autoscaling.target",
        "ratio <= 1",
    ),
    (
        "draft-without-model",
        _with("engine.speculative", {"method": "draft"}),
        "spec.engine.speculative.draftModel",
        "draftModel is required",
    ),
    (
        "ngram-with-draft-model",
        _with("engine.speculative", {"method": "ngram", "draftModel": "builtin://smollm2-135m"}),
        "spec.engine.speculative.draftModel",
        "only used with method draft",
    ),
    (
        "tp-on-cpu",
        _with("engine.tensorParallelSize", 2),
        "spec.engine.tensorParallelSize",
        "tensorParallelSize must be 1 on the CPU",
    ),
    (
        "tp-above-gpus",
        {**_with("engine.tensorParallelSize", 4), "resources": {"gpus": 2}},
        "spec.engine.tensorParallelSize",
        "<= gpus",
    ),
    (
        "tp-one-above-gpus",
        {**_with("engine.tensorParallelSize", 3), "resources": {"gpus": 2}},
        "spec.engine.tensorParallelSize",
        "tensorParallelSize must be 1 on the CPU and <= gpus on GPUs",
    ),
    ("too-many-gpus", _with("resources.gpus", 64), "spec.resources.gpus", "less than or equal to 16"),
    (
        "grace-too-short",
        _with(
            "lifecycle",
            {"preStopSeconds": 10, "drainTimeoutSeconds": 30, "terminationGracePeriodSeconds": 20},
        ),
        "spec.lifecycle.terminationGracePeriodSeconds",
        "must exceed",
    ),
    (
        "bad-interval",
        _with("monitoring.serviceMonitor.interval", "soon"),
        "spec.monitoring.serviceMonitor.interval",
        "should match",
    ),
    (
        "cache-without-size",
        _with("modelCache", {"accessMode": "ReadWriteOnce"}),
        "spec.modelCache.size",
        "Required value",
    ),
    (
        "picker-without-name",
        _with("routing.inferencePool", {"endpointPicker": {"port": 9002}}),
        "spec.routing.inferencePool.endpointPicker.name",
        "Required value",
    ),
    ("bad-pull-policy", _with("imagePullPolicy", "Sometimes"), "spec.imagePullPolicy", "Unsupported value"),
]


@pytest.mark.parametrize(("spec", "field", "words"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_engine_is_rejected_naming_the_field(
    cli: Cli, crds: None, namespace: str, spec, field, words
):
    with pytest.raises(CommandError) as err:
        cli.apply(engine("bad", namespace, spec))
    message = err.value.stderr
    assert field in message, message
    assert words in message, message
    assert cli.get("inferenceengine", "bad", namespace) is None


@pytest.mark.parametrize(("gpus", "tp"), [(2, 2), (4, 2), (8, 8)])
def test_tensor_parallel_within_gpus_is_accepted(cli: Cli, crds: None, namespace: str, gpus: int, tp: int):
    name = f"tp{tp}-of-{gpus}"
    cli.apply(
        engine(name, namespace, {**_with("engine.tensorParallelSize", tp), "resources": {"gpus": gpus}})
    )
    live = cli.get("inferenceengine", name, namespace)
    assert live["spec"]["engine"]["tensorParallelSize"] == tp and live["spec"]["resources"]["gpus"] == gpus


def test_bad_name_is_rejected(cli: Cli, crds: None, namespace: str):
    with pytest.raises(CommandError) as err:
        cli.apply(engine("a" * 60, namespace, MINIMAL))
    assert "metadata.name must be a DNS-1035 label of at most 50 characters" in err.value.stderr


def test_model_uri_alone_gets_a_full_valid_spec(cli: Cli, crds: None, namespace: str):
    cli.apply(engine("minimal", namespace, MINIMAL))
    live = cli.get("inferenceengine", "minimal", namespace)
    assert live is not None
    parsed = InferenceEngineSpec.model_validate(live["spec"])
    expected = InferenceEngineSpec.model_validate(MINIMAL).model_dump(
        mode="json", by_alias=True, exclude_none=True
    )
    # Every defaulted field the operator would assume is written into the object by the server.
    assert parsed.model_dump(mode="json", by_alias=True, exclude_none=True) == expected
    for key in ("resources", "engine", "service", "autoscaling", "monitoring", "lifecycle", "scheduling"):
        assert live["spec"][key] == expected[key], key


def test_every_defaulted_variant_is_valid(cli: Cli, crds: None, namespace: str):
    """Objects the defaults complete (a sub-object given as {}) pass every CEL rule."""
    for i, key in enumerate(["autoscaling", "service", "lifecycle", "engine", "monitoring", "routing"]):
        cli.apply(engine(f"defaults-{i}", namespace, {**MINIMAL, key: {}}))
        assert cli.get("inferenceengine", f"defaults-{i}", namespace) is not None
