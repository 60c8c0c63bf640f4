"""Stuck engine pods become a Degraded condition that names the pod and the cause."""

from __future__ import annotations

from pagedinfer.operator.pod_health import pod_problem


def _pod(name: str, **status) -> dict:
    return {"metadata": {"name": name}, "status": status}


def _waiting(reason: str, message: str = "", last: dict | None = None) -> dict:
    status = {"name": "engine", "state": {"waiting": {"reason": reason, "message": message}}}
    if last:
        status["lastState"] = {"terminated": last}
    return status


def test_healthy_or_starting_pods_are_no_problem():
    assert pod_problem([]) is None
    starting = _pod("a", containerStatuses=[_waiting("ContainerCreating")])
    running = _pod("b", containerStatuses=[{"name": "engine", "state": {"running": {}}}])
    assert pod_problem([starting, running]) is None


def test_missing_image_names_pod_and_message():
    msg = 'Container image "localhost/nope:1" is not present with pull policy of Never'
    cond = pod_problem([_pod("e-1", containerStatuses=[_waiting("ErrImageNeverPull", msg)])])
    assert cond is not None and cond.status == "True" and cond.type == "Degraded"
    assert cond.reason == "ErrImageNeverPull"
    assert "pod e-1 container engine" in cond.message and "localhost/nope:1" in cond.message


def test_crash_loop_reports_exit_code_and_last_lines():
    last = {
        "exitCode": 1,
        "reason": "Error",
        "message": "loading\nValueError: unknown builtin model 'nope'\n",
    }
    cond = pod_problem([_pod("e-2", containerStatuses=[_waiting("CrashLoopBackOff", "back-off", last)])])
    assert cond is not None and cond.reason == "CrashLoopBackOff"
    assert "exited with code 1" in cond.message and "unknown builtin model" in cond.message


def test_init_containers_and_unschedulable_pods():
    init = _pod("e-3", initContainerStatuses=[_waiting("ImagePullBackOff", "pull failed")])
    assert pod_problem([init]).reason == "ImagePullBackOff"
    unschedulable = _pod(
        "e-4",
        conditions=[
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/1 nodes"}
        ],
    )
    cond = pod_problem([unschedulable])
    assert cond.reason == "Unschedulable" and "0/1 nodes" in cond.message


def test_terminating_pods_are_ignored():
    pod = _pod("e-5", containerStatuses=[_waiting("CrashLoopBackOff")])
    pod["metadata"]["deletionTimestamp"] = "2026-12-07T00:00:00Z"
    assert pod_problem([pod]) is None


def test_running_unready_pods_are_asked_for_startup_and_a_failed_load_is_reported():
    from pagedinfer.operator.pod_health import failed_startup, loading_pod_urls

    loading = _pod(
        "e-6", phase="Running", podIP="10.244.0.7", conditions=[{"type": "Ready", "status": "False"}]
    )
    ready = _pod("e-7", phase="Running", podIP="10.244.0.8", conditions=[{"type": "Ready", "status": "True"}])
    assert loading_pod_urls([loading, ready], 8000) == {"e-6": "http://10.244.0.7:8000/startup"}
    assert failed_startup({"e-6": {"state": "loading", "phase": "loading_weights"}, "e-7": None}) is None
    cond = failed_startup({"e-6": {"state": "failed", "phase": "failed", "error": "unknown model 'nope'"}})
    assert (
        cond.reason == "EngineFailed" and "pod e-6" in cond.message and "unknown model 'nope'" in cond.message
    )
