"""The whole desired state of one `InferenceEngine`: every owned object, or its absence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedinfer.operator import resources as res
from pagedinfer.operator.builders import meta
from pagedinfer.operator.builders.deployment import RenderInput, build_deployment
from pagedinfer.operator.builders.policies import build_hpa, build_pdb
from pagedinfer.operator.builders.routing import build_inference_pool
from pagedinfer.operator.builders.service import build_service, build_service_monitor
from pagedinfer.operator.builders.storage import build_model_cache_pvc


@dataclass(frozen=True)
class Desired:
    """One owned object: `body` to apply, or None when it must not exist."""

    resource: res.Resource
    name: str
    body: dict[str, Any] | None


def desired_state(inp: RenderInput) -> list[Desired]:
    """Pure: spec -> owned objects in apply order. Raises SpecError when it cannot be realised."""
    name = inp.ref.name
    return [
        Desired(res.PVC, meta.model_cache_name(inp.ref), build_model_cache_pvc(inp)),
        Desired(res.SERVICE, name, build_service(inp)),
        Desired(res.DEPLOYMENT, name, build_deployment(inp)),
        Desired(res.PDB, name, build_pdb(inp)),
        Desired(res.HPA, name, build_hpa(inp)),
        Desired(res.SERVICE_MONITOR, name, build_service_monitor(inp)),
        Desired(res.INFERENCE_POOL, name, build_inference_pool(inp)),
    ]
