"""`ContinuousBatchingConfig`: the engine's knobs, with transformers' names, validated on creation."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from dataclasses import dataclass, fields
from typing import Any

from engine.settings_table import engine_settings

logger = logging.getLogger("cbserve.engine")

# default_compile_level -> the CompileConfig fields transformers gives that level
COMPILE_LEVELS = {1: {"mode": "default", "dynamic": True}, 2: {"mode": "max-autotune-no-cudagraphs", "dynamic": True},
                  3: {"mode": "max-autotune-no-cudagraphs", "dynamic": False}}  # fmt: skip
# transformers fields that mean nothing in cbserve: (default, why)
NO_EFFECT = {
    "auto_switch_to_flash": (True, "cbserve always runs its own paged attention (flash-attn on CUDA)"),
    "disable_nccl_graph_mixing": (True, "under tensor parallel every cbserve rank captures the same CUDA graphs "
                                  "(all-reduces inside) in lockstep"),
    "q_padding_interval_size": (0, "cbserve pads CUDA-graph steps to its own buckets (engine/backends/cuda/graphs.py)"),
    "kv_padding_interval_size": (0, "cbserve pads CUDA-graph steps to its own buckets (engine/backends/cuda/graphs.py)"),
}
_warned: set[str] = set()
DEFAULT_BLOCK_SIZE = {"cpu": 64, "cuda": 256}
# max_decode_stall unset: the cap where tokens are streamed; offline batches (generate_batch) leave it off:
# nobody reads their tokens before the batch ends, and on an offline W3 (long prompts) it cost 12-15%.
# 16: a prompt that arrives alone beside running decodes mostly goes whole in one step, as vLLM's does (its
# first token as soon as vLLM's), a long one or several are still cut; prompts that arrive together go as a
# wave (prefill_waves). Measured against 4, 8 and 12 under three loads (docs/benchmarks.md).
STREAMING_DECODE_STALL = 16.0
OFFLINE_DECODE_STALL = 0.0


@dataclass
class ContinuousBatchingConfig:
    """Configuration of the continuous-batching engine.

    Sizes left as None are derived at start-up from the model and the memory available
    (see `engine.backends.memory` and the start-up log line that reports them).
    """

    # Tokens per KV block (transformers calls this `page_size`; both names are accepted).
    # None: the device's default (DEFAULT_BLOCK_SIZE): flash-attn's paged kernels want 256 on CUDA;
    # on the CPU a decode token's keys and values are read from memory a block's rows in order, and
    # 64-token blocks read faster than 16-token ones (docs/benchmarks.md; vLLM-CPU's default is 128).
    block_size: int | None = None
    # Blocks in the KV cache; None sizes the cache from `max_memory_percent`.
    num_blocks: int | None = None
    # Token budget of one step: decodes plus prompt chunks. None: derived at start-up.
    max_batch_tokens: int | None = None
    # With decodes running, a step's prompt tokens are capped so that the step is predicted to take at most
    # this many times a step of its decodes alone (engine/step_cost.py fits the prediction to the measured
    # steps); at least 16 prompt tokens per step (one block if smaller). 0: off, prompt chunks fill max_batch_tokens.
    # None: STREAMING_DECODE_STALL where tokens are streamed (the manager, the server, LLMEngine), off for
    # offline batches (generate_batch), whose callers read no token until the batch ends.
    max_decode_stall: float | None = None
    # With that cap on: when at least two requests wait for their first token and they outnumber the decoding
    # ones, they are prefilled first as a wave (shortest first, uncapped; at most 4 steps' budget of prompt
    # tokens; first tokens in its last step, or its majority's when the prompts that end it are done, where
    # one pause each stays under 1 in 200 of the wave's gaps) and the running decodes wait for it, so that
    # requests that arrive together decode together. False: every prompt goes in capped chunks beside the
    # decodes (a burst's first tokens come sooner, and its users' streams stall every step; docs/engine.md).
    prefill_waves: bool = True
    # Share of the memory free after the model loads that the KV cache may take. None: 0.9, as
    # transformers resolves it when no logits processor needs vocabulary-sized scratch space.
    max_memory_percent: float | None = 0.9
    # Cap on requests running at once. None: derived at start-up.
    max_requests_per_batch: int | None = None
    # Cap on blocks one request may hold (context = this x block_size). None, or transformers' 0
    # (which turns its fast decode path off): no cap beyond the cache.
    max_blocks_per_request: int | None = None
    # Prefix caching: requests sharing a prompt prefix share its full blocks.
    allow_block_sharing: bool = True
    # Async batching: launch step N+1 before step N's tokens are back on the host (decodes scheduled ahead,
    # fed their tokens on the device), so that a GPU's forward overlaps the host's work between steps.
    # None: off (it has not been measured on a GPU yet). The CPU turns it down with a warning: a step runs
    # inside its launch there (engine/backends/cpu_executor.py).
    use_async_batching: bool | None = None
    # GPU only: CUDA graphs, as a bool or a (varlen, decode) pair.
    use_cuda_graph: bool | tuple[bool, bool] | None = None
    # GPU only: torch.compile of prefill/mixed steps and of decode steps (a transformers
    # CompileConfig or a dict of its fields); None runs eagerly. See docs/gpu.md.
    varlen_compile_config: Any = None
    decode_compile_config: Any = None
    # transformers' shorthand for those two: 0 eager; 1 mode "default", dynamic; 2 "max-autotune-no-cudagraphs",
    # dynamic; 3 the same, static shapes. Fills only a path whose compile config is None.
    default_compile_level: int = 0
    # "fifo": running decodes first, then prompt chunks; "prefill_first": prompt chunks first.
    scheduler_type: str = "fifo"
    # Share of the KV blocks kept free for running requests: while fewer are free, no new request is
    # admitted (one always is when nothing runs). None: 0, cbserve preempts instead (transformers' FIFO: 0.15).
    safety_margin: float | None = None
    # The manager's output thread (engine/output_thread.py): text, stop strings and the delivery of outputs
    # run beside the engine's steps, so the engine thread never calls the tokenizer. False: on the engine thread.
    output_thread: bool = True
    # Return the sampled token's logprob for every request by default.
    return_logprobs: bool = False
    # Which distribution logprobs describe (vLLM's names): "raw_logprobs", the model's own (log_softmax of
    # its logits); "processed_logprobs", the one each token was drawn from (after bias, penalties, grammar,
    # temperature, top-k, top-p and min-p), which is what transformers returns.
    logprobs_mode: str = "raw_logprobs"
    # Host pool (GiB) for swapping preempted requests' KV blocks; 0 recomputes them instead.
    cpu_offload_space: float = 0.0
    # The pool is clamped to this share of the host's total RAM (1.0: no clamp), as transformers does.
    cpu_offload_space_safety_threshold: float = 0.8
    # CPU only: GiB the KV cache takes at most (within max_memory_percent of the available memory and half
    # the machine's, engine/backends/memory.py). A CPU serves far fewer tokens at once than 1 GiB holds.
    cpu_kv_cache_space: float = 1.0
    # Waiting requests accepted before `add_request` refuses with QueueFullError; 0 = unbounded.
    max_queue_size: int = 0
    # Accepted for transformers compatibility: per-request sampling parameters always work.
    per_request_processors: bool = False
    # Accepted for transformers compatibility: cbserve applies no logits processors of a
    # generation config that it could drop (its sampling parameters are per request).
    drop_unsupported_processors: bool = True
    # transformers' CUDA-graph padding granularities (0: its presets). cbserve pads graph steps to
    # its own buckets (engine/backends/cuda/graphs.py): accepted, and a value other than 0 is logged once (NO_EFFECT).
    q_padding_interval_size: int = 0
    kv_padding_interval_size: int = 0
    # Deprecated in transformers (5.11, 5.13), accepted with a FutureWarning: True sets default_compile_level 3
    # as there; max_cached_graphs has no effect.
    use_default_compile_configs: bool | None = None
    max_cached_graphs: int | None = None
    # transformers-only switches, accepted so its configs load; a value other than the default logs once
    # why it has no effect here (NO_EFFECT below).
    auto_switch_to_flash: bool = True
    disable_nccl_graph_mixing: bool = True
    # Tensor parallel: ranks of one engine (engine/tensor_parallel.py, engine/tp_group.py), and how long a
    # rank waits in a forward's all-reduce before the group counts as broken (None: 1800 s).
    tensor_parallel_size: int = 1
    cpu_group_timeout: float | None = 300.0
    # Seed of the sampler for requests that do not bring their own.
    seed: int | None = None
    # CPU only: linear layers on oneDNN-packed copies of their weights (engine/backends/cpu_linear.py;
    # one more copy of those weights in memory). None: on when the copy takes under a quarter of free memory.
    cpu_packed_weights: bool | None = None
    # Attention backend: "cpu" (torch SDPA), "cuda" (flash-attn), or None to pick from the device.
    attn_backend: str | None = None
    # transformers' name for block_size.
    page_size: dataclasses.InitVar[int | None] = None

    def __post_init__(self, page_size: int | None) -> None:
        if page_size is not None:
            if self.block_size not in (None, page_size):
                raise ValueError(
                    f"block_size ({self.block_size}) and page_size ({page_size}) are the same knob; give one"
                )
            self.block_size = page_size
        self._validate()

    def _validate(self) -> None:
        """Each field against its rule in engine/settings_table.py; then what no single rule says."""
        if self.max_blocks_per_request == 0 and not isinstance(self.max_blocks_per_request, bool):
            self.max_blocks_per_request = None  # transformers' 0: no fast-path table; here: no cap
        if self.max_memory_percent is None:
            self.max_memory_percent = 0.9
        for item in engine_settings():
            setattr(self, item.name, item.check(getattr(self, item.name)))
        if self.use_default_compile_configs is not None:  # transformers 5.11: True means level 3
            warnings.warn("use_default_compile_configs is deprecated in transformers: use default_compile_level "
                          "(True is level 3, False level 0)", FutureWarning, stacklevel=4)  # fmt: skip
            self.default_compile_level = 3 if self.use_default_compile_configs else 0
        if self.max_cached_graphs is not None:
            warnings.warn("max_cached_graphs is deprecated in transformers and has no effect", FutureWarning, stacklevel=4)
        for name in ("varlen_compile_config", "decode_compile_config"):
            if self.default_compile_level and getattr(self, name) is None:
                setattr(self, name, dict(COMPILE_LEVELS[self.default_compile_level]))
        for name, (default, why) in NO_EFFECT.items():
            if getattr(self, name) != default and name not in _warned:
                _warned.add(name)
                logger.warning("%s=%r has no effect: %s", name, getattr(self, name), why)
        if self.use_async_batching and self.tensor_parallel_size > 1:
            raise ValueError("use_async_batching needs tensor_parallel_size 1: the other ranks take each step's "
                             "token ids from the host")
        graph = self.use_cuda_graph
        if isinstance(graph, list):
            self.use_cuda_graph = graph = tuple(graph)
        if not (graph is None or isinstance(graph, bool)) and not (
            isinstance(graph, tuple) and len(graph) == 2 and all(isinstance(g, bool) for g in graph)
        ):
            raise ValueError(f"use_cuda_graph must be a bool or a (varlen, decode) pair of bools, got {graph!r}")
        for name in ("varlen_compile_config", "decode_compile_config"):
            value = getattr(self, name)
            if isinstance(value, dict):
                from transformers import CompileConfig

                try:
                    setattr(self, name, CompileConfig(**value))
                except TypeError as exc:
                    raise ValueError(f"{name}: {exc}") from None

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)] + ["page_size"]

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ContinuousBatchingConfig:
        """Build from a mapping (YAML, environment); an unknown key is a ValueError naming it."""
        known = set(cls.field_names())
        for key in values:
            if key not in known:
                raise ValueError(f"unknown engine setting {key!r}; known: {', '.join(sorted(known))}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
