"""`generate_batch`: run a list of prompts to completion with continuous batching, in this thread."""

from __future__ import annotations

import dataclasses
import inspect
import types
import warnings
from typing import Any

import torch
from tqdm.auto import tqdm

from engine.config import ContinuousBatchingConfig
from engine.llm_engine import SAMPLING_KEYS, LLMEngine
from engine.request import GenerationOutput, Request, child_id

# per-request keywords generate_batch passes on to every prompt
REQUEST_KEYS = {p for p in inspect.signature(LLMEngine.make_request).parameters if p not in ("self", "input_ids",
                "request_id", "sampling")} | SAMPLING_KEYS  # fmt: skip
# config fields older transformers releases took as generate_batch keywords
CONFIG_KEYS = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
CACHED = "_cbserve_engine"  # the model attribute holding a persistent engine


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
    persistent_manager: bool = False,
    warmup: bool = True,
    **kwargs: Any,
) -> dict[str, GenerationOutput]:
    """Generate for every prompt; returns {request_id: GenerationOutput} in input order.

    `kwargs` are per-request parameters applied to every prompt (temperature, top_k, top_p, seed,
    eos_token_id, ignore_eos, logprobs, stop_strings, structured_output, ...); an unknown one is a
    TypeError before any work. Stop strings need `tokenizer`; outputs then carry `text`, cut right
    before the stop string. A prompt that fails validation gets a FAILED output carrying the error;
    the others still run.

    As in transformers: `persistent_manager=True` keeps the engine (its KV cache, packed weights,
    prefix cache) on the model for the next call with the same config, as an RL loop wants
    (`destroy_cached_engine(model)` frees it); `warmup` captures what the device captures ahead of
    time (nothing on the CPU). Config fields passed as keywords (`num_blocks=`, `max_batch_tokens=`,
    `use_cuda_graph=`, ...) still work, with a FutureWarning.
    """
    if not inputs:
        return {}
    continuous_batching_config = _config_from_keywords(continuous_batching_config, kwargs)
    unknown = set(kwargs) - REQUEST_KEYS
    if unknown:
        raise TypeError(f"generate_batch() got unexpected keyword argument(s): {', '.join(sorted(unknown))}")
    if "num_return_sequences" not in kwargs and getattr(generation_config, "num_return_sequences", None):
        kwargs["num_return_sequences"] = generation_config.num_return_sequences
    engine = _engine(model, continuous_batching_config, generation_config, tokenizer, persistent_manager)
    if warmup:
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
        if not persistent_manager:
            engine.close()


def _config_from_keywords(config: ContinuousBatchingConfig | None, kwargs: dict[str, Any]) -> ContinuousBatchingConfig | None:
    """Config fields given as generate_batch keywords (older transformers' style), moved into a copy
    of the config with a FutureWarning; `kwargs` keeps the rest."""
    given = {k: kwargs.pop(k) for k in list(kwargs) if k in CONFIG_KEYS and k not in REQUEST_KEYS}
    if not given:
        return config
    warnings.warn(f"pass {', '.join(sorted(given))} in continuous_batching_config=ContinuousBatchingConfig(...), "
                  "not as generate_batch keywords", FutureWarning, stacklevel=3)  # fmt: skip
    return dataclasses.replace(config or ContinuousBatchingConfig(), **given)


def _engine(model, config, generation_config, tokenizer, persistent: bool) -> LLMEngine:
    """A new engine, or with `persistent` the one kept on the model if it was built the same way."""
    cached = getattr(model, CACHED, None)
    key = (config or ContinuousBatchingConfig(), id(generation_config), id(tokenizer))
    if persistent and cached is not None:
        engine, cached_key = cached
        if cached_key == key:
            return engine
        destroy_cached_engine(model)  # another config: built again
    engine = LLMEngine(model, config, generation_config, tokenizer=tokenizer)
    if persistent:
        setattr(model, CACHED, (engine, key))
    return engine


def destroy_cached_engine(model: torch.nn.Module) -> None:
    """Free the engine `generate_batch(..., persistent_manager=True)` kept on `model` (transformers'
    `destroy_cached_continuous_batching_manager`)."""
    cached = getattr(model, CACHED, None)
    if cached is not None:
        cached[0].close()
        delattr(model, CACHED)


def _failed(request_id: str, ids: Any, error: str) -> GenerationOutput:
    from engine.request import RequestStatus

    prompt = list(ids) if isinstance(ids, (list, tuple)) else []
    return GenerationOutput(request_id, prompt_ids=prompt, error=error, status=RequestStatus.FAILED, finish_reason="error")


def use_cbserve(model: torch.nn.Module) -> torch.nn.Module:
    """One-line opt-in: `model.generate_batch(...)` then runs on cbserve's engine."""
    model.generate_batch = types.MethodType(generate_batch, model)
    model.destroy_cached_continuous_batching_manager = types.MethodType(destroy_cached_engine, model)
    return model
