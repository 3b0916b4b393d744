"""Each row of the GPU check in a process of its own, forked from one that has imported torch,
transformers and cbserve once, so that a row does not spend its first seconds importing them again
(3-6 s a row, ten rows a run).

The rows are forked from multiprocessing's fork server: a fresh interpreter that imports `PRELOAD`
and nothing more. It never touches CUDA (importing torch, transformers and these modules starts no
CUDA context), so each forked row initialises CUDA for itself as a spawned process would; the parent,
which has asked CUDA whether a device is there, is never the one forked.

The fork server was started with the environment of its time; a row takes the caller's environment
of the moment it starts (libraries the server loaded read theirs at load: OpenMP's settings are the
server's). A row's process starts a session of its own (as `gpu_check.run_process` does for a
command), so a row past its limit is killed with whatever it started (a server, tensor-parallel
ranks), and writes its output to its log.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

PRELOAD = ("torch", "transformers", "transformers.models.llama.modeling_llama", "engine.llm_engine", "engine.generate",
           "engine.testing", "scripts.gpu_check")  # fmt: skip

_context: multiprocessing.context.BaseContext | None = None


def _fork_server() -> multiprocessing.context.BaseContext:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(list(PRELOAD))
    return _context


def _row(argv: list[str], log: str, environ: dict[str, str]) -> None:
    """In the forked process: the caller's environment as it is now (the fork server keeps the one it
    started with), a session of its own, output to `log`, then gpu_check's row."""
    os.environ.clear()
    os.environ.update(environ)
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    import torch

    bad_fork = getattr(torch.cuda, "_is_in_bad_fork", lambda: False)
    if bad_fork():  # never, as PRELOAD stands: one of its imports would have started CUDA in the server
        sys.exit("the fork server had started CUDA before this row was forked; run with GPU_CHECK_FORK=0")
    from scripts import gpu_check

    sys.exit(gpu_check.main(argv))  # multiprocessing makes SystemExit's code the exit status


def end_session(pid: int, wait: Callable[[float], object]) -> None:
    """SIGTERM, then SIGKILL, to the session that process `pid` leads (whatever it started goes too),
    `wait(10)` after each; nothing once the session is gone."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        wait(10)


def run_forked(argv: list[str], timeout: float, log: Path) -> tuple[int | None, float]:
    """gpu_check's `main(argv)` in a forked process, as `run_process` runs a command: the exit status
    (None when it was killed at `timeout`) and the seconds it ran."""
    start = time.monotonic()
    proc = _fork_server().Process(target=_row, args=(argv, str(log), dict(os.environ)), name="gpu-check-row")
    proc.start()
    proc.join(timeout)
    code = proc.exitcode
    end_session(proc.pid, proc.join)
    if proc.is_alive():  # killed before its session began: the process alone
        proc.kill()
        proc.join()
    return code, time.monotonic() - start
