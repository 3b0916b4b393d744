"""`cbserve serve` started as the operator's pod starts it, answering a streamed chat.

The command is operator/cbserve_operator/workload.py's `server_command` (the venv's `cbserve`
console script, `--model`, `--served-model-name`, `--port`, `--config engine.yaml`,
`--drain-timeout`, `--device cuda`, or `cpu` on the CPU), plus `--host 127.0.0.1`, over a saved test
model and an engine.yaml as the operator's ConfigMap holds one. Asserted: /ready answers 200;
/v1/models says the engine (weights and KV cache) is on the device with the attention backend an
engine gets there (flash-attn's, or the fallback when flash-attn is not installed); a chat without a temperature (the server's default), `stream: true`, arrives as
server-sent events with content, a finish reason and `[DONE]`; SIGTERM stops the server with exit 0.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from scripts.gpu_checks.common import Context
from scripts.gpu_checks.report import require

NAME = "cbserve serve on the device, streamed chat"
TIMEOUT_S = 180
READY_TIMEOUT_S = 150


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(model: Path, config: Path, port: int, device: str) -> list[str]:
    """The pod's `cbserve serve` command (workload.server_command's flags), on 127.0.0.1:`port`."""
    script = Path(sys.executable).parent / "cbserve"
    entry = [str(script)] if script.exists() else [sys.executable, "-m", "engine.cli"]
    return [*entry, "serve", "--model", str(model), "--served-model-name", model.name, "--port", str(port),
            "--config", str(config), "--drain-timeout", "20", "--device", device, "--host", "127.0.0.1"]  # fmt: skip


def wait_ready(httpx, proc: subprocess.Popen, url: str, log: Path) -> float:
    start = time.monotonic()
    while time.monotonic() - start < READY_TIMEOUT_S:
        if proc.poll() is not None:
            raise RuntimeError(f"cbserve serve exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.2)  # polling the readiness probe, as the kubelet does, with a deadline
    raise TimeoutError(f"not ready after {READY_TIMEOUT_S} s: {log.read_text()[-2000:]}")


def stream_chat(httpx, url: str, model: str) -> tuple[str, list[dict], bool, float]:
    """A chat with `stream: true` and no temperature: the text, the chunks, whether [DONE] came, and the
    seconds to the first content."""
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me about the quick brown fox."}],
            "max_tokens": 16, "stream": True}  # fmt: skip
    text, chunks, done, first = "", [], False, None
    start = time.monotonic()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            chunks.append(chunk)
            delta = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
            if delta:
                first = first if first is not None else time.monotonic() - start
                text += delta
    return text, chunks, done, first if first is not None else float("nan")


def run(ctx: Context) -> dict:
    import httpx
    import yaml

    from engine.testing import save_test_model

    folder = save_test_model(ctx.work / "serve-model" / "tiny-llama", "llama")
    config = ctx.work / "engine.yaml"  # the operator's ConfigMap: engine settings only
    config.write_text(yaml.safe_dump({"max_memory_percent": 0.3, "max_requests_per_batch": 8}))
    port = free_port()
    log = ctx.work / "serve.log"
    device = "cuda" if ctx.cuda else "cpu"
    cmd = command(folder, config, port, device)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(ctx.device.index or 0)} if ctx.cuda else dict(os.environ)
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        ready_s = wait_ready(httpx, proc, url, log)
        engine = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["engine"]
        text, chunks, done, first_s = stream_chat(httpx, url, folder.name)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    finish = next((c["choices"][0].get("finish_reason") for c in reversed(chunks) if c.get("choices")), None)
    figures = {"device": engine["device"], "attention": engine["attn_backend"], "dtype": engine["dtype"],
               "kv cache GiB": engine["kv_cache_bytes"] / (1 << 30), "ready s": ready_s, "first content s": first_s,
               "chunks": len(chunks), "finish": finish, "exit code": code}  # fmt: skip
    require(engine["device"].startswith(device), f"the engine runs on {engine['device']}, not {device}", figures)
    expected = ctx.attention()[0]
    require(engine["attn_backend"] == expected, f"attention is {engine['attn_backend']}, not {expected}", figures)
    require(engine["kv_cache_bytes"] > 0, "no KV cache", figures)
    require(bool(text) and done and finish in ("length", "stop"), "the stream had no content, finish or [DONE]", figures)
    require(code == 0, f"SIGTERM ended the server with {code}", figures)
    return figures
