"""transformers' continuous-batching methods on a model, backed by cbserve: `use_cbserve(model)`.

transformers gives every model `generate_batch`, `init_continuous_batching`,
`continuous_batching_context_manager` and `destroy_cached_continuous_batching_manager`
(`ContinuousMixin`). `use_cbserve` binds cbserve's versions of all four to one model instance, so
code written against transformers' guide runs on cbserve's engine unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Iterator
from typing import Any

import torch

from engine.config import ContinuousBatchingConfig
from engine.generate import destroy_cached_engine, generate_batch
from engine.manager import CACHED, ContinuousBatchingManager

logger = logging.getLogger("cbserve.manager")


def init_continuous_batching(
    model: torch.nn.Module,
    generation_config=None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    workload_hints: Any = None,
    tokenizer=None,
) -> ContinuousBatchingManager:
    """A manager for `model` (not started). The one kept on the model by `persistent_manager=True` or
    `stop(keep_for_next_session=True)` is returned when it was built with these arguments (None
    matches anything, as in transformers); one built otherwise is destroyed and a new one built."""
    cached = getattr(model, CACHED, None)
    if cached is not None:
        if cached.built_like(continuous_batching_config):
            cached.use_generation_config(generation_config, tokenizer)
            return cached
        logger.info("the manager kept on the model was built with another config: building a new one")
        destroy_cached_engine(model)
    return ContinuousBatchingManager(model, generation_config, continuous_batching_config, tokenizer=tokenizer,
                                     workload_hints=workload_hints)  # fmt: skip


@contextlib.contextmanager
def continuous_batching_context_manager(
    model: torch.nn.Module,
    generation_config=None,
    block: bool = True,
    timeout: float | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    persistent_manager: bool = False,
    warmup: bool = True,
    workload_hints: Any = None,
    tokenizer=None,
) -> Iterator[ContinuousBatchingManager]:
    """A started manager for the `with` block; stopped on exit (in-flight requests finish, unless the
    block raised: then they are aborted), destroyed unless `persistent_manager` keeps it on the model."""
    manager = init_continuous_batching(model, generation_config, continuous_batching_config, workload_hints, tokenizer)
    if warmup and not manager.is_running():
        manager.warmup()
    manager.start()
    failed = True
    try:
        yield manager
        failed = False
    finally:
        manager.stop(block=block, timeout=timeout, hard_stop=failed, keep_for_next_session=persistent_manager)
        if not persistent_manager:
            manager.destroy()


def use_cbserve(model: torch.nn.Module) -> torch.nn.Module:
    """One-line opt-in: the model's `generate_batch`, `init_continuous_batching`,
    `continuous_batching_context_manager` and `destroy_cached_continuous_batching_manager` run on cbserve."""
    model.generate_batch = types.MethodType(generate_batch, model)
    model.init_continuous_batching = types.MethodType(init_continuous_batching, model)
    model.continuous_batching_context_manager = types.MethodType(continuous_batching_context_manager, model)
    model.destroy_cached_continuous_batching_manager = types.MethodType(destroy_cached_engine, model)
    return model
