"""report.html: one self-contained page (plots embedded) with the table and the run's settings."""

from __future__ import annotations

import base64
import html
import json
import os
import platform
import time
from pathlib import Path

from loadtest.report import table

STYLE = """body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;color:#222}
pre{background:#f6f6f6;padding:1em;overflow-x:auto}img{max-width:100%;display:block;margin:1em 0}
td,th{padding:2px 10px;text-align:left;border-bottom:1px solid #ddd}"""


def host() -> str:
    """The load generator's CPU: model, family and model number, the widest vector ISA, cores."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() not in fields:
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())
    isa = next((f for f in ("avx512f", "avx2") if f in flags), "no AVX2")
    model = fields.get("model name") or platform.processor() or "unknown CPU"
    family = f" (family {fields['cpu family']} model {fields.get('model', '?')})" if "cpu family" in fields else ""
    return f"{model}{family}, {isa}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.machine()}"


def _image(path: Path) -> str:
    if not path.exists():
        return ""
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{html.escape(path.stem)}" src="data:image/png;base64,{data}">'


def _settings(settings: dict) -> str:
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(json.dumps(v))}</td></tr>"
                   for k, v in settings.items())  # fmt: skip
    return f"<table>{rows}</table>"


def page(title: str, body: str) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M %Z")
    return (f"<!doctype html><meta charset='utf-8'><title>{html.escape(title)}</title><style>{STYLE}</style>"
            f"<h1>{html.escape(title)}</h1><p>{html.escape(stamp)}; load generated on {html.escape(host())}</p>"
            f"{body}")  # fmt: skip


def write_run(out: Path, summary: dict, images: list[str]) -> Path:
    """The page of one run: its summary table, then the PNGs named in `images` (files in `out`)."""
    s = summary
    target = s.get("target", {})
    body = (f"<p>Target <b>{html.escape(str(target.get('name')))}</b> at {html.escape(str(target.get('url')))}, "
            f"model {html.escape(str(target.get('model')))}</p>"
            f"<pre>{html.escape(table(s, s.get('server')))}</pre>"
            + "".join(_image(out / name) for name in images)
            + "<h2>Settings</h2>" + _settings(s.get("settings", {})))  # fmt: skip
    path = out / "report.html"
    path.write_text(page("Load test", body))
    return path


def write_sweep(out: Path, points: list[dict]) -> Path:
    rows = "".join(f"<tr><td>{p['concurrency']}</td><td>{p['output_throughput']:.1f}</td>"
                   f"<td>{p['median_ttft_ms']:.0f}</td><td>{p['median_itl_ms']:.1f}</td>"
                   f"<td>{p['median_e2el_ms']:.0f}</td><td>{p['p99_e2el_ms']:.0f}</td></tr>"
                   for p in points)  # fmt: skip
    head = ("<tr><th>users</th><th>output tok/s</th><th>TTFT p50 (ms)</th><th>ITL p50 (ms)</th>"
            "<th>E2E p50 (ms)</th><th>E2E p99 (ms)</th></tr>")  # fmt: skip
    body = f"<table>{head}{rows}</table>" + _image(out / "sweep.png")
    if points:
        body += "<h2>Settings</h2>" + _settings(points[0].get("settings", {}))
    path = out / "report.html"
    path.write_text(page("Load-test sweep", body))
    return path


def write_compare(out: Path, text_table: str, images: list[str], settings: dict) -> Path:
    body = (f"<pre>{html.escape(text_table)}</pre>" + "".join(_image(out / name) for name in images)
            + "<h2>Settings</h2>" + _settings(settings))  # fmt: skip
    path = out / "report.html"
    path.write_text(page("Servers compared", body))
    return path
