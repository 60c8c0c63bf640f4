"""The model-cache PersistentVolumeClaim (only when spec.modelCache is set)."""

from __future__ import annotations

from typing import Any

from pagedinfer.operator.builders import meta
from pagedinfer.operator.builders.deployment import RenderInput


def build_model_cache_pvc(inp: RenderInput) -> dict[str, Any] | None:
    cache = inp.spec.model_cache
    if cache is None:
        return None
    spec: dict[str, Any] = {
        "accessModes": [cache.access_mode.value],
        "resources": {"requests": {"storage": str(cache.size)}},
    }
    if cache.storage_class_name:
        spec["storageClassName"] = cache.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": meta.object_meta(inp.ref, meta.model_cache_name(inp.ref)),
        "spec": spec,
    }
