"""Two commits of cbserve on one workload, alternating in one run: did a change make the engine slower?

    python benchmarks/ab_commits.py OLD NEW --workload W1 --rounds 3

Each commit is checked out into a temporary git worktree; each round runs `benchmarks/throughput.py
--peers none --runs 1` once per commit (the order swaps every round), with this interpreter and the
commit's own code on sys.path. The table gives each commit's median and per-round tok/s and the
ratio NEW / OLD, with the host they came from. Both commits must share this venv's dependencies.
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
RATE = re.compile(r"^run 1 cbserve: ([0-9.]+) tok/s$", re.M)


def worktree(commit: str, parent: Path) -> Path:
    path = parent / commit.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(path), commit], check=True)
    return path


def one_run(tree: Path, workload: str, extra: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{tree / 'operator'}"}
    out = subprocess.run([sys.executable, "benchmarks/throughput.py", "--peers", "none", "--runs", "1",
                          "--workload", workload, *extra], cwd=tree, env=env, capture_output=True, text=True,
                         timeout=3600)  # fmt: skip
    match = RATE.search(out.stdout)
    if out.returncode != 0 or match is None:
        raise SystemExit(f"{tree.name}: throughput.py failed ({out.returncode}):\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return float(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--workload", default="W1", choices=["W1", "W2", "W3", "W4"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="random", choices=["random", "embedded"])
    args = parser.parse_args()
    from engine.backends.cpu_isa import capabilities

    commits = [args.old, args.new]
    rates: dict[str, list[float]] = {c: [] for c in commits}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {c: worktree(c, Path(tmp)) for c in commits}
        try:
            for r in range(args.rounds):
                for c in commits if r % 2 == 0 else commits[::-1]:
                    rates[c].append(one_run(trees[c], args.workload, ["--model", args.model]))
                    print(f"round {r + 1} {c}: {rates[c][-1]:.1f} tok/s", flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    print(f"\n{args.workload} ({args.model} model), cbserve only, {args.rounds} alternating rounds, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\nhost: {capabilities().describe()}")
    print(f"{'commit':<14}{'median tok/s':>14}  rounds")
    for c in commits:
        print(f"{c:<14}{statistics.median(rates[c]):>14.1f}  " + ", ".join(f"{x:.1f}" for x in rates[c]))
    print(f"new / old: {statistics.median(rates[args.new]) / statistics.median(rates[args.old]):.3f}")


if __name__ == "__main__":
    main()
