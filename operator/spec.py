"""The `InferenceEngine` spec as pydantic models: the one source of truth for the CRD schema.

`crd.py` turns these models into the CRD's openAPIV3Schema (defaults, enums, bounds and the
CEL rules declared here in `x-kubernetes-validations`); the operator parses every CR through
the same models, and the Python validators below mirror the CEL rules so a cluster without
CEL (or the API mock in tests) still rejects what the CRD would.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

GROUP = "serving.pagedinfer.io"
VERSION = "v1alpha1"
PLURAL = "inferenceengines"
KIND = "InferenceEngine"

# A Kubernetes resource quantity ("500m", "8Gi", "1.5", "2e3").
QUANTITY_PATTERN = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"


def _rules(*rules: tuple[str, str]) -> dict[str, Any]:
    return {"x-kubernetes-validations": [{"rule": rule, "message": msg} for rule, msg in rules]}


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True, protected_namespaces=()
    )


class Dtype(str, Enum):
    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class SpeculativeMethod(str, Enum):
    NGRAM = "ngram"
    DRAFT = "draft"


class ServiceType(str, Enum):
    CLUSTER_IP = "ClusterIP"
    NODE_PORT = "NodePort"
    LOAD_BALANCER = "LoadBalancer"


class PullPolicy(str, Enum):
    ALWAYS = "Always"
    IF_NOT_PRESENT = "IfNotPresent"
    NEVER = "Never"


class AutoscalingMetric(str, Enum):
    """Per-pod metric the HPA scales on (served to it by e.g. prometheus-adapter)."""

    NUM_REQUESTS_WAITING = "numRequestsWaiting"  # pagedinfer_num_requests_waiting
    KV_CACHE_USAGE = "kvCacheUsage"  # pagedinfer_kv_cache_usage_ratio


class AccessMode(str, Enum):
    READ_WRITE_ONCE = "ReadWriteOnce"
    READ_WRITE_MANY = "ReadWriteMany"


class SecretKeyRef(_Model):
    name: str = Field(min_length=1, max_length=253)
    key: str = Field(default="api-key", min_length=1, max_length=253)


class ModelSpec(_Model):
    """Which weights to serve: builtin://NAME, hf://ORG/NAME, pvc://CLAIM/PATH or a path in the image."""

    uri: str = Field(min_length=1, max_length=512)
    served_name: str | None = Field(default=None, min_length=1, max_length=128)
    revision: str | None = Field(default=None, min_length=1, max_length=128)
    # HF_TOKEN for gated hf:// models, read by the download init container only.
    token_secret_ref: SecretKeyRef | None = None


class ResourcesSpec(_Model):
    """Compute for one replica; `gpus: 0` runs the CPU engine."""

    gpus: int = Field(default=0, ge=0, le=16)
    cpu: int | str = "2"
    memory: int | str = "8Gi"
    gpu_resource_name: str = Field(default="nvidia.com/gpu", min_length=1, max_length=253)

    @model_validator(mode="after")
    def _check_quantities(self) -> ResourcesSpec:
        _check_quantity("resources.cpu", self.cpu)
        _check_quantity("resources.memory", self.memory)
        return self


class SpeculativeSpec(_Model):
    model_config = ConfigDict(
        json_schema_extra=_rules(
            ("self.method != 'draft' || has(self.draftModel)", "draftModel is required when method is draft"),
            ("self.method != 'ngram' || !has(self.draftModel)", "draftModel is only used with method draft"),
        )
    )
    method: SpeculativeMethod
    draft_model: str | None = Field(default=None, min_length=1, max_length=512)
    num_tokens: int = Field(default=4, ge=1, le=16)

    @model_validator(mode="after")
    def _check_draft(self) -> SpeculativeSpec:
        if self.method is SpeculativeMethod.DRAFT and self.draft_model is None:
            raise ValueError("draftModel is required when method is draft")
        if self.method is SpeculativeMethod.NGRAM and self.draft_model is not None:
            raise ValueError("draftModel is only used with method draft")
        return self


class EngineSpec(_Model):
    """Engine flags, passed to `pagedinfer serve` one to one."""

    dtype: Dtype = Dtype.AUTO
    block_size: int = Field(default=16, json_schema_extra={"enum": [8, 16, 32, 64, 128]})
    max_num_seqs: int = Field(default=256, ge=1, le=4096)
    max_model_len: int | None = Field(default=None, ge=16, le=1048576)
    gpu_memory_utilization: float = Field(default=0.9, ge=0.1, le=0.99)
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = Field(default=1, ge=1, le=16)
    speculative: SpeculativeSpec | None = None
    extra_args: list[str] = Field(default_factory=list, max_length=64)

    @model_validator(mode="after")
    def _check_block_size(self) -> EngineSpec:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError("engine.blockSize must be one of 8, 16, 32, 64, 128")
        return self


class ServiceSpec(_Model):
    model_config = ConfigDict(
        json_schema_extra=_rules(("self.grpcPort != self.httpPort", "ports must differ"))
    )
    type: ServiceType = ServiceType.CLUSTER_IP
    grpc_port: int = Field(default=50051, ge=1024, le=65535)
    http_port: int = Field(default=8000, ge=1024, le=65535)

    @model_validator(mode="after")
    def _check_ports(self) -> ServiceSpec:
        if self.grpc_port == self.http_port:
            raise ValueError("service.grpcPort and service.httpPort must differ")
        return self


