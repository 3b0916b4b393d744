"""Evaluate a model on a list of prompts with cbserve's generate_batch.

    python examples/generate_batch.py [--model PATH] [--max-new-tokens 32]

With no --model it builds a small random Llama (nothing is downloaded); with --model it loads a
local checkpoint folder with transformers.
"""

from __future__ import annotations

import argparse
import time

import torch

from engine import ContinuousBatchingConfig, generate_batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="a local checkpoint folder")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(args.model)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        texts = ["The capital of France is", "def fibonacci(n):", "Continuous batching is"]
        prompts = [tokenizer(t).input_ids for t in texts]
    else:
        from engine.testing import build_test_model, build_test_tokenizer, random_prompts

        model, tokenizer = build_test_model("llama"), build_test_tokenizer()
        prompts = random_prompts(64, 16, 128, model.config.vocab_size)
    start = time.perf_counter()
    outputs = generate_batch(model, prompts, max_new_tokens=args.max_new_tokens,
                             continuous_batching_config=ContinuousBatchingConfig(block_size=16))
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.generated_tokens) for o in outputs.values())
    print(f"{len(outputs)} requests, {tokens} tokens in {elapsed:.2f}s: {tokens / elapsed:.1f} output tok/s")
    first = next(iter(outputs.values()))
    print("first completion:", repr(tokenizer.decode(first.generated_tokens)))


if __name__ == "__main__":
    main()
