"""`python -m loadtest compare`: the same seeded load against several servers in turn, one report.

Every target is started (or reached) and made ready first, warmed with two short requests, then
measured one at a time, the order rotating each round (A B C, then B C A, ...), so no server
always runs first or last. Within a round every target gets the same prompts (seed --seed + round);
each round draws new ones, and each load its own (loadtest/loads.py), so no round finds an earlier
one's prompts in a prefix cache. Servers wait idle while another is measured; the report says how
much CPU each used meanwhile, since on a small machine an idle server that spins would slow the
others. It also gives each started
server's CPU time per 1,000 output tokens while measured, the cores it kept busy (its CPU-seconds in
the measured windows over their wall time), and the share of a core Locust took.

Several loads (loadtest/loads.py) can run one after another on the same started servers, each into a
folder of its own with its own table; an open-loop load's rate may be derived from an earlier
closed-loop load's request throughputs.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import requests

from loadtest import html_report
from loadtest.arrivals import pool_tallies
from loadtest.cpu_trace import CpuTrace
from loadtest.loads import Load, describe, load_args, open_loop_rate
from loadtest.report import summarize
from loadtest.run import RunResult, run_locust, settings
from loadtest.target import Target, UsageError, auth_headers

COMPARE_PLOTS = [
    "rounds.png", "throughput_over_time.png", "latency_cdf.png", "latency_ccdf.png", "server_over_time.png",
]


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
    tallies = [r.summary["open_loop"] for r in runs if r.summary.get("open_loop")]
    if tallies:
        summary["open_loop"] = pool_tallies(tallies)
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
    if any(pooled_by_name[n].get("open_loop") for n in names):
        loops = [pooled_by_name[n].get("open_loop") for n in names]
        row("offered / sent requests/s", ["-" if o is None else f"{o['offered_rate']:.2f} / {o['sent_rate']:.2f}"
                                          for o in loops])  # fmt: skip
        row("arrivals dropped", ["-" if o is None else f"{o['dropped']} of {o['offered']}" for o in loops])
    if pooled_by_name[ref].get("request_goodput") is not None:
        metric("goodput requests/s", "request_goodput", ".2f")
    for key, label in (("ttft", "TTFT"), ("itl", "ITL"), ("first_itl", "after 1st token"), ("tpot", "TPOT"),
                       ("e2el", "E2E")):  # fmt: skip
        row(f"{label} ms p50 / p90 / p99",
            ["/".join(f"{pooled_by_name[n][f'p{q}_{key}_ms']:.0f}" for q in (50, 90, 99)) for n in names])  # fmt: skip
        row(f"  p50 ratio to {ref}", [_ratio(pooled_by_name[n][f"p50_{key}_ms"], pooled_by_name[ref][f"p50_{key}_ms"])
                                       for n in names])  # fmt: skip
        if key == "itl":  # tokens whose text came with the next token's: their gap spans two steps
            row("  tokens held with the next", [f"{pooled_by_name[n].get('held_tokens', 0)} "
                                                f"({pooled_by_name[n].get('held_token_share', 0.0):.2%})" for n in names])  # fmt: skip
    row("completed / failed", [f"{pooled_by_name[n]['completed']} / {pooled_by_name[n]['failed']}" for n in names])
    row("server CPU-s per 1k tokens", ["-" if busy_cpu.get(n) is None or not pooled_by_name[n]["total_output_tokens"]
                                       else f"{1000 * busy_cpu[n] / pooled_by_name[n]['total_output_tokens']:.1f}"
                                       for n in names])  # fmt: skip
    if any(pooled_by_name[n].get("server_busy_cores") is not None for n in names):
        row("server busy cores", ["-" if pooled_by_name[n].get("server_busy_cores") is None
                                  else f"{pooled_by_name[n]['server_busy_cores']:.2f}" for n in names])  # fmt: skip
    row("Locust's CPU share", [f"{pooled_by_name[n]['load_generator_cpu_s'] / pooled_by_name[n]['duration']:.0%}"
                               for n in names])  # fmt: skip
    row("CPU-s used idle (others ran)", ["-" if idle_cpu.get(n) is None else f"{idle_cpu[n]:.1f}" for n in names])
    return "\n".join(lines)


def measure(targets: list[Target], args: argparse.Namespace, out: Path,
            traces: dict[str, CpuTrace]) -> tuple[dict[str, list[RunResult]], dict, dict, dict]:  # fmt: skip
    """--rounds rounds of one load, the order rotating. Returns each target's runs, the CPU-seconds each
    started server used while another ran, those it used in its own measured windows, and those
    windows' seconds (runs with no request have no window)."""
    results: dict[str, list[RunResult]] = {t.name: [] for t in targets}
    idle_cpu: dict[str, float | None] = {t.name: (0.0 if t.command else None) for t in targets}
    busy_cpu: dict[str, float | None] = {t.name: (0.0 if t.name in traces else None) for t in targets}
    windows: dict[str, float] = {t.name: 0.0 for t in targets}
    for r in range(args.rounds):
        order = targets[r % len(targets) :] + targets[: r % len(targets)]
        for t in order:
            others = [o for o in targets if o is not t and o.command]
            before = {o.name: o.cpu_seconds() for o in others}
            result = run_locust(t, out / t.name / f"round{r + 1}", args.users, args, seed=args.seed + r)
            for o in others:
                now = o.cpu_seconds()
                if now is not None and before[o.name] is not None:
                    idle_cpu[o.name] += now - before[o.name]
            trace = traces.get(t.name)
            if trace is not None and result.rows:  # the window: first request sent to last answer received
                trace.sample()
                used = trace.between(result.t0, result.t0 + result.summary["duration"])
                busy_cpu[t.name] += used or 0.0
                windows[t.name] += result.summary["duration"]
            results[t.name].append(result)
            s = result.summary
            print(f"  round {r + 1} {t.name:<12} {s['output_throughput']:8.1f} output tok/s, "
                  f"{s['completed']} requests, {s['failed']} failed", flush=True)  # fmt: skip
    return results, idle_cpu, busy_cpu, windows


