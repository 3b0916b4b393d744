"""`python -m loadtest`: load-test an OpenAI-compatible endpoint with Locust and write a report.

    python -m loadtest [--url URL | --model PATH] [--api-key KEY] [--users N] [--duration 60s]
                       [--rate R [--max-in-flight 256]] [--shape steps:1,2,4@10] [--sweep] [--endpoint chat|completions]
                       [--input-len 64:192] [--output-len 64] [--shared-prefix 0] [--seed 0]
                       [--temperature 0] [--slo ttft_ms=500 --slo tpot_ms=50] [--fail-on-slo] [--out DIR]
    python -m loadtest compare --target NAME=URL --target NAME=cmd:COMMAND {port} ... [--rounds N]
                       [the load flags above]

With no --url it starts `cbserve serve` (the embedded SmolLM2 model unless --model) on a free
port of 127.0.0.1. Readiness is asked of /ready, else /health, else /v1/models. The output folder
holds report.html (plots embedded), summary.json, requests.jsonl, Locust's CSV and HTML, the
server's gauges over the run and the PNG plots.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from loadtest.compare import compare
from loadtest.dataset import LengthSpec
from loadtest.report import parse_slos, table
from loadtest.run import run_locust, sweep
from loadtest.target import Target, UsageError, cbserve_command, free_port, parse_target


def parse_duration(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(s|m|h)?", text.strip())
    if not m:
        raise UsageError(f"--duration must look like 30s, 2m or 1h, got {text!r}")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, None: 1}[m.group(2)]


def check_shape(text: str) -> str:
    if not re.fullmatch(r"steps:\d+(,\d+)*@\d+(\.\d+)?|ramp:\d+-\d+@\d+(\.\d+)?", text):
        raise UsageError(f"--shape must be steps:U1,U2,...@SECONDS or ramp:LOW-HIGH@SECONDS, got {text!r}")
    return text


def load_flags() -> argparse.ArgumentParser:
    """The flags that shape the load, shared by a single run and `compare`."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as Authorization: Bearer KEY (default: $OPENAI_API_KEY)")  # fmt: skip
    p.add_argument("--model-name", help="the model name to send (default: what /v1/models lists)")
    p.add_argument("--users", type=int, default=4, help="concurrent users (closed loop)")
    p.add_argument("--duration", default="60s")
    p.add_argument("--rate", type=float, help="open loop: seeded Poisson arrivals, requests per second")
    p.add_argument("--max-in-flight", type=int, default=256,
                   help="open loop: an arrival that finds this many requests unanswered is dropped")  # fmt: skip
    p.add_argument("--shape", help="steps:1,2,4@10 or ramp:1-8@30 (users over time)")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--input-len", default="64:192", help="prompt words: N or LOW:HIGH")
    p.add_argument("--output-len", default="64",
                   help="output tokens: N or LOW:HIGH (drawn per request, seeded; ignore_eos holds them)")  # fmt: skip
    p.add_argument("--shared-prefix", type=int, default=0, help="words every prompt shares (prefix caching)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt sequence")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="every request's (default 0: greedy; the OpenAI default, 1, samples)")  # fmt: skip
    p.add_argument("--slo", action="append", default=[], help="ttft_ms=MS, tpot_ms=MS, itl_ms=MS or e2el_ms=MS")
    p.add_argument("--ready-timeout", type=float, default=300, help="seconds to wait for a server to be ready")
    return p


