"""Why an engine pod cannot serve, read from its status as the kubelet and the scheduler
write it, and how soon a failed one may be replaced (pure, no I/O).

`pod_failure` names one reason per pod (a CamelCase word fit for a condition and a
metric label) and the container's last message:

- a container waiting for a reason that needs a human: `CrashLoopBackOff` (or
  `OOMKilled` when the crash was the kernel's OOM killer: `lastState.terminated.reason`),
  `ImagePullBackOff`, `ErrImagePull`, `InvalidImageName`, `CreateContainerConfigError`,
  `CreateContainerError`, `RunContainerError`;
- a container terminated `OOMKilled`;
- a pod the kubelet failed (`phase: Failed`: `Evicted`, `UnexpectedAdmissionError`, ...);
- `ReadinessProbeFailing`: started (its startup probe passed) but not Ready for longer
  than `stall_after`;
- `Unschedulable`: no node for longer than `stall_after` (until then it is capacity
  asked for, `observation.EngineView.unschedulable`).

`backoffs.RecreateBackoff` spaces out the replacements of failed pods.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loraplex_operator.resources import parse_time

CRASH_LOOP = "CrashLoopBackOff"
OOM_KILLED = "OOMKilled"
NOT_READY = "ReadinessProbeFailing"
UNSCHEDULABLE = "Unschedulable"
POD_FAILED = "PodFailed"  # a Failed pod whose reason the kubelet did not name
# Container waiting reasons that do not go away by waiting (the kubelet's own words).
WAITING = frozenset(
    {
        CRASH_LOOP,
        "ImagePullBackOff",
        "ErrImagePull",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)
_WORD = re.compile(r"[A-Za-z][A-Za-z0-9]{0,63}")
MAX_MESSAGE = 1024  # of the container's message: an Event's is cut at 1024 too


@dataclass(frozen=True)
class PodFailure:
    pod: str
    reason: str
    message: str
    container: str | None = None

    def describe(self) -> str:
        where = f"engine pod {self.pod}" + (
            f" container {self.container}" if self.container else ""
        )
        return f"{where}: {self.reason}" + (f": {self.message}" if self.message else "")


def pod_failure(
    pod: Mapping[str, Any], now: float, stall_after: float = 600.0
) -> PodFailure | None:
    """Why `pod` cannot serve and will not by itself, or None (see the module doc)."""
    name = pod.get("metadata", {}).get("name", "")
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return None
    status = pod.get("status") or {}
    statuses = [
        *(status.get("initContainerStatuses") or ()),
        *(status.get("containerStatuses") or ()),
    ]
    if status.get("phase") == "Failed":
        return _failed_pod(name, status, statuses)
    for cs in statuses:
        failure = _container_failure(name, cs)
        if failure is not None:
            return failure
    if status.get("phase") == "Running":
        return _not_ready(name, status, statuses, now, stall_after)
    return _unschedulable(name, status, now, stall_after)


def _container_failure(pod: str, cs: Mapping[str, Any]) -> PodFailure | None:
    state, last = cs.get("state") or {}, (cs.get("lastState") or {}).get("terminated") or {}
    waiting, terminated = state.get("waiting") or {}, state.get("terminated") or {}
    container = cs.get("name")
    if terminated.get("reason") == OOM_KILLED:
        return PodFailure(pod, OOM_KILLED, _terminated(terminated), container)
    reason = waiting.get("reason")
    if reason not in WAITING:
        return None
    if reason == CRASH_LOOP and last.get("reason") == OOM_KILLED:
        reason = OOM_KILLED
    parts = [str(waiting.get("message") or "")]
    if last:
        parts.append(f"last exit: {_terminated(last)}")
    return PodFailure(pod, str(reason), _cut("; ".join(p for p in parts if p)), container)


def _terminated(t: Mapping[str, Any]) -> str:
    """`exit code 1 (Error): <the container's last message>`."""
    head = f"exit code {t.get('exitCode')}" + (f" ({t['reason']})" if t.get("reason") else "")
    message = str(t.get("message") or "").strip()
    return _cut(f"{head}: {message}" if message else head)


def _failed_pod(
    pod: str, status: Mapping[str, Any], statuses: list[Mapping[str, Any]]
) -> PodFailure:
    for cs in statuses:
        terminated = (cs.get("state") or {}).get("terminated") or {}
        if terminated.get("reason") == OOM_KILLED:
            return PodFailure(pod, OOM_KILLED, _terminated(terminated), cs.get("name"))
    reason = str(status.get("reason") or "")
    message = str(status.get("message") or "")
    if not message:
        for cs in statuses:
            terminated = (cs.get("state") or {}).get("terminated")
            if terminated:
                return PodFailure(
                    pod, _word(reason) or POD_FAILED, _terminated(terminated), cs.get("name")
                )
    return PodFailure(pod, _word(reason) or POD_FAILED, _cut(message))


def _not_ready(
    pod: str,
    status: Mapping[str, Any],
    statuses: list[Mapping[str, Any]],
    now: float,
    stall_after: float,
) -> PodFailure | None:
    """Started (the startup probe passed) and running, yet not Ready for `stall_after`."""
    ready = _condition(status, "Ready")
    if ready is None or ready.get("status") == "True":
        return None
    for cs in statuses:
        running = (cs.get("state") or {}).get("running")
        if not running or not cs.get("started") or cs.get("ready"):
            continue
        since = max(
            parse_time(running.get("startedAt")) or now,
            parse_time(ready.get("lastTransitionTime")) or 0.0,
        )
        if now - since >= stall_after:
            message = f"running but not ready for {now - since:.0f} s (readiness probe failing)"
            if ready.get("message"):
                message += f"; {ready['message']}"
            return PodFailure(pod, NOT_READY, _cut(message), cs.get("name"))
    return None


def _unschedulable(
    pod: str, status: Mapping[str, Any], now: float, stall_after: float
) -> PodFailure | None:
    cond = _condition(status, "PodScheduled")
    if not cond or cond.get("status") != "False" or cond.get("reason") != UNSCHEDULABLE:
        return None
    since = parse_time(cond.get("lastTransitionTime"))
    if since is None or now - since < stall_after:
        return None
    message = str(cond.get("message") or "no node fits it")
    return PodFailure(pod, UNSCHEDULABLE, _cut(f"unschedulable for {now - since:.0f} s: {message}"))


def _condition(status: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    return next((c for c in status.get("conditions") or () if c.get("type") == type_), None)


def _word(reason: str) -> str | None:
    return reason if _WORD.fullmatch(reason) else None


def _cut(message: str) -> str:
    return message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 1] + "…"
