"""`generate_batch`: run a list of prompts to completion with continuous batching, in this thread."""

from __future__ import annotations

import types
from typing import Any

import torch
from tqdm.auto import tqdm

from engine.config import ContinuousBatchingConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerationOutput, Request, child_id


@torch.inference_mode()
def generate_batch(
    model: torch.nn.Module,
    inputs: list[list[int]],
    generation_config=None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    progress_bar: bool = True,
    record_timestamps: bool = False,
    max_new_tokens: int | None = None,
    tokenizer=None,
    **kwargs: Any,
) -> dict[str, GenerationOutput]:
    """Generate for every prompt; returns {request_id: GenerationOutput} in input order.

    `kwargs` are per-request parameters applied to every prompt (temperature, top_k, top_p, seed,
    eos_token_id, ignore_eos, logprobs, stop_strings, ...). Stop strings need `tokenizer`; outputs
    then carry `text`, cut right before the stop string. A prompt that fails validation gets a
    FAILED output carrying the error; the others still run.
    """
    if not inputs:
        return {}
    if "num_return_sequences" not in kwargs and getattr(generation_config, "num_return_sequences", None):
        kwargs["num_return_sequences"] = generation_config.num_return_sequences
    engine = LLMEngine(model, continuous_batching_config, generation_config, tokenizer=tokenizer)
    engine.warmup()
    try:
        outputs: dict[str, GenerationOutput] = {}
        reqs = []
        for i, ids in enumerate(inputs):
            rid = f"req_{i}"
            try:
                req = engine.make_request(
                    ids, request_id=rid, max_new_tokens=max_new_tokens, record_timestamps=record_timestamps, **kwargs
                )
            except ValueError as exc:
                outputs[rid] = _failed(rid, ids, str(exc))
                continue
            engine.add_request(req)
            reqs.append(req)
            outputs[rid] = None  # keeps input order
        total = sum(1 + r.num_children for r in reqs)
        finished: dict[str, Request] = {}
        with tqdm(total=total, disable=not progress_bar, desc=f"Generating {total} sequences", unit="seq") as bar:
            while engine.has_unfinished():
                done = [r for r in engine.step() if r.is_finished]
                finished.update((r.request_id, r) for r in done)
                bar.update(len(done))
        result: dict[str, GenerationOutput] = {}
        for rid, out in outputs.items():  # input order, each request's siblings right after it
            if out is not None:
                result[rid] = out
                continue
            family = [rid] + [child_id(rid, i) for i in range(kwargs.get("num_return_sequences", 1) - 1)]
            for member in family:
                result[member] = finished[member].to_output()
        return result
    finally:
        engine.close()


def _failed(request_id: str, ids: Any, error: str) -> GenerationOutput:
    from engine.request import RequestStatus

    prompt = list(ids) if isinstance(ids, (list, tuple)) else []
    return GenerationOutput(request_id, prompt_ids=prompt, error=error, status=RequestStatus.FAILED, finish_reason="error")


def use_cbserve(model: torch.nn.Module) -> torch.nn.Module:
    """One-line opt-in: `model.generate_batch(...)` then runs on cbserve's engine."""
    model.generate_batch = types.MethodType(generate_batch, model)
    return model
