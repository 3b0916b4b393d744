"""The server under test: reach it by URL or start it from a command line, wait until it is ready.

Any OpenAI-compatible endpoint works. Readiness is asked of `/ready` (cbserve), else `/health`
(vLLM, llama.cpp, TGI, SGLang), else `/v1/models` (hosted endpoints): a path that answers 404 or
405 does not exist there and the next is tried; any other answer means "not yet".
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import requests

READINESS_PATHS = ("/ready", "/health", "/v1/models")


class UsageError(Exception):
    """Bad flags or an unreachable server: one line to stderr, exit status 2 or 1."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@dataclass
class Target:
    """One endpoint: a name for the report, its URL, and the process if this run started it."""

    name: str
    url: str
    api_key: str | None = None
    command: list[str] | None = None
    proc: subprocess.Popen | None = None
    model_name: str | None = None
    readiness: str | None = None  # the path that answered 200
    env: dict[str, str] = field(default_factory=dict)

    def start(self, log: Path) -> None:
        """Start `command` (stdout and stderr to `log`) in a process group of its own."""
        if self.command is None or self.proc is not None:
            return
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as out:
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, **self.env}, start_new_session=True)  # fmt: skip

    def stop(self, timeout: float = 60) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def cpu_seconds(self) -> float | None:
        """CPU time used so far by the started process and its children (None if not started here)."""
        if self.proc is None:
            return None
        try:
            root = psutil.Process(self.proc.pid)
            total = 0.0
            for p in [root, *root.children(recursive=True)]:
                try:
                    t = p.cpu_times()
                    total += t.user + t.system
                except psutil.NoSuchProcess:
                    pass
            return total
        except psutil.NoSuchProcess:
            return None

    def wait_ready(self, timeout: float) -> None:
        self.readiness = wait_ready(self.url, timeout, self.proc, self.api_key)
        self.model_name = self.model_name or served_model(self.url, self.api_key)


def wait_ready(url: str, timeout: float, proc: subprocess.Popen | None = None, api_key: str | None = None) -> str:
    """Poll the readiness paths until one answers 200; returns that path. UsageError on timeout."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    base = url.rstrip("/")
    while True:
        if proc is not None and proc.poll() is not None:
            raise UsageError(f"the server exited with status {proc.returncode} before it was ready", 1)
        for path in READINESS_PATHS:
            try:
                r = requests.get(base + path, timeout=3, headers=auth_headers(api_key))
            except requests.RequestException as exc:
                last = type(exc).__name__
                break  # nothing listening yet: no other path will answer either
            if r.status_code == 200:
                return path
            if r.status_code in (401, 403):
                raise UsageError(f"{base}{path} answered {r.status_code}: pass the endpoint's key with --api-key "
                                 "or OPENAI_API_KEY", 1)  # fmt: skip
            last = f"{path} answered {r.status_code}"
            if r.status_code not in (404, 405):
                break  # the path exists and says "not yet"
        if time.monotonic() >= deadline:
            raise UsageError(f"{url} is not ready after {timeout:.0f} s ({last})", 1)
        time.sleep(0.5)  # polling a readiness probe, bounded by the deadline


def served_model(url: str, api_key: str | None = None) -> str | None:
    try:
        r = requests.get(url.rstrip("/") + "/v1/models", timeout=5, headers=auth_headers(api_key))
        return r.json()["data"][0]["id"]
    except (requests.RequestException, KeyError, IndexError, TypeError, ValueError):
        return None


def cbserve_command(port: int, model: str | None = None, engine_yaml: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "engine.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning"]  # fmt: skip
    if model:
        cmd += ["--model", model]
    if engine_yaml:
        cmd += ["--config", engine_yaml]
    return cmd


def parse_target(text: str, api_key: str | None) -> Target:
    """NAME=URL, or NAME=cmd:COMMAND LINE with {port} where the free port goes."""
    name, sep, spec = text.partition("=")
    if not sep or not name or not spec:
        raise UsageError(f"--target takes NAME=URL or NAME=cmd:COMMAND, got {text!r}")
    if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise UsageError(f"--target name {name!r} must be letters, digits, '-', '_' or '.'")
    if spec.startswith("cmd:"):
        if "{port}" not in spec:
            raise UsageError(f"--target {name}: the command must contain {{port}}")
        port = free_port()
        command = shlex.split(spec[4:].replace("{port}", str(port)))
        return Target(name, f"http://127.0.0.1:{port}", api_key, command=command)
    if not spec.startswith(("http://", "https://")):
        raise UsageError(f"--target {name}: {spec!r} is neither a URL (http://...) nor cmd:COMMAND")
    return Target(name, spec, api_key)