def check_load_flags(args: argparse.Namespace) -> None:
    args.duration_s = parse_duration(args.duration)
    if args.users < 1:
        raise UsageError(f"--users must be >= 1, got {args.users}")
    if args.rate is not None and args.rate <= 0:
        raise UsageError(f"--rate must be > 0 requests/s, got {args.rate}")
    if args.max_in_flight < 1:
        raise UsageError(f"--max-in-flight must be >= 1, got {args.max_in_flight}")
    if not 0 <= args.temperature <= 2:
        raise UsageError(f"--temperature must be in [0, 2], as the OpenAI API takes it, got {args.temperature}")
    if args.shape:
        check_shape(args.shape)
    try:
        LengthSpec.parse(args.input_len, "--input-len")
        LengthSpec.parse(args.output_len, "--output-len")
        args.slos = parse_slos(args.slo)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def parse_compare_args(argv: list[str], targets: list[Target] | None = None) -> argparse.Namespace:
    """The compare flags; `targets` (built by a caller such as benchmarks/serve_compare.py, which may
    add more to args.targets) go first, and with them no --target is needed."""
    p = argparse.ArgumentParser(prog="python -m loadtest compare", parents=[load_flags()],
                                description="The same seeded load against several servers in turn.")  # fmt: skip
    p.add_argument("--target", action="append", default=[],
                   help="NAME=URL, or NAME=cmd:COMMAND with {port} (started here, stopped after)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=1, help="measure each target this many times, order rotating")
    p.add_argument("--out", default="reports/compare")
    args = p.parse_args(argv)
    check_load_flags(args)
    if args.rounds < 1:
        raise UsageError(f"--rounds must be >= 1, got {args.rounds}")
    args.targets = [*(targets or []), *(parse_target(t, args.api_key) for t in args.target)]
    if not args.targets and targets is None:
        raise UsageError("compare needs at least one --target NAME=URL or NAME=cmd:COMMAND")
    names = [t.name for t in args.targets]
    if len(set(names)) != len(names):
        raise UsageError(f"--target names must differ, got {', '.join(names)}")
    if args.model_name:
        for t in args.targets:
            t.model_name = args.model_name
    return args


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest", parents=[load_flags()],
                                description=__doc__.splitlines()[0])  # fmt: skip
    p.add_argument("--url", help="an endpoint to test (default: start cbserve serve here)")
    p.add_argument("--model", help="with no --url: the model folder cbserve serves (default: embedded SmolLM2)")
    p.add_argument("--engine-config", help="with no --url: engine YAML for the server")
    p.add_argument("--sweep", action="store_true", help="users 1, 2, 4, ... until throughput stops rising")
    p.add_argument("--sweep-max", type=int, default=64)
    p.add_argument("--fail-on-slo", action="store_true", help="exit 3 when fewer than 90%% of requests meet the SLOs")
    p.add_argument("--out", default="reports/loadtest")
    args = p.parse_args(argv)
    check_load_flags(args)
    if args.fail_on_slo and not args.slos:
        raise UsageError("--fail-on-slo needs at least one --slo")
    return args


def single(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.url:
        target = Target("endpoint", args.url, args.api_key, model_name=args.model_name)
        timeout = min(args.ready_timeout, 30)
    else:
        which = f" --model {args.model}" if args.model else " (embedded SmolLM2)"
        print("starting cbserve serve" + which, flush=True)
        port = free_port()
        target = Target("cbserve", f"http://127.0.0.1:{port}", args.api_key, model_name=args.model_name,
                        command=cbserve_command(port, args.model, args.engine_config))  # fmt: skip
        target.start(out / "server.log")
        timeout = args.ready_timeout
    try:
        target.wait_ready(timeout)
        print(f"load-testing {target.url} ({target.model_name})", flush=True)
        if args.sweep:
            points = sweep(target, out, args)
            print(f"\nsweep: {len(points)} points; report {out / 'report.html'}")
            return 0
        summary = run_locust(target, out, args.users, args).summary
    finally:
        target.stop()
    print()
    print(table(summary, summary["server"]))
    print(f"\nreport: {out}/report.html (summary.json, requests.jsonl, locust.html, *.png)")
    if args.fail_on_slo and summary["completed"] and summary["request_goodput"] < 0.9 * summary["request_throughput"]:
        print("SLOs missed: fewer than 90% of requests met them", file=sys.stderr)
        return 3
    return 0 if summary["completed"] else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["compare"]:
            args = parse_compare_args(argv[1:])
            return compare(args.targets, args)
        return single(parse_args(argv))
    except UsageError as exc:
        print(f"loadtest: error: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:
        return 130
