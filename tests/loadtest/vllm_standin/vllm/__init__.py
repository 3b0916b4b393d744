"""A stand-in for vLLM's offline API, as much of it as benchmarks/vllm_peer.py's `--serve` uses.

`LLM.generate` answers every prompt with `max_tokens` copies of its last token id, taking 40 ms per
prompt, or 4 ms where Intel OpenMP's runtime is in LD_PRELOAD: the tests of the preload choice need
one variant measurably faster. It is put on PYTHONPATH by tests/loadtest/test_vllm_preload.py only.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    temperature: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False


@dataclass
class _Completion:
    token_ids: list[int]


@dataclass
class _Output:
    outputs: list[_Completion]
    metrics: None = None


@dataclass
class LLM:
    model: str
    skip_tokenizer_init: bool = False
    dtype: str = "auto"
    enable_prefix_caching: bool = False
    extra: dict = field(default_factory=dict)

    def generate(self, prompts, params: SamplingParams, use_tqdm: bool = True) -> list[_Output]:
        per_prompt = 0.004 if "libiomp5" in os.environ.get("LD_PRELOAD", "") else 0.04
        time.sleep(per_prompt * len(prompts))  # the stand-in's forward passes
        return [_Output([_Completion([p["prompt_token_ids"][-1]] * params.max_tokens)]) for p in prompts]
