#!/usr/bin/env python
"""One command on one GPU machine: check cbserve's GPU path end to end and measure it.

    bash scripts/gpu_check.sh                                   # on the GPU machine (installs the bundle first)
    python scripts/gpu_check.py --out results/                  # every check on cuda:0, bfloat16
    python scripts/gpu_check.py --small --vllm off              # a 1B throughput model, no vLLM line
    python scripts/gpu_check.py --only kernels,graphs           # some checks
    python scripts/gpu_check.py --device cpu --quick --out /tmp/gc   # the CPU smoke run (stand-ins)

Runs the checks of scripts/gpu_checks/ in order (each module's docstring says what it asserts), each
in a process of its own (forked from one that has imported torch, transformers and cbserve:
scripts/gpu_checks/forked.py; GPU_CHECK_FORK=0 starts each from scratch) with the module's time
limit (so a sticky CUDA error or a hang ends that row alone), and within one budget for the whole
run (`--budget`, 450 s): a check is started only while `MIN_START_S` of it are left, and given at
most what is left. Each is a row: pass, fail (why) or
skipped (why: its requirement is absent here, or the budget is spent). Prints the markdown table
and, with --out, writes gpu_check.json and gpu_check.md there after every row (the table to paste
into docs/benchmarks.md, with the GPU, driver, CUDA, torch, transformers, flash-attn and attention
backend, and the date) and each row's log under logs/. Exit status 1 when any check failed. No
network is needed and nothing is installed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from scripts.gpu_checks import (  # noqa: E402
    async_batching,
    equality,
    forked,
    graphs,
    kernels,
    memory,
    report,
    sampling,
    serve,
    sync,
    tensor_parallel,
    throughput,
    transformers_peer,
    vllm_peer,
)
from scripts.gpu_checks.common import Context  # noqa: E402
from scripts.gpu_checks.environment import environment  # noqa: E402

# in this order: the correctness rows first, the measurements (8B model) last
CHECKS = {"kernels": kernels, "equality": equality, "graphs": graphs, "sampling": sampling, "sync": sync,
          "async": async_batching, "serve": serve, "memory": memory, "throughput": throughput,
          "transformers": transformers_peer,
          "vllm": vllm_peer, "tensor-parallel": tensor_parallel}  # fmt: skip
ARCHS = ("llama", "qwen2", "qwen3", "mistral")
BUDGET_S = 450  # the whole run; scripts/gpu_check.sh adds the bundle's install and stays under 8 minutes
MIN_START_S = 30  # a check is not started with less of the budget left
ENV_TIMEOUT_S = 120


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check.py", description="Check cbserve's GPU path and measure it.")
    p.add_argument("--device", default="cuda:0", help="torch device (default cuda:0; 'cpu' for the smoke run)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="models' dtype (auto: bfloat16 on CUDA, float32 on the CPU)")  # fmt: skip
    p.add_argument("--out", type=Path, help="write gpu_check.json, gpu_check.md and logs/ into this folder")
    p.add_argument("--only", help=f"comma-separated checks to run, of: {', '.join(CHECKS)}")
    p.add_argument("--skip", default="", help="comma-separated checks to leave out (shown as skipped)")
    p.add_argument("--budget", type=float, default=BUDGET_S, help=f"seconds for the whole run (default {BUDGET_S})")
    p.add_argument("--archs", default=",".join(ARCHS), help="test architectures of the equality check")
    p.add_argument("--block-size", type=int, default=256, help="KV block size on CUDA (a multiple of 256)")
    p.add_argument("--min-exact", type=float, default=0.9,
                   help="share of exact greedy matches of two ranks against one (tensor-parallel)")  # fmt: skip
    p.add_argument("--small", action="store_true", help="throughput and memory on a 1B-shaped Llama, not 8B")
    p.add_argument("--quick", action="store_true", help="the smallest sizes (the CPU smoke test's)")
    p.add_argument("--vllm", default="auto", help="auto: this Python's vLLM if it has one; off; or the Python "
                                                 "(or venv folder) of one; nothing is installed")  # fmt: skip
    p.add_argument("--two-ranks", action="store_true", help="with --device cpu: run the tensor-parallel line on two "
                                                            "CPU ranks (with CUDA it runs whenever two GPUs are there)")  # fmt: skip
    # how the run starts its own processes (not for people)
    p.add_argument("--row", help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def selected(args: argparse.Namespace) -> dict[str, str]:
    """Each check's name and, for one left out, why."""
    names = list(CHECKS)
    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else names
    skip = {n.strip() for n in args.skip.split(",") if n.strip()}
    unknown = (set(only) | skip) - set(names)
    if unknown:
        raise SystemExit(f"unknown check(s): {', '.join(sorted(unknown))}; the checks are {', '.join(names)}")
    return {n: ("" if n in only and n not in skip else "left out (--only/--skip)") for n in names}


def dtype_of(args: argparse.Namespace) -> torch.dtype:
    if args.dtype != "auto":
        return getattr(torch, args.dtype)
    return torch.bfloat16 if torch.device(args.device).type == "cuda" else torch.float32


