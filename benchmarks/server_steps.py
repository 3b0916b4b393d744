"""The same decode step inside `cbserve serve` and in a bare engine, side by side.

    python benchmarks/server_steps.py [--model FILE] [--serve-args "--quantization gguf ..."]
        [--variant NAME=ENV=VALUE[,ENV=VALUE]]... [--rounds 5] [--tokens 300]

Starts one `cbserve serve` per variant (the default one, plus each --variant with its environment),
each writing its step log (CBSERVE_STEP_LOG), and builds an `LLMEngine` in this process from the same
model, dtype (what the first server reports in /v1/models), quantization and activations. Then, round
after round and one at a time, each runs a single request of --tokens tokens: the engine here by
calling `step()` in a loop, each server through one completion (streamed unless --no-stream). Printed per round: the median
decode step of each, in milliseconds (the servers' from their step logs, the steps inside that
request's time span). The host's speed moves by a fifth within minutes; the rounds alternate so that
each row compares runs seconds apart.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadtest.target import Target, cbserve_command, free_port  # noqa: E402


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """NAME=ENV=VALUE[,ENV=VALUE...] -> (NAME, {ENV: VALUE})."""
    name, sep, rest = text.partition("=")
    env = dict(pair.split("=", 1) for pair in rest.split(",") if "=" in pair)
    if not sep or not name or not env or len(env) != len([p for p in rest.split(",") if p]):
        raise argparse.ArgumentTypeError(f"--variant takes NAME=ENV=VALUE[,ENV=VALUE], got {text!r}")
    return name, env


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a GGUF file or a checkpoint folder (default: the embedded SmolLM2)")
    p.add_argument("--serve-args", default="", help="more `cbserve serve` flags, one string, for every server")
    p.add_argument("--variant", action="append", type=parse_variant, default=[],
                   help="another server, with these environment variables")  # fmt: skip
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=300, help="tokens each request generates")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="every request's (the OpenAI default, 1.0, samples; 0 is greedy)")  # fmt: skip
    p.add_argument("--no-stream", dest="stream", action="store_false",
                   help="ask for the whole completion at the end instead of a stream of tokens")  # fmt: skip
    args = p.parse_args(argv)
    if args.rounds < 1 or args.tokens < 8:
        p.error("--rounds takes 1 or more and --tokens 8 or more")
    return args


def window_median(log: Path, start: float, end: float) -> float | None:
    """Median seconds of the one-row decode steps (no prompt tokens) logged between start and end."""
    seconds = []
    for line in log.read_text().splitlines():
        row = json.loads(line)
        if start < row["t"] < end and row["decode_rows"] == 1 and not row["prefill_tokens"]:
            seconds.append(row["seconds"])
    return statistics.median(seconds) if seconds else None


def complete(target: Target, tokens: int, prompt: str, stream: bool, temperature: float) -> None:
    body = {"model": target.model_name, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "stream": stream,
            "temperature": temperature}
    with requests.post(target.url + "/v1/completions", json=body, stream=stream, timeout=600) as r:
        r.raise_for_status()
        for _ in r.iter_lines():
            pass


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from engine import ContinuousBatchingConfig, LLMEngine
    from engine.loader import load_model

    folder = Path(tempfile.mkdtemp(prefix="server_steps-"))
    servers: list[tuple[Target, Path]] = []
    extra = args.serve_args.split()
    for name, env in [("server", {}), *args.variant]:
        port = free_port()
        log = folder / f"{name}.steps.jsonl"
        target = Target(name, f"http://127.0.0.1:{port}", command=cbserve_command(port, args.model) + extra,
                        env={**env, "CBSERVE_STEP_LOG": str(log)})  # fmt: skip
        servers.append((target, log))
    try:
        for target, _ in servers:
            target.start(folder / f"{target.name}.log")
        for target, _ in servers:
            target.wait_ready(600)
        engine_info = requests.get(servers[0][0].url + "/v1/models", timeout=10).json()["data"][0]["engine"]
        quantization, activations = _flag(extra, "--quantization", "auto"), _flag(extra, "--quantized-activations", "float")
        loaded = load_model(args.model, engine_info["dtype"], None, "cpu", quantization, activations)
        engine = LLMEngine(loaded.model, ContinuousBatchingConfig(num_blocks=engine_info["kv_cache_blocks"]),
                           tokenizer=loaded.tokenizer)  # fmt: skip
        rng = random.Random(0)
        print(f"dtype {engine_info['dtype']}, quantization {quantization}, activations {activations}; the median "
              "one-row decode step, ms")  # fmt: skip
        rows = []
        for i in range(args.rounds):
            req = engine.make_request([rng.randrange(100, engine.vocab_size) for _ in range(8)],
                                      max_new_tokens=args.tokens, ignore_eos=True, temperature=args.temperature,
                                      do_sample=args.temperature > 0)  # fmt: skip
            engine.add_request(req)
            steps = []
            while engine.has_unfinished():
                start = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - start)
            row = {"engine": 1e3 * statistics.median(steps[8:])}
            for target, log in servers:
                start = time.time()
                complete(target, args.tokens, f"round {i} of {target.name}", args.stream, args.temperature)
                median = window_median(log, start, time.time())
                row[target.name] = None if median is None else 1e3 * median
            rows.append(row)
            print(f"round {i + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items() if v is not None), flush=True)
        names = list(rows[0])
        print("median of rounds: " + ", ".join(
            f"{k} {statistics.median(r[k] for r in rows if r[k] is not None):.2f}" for k in names))  # fmt: skip
    finally:
        for target, _ in servers:
            target.stop()
    return 0


def _flag(extra: list[str], flag: str, default: str) -> str:
    """A flag's value among the `cbserve serve` flags (the engine here is built as the servers are)."""
    return extra[extra.index(flag) + 1] if flag in extra[:-1] else default


if __name__ == "__main__":
    sys.exit(main())
