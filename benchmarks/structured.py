"""What structured output costs: the same batch free and under a grammar, in one process run.

    python benchmarks/structured.py [--runs 3] [--requests 16] [--max-new-tokens 96]

The embedded SmolLM2-135M-Instruct (fp32, 2 threads), greedy, 16 chat prompts asking for a
person as JSON. Modes, alternated within each run: `free` (no constraint, EOS ignored so every
request makes max-new-tokens), `json` (a JSON schema with free-length strings; requests end where
the grammar does) and `regex` (a regular expression that never ends, EOS ignored). Prints output
tokens/s (median of the runs), how many tokens each mode made, and the time spent in sampling
(where each constrained row's mask is computed and applied) per step, per token and as a share
of the wall time. Constrained requests end where their grammar lets the model end, so a mode
that makes fewer tokens runs smaller batches towards the end: compare the sampling columns,
not the tokens/s, across modes. It also times the mask alone on the same data: `apply_bitmask`
(copy of the logits included) against unpacking the bits and a `masked_fill`.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from engine import ContinuousBatchingConfig, LLMEngine
from engine.backends.cpu_isa import capabilities
from engine.structured import allocate_bitmask, apply_bitmask

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                   "hobbies": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "city", "hobbies"],
}  # fmt: skip
MODES = {"free": None, "json": {"json": SCHEMA}, "regex": {"regex": r"[A-Za-z ,.]+"}}
NAMES = ["Ann", "Bo", "Cyril", "Dana", "Emeka", "Fatima", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea", "Mo", "Nia",
         "Oskar", "Pia"]  # fmt: skip


def run(engine: LLMEngine, prompts: list[list[int]], spec, new_tokens: int) -> tuple[float, int, float, int]:
    gc.collect()
    before = dict(engine.step_times)
    steps = 0
    start = time.perf_counter()
    reqs = [engine.make_request(p, max_new_tokens=new_tokens, ignore_eos=spec is None or "regex" in spec,
                                structured_output=spec) for p in prompts]  # fmt: skip
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - start
    sample = engine.step_times["sample"] - before.get("sample", 0.0)
    return elapsed, sum(r.num_generated for r in reqs), sample, steps


def unpack_and_fill(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The obvious way to apply a bitmask, the peer of `apply_bitmask`: unpack the bits, masked_fill."""
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> bits) & 1).reshape(bitmask.shape[0], -1)[:, : logits.shape[1]]
    return logits.masked_fill(allowed == 0, float("-inf"))


def time_masks(rows: int, vocab: int, repeats: int = 50) -> tuple[float, float]:
    """ms per call of apply_bitmask and of unpack_and_fill on `rows` x `vocab` logits, same data."""
    g = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32, generator=g)
    logits = torch.randn(rows, vocab, generator=g)
    reference = unpack_and_fill(logits, bitmask)
    mine = logits.clone()
    apply_bitmask(mine, bitmask, list(range(rows)))
    assert torch.equal(mine, reference)
    out = []
    for fn in (lambda: apply_bitmask(logits.clone(), bitmask, list(range(rows))), lambda: unpack_and_fill(logits, bitmask)):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        out.append((time.perf_counter() - start) / repeats * 1e3)
    return out[0], out[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    torch.set_num_threads(2)
    from engine.loader import load_model

    loaded = load_model(None, dtype="float32")
    tok = loaded.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Describe a person called {n} as JSON."}],
                                       add_generation_prompt=True) for n in NAMES[: args.requests]]  # fmt: skip
    prompts = [p["input_ids"] if hasattr(p, "keys") else list(p) for p in prompts]
    engine = LLMEngine(loaded.model, ContinuousBatchingConfig(block_size=16, num_blocks=2048, max_batch_tokens=1024),
                       tokenizer=tok)  # fmt: skip
    t = time.perf_counter()
    for spec in MODES.values():
        if spec is not None:
            engine.compile_grammar(spec)
    compile_s = time.perf_counter() - t
    run(engine, prompts[:2], None, 4)  # warm-up
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\nhost: {capabilities().describe()}\n"
          f"tokenizer wrapped for llguidance and both grammars compiled in {compile_s * 1e3:.0f} ms", flush=True)
    results: dict[str, list[tuple[float, int, float, int]]] = {m: [] for m in MODES}
    for _ in range(args.runs):
        for mode, spec in MODES.items():
            results[mode].append(run(engine, prompts, spec, args.max_new_tokens))
    table, unpacked = time_masks(args.requests, engine.vocab_size)
    print(f"mask on {args.requests} x {engine.vocab_size} logits: apply_bitmask {table:.2f} ms (copy included), "
          f"unpack + masked_fill {unpacked:.2f} ms")
    print("| mode | output tok/s | tokens | steps | sampling ms/step | sampling µs/token | sampling share of wall |\n"
          "|---|---:|---:|---:|---:|---:|---:|")
    for mode, rows in results.items():
        rate = statistics.median(tokens / elapsed for elapsed, tokens, _, _ in rows)
        elapsed, tokens, sample, steps = rows[-1]
        print(f"| {mode} | {rate:.1f} | {tokens} | {steps} | {sample / steps * 1e3:.2f} | {sample / tokens * 1e6:.0f} "
              f"| {sample / elapsed:.1%} |")


if __name__ == "__main__":
    main()
