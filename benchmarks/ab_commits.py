"""Two commits of cbserve on one workload, alternating in one run: did a change make the engine slower?

    python benchmarks/ab_commits.py OLD NEW --workload W1 --rounds 3 [--peers none|all|vllm|...]
    python benchmarks/ab_commits.py OLD NEW --bench steps --rounds 3 [--dtype float32]

Each commit is checked out into a temporary git worktree; each round runs `benchmarks/throughput.py
--peers PEERS --runs 1 --limits none` once per commit (the order swaps every round), with this interpreter and the
commit's own code on sys.path. The table gives each commit's median and per-round tok/s and the
ratio NEW / OLD, with the host they came from; with peers, also each peer's rate in that commit's
runs and cbserve's ratio to it (the peers are the yardstick for the minutes each commit ran in).
Both commits must share this venv's dependencies.

`--bench steps` times steps instead: this tree's `benchmarks/cpu_paths.py steps` (so that an older
commit gets the same measurement) on each commit's engine and kernels, the embedded SmolLM2-135M on
the native decoder stack: the step of a lone 580-token prompt and decode steps at batch 1, 8 and
16, milliseconds (lower is better).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RATE = re.compile(r"^run 1 (.+): ([0-9.]+) tok/s$", re.M)


def worktree(commit: str, parent: Path) -> Path:
    path = parent / commit.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(path), commit], check=True)
    return path


STEP = re.compile(r"^run 1 (prompt \d+|batch +\d+) native: ([0-9.]+) ms", re.M)


def run_in(tree: Path, command: list[str], what: str) -> str:
    """`command` with `tree`'s code first on sys.path, in `tree`: its stdout, or the run ends naming it."""
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{tree / 'operator'}"}
    out = subprocess.run([sys.executable, *command], cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"{tree.name}: {what} failed ({out.returncode}):\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return out.stdout


def one_run(tree: Path, workload: str, extra: list[str]) -> dict[str, float]:
    """One throughput.py run in `tree`: output tok/s by system (cbserve and the peers asked for)."""
    stdout = run_in(tree, ["benchmarks/throughput.py", "--runs", "1", "--workload", workload, "--limits", "none",
                           *extra], "throughput.py")  # fmt: skip
    rates = {name: float(rate) for name, rate in RATE.findall(stdout)}
    if "cbserve" not in rates:
        raise SystemExit(f"{tree.name}: throughput.py printed no cbserve rate:\n{stdout[-2000:]}")
    return rates


def steps_run(tree: Path, dtype: str) -> dict[str, float]:
    """One `cpu_paths.py steps` run (this tree's script) on `tree`'s engine: milliseconds by step kind."""
    stdout = run_in(tree, [str(ROOT / "benchmarks" / "cpu_paths.py"), "steps", "--model", "embedded", "--dtype", dtype,
                           "--runs", "1", "--paths", "native", "--batches", "1,8,16", "--lone-prompt", "580"],
                    "cpu_paths.py steps")  # fmt: skip
    ms = {" ".join(kind.split()) + " ms": float(value) for kind, value in STEP.findall(stdout)}
    if len(ms) != 4:
        raise SystemExit(f"{tree.name}: cpu_paths.py steps printed {len(ms)} of 4 step kinds:\n{stdout[-2000:]}")
    return ms


def steps_table(commits: list[str], runs: dict[str, list[dict[str, float]]]) -> None:
    old, new = commits
    print(f"{'step':<16}" + "".join(f"{c + ' median':>22}" for c in commits) + f"{'new / old':>11}  rounds (old; new)")
    for kind in runs[old][0]:
        med = {c: statistics.median(run[kind] for run in runs[c]) for c in commits}
        rounds = "; ".join(", ".join(f"{run[kind]:.1f}" for run in runs[c]) for c in commits)
        print(f"{kind:<16}{med[old]:>22.1f}{med[new]:>22.1f}{med[new] / med[old]:>11.3f}  {rounds}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--workload", default="W1", choices=["W1", "W2", "W3", "W4"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="random", choices=["random", "embedded"])
    parser.add_argument("--peers", default="none", choices=["all", "transformers", "generate", "vllm", "none"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--bench", default="throughput", choices=["throughput", "steps"],
                        help="throughput: the workload's output tok/s; steps: step milliseconds (cpu_paths.py steps)")
    args = parser.parse_args()
    from engine.backends.cpu_isa import capabilities

    commits = [args.old, args.new]
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in commits}
    extra = ["--model", args.model, "--peers", args.peers, "--dtype", args.dtype]
    with tempfile.TemporaryDirectory() as tmp:
        trees = {c: worktree(c, Path(tmp)) for c in commits}
        try:
            for r in range(args.rounds):
                for c in commits if r % 2 == 0 else commits[::-1]:
                    steps = args.bench == "steps"
                    runs[c].append(steps_run(trees[c], args.dtype) if steps else one_run(trees[c], args.workload, extra))
                    print(f"round {r + 1} {c}: " + ", ".join(f"{k} {v:.1f}" for k, v in runs[c][-1].items())
                          + ("" if steps else " tok/s"), flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    if args.bench == "steps":
        print(f"\nsteps ({args.dtype}, the embedded model, native stack), {args.rounds} alternating rounds, "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\nhost: {capabilities().describe()}")
        return steps_table(commits, runs)
    peers = "cbserve only" if args.peers == "none" else f"peers: {args.peers}"
    print(f"\n{args.workload} ({args.dtype}, {args.model} model), {peers}, {args.rounds} alternating rounds, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\nhost: {capabilities().describe()}")
    median = {c: {name: statistics.median(run[name] for run in runs[c]) for name in runs[c][0]} for c in commits}
    print(f"{'commit':<14}{'system':<30}{'median tok/s':>14}{'cbserve is':>12}  rounds")
    for c in commits:
        for name, rate in median[c].items():
            ratio = "" if name == "cbserve" else f"{median[c]['cbserve'] / rate:.2f}x"
            rounds = ", ".join(f"{run[name]:.1f}" for run in runs[c])
            print(f"{c:<14}{name:<30}{rate:>14.1f}{ratio:>12}  {rounds}")
    print(f"cbserve new / old: {median[args.new]['cbserve'] / median[args.old]['cbserve']:.3f}")


if __name__ == "__main__":
    main()
