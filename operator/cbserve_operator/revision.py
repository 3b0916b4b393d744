"""Which revision of a CBDeployment's spec a record in its status was made for.

The generation alone does not say: an autoscaler writing `spec.replicas` through the scale subresource
bumps it without changing what the pods run. A spec with new CRD defaults reads differently without a
new generation. A record (`{generation, specHash}`) still holds while either matches: the same
generation, or the same spec but for `replicas`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import zlib
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


def pack(template: Mapping[str, Any]) -> str:
    """A pod template as an annotation value (zlib, base64: a rendered template is a few KB)."""
    return base64.b64encode(zlib.compress(json.dumps(template, sort_keys=True).encode(), 9)).decode()


def unpack(value: str) -> dict[str, Any] | None:
    try:
        template = json.loads(zlib.decompress(base64.b64decode(value)))
    except (ValueError, zlib.error):
        return None
    return template if isinstance(template, dict) else None
