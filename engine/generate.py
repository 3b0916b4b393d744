"""`generate_batch`: run a list of prompts to completion with continuous batching, in this thread."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any

import torch
from tqdm.auto import tqdm

from engine import telemetry
from engine.config import OFFLINE_DECODE_STALL, ContinuousBatchingConfig
from engine.llm_engine import SAMPLING_KEYS, LLMEngine
from engine.manager import CACHED, ContinuousBatchingManager
from engine.output_processor import family_ids
from engine.request import GenerationOutput, Request

# per-request keywords generate_batch passes on to every prompt
REQUEST_KEYS = {p for p in inspect.signature(LLMEngine.make_request).parameters if p not in ("self", "input_ids",
                "request_id", "sampling")} | SAMPLING_KEYS  # fmt: skip
# config fields older transformers releases took as generate_batch keywords
CONFIG_KEYS = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}


@telemetry.traced_batch
@torch.inference_mode()
def generate_batch(
    model: torch.nn.Module,
    inputs: list[list[int]],
    generation_config=None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    record_timestamps: bool = False,
    progress_bar: bool = False,
    persistent_manager: bool = False,
    warmup: bool = True,
    *,
    max_new_tokens: int | None = None,
    tokenizer=None,
    **kwargs: Any,
) -> dict[str, GenerationOutput]:
    """Generate for every prompt; returns {request_id: GenerationOutput} in input order. The
    positional parameters are transformers' and in its order; cbserve's own are keyword-only.

    `kwargs` are per-request parameters applied to every prompt (temperature, top_k, top_p, seed,
    eos_token_id, ignore_eos, logprobs, stop_strings, detokenize, structured_output, ...); an unknown one
    is a TypeError before any work. Stop strings and `detokenize=True` need `tokenizer`; outputs then carry
    `text`, cut right before a stop string (the sequence ends at the token that completes it). A prompt that fails validation gets a FAILED output carrying the error;
    the others still run.

    As in transformers: `persistent_manager=True` keeps a manager, and with it the engine (KV cache,
    packed weights, prefix cache), on the model for the next call with the same config, as an RL loop
    wants (`destroy_cached_engine(model)` frees it); `warmup` captures what the device captures ahead of
    time (nothing on the CPU). Config fields passed as keywords (`num_blocks=`, `max_batch_tokens=`,
    `use_cuda_graph=`, ...) still work, with a FutureWarning.
    """
    if not inputs:
        return {}
    continuous_batching_config = _config_from_keywords(continuous_batching_config, kwargs)
    unknown = set(kwargs) - REQUEST_KEYS
    if unknown:
        raise TypeError(f"generate_batch() got unexpected keyword argument(s): {', '.join(sorted(unknown))}")
    engine = _engine(model, continuous_batching_config, generation_config, tokenizer, persistent_manager)
    if warmup:
        engine.warmup()
    streaming_stall = engine.scheduler.max_decode_stall
    if engine.config.max_decode_stall is None:  # unset: no prompt cap for a batch nobody reads until it ends
        engine.scheduler.max_decode_stall = OFFLINE_DECODE_STALL
    try:
        outputs: dict[str, GenerationOutput | int] = {}  # a failed prompt's output, or its number of sequences
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
            outputs[rid] = 1 + req.num_children  # keeps input order
            engine.add_request(req)
            reqs.append(req)
        total = sum(1 + r.num_children for r in reqs)
        finished: dict[str, Request] = {}
        with tqdm(total=total, disable=not progress_bar, desc=f"Generating {total} sequences", unit="seq") as bar:
            while engine.has_unfinished():
                done = [r for r in engine.step() if r.is_finished]
                finished.update((r.request_id, r) for r in done)
                bar.update(len(done))
        result: dict[str, GenerationOutput] = {}
        for rid, out in outputs.items():  # input order, each request's siblings right after it
            if isinstance(out, GenerationOutput):
                result[rid] = out
                continue
            for member in family_ids(rid, out):
                result[member] = engine.output_processor.make_output(finished[member])
        return result
    finally:
        engine.scheduler.max_decode_stall = streaming_stall  # a kept manager's engine streams again after
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
    """A new engine, or with `persistent` the one of the manager kept on the model, if built the same way."""
    if not persistent:
        return LLMEngine(model, config, generation_config, tokenizer=tokenizer)
    manager = getattr(model, CACHED, None)
    if manager is not None and not manager.built_like(config or ContinuousBatchingConfig()):
        destroy_cached_engine(model)  # built another way: built again
        manager = None
    if manager is None:
        manager = ContinuousBatchingManager(model, generation_config, config, tokenizer=tokenizer)
        setattr(model, CACHED, manager)
    if manager.is_running():
        raise RuntimeError("the manager kept on this model is running: stop it before generate_batch(..., "
                           "persistent_manager=True), or call destroy_cached_engine(model)")  # fmt: skip
    engine = manager.ready_engine()
    engine.use_generation_config(generation_config, tokenizer)  # this call's, as transformers reads it per call
    return engine


def destroy_cached_engine(model: torch.nn.Module) -> None:
    """Free the manager and engine kept on `model` by `generate_batch(..., persistent_manager=True)` or
    `stop(keep_for_next_session=True)` (transformers' `destroy_cached_continuous_batching_manager`)."""
    manager = getattr(model, CACHED, None)
    if manager is not None:
        manager.destroy()
        if hasattr(model, CACHED):
            delattr(model, CACHED)


def _failed(request_id: str, ids: Any, error: str) -> GenerationOutput:
    from engine.request import RequestStatus

    prompt = list(ids) if isinstance(ids, (list, tuple)) else []
    return GenerationOutput(request_id, prompt_ids=prompt, error=error, status=RequestStatus.FAILED, finish_reason="error")
