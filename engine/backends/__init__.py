"""Attention backends behind one boundary (see base.py). GPU code is imported only when asked for."""

from __future__ import annotations

import torch

from engine.backends.base import AttentionBackend, AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend"]


def get_backend(device: torch.device | str, name: str | None = None) -> AttentionBackend:
    """The backend for a device: "cpu" (C++ kernels, torch SDPA) or "cuda" (flash-attn, else FlexAttention,
    else SDPA: engine/backends/cuda/__init__.py's `choose_backend`)."""
    device = torch.device(device)
    name = name or ("cuda" if device.type == "cuda" else "cpu")
    if name == "cpu":
        from engine.backends.cpu import SDPABackend

        return SDPABackend()
    if name == "cuda":
        from engine.backends import cuda  # lazy: flash-attn and CUDA only here

        return cuda.make_backend(device)
    raise ValueError(f"attn_backend must be 'cpu' or 'cuda', got {name!r}")
