"""The Service (named grpc and http ports) and the optional ServiceMonitor."""

from __future__ import annotations

from typing import Any

from pagedinfer.operator.builders import meta
from pagedinfer.operator.builders.deployment import RenderInput


def build_service(inp: RenderInput) -> dict[str, Any]:
    svc = inp.spec.service
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta.object_meta(inp.ref, inp.ref.name),
        "spec": {
            "type": svc.type.value,
            "selector": meta.selector_labels(inp.ref),
            "ports": [
                {
                    "name": "grpc",
                    "port": svc.grpc_port,
                    "targetPort": "grpc",
                    "protocol": "TCP",
                    "appProtocol": "kubernetes.io/h2c",
                },
                {"name": "http", "port": svc.http_port, "targetPort": "http", "protocol": "TCP"},
            ],
        },
    }


def endpoints(inp: RenderInput) -> dict[str, str]:
    """In-cluster addresses written to status.endpoints."""
    host = f"{inp.ref.name}.{inp.ref.namespace}.svc.{inp.config.cluster_domain}"
    return {
        "grpc": f"{host}:{inp.spec.service.grpc_port}",
        "http": f"http://{host}:{inp.spec.service.http_port}",
    }


def build_service_monitor(inp: RenderInput) -> dict[str, Any] | None:
    """monitoring.coreos.com/v1 ServiceMonitor, or None when monitoring is off."""
    mon = inp.spec.monitoring.service_monitor
    if not mon.enabled:
        return None
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": meta.object_meta(inp.ref, inp.ref.name, extra_labels=dict(mon.labels)),
        "spec": {
            "selector": {"matchLabels": meta.common_labels(inp.ref)},
            "namespaceSelector": {"matchNames": [inp.ref.namespace]},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": mon.interval, "scheme": "http"}],
        },
    }
