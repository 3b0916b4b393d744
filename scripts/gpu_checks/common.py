"""What the checks share: the run's settings, test models on the device, the engine's loop, matching."""

from __future__ import annotations

import dataclasses
import gc
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class Context:
    device: torch.device
    dtype: torch.dtype  # of the models (float32 on the CPU unless asked)
    block_size: int  # on CUDA; the CPU runs blocks of 16
    min_exact: float
    archs: list[str]
    quick: bool = False  # the CPU smoke test's sizes
    small: bool = False  # a smaller throughput model than the 8B shape
    vllm: str = "auto"  # "auto" (install into a venv if the registry has a build), "off", or a venv's python
    two_ranks: bool = False
    work: Path = Path("/tmp")  # scratch: saved models, the vLLM venv's log
    shared: dict[str, Any] = field(default_factory=dict)  # objects two checks use (the throughput model)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def exact_required(self) -> bool:
        """float32 on the CPU: tokens must be equal; half precision may flip near-ties."""
        return not self.cuda and self.dtype == torch.float32

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def test_model(self, arch: str = "llama", **overrides):
        from engine.testing import build_test_model

        return build_test_model(arch, vocab_size=512, **overrides).to(device=self.device, dtype=self.dtype)

    def config(self, **fields: Any):
        """The engine config of a check: the CUDA backend with flash-attn's block size, else the CPU's."""
        from engine import ContinuousBatchingConfig

        if self.cuda:
            return ContinuousBatchingConfig(block_size=self.block_size, attn_backend="cuda", **fields)
        return ContinuousBatchingConfig(block_size=16, **fields)

    def release(self, key: str) -> None:
        """Drop a shared object and give its device memory back."""
        self.shared.pop(key, None)
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def serve_all(engine, prompts: list[list[int]], max_new_tokens: int, on_step=None, per_prompt: list[dict] | None = None,
              **request: Any) -> list[list[list[int]]]:
    """Run the engine's own loop over `prompts`, all added at once, until all finish: each prompt's
    sequences' generated ids (n > 1: the request's, then its siblings'). `request` applies to every
    prompt, `per_prompt[i]` to prompt i; `on_step(engine)` runs after every step."""
    from engine.output_processor import family_ids

    per_prompt = per_prompt or [{} for _ in prompts]
    reqs = [engine.make_request(p, max_new_tokens=max_new_tokens, ignore_eos=True, **{**request, **extra})
            for p, extra in zip(prompts, per_prompt)]
    families = [family_ids(r.request_id, 1 + r.num_children) for r in reqs]
    for r in reqs:
        engine.add_request(r)
    finished = {}
    with torch.inference_mode():
        while engine.has_unfinished():
            for r in engine.step():
                if r.is_finished:
                    finished[r.request_id] = r
            if on_step is not None:
                on_step(engine)
    bad = [r for r in finished.values() if r.finish_reason not in ("length", "stop")]
    if bad:
        raise RuntimeError(f"request {bad[0].request_id} ended with {bad[0].finish_reason}: {bad[0].error}")
    return [[finished[i].generated_ids for i in ids] for ids in families]


def reference_tokens(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy `model.generate`, one prompt at a time."""
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=model.device)
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(gen[0, len(prompt) :].tolist())
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def matches(got: list[list[int]], expected: list[list[int]]) -> dict[str, Any]:
    """Exact matches and the mean common prefix of token lists, pairwise."""
    return {"exact": sum(g == e for g, e in zip(got, expected)), "total": len(expected),
            "mean_prefix": statistics.mean(common_prefix(g, e) for g, e in zip(got, expected))}  # fmt: skip


class StepWatch:
    """Stands where the executor keeps its step dispatcher and calls it unchanged, noting each step's
    shape (the executor only calls it; everything else is read through to the dispatcher)."""

    def __init__(self, dispatch) -> None:
        self.dispatch = dispatch
        self.decode_batches: list[int] = []  # sequences of each pure decode step
        self.steps = 0

    def __call__(self, input_ids, positions, meta, logits_rows):
        self.steps += 1
        if meta.num_decodes == meta.num_seqs:
            self.decode_batches.append(meta.num_seqs)
        return self.dispatch(input_ids, positions, meta, logits_rows)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dispatch, name)


def with_fields(config, **fields: Any):
    return dataclasses.replace(config, **fields)
