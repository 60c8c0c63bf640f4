"""Rendering helpers shared by the builder tests."""

from __future__ import annotations

from typing import Any

from pagedinfer.operator.builders.deployment import RenderInput
from pagedinfer.operator.builders.meta import EngineRef
from pagedinfer.operator.config import OperatorConfig
from pagedinfer.operator.spec import InferenceEngineSpec

# Every spec field set (a GPU engine with every option): the examples of the builder and CRD tests.
FULL_SPEC: dict[str, Any] = {
    "model": {
        "uri": "hf://meta-llama/Meta-Llama-3-8B-Instruct",
        "servedName": "llama-3-8b",
        "revision": "main",
        "tokenSecretRef": {"name": "hf", "key": "token"},
    },
    "image": "ghcr.io/pagedinfer/engine:0.1.0",
    "imagePullPolicy": "Always",
    "replicas": 2,
    "resources": {"gpus": 2, "cpu": "8", "memory": "64Gi", "gpuResourceName": "nvidia.com/gpu"},
    "engine": {
        "dtype": "bfloat16",
        "blockSize": 16,
        "maxNumSeqs": 128,
        "maxModelLen": 8192,
        "gpuMemoryUtilization": 0.9,
        "enablePrefixCaching": True,
        "tensorParallelSize": 2,
        "speculative": {"method": "draft", "draftModel": "hf://meta-llama/Llama-3.2-1B", "numTokens": 4},
        "extraArgs": ["--seed", "1"],
    },
    "service": {"type": "ClusterIP", "grpcPort": 50051, "httpPort": 8000},
    "auth": {"apiKeySecretRef": {"name": "api", "key": "key"}},
    "autoscaling": {
        "enabled": True,
        "minReplicas": 1,
        "maxReplicas": 4,
        "metric": "kvCacheUsage",
        "target": 0.8,
    },
    "monitoring": {"serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "prom"}}},
    "routing": {"inferencePool": {"endpointPicker": {"name": "llm-epp", "port": 9002}}},
    "scheduling": {
        "nodeSelector": {"gpu": "h100"},
        "tolerations": [{"key": "dedicated", "operator": "Exists"}],
        "affinity": {"nodeAffinity": {}},
        "priorityClassName": "high",
        "runtimeClassName": "nvidia",
    },
    "modelCache": {"size": "50Gi", "storageClassName": "fast", "accessMode": "ReadWriteMany"},
    "lifecycle": {
        "startupTimeoutSeconds": 1200,
        "preStopSeconds": 5,
        "drainTimeoutSeconds": 30,
        "terminationGracePeriodSeconds": 60,
    },
}


REF = EngineRef(name="llama", namespace="ml", uid="uid-123", generation=2)


def render_input(spec: dict[str, Any], config: OperatorConfig | None = None) -> RenderInput:
    return RenderInput(REF, InferenceEngineSpec.model_validate(spec), config or OperatorConfig())


def pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]


def engine_container(deployment: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod_spec(deployment)["containers"] if c["name"] == "engine")


def arg_value(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None
