"""What the test kubelet (and the scheduler it stands in for) writes into a Pod's status,
in the shapes a real kubelet writes (core/v1 PodStatus, ContainerStatus), and the checks
it makes before it runs a container (pure: no processes, no API calls).

- Scheduling: a Pod whose `nodeSelector` the node's labels do not match is left
  `Pending` with `PodScheduled=False, Unschedulable` and the scheduler's message.
- Admission on the node: a Pod that asks for an extended resource (a GPU) whose devices
  the node's device plugin reports unhealthy is failed, `phase: Failed`,
  `reason: UnexpectedAdmissionError`, as the kubelet's device manager does.
- Image pull: an image the node's registry lacks gives `ErrImagePull`, then
  `ImagePullBackOff` between tries.
- Container config: an env var from a Secret that is missing gives
  `CreateContainerConfigError` (`secret "x" not found`), retried.
- A container that exits: `lastState.terminated` (exit code, reason `Error` or
  `OOMKilled`, its message: the log's tail, as `terminationMessagePolicy:
  FallbackToLogsOnError` says) and, while the restart waits, `CrashLoopBackOff`.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from loraplex_operator import manifests

FALLBACK_LOG_BYTES = 2048  # the kubelet's FallbackToLogsOnError: the log's last 2 KiB


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def unschedulable(pod: Mapping[str, Any], node_labels: Mapping[str, str]) -> str | None:
    """The scheduler's message when no node (this one node) fits the Pod, else None."""
    selector = pod.get("spec", {}).get("nodeSelector") or {}
    if all(node_labels.get(k) == v for k, v in selector.items()):
        return None
    return "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector."


def admission_error(pod: Mapping[str, Any], unhealthy: set[str]) -> str | None:
    """The device manager's refusal of a Pod asking for unhealthy devices, else None."""
    for container in pod.get("spec", {}).get("containers") or ():
        limits = (container.get("resources") or {}).get("limits") or {}
        for resource in sorted(set(limits) & unhealthy):
            return (
                "Allocate failed due to no healthy devices present; cannot allocate "
                f"unhealthy devices {resource}, which is unexpected"
            )
    return None


def memory_limit(pod: Mapping[str, Any]) -> int | None:
    """The engine container's memory limit in bytes (Ki/Mi/Gi and plain), if any."""
    for container in pod.get("spec", {}).get("containers") or ():
        if container.get("name") != manifests.CONTAINER:
            continue
        value = str(((container.get("resources") or {}).get("limits") or {}).get("memory") or "")
        if not value:
            return None
        for suffix, scale in (("Ki", 2**10), ("Mi", 2**20), ("Gi", 2**30)):
            if value.endswith(suffix):
                return int(float(value[: -len(suffix)]) * scale)
        return int(float(value))
    return None


def terminated(exit_code: int, oom: bool, log_tail: str, started: str) -> dict[str, Any]:
    message = log_tail.encode()[-FALLBACK_LOG_BYTES:].decode(errors="replace")
    out: dict[str, Any] = {
        "exitCode": exit_code,
        "reason": "OOMKilled" if oom else ("Completed" if exit_code == 0 else "Error"),
        "startedAt": started,
        "finishedAt": now(),
    }
    if message.strip() and exit_code != 0:
        out["message"] = message
    return out


def pod_status(
    phase: str,
    state: Mapping[str, Any],
    *,
    ready: bool = False,
    started: bool = False,
    restarts: int = 0,
    last: Mapping[str, Any] | None = None,
    image: str = "",
    scheduled: Mapping[str, Any] | None = None,
    **pod_level: Any,
) -> dict[str, Any]:
    """A status patch: the phase, the Ready conditions, the engine container's status."""
    flag = "True" if ready else "False"
    cs: dict[str, Any] = {
        "name": manifests.CONTAINER,
        "ready": ready,
        "started": started,
        "restartCount": restarts,
        "image": image,
        "state": dict(state),
        "lastState": {"terminated": dict(last)} if last else {},
    }
    ready_cond: dict[str, Any] = {"type": "Ready", "status": flag, "lastTransitionTime": now()}
    if not ready:
        ready_cond["reason"] = "ContainersNotReady"
        ready_cond["message"] = f"containers with unready status: [{manifests.CONTAINER}]"
    conditions = [
        scheduled or {"type": "PodScheduled", "status": "True", "lastTransitionTime": now()},
        ready_cond,
        {**ready_cond, "type": "ContainersReady"},
    ]
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": conditions,
        "containerStatuses": [cs],
        **pod_level,
    }
    if ready:
        status["podIP"] = "127.0.0.1"
    return {"status": status}


def waiting(reason: str, message: str = "") -> dict[str, Any]:
    return {"waiting": {"reason": reason, **({"message": message} if message else {})}}


def running(since: str) -> dict[str, Any]:
    return {"running": {"startedAt": since}}


def unscheduled(message: str) -> dict[str, Any]:
    """The status the scheduler writes on a Pod no node fits."""
    cond = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": message,
        "lastTransitionTime": now(),
    }
    return {"status": {"phase": "Pending", "conditions": [cond]}}


def back_off_message(pod: Mapping[str, Any], seconds: float) -> str:
    meta = pod["metadata"]
    return (
        f"back-off {seconds:.0f}s restarting failed container={manifests.CONTAINER} "
        f"pod={meta['name']}_{meta['namespace']}({meta.get('uid', '')})"
    )
