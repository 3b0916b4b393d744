"""What choosing the step's tokens costs: `engine.sampler.Sampler` on logits of a vocabulary's width.

    python benchmarks/sampler.py [--vocab 49152] [--rows 1,16] [--repeats 30]
    python benchmarks/sampler.py --steps [--rows 16] [--runs 4] [--dtype bfloat16]

For each batch size, the median milliseconds of one `Sampler` call over bfloat16 logits, twice: as
the engine's CPU executor makes it (with the C++ kernels' argmax, one-pass race and logsumexp,
engine/csrc/sample_cpu.cpp) and with torch's ops alone (as on a backend without them), for greedy
rows, temperature 1 (unseeded, as the HTTP server's default), the same with transformers' top-k of 50
(the Python API's default), the same with the logprobs of the token and of the row's top 5 (as an RL
trainer asks), temperature 0.8 with a seed, and top-p
0.9 over two kinds of logits: flat (standard normal: the nucleus is most of the vocabulary) and
peaked (normal with a standard deviation of 4, as a trained model's tend to be: a nucleus of a few to
a hundred tokens).

`--steps` times whole decode steps instead: an `LLMEngine` on the embedded SmolLM2 decodes --rows
requests sampled at temperature 1 without a top-k (the HTTP server's default; the Python API's is
transformers', a top-k of 50) (64 tokens each, after their 32-token prompts), the sampler with and
without the race alternating run by run, and prints the median milliseconds a decode step of each run
and of each side.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.backends.cpu import SDPABackend
from engine.request import Request, SamplingParams
from engine.sampler import Sampler

CASES = {
    "greedy": (dict(temperature=0.0), 1.0),
    "temperature 1": (dict(temperature=1.0), 1.0),
    "temperature 1, top-k 50": (dict(temperature=1.0, top_k=50), 1.0),
    "temperature 1, logprobs 5": (dict(temperature=1.0, logprobs=5), 1.0),
    "temperature 0.8, seeded": (dict(temperature=0.8, seed=0), 1.0),
    "top-p 0.9, flat logits": (dict(temperature=0.8, top_p=0.9, seed=0), 1.0),
    "top-p 0.9, peaked logits": (dict(temperature=0.8, top_p=0.9, seed=0), 4.0),
}


def time_case(rows: int, vocab: int, params: dict, scale: float, repeats: int, backend: SDPABackend | None) -> float:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=g) * scale).bfloat16()
    reqs = [Request(f"r{i}", [1, 2, 3], 16, SamplingParams(**{**params, "seed": params.get("seed") and i}),
                    frozenset()) for i in range(rows)]  # fmt: skip
    sampler = Sampler(0) if backend is None else Sampler(0, argmax=backend.argmax, race=backend.sample_race,
                                                         logsumexp=backend.logsumexp)  # fmt: skip
    for _ in range(3):
        sampler(logits, reqs)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sampler(logits, reqs)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def time_steps(rows: int, runs: int, dtype: str) -> None:
    """Decode steps of sampled rows on the embedded model, the race on and off alternating."""
    from engine import ContinuousBatchingConfig, LLMEngine
    from engine.loader import load_model

    loaded = load_model(None, dtype)
    engine = LLMEngine(loaded.model, ContinuousBatchingConfig(num_blocks=256), tokenizer=loaded.tokenizer)
    race = engine.sampler.race
    print(f"decode steps of {rows} rows at temperature 1, SmolLM2 {dtype}, {torch.get_num_threads()} threads; "
          "median ms a step")  # fmt: skip
    sides: dict[str, list[float]] = {"race": [], "torch": []}
    for run in range(2 * runs):
        name = ("race", "torch")[run % 2]
        engine.sampler.race = race if name == "race" else None
        for i in range(rows):
            engine.add_request(engine.make_request([100 + (run * rows + i + j) % 4000 for j in range(32)],
                                                   max_new_tokens=64, ignore_eos=True, temperature=1.0, top_k=0,
                                                   do_sample=True))  # fmt: skip
        times = []
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        step = 1e3 * statistics.median(times[4:])  # after the prompts' steps
        sides[name].append(step)
        print(f"run {run + 1} ({name}): {step:.2f}", flush=True)
    print("median of runs: " + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in sides.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--rows", default="1,16")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--steps", action="store_true", help="time decode steps of the embedded model instead")
    p.add_argument("--runs", type=int, default=4, help="--steps: runs of each side")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="--steps: the model's")
    args = p.parse_args()
    if args.steps:
        time_steps(int(args.rows.split(",")[-1]), args.runs, args.dtype)
        return
    rows = [int(r) for r in args.rows.split(",")]
    backend = SDPABackend()
    races = {"engine": backend if backend.ops is not None else None, "torch": None}
    print(f"Sampler over {args.vocab} logits, {torch.get_num_threads()} threads; median ms of {args.repeats} calls; "
          "engine: with the C++ kernels' argmax and one-pass race, as the CPU executor runs it; torch: torch's ops alone")  # fmt: skip
    print("| case | " + " | ".join(f"{r} rows, {name}" for r in rows for name in races) + " |")
    print("|---|" + "---:|" * (len(rows) * len(races)))
    for name, (params, scale) in CASES.items():
        cells = [f"{time_case(r, args.vocab, params, scale, args.repeats, race):.2f}" for r in rows for race in races.values()]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
