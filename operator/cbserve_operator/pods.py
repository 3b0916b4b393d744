"""Why a CBDeployment's pods do not start, from the pods' own status and the workload's conditions.

What the Deployment's Progressing condition does not say until its deadline (35 minutes and more):
a pod the scheduler cannot place (its message: which resource is short), an image it cannot pull, a
container that crashes in a loop or cannot be created, and pods the ReplicaSet may not create (an
exceeded ResourceQuota: the Deployment's ReplicaFailure condition).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# container waiting reasons that mean the pod will not start by itself, most telling first
STUCK_WAITING = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
                 "CreateContainerError", "RunContainerError", "CrashLoopBackOff")


@dataclass(frozen=True)
class Problem:
    reason: str  # CamelCase, for the condition and the REASON column
    message: str


def _condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    for cond in (obj.get("status", {}) or {}).get("conditions", []) or []:
        if cond.get("type") == type_:
            return cond
    return {}


def pod_problem(pod: dict[str, Any]) -> Problem | None:
    """What keeps one pod from running, or None."""
    name = pod["metadata"]["name"]
    status = pod.get("status", {}) or {}
    for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        if reason in STUCK_WAITING:
            detail = waiting.get("message") or reason
            last = ((cs.get("lastState") or {}).get("terminated")) or {}
            if reason == "CrashLoopBackOff" and last:
                detail = (f"{detail}; last exit code {last.get('exitCode')}"
                          f"{' (' + last['reason'] + ')' if last.get('reason') else ''}")  # fmt: skip
            return Problem(reason, f"pod {name}, container {cs.get('name')}: {detail}")
    scheduled = _condition(pod, "PodScheduled")
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        return Problem("Unschedulable", f"pod {name}: {scheduled.get('message') or 'the scheduler cannot place it'}")
    return None


def workload_problem(workload: dict[str, Any] | None) -> Problem | None:
    """A Deployment whose ReplicaSet may not create pods (ReplicaFailure: a quota, a forbidden field)."""
    failure = _condition(workload or {}, "ReplicaFailure")
    if failure.get("status") != "True":
        return None
    message = failure.get("message") or failure.get("reason") or "the ReplicaSet cannot create pods"
    return Problem("QuotaExceeded" if "exceeded quota" in message else "ReplicaFailure", message)


def first_problem(workload: dict[str, Any] | None, pods: list[dict[str, Any]]) -> Problem | None:
    """The most telling problem among the workload's and its pods', with how many pods share it."""
    found = workload_problem(workload)
    if found is not None:
        return found
    problems = [p for p in (pod_problem(pod) for pod in pods if not pod["metadata"].get("deletionTimestamp")) if p]
    if not problems:
        return None
    order = {reason: i for i, reason in enumerate((*STUCK_WAITING, "Unschedulable"))}
    problems.sort(key=lambda p: order.get(p.reason, len(order)))
    first = problems[0]
    others = len(problems) - 1
    return Problem(first.reason, first.message + (f" (and {others} more pod{'s' if others > 1 else ''})" if others else ""))
