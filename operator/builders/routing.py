"""InferencePool (Gateway API Inference Extension): inference gateways route to this engine's pods.

The pool selects exactly the pods of one InferenceEngine and names the HTTP port; the gateway's
endpoint picker then chooses a pod by the `vllm:*` queue and KV-cache gauges the engine exports.
"""

from __future__ import annotations

from typing import Any

from pagedinfer.operator.builders import meta
from pagedinfer.operator.builders.deployment import RenderInput

INFERENCE_POOL_API = "inference.networking.k8s.io/v1"


def build_inference_pool(inp: RenderInput) -> dict[str, Any] | None:
    """inference.networking.k8s.io/v1 InferencePool, or None when spec.routing.inferencePool is absent."""
    pool = inp.spec.routing.inference_pool
    if pool is None:
        return None
    spec: dict[str, Any] = {
        "selector": {"matchLabels": meta.selector_labels(inp.ref)},
        "targetPorts": [{"number": inp.spec.service.http_port}],
    }
    if pool.endpoint_picker is not None:
        picker = pool.endpoint_picker
        spec["endpointPickerRef"] = {
            "kind": "Service",
            "name": picker.name,
            "port": {"number": picker.port},
            "failureMode": picker.failure_mode.value,
        }
    return {
        "apiVersion": INFERENCE_POOL_API,
        "kind": "InferencePool",
        "metadata": meta.object_meta(inp.ref, inp.ref.name),
        "spec": spec,
    }
