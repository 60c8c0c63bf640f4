"""Status from the live Deployment: phase, replica counts and standard conditions.

Pure functions; `lastTransitionTime` changes only when a condition's status changes, so an
unchanged world yields an identical status and no write.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from pagedinfer.operator.status import ConditionStatus, ConditionType, Phase

TRUE, FALSE = ConditionStatus.TRUE.value, ConditionStatus.FALSE.value


@dataclass(frozen=True)
class Cond:
    """A condition before its transition time is known."""

    type: str
    status: str
    reason: str
    message: str = ""


def now_iso() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _deployment_condition(deployment: dict[str, Any], ctype: str) -> dict[str, Any]:
    for cond in (deployment.get("status") or {}).get("conditions") or []:
        if cond.get("type") == ctype:
            return cond
    return {}


@dataclass(frozen=True)
class ReplicaCounts:
    desired: int
    current: int
    ready: int
    updated: int

    @staticmethod
    def of(deployment: dict[str, Any] | None, fallback_desired: int) -> ReplicaCounts:
        if deployment is None:
            return ReplicaCounts(fallback_desired, 0, 0, 0)
        st = deployment.get("status") or {}
        desired = (deployment.get("spec") or {}).get("replicas", fallback_desired)
        return ReplicaCounts(
            int(desired),
            int(st.get("replicas", 0)),
            int(st.get("readyReplicas", 0)),
            int(st.get("updatedReplicas", 0)),
        )


def workload_conditions(deployment: dict[str, Any] | None, counts: ReplicaCounts) -> tuple[Phase, list[Cond]]:
    """Phase and Available/Progressing/Degraded from the Deployment's status."""
    progressing = _deployment_condition(deployment or {}, "Progressing")
    failure = _deployment_condition(deployment or {}, "ReplicaFailure")
    deadline = progressing.get("reason") == "ProgressDeadlineExceeded"
    rolling = counts.updated < counts.desired or counts.current > counts.desired
    available = Cond(
        ConditionType.AVAILABLE.value,
        TRUE if counts.ready > 0 or counts.desired == 0 else FALSE,
        "MinimumReplicasAvailable" if counts.ready > 0 else "NoReplicasReady",
        f"{counts.ready}/{counts.desired} replicas ready",
    )
    progress = Cond(
        ConditionType.PROGRESSING.value,
        FALSE if deadline or not rolling else TRUE,
        "ProgressDeadlineExceeded" if deadline else ("RollingOut" if rolling else "RolloutComplete"),
        progressing.get("message", ""),
    )
    if failure.get("status") == TRUE:
        degraded = Cond(ConditionType.DEGRADED.value, TRUE, "ReplicaFailure", failure.get("message", ""))
    elif deadline:
        degraded = Cond(
            ConditionType.DEGRADED.value, TRUE, "ProgressDeadlineExceeded", progressing.get("message", "")
        )
    elif 0 < counts.ready < counts.desired and not rolling:
        degraded = Cond(ConditionType.DEGRADED.value, TRUE, "ReplicasUnavailable", available.message)
    else:
        degraded = Cond(ConditionType.DEGRADED.value, FALSE, "AsExpected")
    return _phase(counts, deadline or failure.get("status") == TRUE, rolling), [available, progress, degraded]


def _phase(counts: ReplicaCounts, failed: bool, rolling: bool) -> Phase:
    if counts.desired == 0:
        return Phase.PENDING
    if counts.ready >= counts.desired and not rolling:
        return Phase.READY
    if failed and counts.ready == 0:
        return Phase.FAILED
    if counts.ready > 0:
        return Phase.LOADING if rolling else Phase.DEGRADED
    return Phase.LOADING if counts.current > 0 else Phase.PENDING


def spec_error_conditions(reason: str, message: str) -> list[Cond]:
    return [
        Cond(ConditionType.DEGRADED.value, TRUE, reason, message),
        Cond(ConditionType.PROGRESSING.value, FALSE, reason, "the spec cannot be realised"),
    ]


def merge_conditions(
    previous: list[dict[str, Any]], new: list[Cond], generation: int | None, timestamp: str
) -> list[dict[str, Any]]:
    """New conditions keyed by type; keeps types not mentioned and unchanged transition times."""
    by_type = {c.get("type"): c for c in previous}
    for cond in new:
        old = by_type.get(cond.type, {})
        changed = old.get("status") != cond.status
        entry = {
            "type": cond.type,
            "status": cond.status,
            "reason": cond.reason,
            "message": cond.message,
            "lastTransitionTime": timestamp
            if changed or not old.get("lastTransitionTime")
            else old["lastTransitionTime"],
        }
        if generation is not None:
            entry["observedGeneration"] = generation
        by_type[cond.type] = entry
    order = [t.value for t in ConditionType]
    return sorted(
        by_type.values(), key=lambda c: order.index(c["type"]) if c["type"] in order else len(order)
    )


def transitions(previous: list[dict[str, Any]], current: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Conditions whose status or reason changed (each becomes one Event)."""
    old = {c.get("type"): (c.get("status"), c.get("reason")) for c in previous}
    return [c for c in current if old.get(c["type"]) != (c["status"], c["reason"])]
