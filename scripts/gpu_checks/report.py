"""Rows of the check, timed, and the two files a run writes: gpu_check.json and gpu_check.md."""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PASS, FAIL, SKIPPED = "pass", "fail", "skipped"


class Skipped(Exception):
    """The check cannot run here (no flash-attn, one GPU, no vLLM build...): the message says why."""

    def __init__(self, reason: str, figures: dict[str, Any] | None = None) -> None:
        super().__init__(reason)
        self.figures = figures or {}


class CheckFailed(AssertionError):
    """The check ran and something is wrong: the message says what, the figures what was measured."""

    def __init__(self, reason: str, figures: dict[str, Any] | None = None) -> None:
        super().__init__(reason)
        self.figures = figures or {}


def require(condition: bool, reason: str, figures: dict[str, Any]) -> None:
    if not condition:
        raise CheckFailed(reason, figures)


@dataclass
class Row:
    check: str
    status: str  # pass | fail | skipped
    reason: str = ""  # why it failed or was skipped
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    detail: str = ""  # an optional markdown table printed under the summary

    def cells(self) -> list[str]:
        reason = " ".join(self.reason.split())  # one line: a table cell
        if len(reason) > CELL_CHARS:
            reason = reason[: CELL_CHARS - 3] + "..."
        status = self.status if not reason else f"{self.status}: {reason}"
        return [self.check, status.replace("|", "/"), f"{self.seconds:.1f}", _figures(self.figures)]


CELL_CHARS = 300  # a failure's reason in the table; a longer error is shown whole below it
DETAIL_CHARS = 6000


def _figures(figures: dict[str, Any]) -> str:
    parts = []
    for key, value in figures.items():
        if key.startswith("_"):
            continue
        if isinstance(value, float):
            value = f"{value:.4g}"
        parts.append(f"{key} {value}")
    return "; ".join(parts).replace("|", "/")


def run_check(name: str, fn: Callable[[], dict[str, Any]], sync: Callable[[], None] = lambda: None) -> Row:
    """Run one check, timed; its outcome as a row (an unexpected error fails the row with its message)."""
    start = time.perf_counter()
    try:
        figures = fn()
        row = Row(name, PASS, figures=figures)
        sync()
    except Skipped as exc:
        row = Row(name, SKIPPED, str(exc), figures=exc.figures)
    except CheckFailed as exc:
        row = Row(name, FAIL, str(exc), figures=exc.figures)
    except Exception as exc:  # a crash is a failure of the check, with the last frame that raised
        traceback.print_exc()  # the whole traceback in the row's log
        where = traceback.extract_tb(exc.__traceback__)[-1]
        message = f"{type(exc).__name__}: {exc}"
        row = Row(name, FAIL, f"{message} ({Path(where.filename).name}:{where.lineno})")
        if len(message) > CELL_CHARS or "\n" in message:  # the whole message under the table
            row.figures["_detail"] = f"### {name}: the error\n\n```\n{message[:DETAIL_CHARS]}\n```"
    row.seconds = time.perf_counter() - start
    row.detail = row.figures.pop("_detail", "")
    return row


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def markdown(environment: list[tuple[str, str]], rows: list[Row], title: str) -> str:
    parts = [f"## {title}", "", table(["what", "value"], [[k, v] for k, v in environment]), "",
             table(["check", "status", "seconds", "figures"], [r.cells() for r in rows])]  # fmt: skip
    for r in rows:
        if r.detail:
            parts += ["", r.detail]
    failed = [r.check for r in rows if r.status == FAIL]
    parts += ["", f"Result: {'FAILED (' + ', '.join(failed) + ')' if failed else 'passed'}, "
                  f"{sum(r.seconds for r in rows):.0f} s in all."]  # fmt: skip
    return "\n".join(parts) + "\n"


def to_json(environment: list[tuple[str, str]], rows: list[Row], argv: list[str]) -> dict[str, Any]:
    return {
        "environment": dict(environment),
        "argv": argv,
        "passed": not any(r.status == FAIL for r in rows),
        "seconds": sum(r.seconds for r in rows),
        "checks": [asdict(r) for r in rows],
    }


def write(out: Path, environment: list[tuple[str, str]], rows: list[Row], argv: list[str], title: str) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "gpu_check.json", out / "gpu_check.md"
    json_path.write_text(json.dumps(to_json(environment, rows, argv), indent=2, default=str) + "\n")
    md_path.write_text(markdown(environment, rows, title))
    return json_path, md_path
