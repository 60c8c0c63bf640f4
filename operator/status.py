"""The `InferenceEngine` status as pydantic models (the CRD's status schema is generated from them)."""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class Phase(str, Enum):
    PENDING = "Pending"  # nothing scheduled yet (or scaled to zero)
    LOADING = "Loading"  # pods exist, none ready: pulling the image, downloading or loading weights
    READY = "Ready"  # every desired replica is ready
    DEGRADED = "Degraded"  # serving, but fewer ready replicas than desired
    FAILED = "Failed"  # the spec cannot be realised, or the rollout exceeded its deadline


class ConditionStatus(str, Enum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class ConditionType(str, Enum):
    AVAILABLE = "Available"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
    MONITORING = "MonitoringConfigured"
    ROUTING = "RoutingConfigured"


class Condition(_Model):
    """A standard Kubernetes condition (metav1.Condition)."""

    type: str
    status: ConditionStatus
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", max_length=1024)
    message: str = Field(default="", max_length=32768)
    last_transition_time: str | None = Field(default=None, json_schema_extra={"format": "date-time"})
    observed_generation: int | None = Field(default=None, ge=0)


class Endpoints(_Model):
    grpc: str
    http: str


class Stats(_Model):
    """Live numbers summed (tokens/s, requests) or averaged (KV usage) over the scraped pods."""

    tokens_per_second: float = 0.0
    kv_cache_usage_percent: int = Field(default=0, ge=0, le=100)
    num_requests_waiting: int = Field(default=0, ge=0)
    num_requests_running: int = Field(default=0, ge=0)
    num_pods_scraped: int = Field(default=0, ge=0)


class InferenceEngineStatus(_Model):
    phase: Phase = Phase.PENDING
    ready: str | None = None  # "readyReplicas/desired", for the printer column
    replicas: int = 0
    ready_replicas: int = 0
    updated_replicas: int = 0
    observed_generation: int | None = None
    selector: str | None = None
    served_model_name: str | None = None
    endpoints: Endpoints | None = None
    inference_pool: str | None = None  # name of the owned InferencePool, when routing asks for one
    stats: Stats | None = None
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
