"""An RL-style loop on cbserve: sample a group per prompt, score, take an optimizer step, repeat.

    python examples/rl_loop.py [--steps 3] [--group 4]

The manager is kept on the model (`persistent_manager=True`), so the engine is built and profiled
once; the optimizer updates the weights in place, which the kept engine notices (its prefix cache
is dropped before the next round). The reward here is a toy (prefer even token ids).
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import GenerationConfig

from engine import ContinuousBatchingConfig, use_cbserve
from engine.testing import build_test_model, random_prompts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--group", type=int, default=4, help="samples per prompt (num_return_sequences)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = use_cbserve(build_test_model("llama"))
    prompts = random_prompts(8, 8, 32, model.config.vocab_size)
    gen = GenerationConfig(max_new_tokens=16, do_sample=True, temperature=1.0, top_k=0,
                           num_return_sequences=args.group, eos_token_id=None)  # fmt: skip
    cfg = ContinuousBatchingConfig(block_size=16, return_logprobs=True, logprobs_mode="processed_logprobs")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(args.steps):
        start = time.perf_counter()
        outputs = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cfg,
                                       persistent_manager=True, seed=step)  # fmt: skip
        rollout_s = time.perf_counter() - start
        model.train()
        loss = torch.zeros(())
        for out in outputs.values():
            ids = torch.tensor([out.prompt_ids + out.generated_tokens])
            reward = sum(t % 2 == 0 for t in out.generated_tokens) / len(out.generated_tokens)
            logits = model(ids).logits[0, len(out.prompt_ids) - 1 : -1]
            logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.generated_tokens)[:, None])
            loss = loss - reward * logprobs.sum() / len(outputs)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()  # in place: the kept engine sees it at its next step
        model.eval()
        print(f"step {step}: {len(outputs)} samples in {rollout_s:.2f}s, loss {loss.item():.3f}")
    model.destroy_cached_continuous_batching_manager()


if __name__ == "__main__":
    main()
