"""Kubernetes Events on the `InferenceEngine` (posted only on condition transitions)."""

from __future__ import annotations

from typing import Any

from pagedinfer.operator.builders.meta import EngineRef
from pagedinfer.operator.conditions import now_iso
from pagedinfer.operator.k8s import KubeClient
from pagedinfer.operator.resources import Resource
from pagedinfer.operator.spec import GROUP, KIND, VERSION

EVENT = Resource("", "v1", "events", "Event")
COMPONENT = "pagedinfer-operator"


def build_event(ref: EngineRef, event_type: str, reason: str, message: str) -> dict[str, Any]:
    stamp = now_iso()
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{ref.name}.", "namespace": ref.namespace},
        "involvedObject": {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "name": ref.name,
            "namespace": ref.namespace,
            "uid": ref.uid,
        },
        "type": event_type,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


async def post_event(client: KubeClient, ref: EngineRef, event_type: str, reason: str, message: str) -> None:
    await client.create(EVENT, build_event(ref, event_type, reason, message))
