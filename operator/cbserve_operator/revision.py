"""Which revision of a CBDeployment's spec a record in its status was made for.

The generation alone does not say: an autoscaler writing `spec.replicas` through the scale subresource
bumps it without changing what the pods run. A spec with new CRD defaults reads differently without a
new generation. A record (`{generation, specHash}`) still holds while either matches: the same
generation, or the same spec but for `replicas`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any


def spec_hash(spec: Mapping[str, Any]) -> str:
    """A digest of the spec without `replicas` (what an autoscaler writes)."""
    rest = {k: v for k, v in spec.items() if k != "replicas"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, default=str).encode()).hexdigest()[:16]


def stamp(spec: Mapping[str, Any], generation: int | None) -> dict[str, Any]:
    """The `{generation, specHash}` a record made now carries."""
    return {"generation": generation, "specHash": spec_hash(spec)}


def same_revision(recorded: Mapping[str, Any] | None, spec: Mapping[str, Any], generation: int | None) -> bool:
    """Whether `recorded` was made for this revision of the spec (replicas aside)."""
    if not recorded:
        return False
    return recorded.get("generation") == generation or recorded.get("specHash") == spec_hash(spec)
