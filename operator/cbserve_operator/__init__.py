"""cbserve's Kubernetes operator: turns a CBDeployment into the objects that serve its model.

Run it with `python -m cbserve_operator` (a thin wrapper over `kopf run`).
"""

GROUP = "cbserve.io"
VERSION = "v1alpha1"
PLURAL = "cbdeployments"
KIND = "CBDeployment"

__all__ = ["GROUP", "VERSION", "PLURAL", "KIND"]
