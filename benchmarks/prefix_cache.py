"""Prefix caching on and off, side by side: 32 prompts sharing a 200-token prefix.

    python benchmarks/prefix_cache.py [--runs 5] [--arch llama] [--new-tokens 16]

Prints, for each setting, the median wall time over the runs (alternating on/off), output
tokens per second, and the prefix-cache hit rate over the shared tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine import ContinuousBatchingConfig, LLMEngine
from engine.testing import build_test_model


def workload(n: int, prefix_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(4, vocab, (prefix_len,), generator=g).tolist()
    own = torch.randint(8, 33, (n,), generator=g).tolist()
    return [prefix + torch.randint(4, vocab, (k,), generator=g).tolist() for k in own]


def run_once(model, prompts, sharing: bool, new_tokens: int) -> tuple[float, dict, list]:
    cfg = ContinuousBatchingConfig(block_size=16, num_blocks=4096, max_batch_tokens=1024, allow_block_sharing=sharing)
    engine = LLMEngine(model, cfg)
    start = time.perf_counter()
    reqs = [engine.make_request(p, max_new_tokens=new_tokens, ignore_eos=True) for p in prompts]
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start, engine.stats(), [r.generated_ids for r in reqs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prefix", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(2)
    # a model big enough that the forward, not bookkeeping, dominates
    model = build_test_model(args.arch, vocab_size=8192, hidden_size=512, intermediate_size=1376,
                             num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, scale=1.0)
    prompts = workload(args.prompts, args.prefix, 8192)
    run_once(model, prompts[:2], True, 2)  # warm-up
    times = {True: [], False: []}
    outputs = {}
    for _ in range(args.runs):
        for sharing in (True, False):
            dt, stats, outs = run_once(model, prompts, sharing, args.new_tokens)
            times[sharing].append(dt)
            outputs[sharing] = outs
            if sharing:
                hit_rate = stats["prefix_cache_hits_total"] / (len(prompts) * args.prefix)
    assert outputs[True] == outputs[False], "prefix caching changed the outputs"
    total = len(prompts) * args.new_tokens
    print(f"{len(prompts)} prompts sharing a {args.prefix}-token prefix, {args.new_tokens} new tokens each, "
          f"median of {args.runs} runs")
    print(f"{'prefix caching':>16} {'median s':>9} {'out tok/s':>10} {'hit rate':>9}")
    for sharing in (True, False):
        med = statistics.median(times[sharing])
        rate = f"{hit_rate:.1%}" if sharing else "-"
        print(f"{'on' if sharing else 'off':>16} {med:9.2f} {total / med:10.1f} {rate:>9}")
    print(f"speed-up: {statistics.median(times[False]) / statistics.median(times[True]):.2f}x; outputs identical")


if __name__ == "__main__":
    main()
