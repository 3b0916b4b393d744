"""The CBDeployment's status: phase, replica counts and conditions, derived from its Deployment (or
LeaderWorkerSet: the same status fields, counted in groups, and no progress deadline) and from why
its pods do not start (pods.py)."""

from __future__ import annotations

import datetime
from typing import Any

from .pods import Problem

CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "ConfigValid", "ModelCached", "RolledBack")  # the CRD's enum


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(type_: str, ok: bool, reason: str, message: str, generation: int | None) -> dict[str, Any]:
    cond: dict[str, Any] = {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message}
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def merge_conditions(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Replace conditions by type; a condition keeps its lastTransitionTime unless its status flips."""
    previous = {c.get("type"): c for c in old or []}
    merged = {c.get("type"): dict(c) for c in old or [] if c.get("type") in CONDITION_TYPES}
    for cond in new:
        before = previous.get(cond["type"])
        same = before is not None and before.get("status") == cond["status"] and before.get("lastTransitionTime")
        merged[cond["type"]] = {**cond, "lastTransitionTime": before["lastTransitionTime"] if same else now()}
    return [merged[t] for t in CONDITION_TYPES if t in merged]


def _deployment_condition(deployment: dict[str, Any], type_: str) -> dict[str, Any]:
    for cond in deployment.get("status", {}).get("conditions", []) or []:
        if cond.get("type") == type_:
            return cond
    return {}


def headline(conditions: list[dict[str, Any]]) -> dict[str, Any]:
    """`status.reason` and `status.message` (the REASON column): the Ready condition's while it is
    False, else none."""
    ready = next((c for c in conditions if c.get("type") == "Ready"), {})
    if ready.get("status") == "True" or not ready:
        return {"reason": None, "message": None}
    return {"reason": ready.get("reason"), "message": ready.get("message")}


def rollout_status(deployment: dict[str, Any] | None, desired: int, generation: int | None,
                   kind: str = "Deployment", problem: Problem | None = None,
                   ) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:  # fmt: skip
    """(phase, replica fields, Ready/Progressing/Degraded conditions) from the status of the Deployment,
    or of the LeaderWorkerSet (`kind`), whose replicas are groups; `problem`: why pods do not start
    (pods.first_problem), which names Ready's and Progressing's reason until the rollout is done."""
    unit = "groups" if kind == "LeaderWorkerSet" else "pods"
    if deployment is None:
        conds = [
            condition("Ready", False, f"{kind}Missing", f"the {kind} does not exist yet", generation),
            condition("Progressing", True, "Creating", f"creating the {kind}", generation),
            condition("Degraded", False, f"{kind}Missing", "", generation),
        ]
        return "Pending", {"replicas": 0, "readyReplicas": 0, "updatedReplicas": 0}, conds

    status = deployment.get("status", {}) or {}
    ready = int(status.get("readyReplicas", 0) or 0)
    updated = int(status.get("updatedReplicas", 0) or 0)
    current = int(status.get("replicas", 0) or 0)
    observed = status.get("observedGeneration")
    dep_generation = deployment.get("metadata", {}).get("generation")
    progressing = _deployment_condition(deployment, "Progressing")
    stuck = progressing.get("status") == "False" and progressing.get("reason") == "ProgressDeadlineExceeded"
    seen = observed is not None and (dep_generation is None or observed >= dep_generation)
    rolled_out = seen and updated >= desired and current <= desired and ready >= desired
    counts = {"replicas": current, "readyReplicas": ready, "updatedReplicas": updated}

    if stuck:
        message = progressing.get("message") or "the rollout exceeded its progress deadline"
        if problem is not None:
            message = f"{message}; {problem.reason}: {problem.message}"
        phase = "Degraded"
        conds = [
            condition("Ready", ready >= desired and desired > 0, "RolloutStuck", f"{ready}/{desired} {unit} ready", generation),
            condition("Progressing", False, "ProgressDeadlineExceeded", message, generation),
            condition("Degraded", True, "ProgressDeadlineExceeded", message, generation),
        ]
    elif rolled_out:
        phase = "Ready"
        conds = [
            condition("Ready", True, "AllReplicasReady", f"{ready}/{desired} {unit} ready", generation),
            condition("Progressing", False, "RolloutComplete", f"every {unit[:-1]} runs the current spec", generation),
            condition("Degraded", False, "AllReplicasReady", "", generation),
        ]
    elif problem is not None:
        phase = "Progressing" if seen or current else "Pending"
        counted = f"{ready}/{desired} {unit} ready, {updated} updated"
        conds = [
            condition("Ready", False, problem.reason, f"{counted}; {problem.message}", generation),
            condition("Progressing", True, problem.reason, problem.message, generation),
            condition("Degraded", False, problem.reason, "", generation),
        ]
    else:
        phase = "Progressing" if seen or current else "Pending"
        conds = [
            condition("Ready", False, "ReplicasNotReady", f"{ready}/{desired} {unit} ready", generation),
            condition("Progressing", True, "RollingOut", f"{updated}/{desired} {unit} updated, {ready} ready", generation),
            condition("Degraded", False, "RollingOut", "", generation),
        ]
    return phase, counts, conds
