"""PodDisruptionBudget (more than one replica) and HorizontalPodAutoscaler (autoscaling on)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from pagedinfer.operator.builders import meta
from pagedinfer.operator.builders.deployment import RenderInput
from pagedinfer.operator.spec import AutoscalingMetric

# The per-pod custom metric the HPA asks the custom metrics API for (e.g. via prometheus-adapter,
# which serves the engine's Prometheus gauge of the same name per pod).
HPA_METRIC_NAMES = {
    AutoscalingMetric.NUM_REQUESTS_WAITING: "pagedinfer_num_requests_waiting",
    AutoscalingMetric.KV_CACHE_USAGE: "pagedinfer_kv_cache_usage_ratio",
}


def max_replicas(inp: RenderInput) -> int:
    auto = inp.spec.autoscaling
    return auto.max_replicas if auto.enabled else inp.spec.replicas


def build_pdb(inp: RenderInput) -> dict[str, Any] | None:
    """Voluntary evictions take one pod at a time, so a rollout or drain never empties the service."""
    if max_replicas(inp) <= 1:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": meta.object_meta(inp.ref, inp.ref.name),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": meta.selector_labels(inp.ref)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def build_hpa(inp: RenderInput) -> dict[str, Any] | None:
    auto = inp.spec.autoscaling
    if not auto.enabled:
        return None
    metric = {
        "type": "Pods",
        "pods": {
            "metric": {"name": HPA_METRIC_NAMES[auto.metric]},
            "target": {"type": "AverageValue", "averageValue": quantity(auto.target)},
        },
    }
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": meta.object_meta(inp.ref, inp.ref.name),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": inp.ref.name},
            "minReplicas": auto.min_replicas,
            "maxReplicas": auto.max_replicas,
            "metrics": [metric],
            "behavior": {
                # Model loading is slow: scale up at once, scale down only after 5 quiet minutes.
                "scaleUp": {"stabilizationWindowSeconds": 0},
                "scaleDown": {"stabilizationWindowSeconds": 300},
            },
        },
    }


def quantity(value: float) -> str:
    """A float as a canonical Kubernetes quantity: 4.0 -> "4", 0.8 -> "800m"."""
    d = Decimal(str(value))
    if d == d.to_integral_value():
        return str(int(d))
    milli = (d * 1000).quantize(Decimal(1))
    return f"{int(milli)}m"
