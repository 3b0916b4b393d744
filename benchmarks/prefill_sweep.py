"""`max_decode_stall` swept: `cbserve serve` once per value under `make compare`'s load, throughput against
the inter-token tail.

    python benchmarks/prefill_sweep.py [--values off,8,4,2,1.5] [python -m loadtest compare flags]

Each value is one target of `python -m loadtest compare` (loadtest/compare.py), so the servers are
measured in turn, the order rotating each round, with the same seeded prompts, and the usual report
lands in --out (default reports/prefill_sweep/). The load is benchmarks/serve_compare.py's: 16 users,
completions, 64-256 words in, 128 tokens out, 60 s, 2 rounds, float32. Then one table, printed and
written to sweep.md there: output tok/s, inter-token p50/p99, TTFT p50/p99 per value.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_compare import DEFAULTS  # noqa: E402

from engine.backends.cpu_isa import capabilities  # noqa: E402
from loadtest.cli import parse_compare_args  # noqa: E402
from loadtest.compare import compare  # noqa: E402
from loadtest.target import Target, UsageError, cbserve_command, free_port  # noqa: E402

VALUES = ("off", "8", "4", "2", "1.5")


def parse_values(text: str) -> list[float]:
    """"off,8,4" -> [0.0, 8.0, 4.0]; "off" and "0" both turn the cap off."""
    values = []
    for part in text.split(","):
        try:
            value = 0.0 if part.strip() == "off" else float(part)
        except ValueError:
            raise UsageError(f"--values takes a comma-separated list of factors (or off), got {part!r}") from None
        if value < 0 or value in values:
            raise UsageError(f"--values: {part!r} is negative or given twice")
        values.append(value)
    return values


def label(value: float) -> str:
    return "stall-off" if value == 0 else f"stall-{value:g}"


def targets(values: list[float]) -> list[Target]:
    chosen = []
    for value in values:
        port = free_port()
        command = cbserve_command(port) + ["--dtype", "float32", "--max-decode-stall", f"{value:g}"]
        chosen.append(Target(label(value), f"http://127.0.0.1:{port}", command=command))
    return chosen


def sweep_table(report: dict) -> str:
    """The markdown table of one compare.json: a row per target, in the order measured."""
    lines = ["| `max_decode_stall` | output tok/s | each round | ITL p50 / p99 (ms) | TTFT p50 / p99 (ms) | requests |",
             "|---|---:|---|---:|---:|---:|"]  # fmt: skip
    for name, s in report["targets"].items():
        rounds = ", ".join(f"{x:.1f}" for x in s["rounds_output_throughput"])
        value = name.removeprefix("stall-")
        lines.append(f"| {value} | {s['output_throughput']:.1f} | {rounds} | {s['p50_itl_ms']:,.0f} / "
                     f"{s['p99_itl_ms']:,.0f} | {s['p50_ttft_ms']:,.0f} / {s['p99_ttft_ms']:,.0f} | "
                     f"{s['completed']} ({s['failed']} failed) |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    text = ",".join(VALUES)
    if "--values" in argv:
        i = argv.index("--values")
        text = argv[i + 1] if i + 1 < len(argv) else ""
        argv = argv[:i] + argv[i + 2 :]
    try:
        values = parse_values(text)
        print(f"host: {capabilities().describe()}", flush=True)
        defaults = [a if a != "reports/compare" else "reports/prefill_sweep" for a in DEFAULTS]
        args = parse_compare_args(defaults + argv, targets=[])
        args.targets = targets(values) + args.targets
        status = compare(args.targets, args)
    except UsageError as exc:
        print(f"prefill_sweep: error: {exc}", file=sys.stderr)
        return exc.status
    out = Path(args.out)
    table = sweep_table(json.loads((out / "compare.json").read_text()))
    (out / "sweep.md").write_text(table + "\n")
    print(f"\n{table}\n\n(also in {out}/sweep.md)")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
