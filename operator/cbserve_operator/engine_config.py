"""The engine YAML the pod reads with `--config`: the settings by their Python names (engine/settings_table.py)."""

from __future__ import annotations

import hashlib
from typing import Any

import yaml

from .spec import Engine


def engine_settings(engine: Engine) -> dict[str, Any]:
    """The settings the spec gives, by their YAML keys; a setting it leaves out takes the server's default."""
    return dict(engine.settings)


def render_engine_yaml(engine: Engine) -> str:
    header = "# Written by the cbserve operator from the CBDeployment's spec.engine; edit the CBDeployment.\n"
    return header + yaml.safe_dump(engine_settings(engine), sort_keys=True)


def config_hash(text: str) -> str:
    """Short content hash; it annotates the pod template so a changed knob rolls the pods."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]
