"""What the engine pods themselves say when they cannot start: a missing image, a crash loop,
no node that fits. The Deployment's status only counts them; these reasons reach the
InferenceEngine's Degraded condition so `kubectl describe ie` tells the user what to fix."""

from __future__ import annotations

from typing import Any

from pagedinfer.operator.conditions import TRUE, Cond
from pagedinfer.operator.status import ConditionType

# Waiting reasons that do not go away by waiting (image pulls, config, crash loops).
STUCK_REASONS = (
    "ErrImageNeverPull",
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
    "CrashLoopBackOff",
)
MAX_MESSAGE = 600


def _container_problem(pod_name: str, status: dict[str, Any]) -> tuple[str, str] | None:
    waiting = (status.get("state") or {}).get("waiting") or {}
    reason = waiting.get("reason")
    if reason not in STUCK_REASONS:
        return None
    message = waiting.get("message") or ""
    last = (status.get("lastState") or {}).get("terminated") or {}
    if reason == "CrashLoopBackOff" and last:
        # The crash itself is the useful part: exit code and the engine's last words.
        tail = (last.get("message") or "").strip().splitlines()[-3:]
        message = f"exited with code {last.get('exitCode')} ({last.get('reason', '')})"
        if tail:
            message += ": " + " | ".join(tail)
    return reason, f"pod {pod_name} container {status.get('name')}: {message}".strip()


def pod_problem(pods: list[dict[str, Any]]) -> Cond | None:
    """A Degraded condition naming the first stuck pod, or None when no pod is stuck."""
    for pod in sorted(pods, key=lambda p: p.get("metadata", {}).get("name", "")):
        if pod.get("metadata", {}).get("deletionTimestamp"):
            continue
        name = pod.get("metadata", {}).get("name", "")
        status = pod.get("status") or {}
        for container in (status.get("initContainerStatuses") or []) + (
            status.get("containerStatuses") or []
        ):
            found = _container_problem(name, container)
            if found is not None:
                reason, message = found
                return Cond(ConditionType.DEGRADED.value, TRUE, reason, message[:MAX_MESSAGE])
        for cond in status.get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("reason") == "Unschedulable":
                message = f"pod {name}: {cond.get('message', '')}"
                return Cond(ConditionType.DEGRADED.value, TRUE, "Unschedulable", message[:MAX_MESSAGE])
    return None


def loading_pod_urls(pods: list[dict[str, Any]], port: int) -> dict[str, str]:
    """/startup URLs of running pods that are not ready yet, by pod name."""
    urls = {}
    for pod in pods:
        status = pod.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
        )
        ip = status.get("podIP")
        if (
            ip
            and not ready
            and status.get("phase") == "Running"
            and not pod["metadata"].get("deletionTimestamp")
        ):
            host = f"[{ip}]" if ":" in ip else ip
            urls[pod["metadata"]["name"]] = f"http://{host}:{port}/startup"
    return urls


def failed_startup(reports: dict[str, dict[str, Any] | None]) -> Cond | None:
    """A Degraded condition for the first pod whose engine reports a failed load, else None.

    A failed load keeps /startup at 503, so the startup probe alone would wait out the whole
    startup budget before Kubernetes says anything; the engine's own error is the useful part."""
    for name in sorted(reports):
        report = reports[name] or {}
        if report.get("state") == "failed" or report.get("phase") == "failed":
            message = f"pod {name}: the engine failed to start: {report.get('error', 'no error given')}"
            return Cond(ConditionType.DEGRADED.value, TRUE, "EngineFailed", message[:MAX_MESSAGE])
    return None
