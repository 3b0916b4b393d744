"""`cbserve serve` settings: command line over CBSERVE_* environment over the --config YAML.

The YAML (the operator writes it into a ConfigMap) holds ContinuousBatchingConfig knobs by their
Python names, plus the server's own `dtype`, `attn_implementation`, `compile` and `max_body_bytes`.
API keys are never read from the YAML (a ConfigMap is no place for a secret): `--api-key` or
`CBSERVE_API_KEY` (comma-separated; a Kubernetes Secret mounted as that variable). Any bad value
becomes one `SettingsError` line naming it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine.config import ContinuousBatchingConfig

from engine.server.guard import DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_BODY_BYTES, split_keys

SERVER_KEYS = ("dtype", "attn_implementation", "compile", "max_body_bytes")
API_KEY_ENV = "CBSERVE_API_KEY"
# the server bounds its admission queue unless told otherwise (max_queue_size; 0 in the YAML or the
# environment means unbounded, as in the engine's API)
DEFAULT_SERVER_QUEUE = 4096
DTYPES = ("auto", "float32", "bfloat16", "float16")
ENV_PREFIX = "CBSERVE_"
# CBSERVE_* variables that set up the process, not the engine or the server: read where they act
# (the cache folder, hf:// models' folder, the CPU probe and kernels, malloc tuning, the benchmark's vLLM venv)
PROCESS_ENV = frozenset({"CBSERVE_CACHE_DIR", "CBSERVE_MODEL_DIR", "CBSERVE_CPU_ISA", "CBSERVE_CPU_KERNELS",
                         "CBSERVE_CPU_MALLOC_TUNING", "CBSERVE_VLLM_VENV", API_KEY_ENV})  # fmt: skip


class SettingsError(ValueError):
    """A bad setting: the message names it and where it came from."""


@dataclass
class ServeSettings:
    model: str | None = None
    served_model_name: str | None = None
    host: str = "0.0.0.0"
    port: int = 8000
    dtype: str = "auto"
    attn_implementation: str | None = None
    compile: bool = False
    log_level: str = "info"
    drain_timeout: float = 30.0
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout: float = DEFAULT_BODY_TIMEOUT
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
    known = set(ContinuousBatchingConfig.field_names()) | set(SERVER_KEYS)
    values = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX) or key in PROCESS_ENV:
            continue
        name = key[len(ENV_PREFIX) :].lower()
        if name not in known:
            raise SettingsError(f"{key}: unknown setting {name!r}")
        try:
            values[name] = yaml.safe_load(raw)
        except yaml.YAMLError:
            raise SettingsError(f"{key}={raw!r}: not a valid value") from None
    return values


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
    for key in SERVER_KEYS:
        if cli.get(key) is not None:
            merged[key] = cli[key]
    server = {k: merged.pop(k) for k in SERVER_KEYS if k in merged}
    merged.setdefault("max_queue_size", queue_default)
    try:
        engine = ContinuousBatchingConfig.from_dict(merged)
    except (ValueError, TypeError) as exc:
        raise SettingsError(f"engine setting: {exc}") from None
    dtype = server.get("dtype", "auto")
    if dtype not in DTYPES:
        raise SettingsError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    compile_ = server.get("compile", False)
    if not isinstance(compile_, bool):
        raise SettingsError(f"compile must be true or false, got {compile_!r}")
    if compile_:
        engine.varlen_compile_config = engine.varlen_compile_config or {}
        engine.decode_compile_config = engine.decode_compile_config or {}
        engine._validate()
    port = cli.get("port") or 8000
    if not 0 < port < 65536:
        raise SettingsError(f"--port must be in 1..65535, got {port}")
    drain = cli.get("drain_timeout")
    if drain is not None and drain < 0:
        raise SettingsError(f"--drain-timeout must be >= 0, got {drain}")
    max_body = server.get("max_body_bytes", DEFAULT_MAX_BODY_BYTES)
    if cli.get("max_body_bytes") is not None:
        max_body = cli["max_body_bytes"]
    if isinstance(max_body, bool) or not isinstance(max_body, int) or max_body < 1024:
        raise SettingsError(f"max_body_bytes must be an integer >= 1024, got {max_body!r}")
    body_timeout = cli.get("body_timeout")
    if body_timeout is not None and not body_timeout > 0:
        raise SettingsError(f"--body-timeout must be > 0, got {body_timeout}")
    keys = tuple(cli.get("api_key") or ()) or split_keys(environ.get(API_KEY_ENV))
    if any(not k.strip() or k != k.strip() for k in keys):
        raise SettingsError("--api-key: a key must be non-empty, without surrounding spaces")
    return ServeSettings(
        model=cli.get("model"),
        served_model_name=cli.get("served_model_name"),
        host=cli.get("host") or "0.0.0.0",
        port=port,
        dtype=dtype,
        attn_implementation=server.get("attn_implementation"),
        compile=compile_,
        log_level=cli.get("log_level") or "info",
        drain_timeout=30.0 if drain is None else drain,
        api_keys=keys,
        max_body_bytes=max_body,
        body_timeout=DEFAULT_BODY_TIMEOUT if body_timeout is None else body_timeout,
        engine=engine,
    )
