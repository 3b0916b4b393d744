"""An RL trainer's generation loop on cbserve and on transformers' own continuous batching.

    python benchmarks/rl_loop.py [--rounds 4] [--prompts 16] [--group 4] [--new 32]

Each round: `generate_batch` over the same prompts with `num_return_sequences=group` (sampled,
temperature 1, top_k 0, a seed per round), then an in-place update of every weight (p += 1e-3 *
noise, as an optimizer step would), as a GRPO-style loop does. Systems, in one process, one after
the other on the same model (the W1 random 8-layer Llama of benchmarks/throughput.py, float32):
  cbserve kept:          model.generate_batch(..., persistent_manager=True) after use_cbserve(model)
  cbserve rebuilt:       the same without persistent_manager (engine built and profiled every round)
  transformers kept:     transformers' generate_batch(..., persistent_manager=True), its best CPU
                         sizing from benchmarks/throughput.py (page_size 32, max_batch_tokens 1024)
  transformers rebuilt:  the same without persistent_manager
Prints per-round wall time and output tok/s (first round, and the median of the others), and
whether, after the last update, each system's greedy output on 4 prompts still equals
model.generate's (a kept cache that ignores the update would reuse stale prefix K/V).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from throughput import build_model  # noqa: E402

from engine import ContinuousBatchingConfig, use_cbserve  # noqa: E402
from engine.backends.cpu_isa import capabilities  # noqa: E402
from engine.testing import random_prompts  # noqa: E402


def update_in_place(model, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 1e-3)


def cbserve_round(model, prompts, gen, kept: bool, seed: int):
    from engine.generate import generate_batch

    cfg = ContinuousBatchingConfig(block_size=16)
    return generate_batch(model, prompts, generation_config=gen, continuous_batching_config=cfg,
                          persistent_manager=kept, seed=seed)  # fmt: skip


def transformers_round(model, prompts, gen, kept: bool, seed: int):
    from transformers.generation.configuration_utils import ContinuousBatchingConfig as HFConfig
    from transformers.generation.continuous_batching.continuous_api import ContinuousMixin

    cfg = HFConfig(page_size=32, num_blocks=2048, max_batch_tokens=1024, seed=seed)
    out = ContinuousMixin.generate_batch(model, prompts, generation_config=gen, continuous_batching_config=cfg,
                                         persistent_manager=kept, progress_bar=False)  # fmt: skip
    return out


def greedy_check(model, prompts, run, kept: bool) -> int:
    """How many of 4 prompts give model.generate's greedy tokens through `run` (the kept manager, if any)."""
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    got = [o.generated_tokens for o in run(model, prompts[:4], gen, kept, 0).values()]
    model.set_attn_implementation("sdpa")
    same = 0
    for p, tokens in zip(prompts[:4], got):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), generation_config=gen)[0, len(p) :].tolist()
        same += tokens == ref
    return same


def main() -> None:
    from transformers import GenerationConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--new", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(2)
    prompts = random_prompts(args.prompts, 64, 128, 32000, seed=0)
    gen = GenerationConfig(max_new_tokens=args.new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                           num_return_sequences=args.group, eos_token_id=None, pad_token_id=0)  # fmt: skip
    systems = {"cbserve kept": (cbserve_round, True), "cbserve rebuilt": (cbserve_round, False),
               "transformers kept": (transformers_round, True), "transformers rebuilt": (transformers_round, False)}  # fmt: skip
    tokens = args.prompts * args.group * args.new
    print(f"host: {capabilities().describe()}\n{args.rounds} rounds of {args.prompts} prompts x {args.group} "
          f"samples x {args.new} tokens ({tokens} output tokens a round), "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)  # fmt: skip
    rows = []
    for name, (fn, kept) in systems.items():
        model = build_model(torch.float32)
        if name.startswith("cbserve"):
            use_cbserve(model)
        times = []
        for r in range(args.rounds):
            start = time.perf_counter()
            out = fn(model, prompts, gen, kept, r)
            times.append(time.perf_counter() - start)
            assert sum(len(o.generated_tokens) for o in out.values()) == tokens, name
            update_in_place(model, r)
            print(f"{name} round {r + 1}: {times[-1]:.2f} s", flush=True)
        rows.append((name, times, greedy_check(model, prompts, fn, kept)))
        del model  # and the manager kept on it
    print(f"\n{'system':<20}{'round 1 s':>11}{'later rounds s (median)':>25}{'later tok/s':>13}{'greedy = generate':>19}")
    for name, times, same in rows:
        later = statistics.median(times[1:]) if len(times) > 1 else times[0]
        print(f"{name:<20}{times[0]:>11.2f}{later:>25.2f}{tokens / later:>13.1f}{f'{same}/4':>19}")


if __name__ == "__main__":
    main()
