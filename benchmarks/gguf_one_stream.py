"""One user and nothing else on the cores: cbserve and llama-server decoding one streamed completion
at a time from the same GGUF file, alternating, with no load generator beside them.

    python benchmarks/gguf_one_stream.py FILE.gguf [--rounds 2] [--streams 2] [--tokens 200]
        [--systems cbserve-int8,llama.cpp]

gguf_serve_compare.py's one-user runs share the two cores with Locust; this measures the decode step
as a single client sees it. Each round starts each server in turn as gguf_serve_compare.py does
(`cbserve serve --quantization gguf`, with `--quantized-activations int8` for cbserve-int8, and
`llama-server` with one slot), sends one warm-up completion, then `--streams` greedy completions of
`--tokens` tokens (`ignore_eos`) one after another, and stops it. Each stream's line: the gaps between
its streamed tokens after the first (TPOT as the client sees it), median, p90 and p99, in ms.
Compare only within one run: the host drifts between minutes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gguf_serve_compare  # noqa: E402

SYSTEMS = ("cbserve", "cbserve-int8", "llama.cpp")
PROMPT = "Once upon a time there was a little robot who"


def gap_stats(arrivals: list[float]) -> dict[str, float]:
    """Median, p90 and p99 (ms) of the gaps between streamed tokens after the first (the first gap is
    the prompt's)."""
    gaps = sorted(b - a for a, b in zip(arrivals[1:], arrivals[2:]))
    if not gaps:
        raise ValueError("fewer than three tokens arrived: no gap between decoded tokens to measure")

    def at(q: float) -> float:
        return round(gaps[min(len(gaps) - 1, int(q * len(gaps)))] * 1e3, 1)

    return {"tokens": len(arrivals), "median_ms": round(statistics.median(gaps) * 1e3, 1), "p90_ms": at(0.9),
            "p99_ms": at(0.99)}  # fmt: skip


def target(system: str, gguf: Path, ctx: int):
    if system == "llama.cpp":
        return gguf_serve_compare.llama_cpp_target(gguf, 1, ctx)
    return gguf_serve_compare.cbserve_target(gguf, 1, ctx, activations="int8" if system == "cbserve-int8" else "float")


def stream(url: str, model: str, tokens: int) -> list[float]:
    """One greedy streamed completion: the arrival time of each streamed chunk."""
    import requests

    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "stream": True, "ignore_eos": True,
            "temperature": 0}  # fmt: skip
    arrivals = []
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                arrivals.append(time.perf_counter())
    return arrivals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf", type=Path)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--streams", type=int, default=2, help="measured completions per server per round")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--systems", default="cbserve-int8,llama.cpp", help=f"a subset of {','.join(SYSTEMS)}")
    p.add_argument("--ctx", type=int, default=1024, help="tokens of context for the one user")
    args = p.parse_args(argv)
    systems = args.systems.split(",")
    if unknown := set(systems) - set(SYSTEMS):
        p.error(f"unknown systems {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
    from engine.backends.cpu_isa import capabilities

    print(capabilities().describe(), flush=True)
    logs = Path(tempfile.mkdtemp(prefix="gguf-one-stream-"))
    for rnd in range(args.rounds):
        for system in systems:
            t = target(system, args.gguf, args.ctx)
            t.start(logs / f"{system}-{rnd}.log")
            try:
                t.wait_ready(600)
                stream(t.url, t.model_name, min(args.tokens, 16))  # warm
                for _ in range(args.streams):
                    row = {"file": args.gguf.name, "round": rnd, "system": system,
                           **gap_stats(stream(t.url, t.model_name, args.tokens))}  # fmt: skip
                    print(json.dumps(row), flush=True)
            finally:
                t.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
