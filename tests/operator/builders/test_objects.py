"""Service, ServiceMonitor, PDB, HPA and PVC rendering, and the desired-state set."""

from __future__ import annotations

import kubernetes_validate
import pytest
from operator_render_tools import FULL_SPEC, REF, render_input

from pagedinfer.operator import resources as res
from pagedinfer.operator.builders.desired import desired_state
from pagedinfer.operator.builders.policies import build_hpa, build_pdb, quantity
from pagedinfer.operator.builders.service import build_service, build_service_monitor, endpoints
from pagedinfer.operator.builders.storage import build_model_cache_pvc

MINIMAL = {"model": {"uri": "builtin://smollm2-135m"}}


def test_service_named_ports_and_endpoints():
    svc = build_service(render_input(MINIMAL | {"service": {"type": "LoadBalancer", "grpcPort": 9000}}))
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert ports["grpc"]["port"] == 9000 and ports["grpc"]["targetPort"] == "grpc"
    assert ports["http"]["port"] == 8000 and ports["http"]["targetPort"] == "http"
    assert svc["spec"]["type"] == "LoadBalancer"
    assert svc["spec"]["selector"] == {
        "app.kubernetes.io/name": "pagedinfer-engine",
        "app.kubernetes.io/instance": "llama",
    }
    eps = endpoints(render_input(MINIMAL))
    assert eps == {
        "grpc": "llama.ml.svc.cluster.local:50051",
        "http": "http://llama.ml.svc.cluster.local:8000",
    }


def test_service_monitor_only_when_enabled():
    assert build_service_monitor(render_input(MINIMAL)) is None
    sm = build_service_monitor(render_input(FULL_SPEC))
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["endpoints"] == [
        {"port": "http", "path": "/metrics", "interval": "15s", "scheme": "http"}
    ]
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["ml"]}


@pytest.mark.parametrize(
    "spec,expected",
    [
        (MINIMAL, False),
        (MINIMAL | {"replicas": 2}, True),
        (MINIMAL | {"autoscaling": {"enabled": True, "maxReplicas": 1}}, False),
        (MINIMAL | {"autoscaling": {"enabled": True, "maxReplicas": 3}}, True),
    ],
)
def test_pdb_when_more_than_one_replica(spec, expected):
    pdb = build_pdb(render_input(spec))
    assert (pdb is not None) == expected
    if pdb:
        assert pdb["spec"]["maxUnavailable"] == 1


def test_hpa_on_a_per_pod_metric():
    assert build_hpa(render_input(MINIMAL)) is None
    hpa = build_hpa(render_input(FULL_SPEC))
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llama"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 4)
    metric = hpa["spec"]["metrics"][0]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "pagedinfer_kv_cache_usage_ratio"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "800m"}
    waiting = build_hpa(render_input(MINIMAL | {"autoscaling": {"enabled": True, "target": 6}}))
    assert waiting["spec"]["metrics"][0]["pods"]["metric"]["name"] == "pagedinfer_num_requests_waiting"
    assert waiting["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "6"


@pytest.mark.parametrize(
    "value,text", [(4.0, "4"), (0.8, "800m"), (0.05, "50m"), (2.5, "2500m"), (100, "100")]
)
def test_quantity(value, text):
    assert quantity(value) == text


def test_model_cache_pvc():
    assert build_model_cache_pvc(render_input(MINIMAL)) is None
    pvc = build_model_cache_pvc(render_input(FULL_SPEC))
    assert pvc["metadata"]["name"] == "llama-model-cache"
    assert pvc["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "50Gi"}},
        "storageClassName": "fast",
    }


def test_desired_state_lists_every_kind_in_apply_order():
    items = desired_state(render_input(FULL_SPEC))
    assert [i.resource for i in items] == list(res.OWNED)
    assert all(i.body is not None for i in items)
    minimal = {i.resource.kind: i.body for i in desired_state(render_input(MINIMAL))}
    assert [k for k, b in minimal.items() if b is not None] == ["Service", "Deployment"]
    for item in items:
        assert item.body["metadata"]["ownerReferences"][0]["uid"] == REF.uid
        assert item.body["metadata"]["namespace"] == REF.namespace
        assert item.body["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "pagedinfer-operator"


@pytest.mark.parametrize(
    "kind", ["Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "PersistentVolumeClaim"]
)
def test_built_in_kinds_validate_offline(kind):
    body = {i.resource.kind: i.body for i in desired_state(render_input(FULL_SPEC))}[kind]
    assert kubernetes_validate.validate(body, "1.30.0", strict=True)
