"""Deployment rendering: every spec field that lands in the pod, defaults, probes, drain, hardening."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
from operator_render_tools import FULL_SPEC, REF, arg_value, engine_container, pod_spec, render_input

from pagedinfer.operator.builders.deployment import build_deployment
from pagedinfer.operator.builders.meta import CONFIG_HASH_ANNOTATION
from pagedinfer.operator.config import OperatorConfig
from pagedinfer.operator.errors import SpecError

MINIMAL = {"model": {"uri": "builtin://smollm2-135m"}}


def test_minimal_cpu_defaults():
    dep = build_deployment(render_input(MINIMAL))
    c = engine_container(dep)
    args = c["args"]
    assert c["command"] == ["pagedinfer"] and args[0] == "serve"
    assert arg_value(args, "--model") == "builtin://smollm2-135m"
    assert arg_value(args, "--served-model-name") == REF.name
    assert arg_value(args, "--device") == "cpu"
    assert arg_value(args, "--dtype") == "auto"
    assert arg_value(args, "--block-size") == "16"
    assert arg_value(args, "--max-num-seqs") == "256"
    assert "--max-model-len" not in args
    assert arg_value(args, "--gpu-memory-utilization") == "0.9"
    assert "--enable-prefix-caching" in args
    assert arg_value(args, "--tensor-parallel-size") == "1"
    assert arg_value(args, "--host") == "0.0.0.0"
    assert arg_value(args, "--http-port") == "8000" and arg_value(args, "--grpc-port") == "50051"
    assert arg_value(args, "--drain-timeout") == "30"
    assert "--speculative-method" not in args and "--revision" not in args
    assert c["image"] == OperatorConfig().image_cpu
    assert c["resources"] == {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "8Gi"}}
    assert dep["spec"]["replicas"] == 1
    assert "initContainers" not in pod_spec(dep)
    assert "tolerations" not in pod_spec(dep)


def test_full_gpu_spec_reaches_the_pod():
    dep = build_deployment(render_input(FULL_SPEC))
    pod, c = pod_spec(dep), engine_container(dep)
    args = c["args"]
    assert arg_value(args, "--model") == "/models/hf/meta-llama--Meta-Llama-3-8B-Instruct@main"
    assert arg_value(args, "--served-model-name") == "llama-3-8b"
    assert arg_value(args, "--device") == "cuda"
    assert arg_value(args, "--dtype") == "bfloat16"
    assert arg_value(args, "--max-num-seqs") == "128"
    assert arg_value(args, "--max-model-len") == "8192"
    assert arg_value(args, "--tensor-parallel-size") == "2"
    assert arg_value(args, "--speculative-method") == "draft"
    assert arg_value(args, "--speculative-model") == "/models/hf/meta-llama--Llama-3.2-1B"
    assert arg_value(args, "--num-speculative-tokens") == "4"
    assert args[-2:] == ["--seed", "1"]
    assert c["image"] == "ghcr.io/pagedinfer/engine:0.1.0" and c["imagePullPolicy"] == "Always"
    assert c["resources"]["requests"]["nvidia.com/gpu"] == "2" == c["resources"]["limits"]["nvidia.com/gpu"]
    assert {"name": "PAGEDINFER_API_KEY", "valueFrom": {"secretKeyRef": {"name": "api", "key": "key"}}} in c[
        "env"
    ]
    # Two downloads into the model-cache PVC, each its own init container; the engine mounts it read-only.
    inits = pod["initContainers"]
    assert [i["name"] for i in inits] == ["fetch-model", "fetch-draft-model"]
    assert inits[0]["args"] == [
        "download",
        "--model",
        "hf://meta-llama/Meta-Llama-3-8B-Instruct",
        "--dest",
        "/models/hf/meta-llama--Meta-Llama-3-8B-Instruct@main",
        "--revision",
        "main",
    ]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in inits[0][
        "env"
    ]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "llama-model-cache"
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    # Scheduling is passed through; the GPU taint is tolerated automatically.
    assert pod["nodeSelector"] == {"gpu": "h100"}
    assert pod["affinity"] == {"nodeAffinity": {}}
    assert pod["priorityClassName"] == "high" and pod["runtimeClassName"] == "nvidia"
    assert {"key": "dedicated", "operator": "Exists"} in pod["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    # Autoscaling on: the Deployment does not carry replicas (the HPA owns them).
    assert "replicas" not in dep["spec"]


def test_security_settings_on_every_container():
    dep = build_deployment(render_input(FULL_SPEC))
    pod = pod_spec(dep)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    for c in pod["containers"] + pod["initContainers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["privileged"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]  # writable scratch


def test_probes_and_drain():
    spec = copy.deepcopy(MINIMAL) | {"lifecycle": {"startupTimeoutSeconds": 605, "preStopSeconds": 7}}
    dep = build_deployment(render_input(spec))
    c = engine_container(dep)
    assert c["startupProbe"]["httpGet"] == {"path": "/startup", "port": "http"}
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 605
    assert c["readinessProbe"]["grpc"] == {"port": 50051}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["lifecycle"]["preStop"] == {"sleep": {"seconds": 7}}
    grace = pod_spec(dep)["terminationGracePeriodSeconds"]
    assert grace > 7 + 30


@pytest.mark.parametrize(
    "pre_stop,drain,grace", [(0, 0, None), (5, 30, None), (120, 3600, None), (5, 30, 36)]
)
def test_grace_period_always_exceeds_prestop_plus_drain(pre_stop, drain, grace):
    lifecycle = {"preStopSeconds": pre_stop, "drainTimeoutSeconds": drain}
    if grace is not None:
        lifecycle["terminationGracePeriodSeconds"] = grace
    dep = build_deployment(render_input(MINIMAL | {"lifecycle": lifecycle}))
    assert pod_spec(dep)["terminationGracePeriodSeconds"] > pre_stop + drain
    assert arg_value(engine_container(dep)["args"], "--drain-timeout") == str(drain)
    assert ("lifecycle" in engine_container(dep)) == (pre_stop > 0)


def test_config_hash_changes_with_the_pod_and_only_then():
    base = build_deployment(render_input(MINIMAL))
    same = build_deployment(render_input(MINIMAL | {"replicas": 5}))
    changed = build_deployment(render_input(MINIMAL | {"engine": {"maxNumSeqs": 64}}))
    h = lambda d: d["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]  # noqa: E731
    assert h(base) == h(same)
    assert h(base) != h(changed)


def test_owner_reference_and_labels():
    dep = build_deployment(render_input(MINIMAL))
    owner = dep["metadata"]["ownerReferences"][0]
    assert owner == {
        "apiVersion": "serving.pagedinfer.io/v1alpha1",
        "kind": "InferenceEngine",
        "name": "llama",
        "uid": "uid-123",
        "controller": True,
        "blockOwnerDeletion": True,
    }
    labels = dep["metadata"]["labels"]
    assert labels["app.kubernetes.io/managed-by"] == "pagedinfer-operator"
    assert labels["serving.pagedinfer.io/engine"] == "llama"
    selector = dep["spec"]["selector"]["matchLabels"]
    assert selector.items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def test_model_uri_schemes():
    pvc = build_deployment(render_input({"model": {"uri": "pvc://weights/llama/8b"}}))
    c = engine_container(pvc)
    assert arg_value(c["args"], "--model") == "/models/pvc/weights/llama/8b"
    volume = next(v for v in pod_spec(pvc)["volumes"] if v["name"] == "pvc-weights")
    assert volume["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    image_path = build_deployment(render_input({"model": {"uri": "/opt/models/x", "revision": "r1"}}))
    assert arg_value(engine_container(image_path)["args"], "--model") == "/opt/models/x"
    assert arg_value(engine_container(image_path)["args"], "--revision") == "r1"
    hf_no_cache = build_deployment(render_input({"model": {"uri": "hf://org/name"}}))
    models = next(v for v in pod_spec(hf_no_cache)["volumes"] if v["name"] == "models")
    assert models == {"name": "models", "emptyDir": {}}
    for bad in [
        "s3://bucket/x",
        "hf://justname",
        "pvc://Bad_Claim/x",
        "pvc://c/../etc",
        "relative/path",
        "builtin://",
    ]:
        with pytest.raises(SpecError) as err:
            build_deployment(render_input({"model": {"uri": bad}}))
        assert err.value.reason == "UnsupportedModelURI"


def test_operator_config_images_and_prefix_caching_off():
    cfg = OperatorConfig(image_cpu="reg/cpu:1", image_gpu="reg/gpu:1")
    cpu = engine_container(
        build_deployment(render_input(MINIMAL | {"engine": {"enablePrefixCaching": False}}, cfg))
    )
    assert cpu["image"] == "reg/cpu:1" and "--no-enable-prefix-caching" in cpu["args"]
    gpu = engine_container(build_deployment(render_input(MINIMAL | {"resources": {"gpus": 1}}, cfg)))
    assert gpu["image"] == "reg/gpu:1"
    amd = MINIMAL | {"resources": {"gpus": 1, "gpuResourceName": "amd.com/gpu"}}
    pod = pod_spec(build_deployment(render_input(amd)))
    assert pod["containers"][0]["resources"]["limits"]["amd.com/gpu"] == "1"
    assert pod["tolerations"] == [{"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


@pytest.mark.parametrize("spec", [MINIMAL, FULL_SPEC], ids=["minimal", "full"])
def test_validates_offline_against_kubernetes_schema(spec):
    dep = build_deployment(render_input(spec))
    assert kubernetes_validate.validate(dep, "1.30.0", strict=True)


@pytest.mark.parametrize(("gpus", "tp"), [(1, 1), (2, 2), (4, 2), (8, 8)])
def test_tensor_parallel_size_drives_flag_gpus_and_shared_memory(gpus, tp):
    spec = copy.deepcopy(FULL_SPEC)
    spec["resources"]["gpus"] = gpus
    spec["engine"]["tensorParallelSize"] = tp
    dep = build_deployment(render_input(spec))
    pod, c = pod_spec(dep), engine_container(dep)
    assert arg_value(c["args"], "--tensor-parallel-size") == str(tp)
    assert (
        c["resources"]["requests"]["nvidia.com/gpu"]
        == str(gpus)
        == c["resources"]["limits"]["nvidia.com/gpu"]
    )
    # NCCL's shared-memory transport between the ranks: memory-backed, 1 GiB per rank
    (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": f"{tp}Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    kubernetes_validate.validate(dep, "1.33", strict=True)


def test_tensor_parallel_above_gpus_is_refused():
    spec = copy.deepcopy(FULL_SPEC)
    spec["engine"]["tensorParallelSize"] = 4
    with pytest.raises((SpecError, ValueError), match="tensorParallelSize must be 1 on the CPU and <= gpus"):
        build_deployment(render_input(spec))