class AuthSpec(_Model):
    api_key_secret_ref: SecretKeyRef


class AutoscalingSpec(_Model):
    """An autoscaling/v2 HPA on a per-pod engine metric; it then owns the replica count."""

    model_config = ConfigDict(
        json_schema_extra=_rules(
            ("self.minReplicas <= self.maxReplicas", "minReplicas must be <= maxReplicas"),
            ("self.metric != 'kvCacheUsage' || self.target <= 1.0", "a kvCacheUsage target is a ratio <= 1"),
        )
    )
    enabled: bool = False
    min_replicas: int = Field(default=1, ge=1, le=1000)
    max_replicas: int = Field(default=4, ge=1, le=1000)
    metric: AutoscalingMetric = AutoscalingMetric.NUM_REQUESTS_WAITING
    target: float = Field(default=4.0, gt=0, le=10000)

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError("autoscaling.minReplicas must be <= maxReplicas")
        if self.metric is AutoscalingMetric.KV_CACHE_USAGE and self.target > 1.0:
            raise ValueError("a kvCacheUsage target is a ratio <= 1")
        return self


class ServiceMonitorSpec(_Model):
    enabled: bool = False
    interval: str = Field(default="30s", pattern=r"^[0-9]+(ms|s|m|h)$")
    labels: dict[str, str] = Field(default_factory=dict)


class MonitoringSpec(_Model):
    service_monitor: ServiceMonitorSpec = Field(default_factory=ServiceMonitorSpec)


class SchedulingSpec(_Model):
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    affinity: dict[str, Any] | None = None
    priority_class_name: str | None = Field(default=None, min_length=1, max_length=253)
    runtime_class_name: str | None = Field(default=None, min_length=1, max_length=253)


class ModelCacheSpec(_Model):
    """A PVC the model is downloaded into once, shared by restarts (and replicas with RWX)."""

    size: int | str
    storage_class_name: str | None = Field(default=None, min_length=1, max_length=253)
    access_mode: AccessMode = AccessMode.READ_WRITE_ONCE

    @model_validator(mode="after")
    def _check_size(self) -> ModelCacheSpec:
        _check_quantity("modelCache.size", self.size)
        return self


class LifecycleSpec(_Model):
    """Startup budget and drain: preStop delay, then SIGTERM and the engine's bounded drain."""

    model_config = ConfigDict(
        json_schema_extra=_rules(
            (
                "!has(self.terminationGracePeriodSeconds) || "
                "self.terminationGracePeriodSeconds > self.preStopSeconds + self.drainTimeoutSeconds",
                "terminationGracePeriodSeconds must exceed preStopSeconds + drainTimeoutSeconds",
            ),
        )
    )
    startup_timeout_seconds: int = Field(default=1800, ge=30, le=14400)
    pre_stop_seconds: int = Field(default=5, ge=0, le=120)
    drain_timeout_seconds: int = Field(default=30, ge=0, le=3600)
    termination_grace_period_seconds: int | None = Field(default=None, ge=1, le=7200)

    @model_validator(mode="after")
    def _check_grace(self) -> LifecycleSpec:
        grace = self.termination_grace_period_seconds
        if grace is not None and grace <= self.pre_stop_seconds + self.drain_timeout_seconds:
            raise ValueError("terminationGracePeriodSeconds must exceed preStopSeconds + drainTimeoutSeconds")
        return self

    @property
    def effective_grace_seconds(self) -> int:
        """What the pod gets: the user's value, else preStop + drain + 15 s of slack."""
        if self.termination_grace_period_seconds is not None:
            return self.termination_grace_period_seconds
        return self.pre_stop_seconds + self.drain_timeout_seconds + 15


TP_RULE = (
    "self.resources.gpus == 0 ? self.engine.tensorParallelSize == 1 "
    ": self.engine.tensorParallelSize <= self.resources.gpus"
)


class InferenceEngineSpec(_Model):
    """Desired state of one served model."""

    model_config = ConfigDict(
        json_schema_extra=_rules(
            (TP_RULE, "tensorParallelSize must be 1 on the CPU and <= gpus on GPUs"),
        )
    )
    model: ModelSpec
    image: str | None = Field(default=None, min_length=1, max_length=512)
    image_pull_policy: PullPolicy = PullPolicy.IF_NOT_PRESENT
    replicas: int = Field(default=1, ge=0, le=1000)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    service: ServiceSpec = Field(default_factory=ServiceSpec)
    auth: AuthSpec | None = None
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec)
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    model_cache: ModelCacheSpec | None = None
    lifecycle: LifecycleSpec = Field(default_factory=LifecycleSpec)

    @model_validator(mode="after")
    def _check_parallelism(self) -> InferenceEngineSpec:
        tp, gpus = self.engine.tensor_parallel_size, self.resources.gpus
        if (gpus == 0 and tp != 1) or (gpus > 0 and tp > gpus):
            raise ValueError("tensorParallelSize must be 1 on the CPU and <= gpus on GPUs")
        return self


def _check_quantity(field: str, value: int | str) -> None:
    import re

    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{field} must not be negative")
        return
    if not re.match(QUANTITY_PATTERN, value):
        raise ValueError(f"{field} is not a Kubernetes quantity: {value!r}")
