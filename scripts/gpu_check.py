#!/usr/bin/env python
"""One command on one GPU machine: check cbserve's GPU path end to end and measure it.

    python scripts/gpu_check.py --out results/                  # every check on cuda:0, bfloat16
    python scripts/gpu_check.py --small --vllm off              # a 1B throughput model, no vLLM line
    python scripts/gpu_check.py --only kernels,graphs           # some checks
    python scripts/gpu_check.py --device cpu --quick --out /tmp/gc   # the CPU smoke run (stand-ins)

Runs the checks of scripts/gpu_checks/ in order (each module's docstring says what it asserts), each
timed, each a row: pass, fail (why) or skipped (why). Prints the markdown table and, with --out,
writes gpu_check.json and gpu_check.md there (the table to paste into docs/benchmarks.md, with the
GPU, driver, CUDA, torch and flash-attn versions and the date). Exit status 1 when any check failed.
No network is needed, except `pip install vllm` for the vLLM line (skipped when it cannot install).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from scripts.gpu_checks import (  # noqa: E402
    equality,
    graphs,
    kernels,
    memory,
    report,
    sampling,
    serve,
    sync,
    tensor_parallel,
    throughput,
    vllm_peer,
)
from scripts.gpu_checks.common import Context  # noqa: E402
from scripts.gpu_checks.environment import environment  # noqa: E402

# in this order: memory before throughput (both use the big model), vLLM after it (frees it), serve last
CHECKS = {"kernels": kernels, "equality": equality, "graphs": graphs, "sampling": sampling, "sync": sync,
          "memory": memory, "throughput": throughput, "vllm": vllm_peer, "serve": serve,
          "tensor-parallel": tensor_parallel}  # fmt: skip
ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check.py", description="Check cbserve's GPU path and measure it.")
    p.add_argument("--device", default="cuda:0", help="torch device (default cuda:0; 'cpu' for the smoke run)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="models' dtype (auto: bfloat16 on CUDA, float32 on the CPU)")  # fmt: skip
    p.add_argument("--out", type=Path, help="write gpu_check.json and gpu_check.md into this folder")
    p.add_argument("--only", help=f"comma-separated checks to run, of: {', '.join(CHECKS)}")
    p.add_argument("--skip", default="", help="comma-separated checks to leave out (shown as skipped)")
    p.add_argument("--archs", default=",".join(ARCHS), help="test architectures of the equality check")
    p.add_argument("--block-size", type=int, default=256, help="KV block size on CUDA (a multiple of 256)")
    p.add_argument("--min-exact", type=float, default=0.9,
                   help="share of exact greedy matches a half-precision row needs (float32 on the CPU: all)")  # fmt: skip
    p.add_argument("--small", action="store_true", help="throughput and memory on a 1B-shaped Llama, not 8B")
    p.add_argument("--quick", action="store_true", help="the smallest sizes (the CPU smoke test's)")
    p.add_argument("--vllm", default="auto", help="auto: pip install vllm into a venv if the registry has a "
                                                 "build that runs here; off; or the folder of such a venv")  # fmt: skip
    p.add_argument("--two-ranks", action="store_true", help="with --device cpu: run the tensor-parallel line on two "
                                                            "CPU ranks (with CUDA it runs whenever two GPUs are there)")  # fmt: skip
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        from engine.backends.cuda import require_cuda

        require_cuda()
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    choice = selected(args)
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as work:
        ctx = Context(device, dtype, args.block_size, args.min_exact, [a.strip() for a in args.archs.split(",") if a.strip()],
                      quick=args.quick, small=args.small, vllm=args.vllm, two_ranks=args.two_ranks, work=Path(work))  # fmt: skip
        env = environment(device)
        rows = []
        for name, module in CHECKS.items():
            if choice[name]:
                rows.append(report.Row(module.NAME, report.SKIPPED, choice[name]))
                continue
            print(f"[gpu_check] {module.NAME} ...", file=sys.stderr, flush=True)
            rows.append(report.run_check(module.NAME, lambda m=module: m.run(ctx), ctx.sync))
            print(f"[gpu_check] {rows[-1].status} in {rows[-1].seconds:.1f} s", file=sys.stderr, flush=True)
        ctx.release("big_model")
    title = f"cbserve GPU check, {datetime.date.today().isoformat()}, {args.device}, {str(dtype).removeprefix('torch.')}"
    print(report.markdown(env, rows, title))
    if args.out:
        paths = report.write(args.out, env, rows, sys.argv[1:] if argv is None else argv, title)
        print(f"wrote {paths[0]} and {paths[1]}", file=sys.stderr)
    return 1 if any(r.status == report.FAIL for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
