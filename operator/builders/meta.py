"""Names, labels and owner references shared by every owned object."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from pagedinfer.operator.spec import GROUP, KIND, VERSION

MANAGED_BY = "pagedinfer-operator"
APP_NAME = "pagedinfer-engine"
ENGINE_LABEL = f"{GROUP}/engine"  # the owning CR's name, on every owned object
CONFIG_HASH_ANNOTATION = f"{GROUP}/config-hash"
MANAGED_SELECTOR = {"app.kubernetes.io/managed-by": MANAGED_BY}


@dataclass(frozen=True)
class EngineRef:
    """Identity of one `InferenceEngine` object."""

    name: str
    namespace: str
    uid: str
    generation: int | None = None

    @staticmethod
    def from_body(body: Any) -> EngineRef:
        meta = body["metadata"]
        return EngineRef(meta["name"], meta["namespace"], meta.get("uid", ""), meta.get("generation"))


def selector_labels(ref: EngineRef) -> dict[str, str]:
    """Immutable pod selector (a Deployment's selector can never change)."""
    return {"app.kubernetes.io/name": APP_NAME, "app.kubernetes.io/instance": ref.name}


def common_labels(ref: EngineRef) -> dict[str, str]:
    return {
        **selector_labels(ref),
        "app.kubernetes.io/component": "inference-engine",
        "app.kubernetes.io/part-of": "pagedinfer",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        ENGINE_LABEL: ref.name,
    }


def selector_string(ref: EngineRef) -> str:
    """The scale subresource's status.selector."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(ref).items()))


def owner_reference(ref: EngineRef) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": ref.name,
        "uid": ref.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def object_meta(ref: EngineRef, name: str, extra_labels: dict[str, str] | None = None) -> dict[str, Any]:
    labels = {**(extra_labels or {}), **common_labels(ref)}
    return {
        "name": name,
        "namespace": ref.namespace,
        "labels": labels,
        "ownerReferences": [owner_reference(ref)],
    }


def config_hash(obj: Any) -> str:
    """A short stable digest of a JSON-able value (the pod template: changing it rolls the pods)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def model_cache_name(ref: EngineRef) -> str:
    return f"{ref.name}-model-cache"
