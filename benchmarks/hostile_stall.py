"""How much one costly request slows another user's stream on `cbserve serve`.

    python benchmarks/hostile_stall.py [--url URL] [--requests stops,stop-caps,bias,plain] [--n 16]
    python benchmarks/hostile_stall.py --detokenizer [--tokens 8000]

Starts `cbserve serve` on the embedded model (or uses --url), then for each kind of request: one
streamed completion of 100 tokens alone (the victim), then the same beside the costly request, sent
1.5 s before it from another thread. Prints the victim's gaps between chunks (p50, p90, the worst)
both times, and the costly request's status and seconds:

  stops      300,000 stop strings of 9 letters, `n` samples, 100 tokens each (the server refuses
             more than 64 since 2f3332f; before, each token scanned all of them);
  stop-caps  64 stop strings of 64 characters, `n` samples, 64 tokens each (the caps, served);
  bias       a `logit_bias` over the whole vocabulary, `n` samples, 150 tokens each;
  plain      the same without the bias: what `n` more sequences in the batch cost by themselves.

`--detokenizer` times the incremental detokenizer alone (engine/detokenizer.py) over `--tokens`
repeats of a token that decodes to a lone byte (U+FFFD), as a model made to repeat it would send.
With `PYTHONPATH=that/tree` it measures another checkout's server and detokenizer (this tree's
installed packages give way to it).
"""

from __future__ import annotations

import argparse
import json
import random
import string
import tempfile
import threading
import time
from pathlib import Path

import requests

from loadtest.target import Target, cbserve_command, free_port

VICTIM = {"prompt": "Tell me about cats.", "max_tokens": 100, "ignore_eos": True, "stream": True}


def costly(kind: str, n: int, vocab: int) -> dict:
    rnd = random.Random(1)
    if kind == "stops":
        stops = ["".join(rnd.choices(string.ascii_letters, k=9)) for _ in range(300_000)]
        return {"prompt": "Write a long story.", "n": n, "max_tokens": 100, "ignore_eos": True, "stop": stops}
    if kind == "stop-caps":
        stops = ["".join(rnd.choices(string.ascii_letters, k=64)) for _ in range(64)]
        return {"prompt": "Write a long story.", "n": n, "max_tokens": 64, "ignore_eos": True, "stop": stops}
    if kind in ("bias", "plain"):
        bias = {str(i): 0.001 for i in range(vocab)} if kind == "bias" else {}
        return {"prompt": "Hello", "n": n, "max_tokens": 150, "ignore_eos": True, "logit_bias": bias}
    raise SystemExit(f"unknown request kind {kind!r}")


def victim_gaps(url: str, model: str) -> list[float]:
    gaps, last = [], None
    with requests.post(url + "/v1/completions", json={"model": model, **VICTIM}, stream=True, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
    return sorted(gaps)


def describe(gaps: list[float]) -> str:
    if not gaps:
        return "no chunks"
    return (f"p50 {1000 * gaps[len(gaps) // 2]:.0f} ms, p90 {1000 * gaps[int(0.9 * len(gaps))]:.0f} ms, "
            f"worst {1000 * gaps[-1]:.0f} ms")  # fmt: skip


def measure(url: str, model: str, kind: str, n: int, vocab: int) -> None:
    raw = json.dumps({"model": model, **costly(kind, n, vocab)}).encode()
    alone = victim_gaps(url, model)
    answer: dict = {}

    def send() -> None:
        started = time.perf_counter()
        r = requests.post(url + "/v1/completions", data=raw, headers={"Content-Type": "application/json"}, timeout=3600)
        answer.update(status=r.status_code, seconds=time.perf_counter() - started)

    thread = threading.Thread(target=send)
    thread.start()
    time.sleep(1.5)  # the costly request admitted and decoding
    beside = victim_gaps(url, model)
    thread.join()
    print(f"{kind}: {len(raw) / 1e6:.1f} MB, answered {answer['status']} in {answer['seconds']:.1f} s; "
          f"another stream alone {describe(alone)}; beside it {describe(beside)}", flush=True)


def detokenizer(tokens: int) -> None:
    from transformers import AutoTokenizer

    from engine.detokenizer import TextStream
    from engine.loader import embedded_folder

    tok = AutoTokenizer.from_pretrained(str(embedded_folder()))
    byte = next(i for i in range(len(tok)) if tok.decode([i]) == "\ufffd")
    stream = TextStream(tok)
    started = time.perf_counter()
    text = "".join(stream.add([byte]) for _ in range(tokens)) + stream.finish()
    took = time.perf_counter() - started
    same = text == tok.decode([byte] * tokens)
    print(f"{tokens} tokens of a lone byte (id {byte}) through the incremental detokenizer: {took:.3f} s "
          f"(the text {'equals' if same else 'differs from'} a decode of all of them)")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running server (default: start `cbserve serve` on the embedded model)")
    p.add_argument("--requests", default="stops,stop-caps,bias,plain")
    p.add_argument("--n", type=int, default=16, help="samples of each costly request")
    p.add_argument("--vocab", type=int, default=49152, help="the served model's vocabulary (the embedded model's)")
    p.add_argument("--detokenizer", action="store_true", help="time the incremental detokenizer alone")
    p.add_argument("--tokens", type=int, default=8000)
    args = p.parse_args(argv)
    if args.detokenizer:
        detokenizer(args.tokens)
        return
    target = Target("cbserve", args.url or f"http://127.0.0.1:{free_port()}")
    if not args.url:
        target.command = cbserve_command(int(target.url.rsplit(":", 1)[1]))
    with tempfile.TemporaryDirectory(prefix="hostile-") as folder:
        target.start(Path(folder, "server.log"))
        try:
            target.wait_ready(600)
            for kind in args.requests.split(","):
                measure(target.url, target.model_name, kind, args.n, args.vocab)
        finally:
            target.stop()


if __name__ == "__main__":
    main()
