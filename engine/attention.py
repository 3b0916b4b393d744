"""The attention function cbserve registers with transformers' AttentionInterface.

Every model that goes through the attention interface calls it once per layer with the layer's
query, key and value ([1, heads, T, head_dim] for the step's packed tokens). It hands them to the
step's backend, which writes K/V into the paged cache and attends over each sequence's own blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from engine.backends.base import AttentionBackend, AttentionMetadata
from engine.kv_cache import PagedKVCache

ATTN_IMPLEMENTATION = "cbserve_paged"


@dataclass
class StepContext:
    """What the attention function needs for one forward; passed as the `cb_step` model kwarg."""

    backend: AttentionBackend
    cache: PagedKVCache
    meta: AttentionMetadata


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cb_step: StepContext | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if cb_step is None:
        raise RuntimeError(
            f"attn_implementation {ATTN_IMPLEMENTATION!r} runs only inside cbserve's engine "
            "(the model forward must receive the `cb_step` kwarg)"
        )
    layer = module.layer_idx
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = cb_step.backend.attend(
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        cb_step.cache.k[layer],
        cb_step.cache.v[layer],
        cb_step.meta,
        scaling=scaling,
        sliding_window=sliding_window,
        softcap=softcap,
    )
    return out.unsqueeze(0), None  # [1, T, H, D]


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
