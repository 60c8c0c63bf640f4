"""Subset comparison, quantities and the three-way merge patch of the idempotent apply."""

from __future__ import annotations

from decimal import Decimal

import pytest

from pagedinfer.operator.apply import (
    LAST_APPLIED,
    is_subset,
    parse_quantity,
    three_way_patch,
    with_last_applied,
)


@pytest.mark.parametrize(
    "text,value",
    [
        ("1", 1),
        ("1000m", 1),
        ("500m", Decimal("0.5")),
        ("8Gi", 8 * 2**30),
        ("1k", 1000),
        ("1.5", Decimal("1.5")),
    ],
)
def test_parse_quantity(text, value):
    assert parse_quantity(text) == Decimal(value)


def test_parse_quantity_rejects_junk():
    assert parse_quantity("abc") is None and parse_quantity("1Xi") is None


def test_subset_ignores_server_defaults_and_status():
    desired = {"spec": {"replicas": 2, "template": {"containers": [{"name": "a", "image": "x"}]}}}
    actual = {
        "spec": {
            "replicas": 2,
            "template": {"containers": [{"name": "a", "image": "x", "terminationMessagePath": "/d"}]},
        },
        "status": {"readyReplicas": 1},
    }
    assert is_subset(desired, actual)


@pytest.mark.parametrize(
    "actual",
    [
        {"spec": {"replicas": 3, "template": {"containers": [{"name": "a", "image": "x"}]}}},
        {"spec": {"replicas": 2, "template": {"containers": [{"name": "a", "image": "y"}]}}},
        {"spec": {"replicas": 2, "template": {"containers": []}}},
        {"spec": {"replicas": 2}},
    ],
)
def test_subset_detects_drift(actual):
    desired = {"spec": {"replicas": 2, "template": {"containers": [{"name": "a", "image": "x"}]}}}
    assert not is_subset(desired, actual)


def test_subset_treats_quantities_and_empty_values_as_the_server_does():
    assert is_subset({"cpu": "1000m", "memory": "1024Mi"}, {"cpu": "1", "memory": "1Gi"})
    assert not is_subset({"cpu": "2"}, {"cpu": "1"})
    assert is_subset({"nodeSelector": {}, "tolerations": []}, {})
    assert is_subset({"emptyDir": {}}, {"emptyDir": {}})


def test_three_way_patch_removes_dropped_keys_but_never_replicas():
    last = {"spec": {"replicas": 3, "priorityClassName": "high", "template": {"a": 1}}, "metadata": {"x": 1}}
    desired = {"spec": {"template": {"a": 2}}, "metadata": {"x": 1}}
    patch = three_way_patch(last, desired)
    assert patch["spec"]["priorityClassName"] is None
    assert "replicas" not in patch["spec"]
    assert patch["spec"]["template"] == {"a": 2}


def test_last_applied_annotation_round_trip():
    body = {"metadata": {"name": "n", "annotations": {"a": "b"}}, "spec": {"x": 1}}
    out = with_last_applied(body)
    assert out["metadata"]["annotations"]["a"] == "b"
    assert '"spec":{"x":1}' in out["metadata"]["annotations"][LAST_APPLIED]
    assert "annotations" in body["metadata"] and LAST_APPLIED not in body["metadata"]["annotations"]
