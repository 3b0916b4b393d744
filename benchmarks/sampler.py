"""What choosing the step's tokens costs: `engine.sampler.Sampler` on logits of a vocabulary's width.

    python benchmarks/sampler.py [--vocab 49152] [--rows 1,16] [--repeats 30]

For each batch size, the median milliseconds of one `Sampler` call over bfloat16 logits, for greedy
rows, temperature 1 (unseeded, as the HTTP server's default), temperature 0.8 with a seed, and top-p
0.9 over two kinds of logits: flat (standard normal: the nucleus is most of the vocabulary) and
peaked (normal with a standard deviation of 4, as a trained model's tend to be: a nucleus of a few to
a hundred tokens). Run it in another tree with `PYTHONPATH=. python /path/to/benchmarks/sampler.py`
to time that tree's sampler.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.request import Request, SamplingParams
from engine.sampler import Sampler

CASES = {
    "greedy": (dict(temperature=0.0), 1.0),
    "temperature 1": (dict(temperature=1.0), 1.0),
    "temperature 0.8, seeded": (dict(temperature=0.8, seed=0), 1.0),
    "top-p 0.9, flat logits": (dict(temperature=0.8, top_p=0.9, seed=0), 1.0),
    "top-p 0.9, peaked logits": (dict(temperature=0.8, top_p=0.9, seed=0), 4.0),
}


def time_case(rows: int, vocab: int, params: dict, scale: float, repeats: int) -> float:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=g) * scale).bfloat16()
    reqs = [Request(f"r{i}", [1, 2, 3], 16, SamplingParams(**{**params, "seed": params.get("seed") and i}),
                    frozenset()) for i in range(rows)]  # fmt: skip
    sampler = Sampler(0)
    for _ in range(3):
        sampler(logits, reqs)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sampler(logits, reqs)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--rows", default="1,16")
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    print(f"Sampler over {args.vocab} logits, {torch.get_num_threads()} threads; median ms of {args.repeats} calls")
    print("| case | " + " | ".join(f"{r} rows" for r in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for name, (params, scale) in CASES.items():
        cells = [f"{time_case(r, args.vocab, params, scale, args.repeats):.2f}" for r in rows]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
