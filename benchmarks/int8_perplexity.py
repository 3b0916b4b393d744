"""What `quantization: int8` costs in quality and buys in speed, on the embedded SmolLM2-135M-Instruct.

The model in float32 (dequantised from its GGUF file) and in bfloat16, then with its linear layers made int8 at load
(engine/int8_weights.py), float activations and int8 activations: perplexity over a fixed English text
(benchmarks/data/perplexity.txt, written for this project), the weights' bytes, and decode speed
(the engine's `generate_batch`, 1 and 8 prompts, greedy). Every variant in this one process, back to back.

    python benchmarks/int8_perplexity.py            # prints a markdown table and the host
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

TEXT = Path(__file__).parent / "data" / "perplexity.txt"


def perplexity(model: torch.nn.Module, ids: torch.Tensor, window: int = 512) -> float:
    """exp of the mean next-token loss over `ids`, in windows of `window` tokens (no overlap)."""
    total, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, ids.shape[1] - 1, window):
            chunk = ids[:, start : start + window + 1]
            logits = model(chunk[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum")
            total, count = total + loss.item(), count + chunk.shape[1] - 1
    return math.exp(total / count)


def decode_tok_s(model: torch.nn.Module, tokenizer, batch: int, new: int) -> float:
    """Output tokens per second of the engine (`generate_batch`, greedy, no EOS) on `batch` prompts."""
    from engine import generate_batch

    prompts = [tokenizer(f"The harbour town woke slowly, day {i}").input_ids for i in range(batch)]
    generate_batch(model, prompts, max_new_tokens=4, ignore_eos=True, progress_bar=False)  # warm
    start = time.perf_counter()
    out = generate_batch(model, prompts, max_new_tokens=new, ignore_eos=True, progress_bar=False)
    return sum(len(o.generated_tokens) for o in out.values()) / (time.perf_counter() - start)


def weight_bytes(model: torch.nn.Module) -> int:
    from engine.backends.cpu_quant import QuantizedLinear

    linear = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, QuantizedLinear))]
    return sum(m.blocks.numel() if isinstance(m, QuantizedLinear) else m.weight.numel() * m.weight.element_size()
               for m in linear)  # fmt: skip


def main() -> None:
    from engine.backends.cpu_quant import QuantizedLinear
    from engine.backends.cpu_isa import capabilities
    from engine.loader import load_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new", type=int, default=32, help="tokens generated per speed run")
    args = p.parse_args()
    rows = []
    for name, dtype, quantization, int8_act in (
        ("float32", "float32", "none", False), ("bfloat16", "bfloat16", "none", False),
        ("int8, float activations", "float32", "int8", False), ("int8, int8 activations", "float32", "int8", True),
    ):  # fmt: skip
        loaded = load_model(None, dtype, quantization=quantization)
        for m in loaded.model.modules():
            if isinstance(m, QuantizedLinear):
                m.int8_activations = int8_act
        ids = loaded.tokenizer(TEXT.read_text(), return_tensors="pt").input_ids
        rows.append((name, perplexity(loaded.model, ids), weight_bytes(loaded.model) / 2**20,
                     decode_tok_s(loaded.model, loaded.tokenizer, 1, args.new),
                     decode_tok_s(loaded.model, loaded.tokenizer, 8, args.new), ids.shape[1]))  # fmt: skip
    print(f"host: {capabilities().describe()}; torch threads {torch.get_num_threads()}\n")
    print("| weights | perplexity | linear weights (MiB) | decode tok/s, batch 1 | decode tok/s, batch 8 |")
    print("|---|---:|---:|---:|---:|")
    for name, ppl, mib, one, eight, _ in rows:
        print(f"| {name} | {ppl:.3f} | {mib:.0f} | {one:.1f} | {eight:.1f} |")
    print(f"\n{rows[0][5]} tokens of {TEXT.name}; perplexity change int8 (float activations) "
          f"{(rows[2][1] / rows[0][1] - 1) * 100:+.2f}%, int8 activations {(rows[3][1] / rows[0][1] - 1) * 100:+.2f}%")


if __name__ == "__main__":
    main()