def _pool_all(results: dict[str, list[RunResult]], busy_cpu: dict[str, float | None], windows: dict[str, float],
              slos: dict) -> dict[str, dict]:  # fmt: skip
    by_name = {name: pooled(runs, slos) for name, runs in results.items()}
    for name, p in by_name.items():
        if busy_cpu.get(name) is not None and windows[name] > 0:
            p["server_cpu_s"] = busy_cpu[name]
            p["server_busy_cores"] = busy_cpu[name] / windows[name]
    return by_name


def _write_load(out: Path, targets: list[Target], args: argparse.Namespace, measured: tuple) -> tuple[str, dict]:
    """One load's plots, compare.json and report.html in `out`; returns its table and its report."""
    from loadtest import plots  # matplotlib loads when there is something to draw

    results, idle_cpu, busy_cpu, windows = measured
    by_name = _pool_all(results, busy_cpu, windows, args.slos)
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
    html_report.write_compare(out, text, COMPARE_PLOTS, report_settings)
    return text, report


def compare(targets: list[Target], args: argparse.Namespace, loads: list[Load] | None = None,
            notes: list[str] | None = None) -> int:  # fmt: skip
    """Start and ready the targets, run each load's rounds on them, write the reports. With no `loads`,
    the one load the flags describe, reported in --out itself; with loads, each in --out/NAME/ and the
    whole in --out. `notes` (how the peers were run) head the report."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    single = loads is None
    loads = loads or [Load("closed", "closed loop", open_loop=bool(args.rate), rate=args.rate)]
    measured: dict[str, tuple] = {}
    sections: list[str] = []
    reports: dict[str, dict] = {}
    traces: dict[str, CpuTrace] = {}
    try:
        for t in targets:
            if t.command:
                print(f"starting {t.name}: {' '.join(t.command)}", flush=True)
                t.start(out / t.name / "server.log")
        for t in targets:
            t.wait_ready(args.ready_timeout)
            warm_up(t, args.endpoint)
            print(f"{t.name} ready at {t.url} ({t.model_name}; readiness from {t.readiness})", flush=True)
        traces = {t.name: CpuTrace(t.cpu_seconds).start() for t in targets if t.command}
        for index, load in enumerate(loads):
            rate = load.rate
            if load.open_loop and rate is None:
                if load.rate_from not in measured:
                    raise UsageError(f"{load.name}: no rate, and no closed-loop load {load.rate_from!r} before it")
                results = measured[load.rate_from][0]
                throughputs = {n: statistics.fmean(r.summary["request_throughput"] for r in runs)
                               for n, runs in results.items()}  # fmt: skip
                try:
                    rate = open_loop_rate(throughputs, load.rate_fraction)
                except ValueError as exc:
                    raise UsageError(f"{load.name}: {exc}", 1) from None
            largs = load_args(args, load, rate, index)
            title = describe(load, largs, rate)
            if not single:
                print(f"\n{title}", flush=True)
            folder = out if single else out / load.name
            measured[load.name] = measure(targets, largs, folder, traces)
            text, report = _write_load(folder, targets, largs, measured[load.name])  # written as each load ends
            reports[load.name] = {"title": title, "rate": rate, **report}
            sections.append(text if single else f"{title}\n\n{text}")
    finally:
        for trace in traces.values():
            trace.stop()
        for t in targets:
            t.stop()
    text = "\n\n".join([*(notes or []), *sections])
    if not single:
        report_settings = {**settings(args, args.users), "rounds": args.rounds, "host": html_report.host(),
                           "loads": [r["title"] for r in reports.values()]}  # fmt: skip
        (out / "compare.json").write_text(json.dumps({"notes": notes or [], "loads": reports}, indent=2))
        html_report.write_compare(out, text, [f"{load.name}/{name}" for load in loads for name in COMPARE_PLOTS],
                                  report_settings)  # fmt: skip
    print()
    print(text)
    where = f"{out}/NAME/roundN/" if single else f"{out}/LOAD/NAME/roundN/"
    print(f"\nreport: {out}/report.html (compare.json; each target's rounds in {where})")
    return 0 if all(p["completed"] for r in reports.values() for p in r["targets"].values()) else 1
