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


def _rules(*rules: tuple[str, str, str]) -> dict[str, Any]:
    """CEL rules as (rule, message, fieldPath): the API server names the field in its error."""
    return {
        "x-kubernetes-validations": [
            {"rule": rule, "message": msg, "fieldPath": path} for rule, msg, path in rules
        ]
    }


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        protected_namespaces=(),
        # A field's docstring is its description in the CRD (`kubectl explain` shows it).
        use_attribute_docstrings=True,
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


class FailureMode(str, Enum):
    FAIL_OPEN = "FailOpen"
    FAIL_CLOSE = "FailClose"


class SecretKeyRef(_Model):
    name: str = Field(min_length=1, max_length=253)
    """Name of a Secret in the InferenceEngine's namespace."""
    key: str = Field(default="api-key", min_length=1, max_length=253)
    """Key inside the Secret."""


class ModelSpec(_Model):
    """Which weights to serve: builtin://NAME, hf://ORG/NAME, pvc://CLAIM/PATH or a path in the image."""

    uri: str = Field(min_length=1, max_length=512)
    """builtin://NAME (weights inside the image), hf://ORG/NAME, pvc://CLAIM/PATH, or a path in the image."""
    served_name: str | None = Field(default=None, min_length=1, max_length=128)
    """Model name clients send in the OpenAI `model` field; default: the last part of the URI."""
    revision: str | None = Field(default=None, min_length=1, max_length=128)
    """Branch, tag or commit of an hf:// model."""
    token_secret_ref: SecretKeyRef | None = None
    """Secret holding HF_TOKEN for gated hf:// models (read by the download init container only)."""


class ResourcesSpec(_Model):
    """Compute for one replica; `gpus: 0` runs the CPU engine."""

    gpus: int = Field(default=0, ge=0, le=16)
    """GPUs per replica; 0 runs the CPU engine."""
    cpu: int | str = "2"
    """CPU request and limit per replica (a Kubernetes quantity)."""
    memory: int | str = "8Gi"
    """Memory request and limit per replica (a Kubernetes quantity)."""
    gpu_resource_name: str = Field(default="nvidia.com/gpu", min_length=1, max_length=253)
    """Extended resource name of the GPUs (e.g. nvidia.com/gpu, or a MIG profile)."""

    @model_validator(mode="after")
    def _check_quantities(self) -> ResourcesSpec:
        _check_quantity("resources.cpu", self.cpu)
        _check_quantity("resources.memory", self.memory)
        return self


class SpeculativeSpec(_Model):
    model_config = ConfigDict(
        json_schema_extra=_rules(
            (
                "self.method != 'draft' || has(self.draftModel)",
                "draftModel is required when method is draft",
                ".draftModel",
            ),
            (
                "self.method != 'ngram' || !has(self.draftModel)",
                "draftModel is only used with method draft",
                ".draftModel",
            ),
        )
    )
    method: SpeculativeMethod
    """ngram: prompt lookup (no extra model); draft: a small model of the same tokenizer proposes."""
    draft_model: str | None = Field(default=None, min_length=1, max_length=512)
    """URI of the draft model (method draft only), in the same forms as model.uri."""
    num_tokens: int = Field(default=4, ge=1, le=16)
    """Tokens proposed per step."""

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
    """Weight and activation dtype; auto: bfloat16 on GPUs, float32 on the CPU."""
    block_size: int = Field(default=16, json_schema_extra={"enum": [8, 16, 32, 64, 128]})
    """Tokens per KV-cache block."""
    max_num_seqs: int = Field(default=256, ge=1, le=4096)
    """Most sequences in one batch."""
    max_model_len: int | None = Field(default=None, ge=16, le=1048576)
    """Longest prompt + output in tokens; default: the model's context length."""
    gpu_memory_utilization: float = Field(default=0.9, ge=0.1, le=0.99)
    """Fraction of GPU memory the engine may use (weights, activations, KV cache)."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes."""
    tensor_parallel_size: int = Field(default=1, ge=1, le=16)
    """GPUs one model is sharded over (<= resources.gpus)."""
    speculative: SpeculativeSpec | None = None
    """Speculative decoding; absent: off."""
    extra_args: list[str] = Field(default_factory=list, max_length=64)
    """Further `pagedinfer serve` flags, appended as given."""

    @model_validator(mode="after")
    def _check_block_size(self) -> EngineSpec:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError("engine.blockSize must be one of 8, 16, 32, 64, 128")
        return self


class ServiceSpec(_Model):
    model_config = ConfigDict(
        json_schema_extra=_rules(("self.grpcPort != self.httpPort", "ports must differ", ".grpcPort"))
    )
    type: ServiceType = ServiceType.CLUSTER_IP
    """Kubernetes Service type."""
    grpc_port: int = Field(default=50051, ge=1024, le=65535)
    """gRPC port (container and Service)."""
    http_port: int = Field(default=8000, ge=1024, le=65535)
    """HTTP port: OpenAI API, WebSocket, probes and /metrics."""

    @model_validator(mode="after")
    def _check_ports(self) -> ServiceSpec:
        if self.grpc_port == self.http_port:
            raise ValueError("service.grpcPort and service.httpPort must differ")
        return self


class AuthSpec(_Model):
    api_key_secret_ref: SecretKeyRef
    """Secret holding the API key clients must send as a bearer token."""


