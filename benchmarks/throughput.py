"""Workload W1 on cbserve and its peers, in one process run, alternating, median of the runs.

    python benchmarks/throughput.py [--runs 3] [--peers all|transformers|generate|none] [--dtype float32]

W1: Llama config (vocab 32000, hidden 512, intermediate 1376, 8 layers, 8 heads, 4 KV heads),
torch.manual_seed(0); 64 prompts of random ids, lengths uniform in [16, 256] (seed 0); 64 new
tokens each; greedy; EOS ignored; torch.set_num_threads(2).

Peers: transformers' own `generate_batch` at its best sizing found here (sdpa, page_size 32,
num_blocks 1024, max_batch_tokens 1024) and `model.generate` on one left-padded batch of 64.
Prints output tokens/s per system (median), the ratio of cbserve to each, and the split of
cbserve's wall time (schedule, forward, sample, output).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine import ContinuousBatchingConfig, LLMEngine

NEW_TOKENS = 64


def build_w1(dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048)  # fmt: skip
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 257, (64,), generator=g).tolist()
    prompts = [torch.randint(0, 32000, (n,), generator=g).tolist() for n in lengths]
    return model, prompts


def run_cbserve(model, prompts) -> tuple[float, list[list[int]], dict]:
    engine = LLMEngine(model, ContinuousBatchingConfig(block_size=16, num_blocks=2048, max_batch_tokens=1024))
    start = time.perf_counter()
    reqs = [engine.make_request(p, max_new_tokens=NEW_TOKENS, ignore_eos=True) for p in prompts]
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
    elapsed = time.perf_counter() - start
    return elapsed, [r.generated_ids for r in reqs], dict(engine.step_times)


def run_transformers(model, prompts) -> tuple[float, list[list[int]]]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig as HFConfig

    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cfg = HFConfig(page_size=32, num_blocks=1024, max_batch_tokens=1024)
    start = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cfg, progress_bar=False)
    elapsed = time.perf_counter() - start
    model.set_attn_implementation("sdpa")
    return elapsed, [o.generated_tokens for o in out.values()]


def run_generate(model, prompts) -> tuple[float, list[list[int]]]:
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros(len(prompts), longest, dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=0)  # fmt: skip
    elapsed = time.perf_counter() - start
    return elapsed, out[:, longest:].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--peers", default="all", choices=["all", "transformers", "generate", "none"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, prompts = build_w1(getattr(torch, args.dtype))
    systems = {"cbserve": run_cbserve}
    if args.peers in ("all", "transformers"):
        systems["transformers generate_batch"] = run_transformers
    if args.peers in ("all", "generate"):
        systems["model.generate (padded)"] = run_generate
    run_cbserve(model, prompts[:4])  # warm-up
    times: dict[str, list[float]] = {name: [] for name in systems}
    outputs: dict[str, list] = {}
    split: dict[str, float] = {}
    for i in range(args.runs):
        for name, fn in systems.items():  # alternate the systems within each run
            result = fn(model, prompts)
            times[name].append(result[0])
            outputs[name] = result[1]
            if name == "cbserve":
                split = result[2]
                split_total = result[0]
            print(f"run {i + 1} {name}: {len(prompts) * NEW_TOKENS / result[0]:.1f} tok/s", flush=True)
    tokens = len(prompts) * NEW_TOKENS
    rates = {name: tokens / statistics.median(t) for name, t in times.items()}
    print(f"\nW1 ({args.dtype}), {tokens} output tokens, median of {args.runs} runs")
    print(f"{'system':<30}{'output tok/s':>14}{'cbserve is':>12}")
    for name, rate in rates.items():
        ratio = "" if name == "cbserve" else f"{rates['cbserve'] / rate:.2f}x"
        print(f"{name:<30}{rate:>14.1f}{ratio:>12}")
    print("\ncbserve's wall time (last run): " + ", ".join(f"{k} {v / split_total:.0%}" for k, v in split.items())
          + f", other {1 - sum(split.values()) / split_total:.0%}")
    if args.dtype == "float32" and "model.generate (padded)" in outputs:
        same = sum(a == b for a, b in zip(outputs["cbserve"], outputs["model.generate (padded)"]))
        print(f"greedy outputs identical to model.generate: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