def context(args: argparse.Namespace, work: Path) -> Context:
    return Context(torch.device(args.device), dtype_of(args), args.block_size, args.min_exact,
                   [a.strip() for a in args.archs.split(",") if a.strip()], quick=args.quick, small=args.small,
                   vllm=args.vllm, two_ranks=args.two_ranks, work=work)  # fmt: skip


def child(args: argparse.Namespace) -> int:
    """In a row's own process: run one check (or, for "environment", describe the machine) and write
    the outcome as JSON to --result."""
    ctx = context(args, args.work)
    if args.row == "environment":
        row = report.run_check("environment", lambda: {"rows": environment(ctx)})
    else:
        module = CHECKS[args.row]
        row = report.run_check(module.NAME, lambda: module.run(ctx), ctx.sync)
    args.result.write_text(json.dumps(asdict(row), default=str))
    return 0


def run_process(cmd: list[str], timeout: float, log: Path) -> tuple[int | None, float]:
    """Run `cmd` in a session of its own, output to `log`; past `timeout` its whole process group is
    killed (a server it started too). The exit status (None when killed) and the seconds it ran."""
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None

        def wait(seconds: float) -> None:
            try:
                proc.wait(seconds)
            except subprocess.TimeoutExpired:
                pass

        forked.end_session(proc.pid, wait)  # whatever it left behind goes too
    return code, time.monotonic() - start


def tail(log: Path, lines: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""


def run_row(key: str, argv: list[str], work: Path, logs: Path, limit: float, why_limit: str) -> report.Row:
    name = CHECKS[key].NAME if key in CHECKS else key
    result, log = work / f"{key}.result.json", logs / f"{key}.log"
    row_argv = [*argv, "--row", key, "--work", str(work), "--result", str(result)]
    if os.environ.get("GPU_CHECK_FORK", "1") == "0":  # each row a fresh interpreter, importing everything itself
        code, seconds = run_process([sys.executable, str(Path(__file__).resolve()), *row_argv], limit, log)
    else:
        code, seconds = forked.run_forked(row_argv, limit, log)
    if result.exists():
        return report.Row(**json.loads(result.read_text()))
    last = (tail(log, 1) or "no output").strip()[:300]
    if code is None:
        return report.Row(name, report.FAIL, f"timed out after {seconds:.0f} s ({why_limit}); last line: {last}", seconds)
    return report.Row(name, report.FAIL, f"its process exited with {code}; last line: {last}", seconds)


def title_of(args: argparse.Namespace, env: list[tuple[str, str]]) -> str:
    attention = dict(env).get("attention backend", "unknown").split(";")[0]
    return (f"cbserve GPU check, {datetime.date.today().isoformat()}, {args.device}, "
            f"{str(dtype_of(args)).removeprefix('torch.')}, attention {attention}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.row:
        return child(args)
    if torch.device(args.device).type == "cuda":
        from engine.backends.cuda import require_cuda

        require_cuda()
    choice = selected(args)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as scratch:
        work = Path(scratch)
        (work / "rows").mkdir()
        logs = args.out / "logs" if args.out else work / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        described = run_row("environment", argv, work, logs, ENV_TIMEOUT_S, f"its limit {ENV_TIMEOUT_S} s")
        if described.status == report.PASS:
            env = [(k, v) for k, v in described.figures["rows"]]
        else:  # the machine could not even be described: say so at the top
            env = [("environment", f"{described.status}: {described.reason}")]
        title = title_of(args, env)
        rows: list[report.Row] = []
        for key, module in CHECKS.items():
            left = args.budget - (time.monotonic() - start)
            if choice[key]:
                row = report.Row(module.NAME, report.SKIPPED, choice[key])
            elif hasattr(module, "requirement") and (absent := module.requirement(context(args, work))):
                row = report.Row(module.NAME, report.SKIPPED, absent)
            elif left < MIN_START_S:
                why = f"not started: {left:.0f} s of the run's {args.budget:.0f} s budget left"
                row = report.Row(module.NAME, report.SKIPPED, why)
            else:
                print(f"[gpu_check] {module.NAME} ...", file=sys.stderr, flush=True)
                limit = min(module.TIMEOUT_S, left)
                why = f"its limit {module.TIMEOUT_S} s" if limit == module.TIMEOUT_S else f"the budget had {left:.0f} s left"
                row = run_row(key, argv, work, logs, limit, why)
                print(f"[gpu_check] {row.status} in {row.seconds:.1f} s" + (f": {row.reason}" if row.reason else ""),
                      file=sys.stderr, flush=True)  # fmt: skip
                if row.status == report.FAIL:
                    print(tail(logs / f"{key}.log"), file=sys.stderr, flush=True)
            (work / "rows" / f"{key}.json").write_text(json.dumps(asdict(row), default=str))
            rows.append(row)
            if args.out:
                report.write(args.out, env, rows, argv, title)
    print(report.markdown(env, rows, title))
    if args.out:
        print(f"wrote {args.out / 'gpu_check.json'} and {args.out / 'gpu_check.md'}", file=sys.stderr)
    return 1 if any(r.status == report.FAIL for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
