"""CUDA attention over the paged cache: flash-attn, else torch's FlexAttention (engine/backends/cuda/flex.py),
else torch SDPA on CUDA. `make_backend` chooses (see `choose_backend`) and logs the choice.

Written to flash-attn 2's documented API (`flash_attn.flash_attn_interface`); flash-attn has not run
on a GPU yet (the FlexAttention and SDPA paths have, on an H200: docs/gpu.md). This module imports on a machine without CUDA or
flash-attn: flash-attn is imported only when a `FlashAttnBackend` is built.

- Every step first writes its new keys and values into the cache by slot mapping.
- A pure decode step (every sequence has one query) calls `flash_attn_with_kvcache` with
  `cache_seqlens` and `block_table`: only tensors, so it is capturable in a CUDA graph.
- A prefill or mixed step calls `flash_attn_varlen_func` with `block_table` over the paged cache
  (`cu_seqlens_k` from the per-sequence cache lengths); its causal mask is aligned bottom-right, so
  a chunk with history sees all of it.
- flash-attn's paged kernels want a page (block) size that is a multiple of 256: `check_config`
  rejects any other `block_size`.

Without flash-attn, or with a flash-attn built for another GPU architecture than this GPU's (the
image records the ones it built for in CBSERVE_FLASH_ATTN_ARCHS), FlexAttention serves: no
package beyond torch and triton, CUDA graphs too. SDPA is the last resort (no triton).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.backends.base import AttentionBackend, AttentionMetadata
from engine.backends.cuda.sdpa import SDPACudaBackend, write_kv

logger = logging.getLogger("cbserve.backends.cuda")

FLASH_BLOCK_MULTIPLE = 256
FLASH_DTYPES = (torch.float16, torch.bfloat16)


def require_cuda() -> None:
    """Raise one clear RuntimeError when the CUDA backend is asked for on a machine without CUDA."""
    if not torch.cuda.is_available():
        built = torch.version.cuda or "none (a CPU-only build)"
        raise RuntimeError(
            "attn_backend 'cuda' was selected but CUDA is not available on this machine "
            f"(torch {torch.__version__}, CUDA build: {built}, torch.cuda.is_available() is False). "
            "Run on a node with an NVIDIA GPU, its driver and a CUDA build of torch (the Dockerfile's "
            "`engine` image), or set attn_backend to 'cpu' or leave it unset to follow the model's device."
        )


def flash_attn_available() -> bool:
    """Whether the flash-attn package is installed (without importing it)."""
    return importlib.util.find_spec("flash_attn") is not None


FLASH_ARCHS_ENV = "CBSERVE_FLASH_ATTN_ARCHS"  # the image records the archs its flash-attn was built for


def flash_archs(value: str | None) -> list[int] | None:
    """`CBSERVE_FLASH_ATTN_ARCHS` ("90", "80;90") as [80, 90]; None when unset or empty (nothing recorded)."""
    if not value or not value.strip():
        return None
    archs = []
    for part in re.split(r"[;,\s]+", value.strip()):
        if not part.isdigit():
            raise ValueError(f"{FLASH_ARCHS_ENV} must list compute capabilities like '90' or '80;90', got {value!r}")
        archs.append(int(part))
    return archs


def arch_runs(capability: tuple[int, int], archs: list[int]) -> bool:
    """Whether code built for one of `archs` (flash-attn ships sm_XY code only, no PTX) runs on a GPU of
    this compute capability: the same major version, a minor version at least the built one's."""
    major, minor = capability
    return any(a // 10 == major and a % 10 <= minor for a in archs)


FLASH_BUILD_ARCHS = (80, 90, 100, 120)  # what flash-attn 2.8.3's setup.py compiles for


def _cc(arch: int) -> str:
    return f"{arch // 10}.{arch % 10}"


@dataclass(frozen=True)
class Choice:
    kernel: str  # "flash-attn", "flex" or "sdpa"
    line: str  # the start-up line that names it and says why
    warn: bool  # logged as a warning: flash-attn is installed but unusable here, or SDPA


def choose_backend(device: torch.device | str, *, flash_installed: bool, capability: tuple[int, int] | None,
                   flash_archs_value: str | None, flex_missing: str | None) -> Choice:  # fmt: skip
    """flash-attn when installed and built for this GPU's compute capability (as far as the image
    recorded it in CBSERVE_FLASH_ATTN_ARCHS; unset: not checked); else FlexAttention when torch has
    it and triton is installed; else SDPA."""
    if flash_installed:
        archs = flash_archs(flash_archs_value)
        if archs is None or capability is None or arch_runs(capability, archs):
            return Choice("flash-attn", f"attention on {device}: flash-attn", warn=False)
        major, minor = capability
        fix = (f"an image built with --build-arg FLASH_ATTN_CUDA_ARCHS={major}0 runs it"
               if major * 10 in FLASH_BUILD_ARCHS else "flash-attn 2 has no build for it")
        why = (f"not flash-attn: it was built for compute capability {', '.join(_cc(a) for a in archs)} "
               f"({FLASH_ARCHS_ENV}={flash_archs_value}) and this GPU is {major}.{minor}; {fix}")
    else:
        why = "flash-attn is not installed (pip install cbserve[gpu], or the Dockerfile's engine image)"
    if flex_missing is None:
        return Choice("flex", f"attention on {device}: FlexAttention (compiled, with CUDA graphs); {why}",
                      warn=flash_installed)  # fmt: skip
    return Choice("sdpa", f"attention on {device}: torch SDPA (slower, no CUDA graphs); {why}; "
                          f"FlexAttention cannot run: {flex_missing}", warn=True)  # fmt: skip


def make_backend(device: torch.device | str) -> AttentionBackend:
    """The CUDA backend for `device` (see `choose_backend`), its choice logged in one line."""
    require_cuda()
    from engine.backends.cuda import flex

    installed = flash_attn_available()

    def choose(flex_missing: str | None) -> Choice:
        return choose_backend(
            device, flash_installed=installed, flex_missing=flex_missing,
            capability=torch.cuda.get_device_capability(device) if installed else None,
            flash_archs_value=os.environ.get(FLASH_ARCHS_ENV),
        )  # fmt: skip

    choice = choose(flex.flex_unavailable())
    flex_backend = None
    if choice.kernel == "flex":  # compiled and run once here, against SDPA, before it serves
        flex_backend = flex.FlexAttnBackend()
        failed = flex.self_check(device, backend=flex_backend)
        if failed is not None:
            choice = choose(failed)
    logger.log(logging.WARNING if choice.warn else logging.INFO, "cbserve: %s", choice.line)
    if choice.kernel == "flash-attn":
        return FlashAttnBackend()
    if choice.kernel == "flex":
        return flex_backend or flex.FlexAttnBackend()
    return SDPACudaBackend()


def flash_window(sliding_window: int | None) -> tuple[int, int]:
    """transformers' `sliding_window` (a query sees keys with q - k < window) as flash-attn's (left, right)."""
    if sliding_window is None:
        return (-1, -1)
    return (sliding_window - 1, 0)


class FlashAttnBackend(AttentionBackend):
    """flash_attn_varlen_func (prefill, mixed) and flash_attn_with_kvcache (pure decode), paged.

    The two kernels can be injected (tests run them as torch reference implementations on the CPU);
    by default they are imported from flash-attn here, not at module import.
    """

    name = "cuda"
    kernel = "flash-attn"
    supports_graphs = True

    def __init__(self, varlen_fn: Callable[..., torch.Tensor] | None = None,
                 kvcache_fn: Callable[..., torch.Tensor] | None = None) -> None:  # fmt: skip
        if varlen_fn is None or kvcache_fn is None:
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

            varlen_fn = varlen_fn or flash_attn_varlen_func
            kvcache_fn = kvcache_fn or flash_attn_with_kvcache
        self._varlen = varlen_fn
        self._kvcache = kvcache_fn

    def check_config(self, block_size: int) -> None:
        if block_size % FLASH_BLOCK_MULTIPLE:
            raise ValueError(
                f"block_size must be a multiple of {FLASH_BLOCK_MULTIPLE} for flash-attn's paged kernels, "
                f"got {block_size}; use 256 (the default) or 512"
            )

    def prepare(self, meta: AttentionMetadata) -> None:
        if meta.num_decodes == meta.num_seqs:
            return  # flash_attn_with_kvcache takes the per-sequence lengths directly
        cu_seqlens_k = torch.zeros(meta.seq_lens_k.shape[0] + 1, dtype=torch.int32, device=meta.seq_lens_k.device)
        torch.cumsum(meta.seq_lens_k, 0, out=cu_seqlens_k[1:])
        meta.extra["cu_seqlens_k"] = cu_seqlens_k

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        scaling: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        if query.dtype not in FLASH_DTYPES:
            raise ValueError(f"flash-attn runs in float16 or bfloat16; the model is in {query.dtype} (set dtype)")
        write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        common: dict[str, Any] = dict(
            softmax_scale=scaling, causal=True, window_size=flash_window(sliding_window), softcap=softcap or 0.0
        )
        if meta.num_decodes == meta.num_seqs:
            out = self._kvcache(
                query.unsqueeze(1),  # [B, 1, H, D]
                k_cache,
                v_cache,
                cache_seqlens=meta.seq_lens_k,
                block_table=meta.block_tables,
                **common,
            )
            return out.squeeze(1)
        return self._varlen(
            query,
            k_cache,
            v_cache,
            cu_seqlens_q=meta.cu_seqlens_q,
            cu_seqlens_k=meta.extra["cu_seqlens_k"],
            max_seqlen_q=meta.max_seqlen_q,
            max_seqlen_k=meta.max_seqlen_k,
            block_table=meta.block_tables,
            **common,
        )
