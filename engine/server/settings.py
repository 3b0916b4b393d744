"""`cbserve serve` settings: command line over CBSERVE_* environment over the --config YAML.

Every setting, its flag, variable, rule and default is a row of engine/settings_table.py: the
ContinuousBatchingConfig fields, and the server's own (`device`, `dtype`, `attn_implementation`,
`compile`, `max_body_bytes`), by their Python names in the YAML (the operator writes it into a
ConfigMap). API keys are never read from the YAML (a ConfigMap is no place for a secret):
`--api-key` or `CBSERVE_API_KEY` (comma-separated; a Kubernetes Secret mounted as that variable).
Any bad value becomes one `SettingsError` line naming it.
"""

from __future__ import annotations

import argparse
import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine.config import ContinuousBatchingConfig
from engine.openmp import engine_nice
from engine.server.guard import DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_BODY_BYTES, split_keys
from engine.settings_table import ENV_PREFIX, SETTINGS, command_settings, known_names, server_settings

API_KEY_ENV = "CBSERVE_API_KEY"
# the server bounds its admission queue unless told otherwise (max_queue_size; 0 in the YAML or the
# environment means unbounded, as in the engine's API)
DEFAULT_SERVER_QUEUE = 4096
# CBSERVE_* variables that set up the process, not the engine or the server: read where they act
# (the cache folder, hf:// models' folder, the CPU probe and kernels, malloc tuning, the native decoder
# stack, the benchmark's vLLM venv, the engine's step log: engine/llm_engine.py STEP_LOG_ENV, the engine
# thread's priority: engine/openmp.py NICE_ENV, async batching on the CPU: engine/backends/cpu_executor.py)
PROCESS_ENV = frozenset({"CBSERVE_CACHE_DIR", "CBSERVE_MODEL_DIR", "CBSERVE_CPU_ISA", "CBSERVE_CPU_KERNELS",
                         "CBSERVE_CPU_MALLOC_TUNING", "CBSERVE_CPU_NATIVE_LAYERS", "CBSERVE_VLLM_VENV", "CBSERVE_STEP_LOG",
                         "CBSERVE_ENGINE_NICE", "CBSERVE_ASYNC_BATCHING_ON_CPU", API_KEY_ENV})  # fmt: skip
_FLAG_TYPES = {"int": int, "float": float, "str": str}


def add_setting_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """One flag per table setting that `cbserve <command>` has, defaulting to None (not given); the help
    shows the setting's default and its variable."""
    for item in command_settings(command):
        flag = item.cli_flag
        assert flag is not None
        default = "" if item.default is None else f"default {item.default}; "
        help = f"{item.doc} ({default}env {item.env})".replace("%", "%%")
        if item.kind == "bool":
            parser.add_argument(flag, dest=item.name, action=argparse.BooleanOptionalAction, help=help)
        else:
            parser.add_argument(flag, dest=item.name, type=_FLAG_TYPES[item.kind], help=help,
                                choices=list(item.choices) or None)  # fmt: skip


class SettingsError(ValueError):
    """A bad setting: the message names it and where it came from."""


@dataclass
class ServeSettings:
    """The table's process and server settings (a test ties each default to its row), the API keys and
    the engine's config."""

    model: str | None = None
    served_model_name: str | None = None
    host: str = "0.0.0.0"
    port: int = 8000
    log_level: str = "info"
    drain_timeout: float = 30.0
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    device: str = "auto"
    dtype: str = "auto"
    quantization: str = "auto"
    quantized_activations: str = "float"
    attn_implementation: str | None = None
    compile: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    api_keys: tuple[str, ...] = ()
    engine: ContinuousBatchingConfig = field(default_factory=ContinuousBatchingConfig)


def _read_yaml(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise SettingsError(f"--config {path}: no such file")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise SettingsError(f"--config {path}: not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise SettingsError(f"--config {path}: expected a mapping of settings, got {type(data).__name__}")
    return data


def _from_env(environ: dict[str, str]) -> dict[str, Any]:
    known = known_names()
    values = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX) or key in PROCESS_ENV:
            continue
        name = key[len(ENV_PREFIX) :].lower()
        if name not in known:
            raise SettingsError(f"{key}: unknown setting {name!r}{_nearest(key, known)}")
        if raw.startswith("tcp://"):  # CBSERVE_PORT=tcp://10.0.0.7:8000 from a Service named cbserve
            raise SettingsError(f"{key}={raw!r}: a Kubernetes service link, not a setting (set the pod's "
                                "enableServiceLinks: false, as the operator's pods do)")  # fmt: skip
        try:
            values[name] = yaml.safe_load(raw)
        except yaml.YAMLError:
            raise SettingsError(f"{key}={raw!r}: not a valid value") from None
    return values


def _nearest(key: str, known: set[str]) -> str:
    """ ", did you mean CBSERVE_X?" for the known variable nearest to `key`, or "" when none is near."""
    names = sorted([ENV_PREFIX + n.upper() for n in known] + sorted(PROCESS_ENV))
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.75)
    return f"; did you mean {close[0]}?" if close else ""


def _check_cpu_isa(value: str | None) -> None:
    """CBSERVE_CPU_ISA is read by the CPU probe when the engine is built; a value it would refuse
    stops start-up here, with the settings' other errors, instead of in the middle of it."""
    from engine.backends.cpu_isa import read_cpu, resolve_isa

    try:
        resolve_isa(read_cpu(), value)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None


def load_settings(cli: dict[str, Any], environ: dict[str, str] | None = None, queue_default: int = 0) -> ServeSettings:
    """`cli` holds the parsed command line (None where a flag was not given). `queue_default` is the
    engine's `max_queue_size` when no setting gives one (`cbserve serve`: DEFAULT_SERVER_QUEUE)."""
    environ = dict(os.environ if environ is None else environ)
    merged: dict[str, Any] = {}
    if cli.get("config"):
        merged.update(_read_yaml(cli["config"]))
    merged.update(_from_env(environ))
    _check_cpu_isa(environ.get("CBSERVE_CPU_ISA"))
    try:
        engine_nice(environ)  # read again by the engine thread as it starts
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    for item in SETTINGS:
        if item.flag and cli.get(item.name) is not None:
            merged[item.name] = cli[item.name]
    server: dict[str, Any] = {}
    for item in server_settings():
        try:
            server[item.name] = item.check(merged.pop(item.name, item.default))
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
    merged.setdefault("max_queue_size", queue_default)
    try:
        engine = ContinuousBatchingConfig.from_dict(merged)
    except (ValueError, TypeError) as exc:
        raise SettingsError(f"engine setting: {exc}") from None
    if server["compile"]:
        engine.varlen_compile_config = engine.varlen_compile_config or {}
        engine.decode_compile_config = engine.decode_compile_config or {}
        engine._validate()
    keys = tuple(cli.get("api_key") or ()) or split_keys(environ.get(API_KEY_ENV))
    if any(not k.strip() or k != k.strip() for k in keys):
        raise SettingsError("--api-key: a key must be non-empty, without surrounding spaces")
    return ServeSettings(api_keys=keys, engine=engine, **server)
