"""`python -m loadtest compare`: the same seeded load against several servers in turn, one report.

Every target is started (or reached) and made ready first, warmed with two short requests, then
measured one at a time, the order rotating each round (A B C, then B C A, ...), so no server
always runs first or last. Within a round every target gets the same prompts (seed --seed + round);
each round draws new ones, so no round finds the last one's prompts in a prefix cache. Servers
wait idle while another is measured; the report says how much CPU each used meanwhile, since on a
small machine an idle server that spins would slow the others. It also gives each started
server's CPU time per 1,000 output tokens while measured, and the share of a core Locust took.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import requests

from loadtest import html_report, plots
from loadtest.report import summarize
from loadtest.run import RunResult, run_locust, settings
from loadtest.target import Target, UsageError, auth_headers


def warm_up(target: Target, endpoint: str) -> None:
    body: dict = {"max_tokens": 8, "temperature": 0}
    if target.model_name:
        body["model"] = target.model_name
    if endpoint == "chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": "Hello there"}]
    else:
        path, body["prompt"] = "/v1/completions", "Hello there"
    for _ in range(2):
        try:
            r = requests.post(target.url.rstrip("/") + path, json=body, headers=auth_headers(target.api_key),
                              timeout=300)  # fmt: skip
        except requests.RequestException as exc:
            raise UsageError(f"{target.name}: warm-up request failed: {type(exc).__name__}", 1) from None
        if r.status_code != 200:
            raise UsageError(f"{target.name}: warm-up request got HTTP {r.status_code}: {r.text[:200]}", 1)


def pooled(runs: list[RunResult], slos: dict[str, float]) -> dict:
    """Percentiles over every round's requests; throughputs as the mean of the rounds'."""
    rows = [row for r in runs for row in r.rows]
    summary = summarize(rows, sum(r.summary["duration"] for r in runs), slos)
    summary["rounds_output_throughput"] = [r.summary["output_throughput"] for r in runs]
    summary["output_throughput"] = statistics.fmean(summary["rounds_output_throughput"])
    summary["request_throughput"] = statistics.fmean(r.summary["request_throughput"] for r in runs)
    summary["load_generator_cpu_s"] = sum(r.summary["load_generator_cpu_s"] for r in runs)
    if slos:
        summary["request_goodput"] = statistics.fmean(r.summary["request_goodput"] for r in runs)
    return summary


def _ratio(value: float | None, reference: float | None) -> str:
    if value is None or not reference:
        return "-"
    return f"{value / reference:.2f}x"


def compare_table(pooled_by_name: dict[str, dict], idle_cpu: dict[str, float | None],
                  busy_cpu: dict[str, float | None]) -> str:  # fmt: skip
    names = list(pooled_by_name)
    ref = names[0]
    rounds = [" ".join(f"{x:.1f}" for x in pooled_by_name[n]["rounds_output_throughput"]) for n in names]
    width = max(20, *(len(n) + 2 for n in names), *(len(r) + 2 for r in rounds))
    lines = [f"{'':<30}" + "".join(f"{n:>{width}}" for n in names)]

    def row(label: str, cells: list[str]) -> None:
        lines.append(f"{label:<30}" + "".join(f"{c:>{width}}" for c in cells))

    def metric(label: str, key: str, fmt: str = ".1f") -> None:
        values = [pooled_by_name[n].get(key) for n in names]
        row(label, ["-" if v is None else format(v, fmt) for v in values])
        row(f"  ratio to {ref}", [_ratio(v, values[0]) for v in values])

    metric("output tok/s (mean of rounds)", "output_throughput")
    row("  each round", rounds)
    metric("requests/s", "request_throughput", ".2f")
    if pooled_by_name[ref].get("request_goodput") is not None:
        metric("goodput requests/s", "request_goodput", ".2f")
    for key, label in (("ttft", "TTFT"), ("itl", "ITL"), ("tpot", "TPOT"), ("e2el", "E2E")):
        row(f"{label} ms p50 / p90 / p99",
            ["/".join(f"{pooled_by_name[n][f'p{q}_{key}_ms']:.0f}" for q in (50, 90, 99)) for n in names])  # fmt: skip
        row(f"  p50 ratio to {ref}", [_ratio(pooled_by_name[n][f"p50_{key}_ms"], pooled_by_name[ref][f"p50_{key}_ms"])
                                       for n in names])  # fmt: skip
    row("completed / failed", [f"{pooled_by_name[n]['completed']} / {pooled_by_name[n]['failed']}" for n in names])
    row("server CPU-s per 1k tokens", ["-" if busy_cpu.get(n) is None or not pooled_by_name[n]["total_output_tokens"]
                                       else f"{1000 * busy_cpu[n] / pooled_by_name[n]['total_output_tokens']:.1f}"
                                       for n in names])  # fmt: skip
    row("Locust's CPU share", [f"{pooled_by_name[n]['load_generator_cpu_s'] / pooled_by_name[n]['duration']:.0%}"
                               for n in names])  # fmt: skip
    row("CPU-s used idle (others ran)", ["-" if idle_cpu.get(n) is None else f"{idle_cpu[n]:.1f}" for n in names])
    return "\n".join(lines)


def compare(targets: list[Target], args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[RunResult]] = {t.name: [] for t in targets}
    idle_cpu: dict[str, float | None] = {t.name: (0.0 if t.command else None) for t in targets}
    busy_cpu: dict[str, float | None] = dict(idle_cpu)  # each started server's CPU time during its own runs
    try:
        for t in targets:
            if t.command:
                print(f"starting {t.name}: {' '.join(t.command)}", flush=True)
                t.start(out / t.name / "server.log")
        for t in targets:
            t.wait_ready(args.ready_timeout)
            warm_up(t, args.endpoint)
            print(f"{t.name} ready at {t.url} ({t.model_name}; readiness from {t.readiness})", flush=True)
        for r in range(args.rounds):
            order = targets[r % len(targets) :] + targets[: r % len(targets)]
            for t in order:
                others = [o for o in targets if o is not t and o.command]
                before = {o.name: o.cpu_seconds() for o in others}
                own = t.cpu_seconds()
                result = run_locust(t, out / t.name / f"round{r + 1}", args.users, args, seed=args.seed + r)
                for o in others:
                    now = o.cpu_seconds()
                    if now is not None and before[o.name] is not None:
                        idle_cpu[o.name] += now - before[o.name]
                now = t.cpu_seconds()
                if own is not None and now is not None:
                    busy_cpu[t.name] += now - own
                results[t.name].append(result)
                s = result.summary
                print(f"  round {r + 1} {t.name:<12} {s['output_throughput']:8.1f} output tok/s, "
                      f"{s['completed']} requests, {s['failed']} failed", flush=True)  # fmt: skip
    finally:
        for t in targets:
            t.stop()
    by_name = {name: pooled(runs, args.slos) for name, runs in results.items()}
    text = compare_table(by_name, idle_cpu, busy_cpu)
    first = {name: runs[0] for name, runs in results.items()}
    all_rows = {name: [row for r in runs for row in r.rows] for name, runs in results.items()}
    plots.throughput_over_time({n: r.rows for n, r in first.items()}, out / "throughput_over_time.png")
    plots.server_over_time({n: (r.samples, r.t0) for n, r in first.items()}, out / "server_over_time.png")
    plots.latency_cdfs(all_rows, args.slos, out / "latency_cdf.png")
    plots.latency_ccdfs(all_rows, args.slos, out / "latency_ccdf.png")
    plots.rounds_bars({n: p["rounds_output_throughput"] for n, p in by_name.items()}, out / "rounds.png")
    report_settings = {**settings(args, args.users), "rounds": args.rounds, "host": html_report.host(),
                       "targets": {t.name: t.command and " ".join(t.command) or t.url for t in targets}}  # fmt: skip
    report = {"settings": report_settings, "idle_cpu_seconds": idle_cpu, "busy_cpu_seconds": busy_cpu,
              "targets": by_name}  # fmt: skip
    (out / "compare.json").write_text(json.dumps(report, indent=2))
    html_report.write_compare(out, text, ["rounds.png", "throughput_over_time.png", "latency_cdf.png",
                                          "latency_ccdf.png", "server_over_time.png"], report_settings)  # fmt: skip
    print()
    print(text)
    print(f"\nreport: {out}/report.html (compare.json; each target's rounds in {out}/NAME/roundN/)")
    return 0 if all(p["completed"] for p in by_name.values()) else 1
