"""Phase and conditions from a Deployment's status; transition times only move on change."""

from __future__ import annotations

import pytest

from pagedinfer.operator.conditions import (
    Cond,
    ReplicaCounts,
    merge_conditions,
    spec_error_conditions,
    transitions,
    workload_conditions,
)
from pagedinfer.operator.status import Phase


def deployment(desired=2, replicas=2, ready=2, updated=2, conditions=()):
    return {
        "spec": {"replicas": desired},
        "status": {
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": updated,
            "conditions": list(conditions),
        },
    }


@pytest.mark.parametrize(
    "dep,phase,available,degraded",
    [
        (None, Phase.PENDING, "False", "False"),
        (deployment(ready=0, replicas=0, updated=0), Phase.PENDING, "False", "False"),
        (deployment(ready=0), Phase.LOADING, "False", "False"),
        (deployment(), Phase.READY, "True", "False"),
        (deployment(ready=1), Phase.DEGRADED, "True", "True"),
        (deployment(ready=1, updated=1), Phase.LOADING, "True", "False"),
        (deployment(desired=0, replicas=0, ready=0, updated=0), Phase.PENDING, "True", "False"),
        (
            deployment(
                ready=0,
                conditions=[{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}],
            ),
            Phase.FAILED,
            "False",
            "True",
        ),
        (
            deployment(
                ready=0, conditions=[{"type": "ReplicaFailure", "status": "True", "message": "quota"}]
            ),
            Phase.FAILED,
            "False",
            "True",
        ),
    ],
)
def test_phase_and_conditions(dep, phase, available, degraded):
    counts = ReplicaCounts.of(dep, 2)
    got_phase, conds = workload_conditions(dep, counts)
    by_type = {c.type: c for c in conds}
    assert got_phase is phase
    assert by_type["Available"].status == available
    assert by_type["Degraded"].status == degraded


def test_merge_keeps_transition_time_when_status_unchanged():
    first = merge_conditions([], [Cond("Available", "False", "NoReplicasReady")], 1, "T1")
    same = merge_conditions(first, [Cond("Available", "False", "NoReplicasReady", "msg")], 2, "T2")
    flipped = merge_conditions(same, [Cond("Available", "True", "MinimumReplicasAvailable")], 2, "T3")
    assert same[0]["lastTransitionTime"] == "T1" and same[0]["observedGeneration"] == 2
    assert flipped[0]["lastTransitionTime"] == "T3"
    assert transitions(same, flipped) == flipped
    assert transitions(flipped, flipped) == []


def test_spec_error_conditions_and_other_types_are_kept():
    prev = merge_conditions([], [Cond("MonitoringConfigured", "True", "ServiceMonitorReady")], 1, "T")
    merged = merge_conditions(prev, spec_error_conditions("InvalidSpec", "bad"), 1, "T")
    by_type = {c["type"]: c for c in merged}
    assert by_type["Degraded"]["status"] == "True" and by_type["Degraded"]["reason"] == "InvalidSpec"
    assert "MonitoringConfigured" in by_type