class AutoscalingSpec(_Model):
    """An autoscaling/v2 HPA on a per-pod engine metric; it then owns the replica count."""

    model_config = ConfigDict(
        json_schema_extra=_rules(
            ("self.minReplicas <= self.maxReplicas", "minReplicas must be <= maxReplicas", ".minReplicas"),
            (
                "self.metric != 'kvCacheUsage' || self.target <= 1.0",
                "a kvCacheUsage target is a ratio <= 1",
                ".target",
            ),
        )
    )
    enabled: bool = False
    """Create an HPA; it then owns the replica count (spec.replicas is its starting point)."""
    min_replicas: int = Field(default=1, ge=1, le=1000)
    """Fewest replicas the HPA keeps."""
    max_replicas: int = Field(default=4, ge=1, le=1000)
    """Most replicas the HPA makes."""
    metric: AutoscalingMetric = AutoscalingMetric.NUM_REQUESTS_WAITING
    """Per-pod metric to scale on (served to the HPA by e.g. prometheus-adapter)."""
    target: float = Field(default=4.0, gt=0, le=10000)
    """Average per-pod value the HPA aims for (kvCacheUsage: a ratio <= 1)."""

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError("autoscaling.minReplicas must be <= maxReplicas")
        if self.metric is AutoscalingMetric.KV_CACHE_USAGE and self.target > 1.0:
            raise ValueError("a kvCacheUsage target is a ratio <= 1")
        return self


class ServiceMonitorSpec(_Model):
    enabled: bool = False
    """Create a ServiceMonitor (needs the Prometheus Operator's CRD)."""
    interval: str = Field(default="30s", pattern=r"^[0-9]+(ms|s|m|h)$")
    """Scrape interval."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Extra labels so a Prometheus instance selects the ServiceMonitor."""


class MonitoringSpec(_Model):
    service_monitor: ServiceMonitorSpec = Field(default_factory=ServiceMonitorSpec)
    """Prometheus Operator scraping of this engine's /metrics."""


class EndpointPickerSpec(_Model):
    """The Gateway API Inference Extension's endpoint picker (EPP) Service the gateway asks."""

    name: str = Field(min_length=1, max_length=253)
    """Name of the endpoint picker's Service in this namespace."""
    port: int = Field(default=9002, ge=1, le=65535)
    """gRPC port of the endpoint picker."""
    failure_mode: FailureMode = FailureMode.FAIL_CLOSE
    """What the gateway does when the picker does not answer."""


class InferencePoolSpec(_Model):
    """An InferencePool (inference.networking.k8s.io/v1) selecting exactly this engine's pods."""

    endpoint_picker: EndpointPickerSpec | None = None
    """The endpoint picker the pool names; absent: the pool has none (set it before routing)."""


class RoutingSpec(_Model):
    inference_pool: InferencePoolSpec | None = None
    """Join the Gateway API Inference Extension; absent: no InferencePool."""


class SchedulingSpec(_Model):
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels the pods must match."""
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    """Pod tolerations (Kubernetes Toleration objects)."""
    affinity: dict[str, Any] | None = None
    """Pod affinity (a Kubernetes Affinity object)."""
    priority_class_name: str | None = Field(default=None, min_length=1, max_length=253)
    """PriorityClass of the pods."""
    runtime_class_name: str | None = Field(default=None, min_length=1, max_length=253)
    """RuntimeClass of the pods (e.g. nvidia)."""


class ModelCacheSpec(_Model):
    """A PVC the model is downloaded into once, shared by restarts (and replicas with RWX)."""

    size: int | str
    """Size of the PVC (a Kubernetes quantity)."""
    storage_class_name: str | None = Field(default=None, min_length=1, max_length=253)
    """StorageClass of the PVC; default: the cluster's default class."""
    access_mode: AccessMode = AccessMode.READ_WRITE_ONCE
    """ReadWriteMany lets replicas on several nodes share one download."""

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
                ".terminationGracePeriodSeconds",
            ),
        )
    )
    startup_timeout_seconds: int = Field(default=1800, ge=30, le=14400)
    """Time a pod may take to download and load the model before the startup probe fails it."""
    pre_stop_seconds: int = Field(default=5, ge=0, le=120)
    """Delay before SIGTERM, while endpoints stop sending traffic to the pod."""
    drain_timeout_seconds: int = Field(default=30, ge=0, le=3600)
    """Time the engine finishes running requests after SIGTERM."""
    termination_grace_period_seconds: int | None = Field(default=None, ge=1, le=7200)
    """Pod grace period; default: preStopSeconds + drainTimeoutSeconds + 15."""

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
            (
                TP_RULE,
                "tensorParallelSize must be 1 on the CPU and <= gpus on GPUs",
                ".engine.tensorParallelSize",
            ),
        )
    )
    model: ModelSpec
    """The weights to serve."""
    image: str | None = Field(default=None, min_length=1, max_length=512)
    """Engine image; default: the operator's CPU or GPU engine image."""
    image_pull_policy: PullPolicy = PullPolicy.IF_NOT_PRESENT
    """Pull policy of the engine image."""
    replicas: int = Field(default=1, ge=0, le=1000)
    """Engine pods; with autoscaling on, the HPA owns this number (`kubectl scale` works too)."""
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    """Compute for one replica."""
    engine: EngineSpec = Field(default_factory=EngineSpec)
    """Engine flags."""
    service: ServiceSpec = Field(default_factory=ServiceSpec)
    """The Service in front of the pods."""
    auth: AuthSpec | None = None
    """API-key authentication; absent: open."""
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    """Horizontal autoscaling on an engine metric."""
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec)
    """Prometheus Operator integration."""
    routing: RoutingSpec = Field(default_factory=RoutingSpec)
    """Inference-gateway integration."""
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    """Where the pods may run."""
    model_cache: ModelCacheSpec | None = None
    """A PVC the model is downloaded into once; absent: each pod downloads into an emptyDir."""
    lifecycle: LifecycleSpec = Field(default_factory=LifecycleSpec)
    """Startup budget and graceful drain."""

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
