"""The executor: everything about the device the model runs on, behind one call per step.

`make_executor(model, config)` (engine/backends/executors.py) builds the one for the model's device:
`CPUExecutor` (engine/backends/cpu_executor.py: packed weights, fused passes, C++ kernels) or
`CUDAExecutor` (engine/backends/cuda/executor.py: flash-attn, graphs). The engine core reads its
sizes and cache geometry once, and each step calls `launch(batch)`, which runs the forward and samples
the tokens of `batch.samples` (`PendingSample`: on the host with `.result()`). The core never asks
which device it is on.

An executor runs one rank. Under tensor parallel (engine/tp_worker.py) the model is the rank's shard
and the executor is handed `RankPeers`: the little it needs from the other ranks (rank 0's cache
sizes, and on rank 0 sending each step's inputs before its forward). It knows no process group.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import torch

from engine.backends import get_backend
from engine.backends.base import AttentionMetadata
from engine.backends.memory import (
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_MAX_REQUESTS,
    GiB,
    CachePlan,
    cap_layer_elements,
    kv_bytes_per_block,
    plan_for_device,
    profile_activation_peak,
    profile_forward,
    read_device_memory,
    step_reserve_bytes,
)
from engine.backends.step_dispatch import Route, StepDispatcher, normalize_cuda_graph_flag, reserved_blocks
from engine.config import DEFAULT_BLOCK_SIZE, ContinuousBatchingConfig
from engine.kv_cache import PagedKVCache, kv_geometry
from engine.model_runner import ModelRunner, ModuleSwaps, NativeForward, StepInputs, restore_modes
from engine.sampler import PendingSample, Sampler, to_device
from engine.scheduler import ScheduledBatch

logger = logging.getLogger("cbserve.engine")


class RankPeers(Protocol):
    """What the executor of one tensor-parallel rank needs from the others (engine/tp_group.TPGroup)."""

    rank: int
    world: int

    def share_sizes(self, sizes: CachePlan) -> CachePlan:
        """Rank 0's sizes, on every rank (each rank passes its own)."""
        ...

    def send_step(self, step: StepInputs, route: Route) -> None:
        """Rank 0, before each forward: the other ranks run the same step, by the same route (the same
        graph); raises when they cannot."""
        ...

    def send_warmup(self) -> None:
        """Rank 0, before capturing its graphs: the other ranks capture theirs with it, in the same order."""
        ...


class Executor:
    """Placement, sizing, the KV cache, module swaps, step dispatch (graphs or compiled) and sampling."""

    # whether `launch` returns before the step has run (a device that queues work); False: the step runs inside it
    launches_ahead = False

    def __init__(self, model: torch.nn.Module, config: ContinuousBatchingConfig, peers: RankPeers | None = None) -> None:
        """`peers`: the other tensor-parallel ranks when `model` is one rank's shard
        (engine/tensor_parallel.py): the KV cache holds the rank's heads, rank 0's sizes are every
        rank's, rank 0 sends each step's inputs to the others before its forward, and only rank 0
        computes logits."""
        self.model, self.config, self.peers = model, config, peers
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if config.cpu_packed_weights and self.device.type != "cpu":
            raise ValueError(f"cpu_packed_weights needs a model on the CPU, this one is on {self.device}")
        text_config = model.config.get_text_config()
        self.max_context: int | None = getattr(text_config, "max_position_embeddings", None)
        num_layers, num_kv_heads, head_dim = kv_geometry(text_config)
        world = peers.world if peers else 1
        num_kv_heads //= world  # a rank's share (tensor_parallel.check_divisible made it whole)
        self.backend = get_backend(self.device, config.attn_backend)
        self.block_size: int = config.block_size or DEFAULT_BLOCK_SIZE.get(self.device.type, 256)
        self.backend.check_config(self.block_size)
        self.graph_flags = normalize_cuda_graph_flag(config.use_cuda_graph, self.device.type, self.backend.supports_graphs)
        extra_blocks = reserved_blocks(self.graph_flags)  # the padding block of graphs, never handed out
        swaps = self.module_swaps()  # before sizing: packed weights take memory
        # ranks sharing one host's memory plan for all of them: the whole model's KV heads
        plan_heads = num_kv_heads * world if self.device.type == "cpu" else num_kv_heads
        self.sizes: CachePlan = self._plan(num_layers, plan_heads, head_dim, extra_blocks)
        if peers:
            own, self.sizes = self.sizes, peers.share_sizes(self.sizes)  # rank 0's, on every rank
            if own.bytes_per_block != self.sizes.bytes_per_block:  # another dtype or model than rank 0's
                raise ValueError(f"tensor parallel: rank {peers.rank} holds {self.dtype} KV blocks of "
                                 f"{own.bytes_per_block} bytes, rank 0 blocks of {self.sizes.bytes_per_block}: every "
                                 "host must load the same model with the same --dtype")  # fmt: skip
        self.async_batching = self.takes_async_batching(bool(config.use_async_batching))  # what the engine runs
        logger.info("cbserve engine: %s", self.placement_line())
        self.cache = PagedKVCache(num_layers, self.sizes.num_blocks + extra_blocks, self.block_size, num_kv_heads,
                                  head_dim, self.dtype, self.device)  # fmt: skip
        self.runner = ModelRunner(model, self.cache, self.backend, swaps)
        self.runner.computes_logits = peers is None or peers.rank == 0  # only rank 0 samples
        self.runner.native = self.native_forward()
        self.dispatch = StepDispatcher.from_config(
            self.runner.forward, config, self.backend, self.device, graph_flags=self.graph_flags,
            block_size=self.block_size, num_blocks=self.sizes.num_blocks, max_requests=self.sizes.max_requests,
            max_batch_tokens=self.sizes.max_batch_tokens, max_context=self.max_context,
        )  # fmt: skip
        self.sampler = Sampler(config.seed, argmax=self.backend.argmax, logprobs_mode=config.logprobs_mode,
                               race=self.backend.sample_race, logsumexp=self.backend.logsumexp)  # fmt: skip
        self.last_times = {"prepare": 0.0, "sample": 0.0}  # of the last launch (the engine times the rest)
        self._graph_weights: list[int] | None = None  # the weights' addresses when graphs were captured

    def placement(self) -> dict:
        """Where the engine runs and how big its KV cache is."""
        return {"device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                "attn_backend": self.backend.name,
                "attention_backend": self.backend.kernel or self.backend.name, "block_size": self.block_size,
                "kv_cache_blocks": self.sizes.num_blocks, "kv_cache_tokens": self.sizes.num_tokens,
                "kv_cache_bytes": self.sizes.cache_bytes,
                "tensor_parallel_size": self.peers.world if self.peers else 1,
                "use_async_batching": self.async_batching,  # as run: asked for, and not turned down (the CPU)
                # a GGUF model's weights: which kinds kept their blocks and the probe that chose (gguf_loader)
                "quantization": getattr(self.model, "cbserve_quantization", {"setting": "none"})}  # fmt: skip

    def placement_line(self) -> str:
        """The start-up log line: device, dtype, attention backend, then the sizes chosen."""
        p = self.placement()
        ranks = f" (rank {self.peers.rank} of {self.peers.world})" if self.peers else ""
        return (f"device {p['device']}{ranks}, dtype {p['dtype']}, attention {p['attention_backend']}; "
                f"{self.sizes.summary()}")

    # -- what a device adds ---------------------------------------------------------------------
    def takes_async_batching(self, asked: bool) -> bool:
        """Whether the engine runs async batching (`use_async_batching`): as asked, by default."""
        return asked

    def module_swaps(self) -> list[ModuleSwaps]:
        """Replacement forwards active only inside the engine's forwards (the CPU's packed linears and
        fused passes); none by default."""
        return []

    def native_forward(self) -> NativeForward | None:
        """A forward of whole steps outside transformers' modules (the CPU's native decoder stack);
        none by default."""
        return None

    def weights_replaced(self) -> None:
        """The model's weights changed (in place, or new tensors): refresh what was made of them. Graphs
        captured over tensors that are no longer the model's are captured again (in-place changes keep
        the graphs: they read the same memory)."""
        if self.weights_moved():
            logger.info("cbserve: the model's weights are new tensors: capturing its CUDA graphs again")
            self.dispatch.recapture()
            self._graph_weights = self._weight_ptrs()

    def weights_moved(self) -> bool:
        """Captured graphs read weights that are no longer the model's (tensors replaced, not changed
        in place); checked each step only while graphs are captured."""
        return self._graph_weights is not None and self._weight_ptrs() != self._graph_weights

    def _weight_ptrs(self) -> list[int]:
        return [p.data_ptr() for p in self.model.parameters()]

    # -- sizing -----------------------------------------------------------------------------------
    def _plan(self, num_layers: int, num_kv_heads: int, head_dim: int, extra_blocks: int) -> CachePlan:
        """Blocks, token budget and request cap: from the config, else from the memory free now."""
        cfg, model, device = self.config, self.model, self.device
        bytes_per_block = kv_bytes_per_block(num_layers, num_kv_heads, head_dim, self.block_size, self.dtype)
        peak = 0
        if cfg.num_blocks is None:  # a full step without a cache (all tokens, every row sampled) on accelerators
            tokens = cfg.max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS.get(device.type, 2048)
            rows = min(cfg.max_requests_per_batch or DEFAULT_MAX_REQUESTS, tokens)
            forward_peak = profile_activation_peak(device, profile_forward(model, tokens, rows, self.max_context, device))
            if device.type != "cpu":  # on the CPU the cache is capped far below the memory instead
                vocab = model.config.get_text_config().vocab_size
                peak = step_reserve_bytes(forward_peak, rows, vocab, any(self.graph_flags))
        plan = plan_for_device(
            read_device_memory(device, cpu_cap_bytes=int(cfg.cpu_kv_cache_space * GiB)),
            cfg.max_memory_percent,
            bytes_per_block,
            self.block_size,
            activation_peak_bytes=peak,
            max_batch_tokens=cfg.max_batch_tokens,
            max_requests=cfg.max_requests_per_batch,
            num_blocks=cfg.num_blocks,
            reserved_blocks=extra_blocks,
        )
        plan, cut = cap_layer_elements(plan, self.backend.max_layer_elements, num_kv_heads, head_dim, extra_blocks,
                                       explicit=cfg.num_blocks is not None)  # fmt: skip
        if cut:
            logger.info("cbserve engine: %s", cut)
        return plan

    # -- per step ---------------------------------------------------------------------------------
    def warmup(self) -> None:
        """Capture what the device captures ahead of time (every graph); nothing on the CPU. Rank 0 of a
        tensor-parallel engine has the other ranks capture theirs with it (their forwards all-reduce
        together)."""
        if self.peers and self.peers.rank == 0 and any(self.graph_flags):
            self.peers.send_warmup()
        self.dispatch.warmup()
        self._graph_weights = self._weight_ptrs() if self.dispatch.captured else None

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, default_logprobs: bool = False, feed: PendingSample | None = None
               ) -> PendingSample:  # fmt: skip
        """Copy-on-write copies, one forward over the batch's tokens (in eval mode), and the sampled tokens
        of `batch.samples` (siblings of n > 1 sample from their parent's row), left on the device until
        `.result()`: on CUDA the forward and the sampling are queued and this returns before they run. A
        batch scheduled ahead (`batch.ahead`, async batching) takes its input tokens from `feed`, the step
        before's tokens, on the device: its row `batch.feed_rows[i]` is row i's input."""
        rows = list(dict.fromkeys(batch.sample_rows))  # each row's logits once
        step = StepInputs.of(batch, rows)
        input_ids = None
        if batch.ahead:
            if feed is None:
                raise ValueError("a batch scheduled ahead needs the step before's tokens (feed)")
            rows_fed = batch.feed_rows
            if len(rows_fed) == feed.tokens.shape[0] and rows_fed == list(range(len(rows_fed))):
                input_ids = feed.tokens  # every row of the step before, in order: no gather
            else:
                input_ids = feed.tokens.index_select(0, to_device(torch.tensor(rows_fed), feed.tokens.device))
        send = None  # tensor parallel: the other ranks run the same step (engine/tp_worker.py), told its route
        if (peers := self.peers) is not None:

            def send(meta: AttentionMetadata) -> None:
                peers.send_step(step, self.dispatch.route(meta, len(step.token_ids)))

        if step.copies:
            self.cache.copy_blocks(step.copies)
        modes = None
        if self.model.training:  # an RL trainer switches train() on between generations
            modes = [m.training for m in self.model.modules()]
            self.model.eval()
        try:
            logits = self.runner.run(step, self.dispatch, send, input_ids)
        finally:
            if modes is not None:
                restore_modes(self.model, modes)
        if len(rows) != len(batch.sample_rows):
            where = {row: i for i, row in enumerate(rows)}
            order = to_device(torch.tensor([where[row] for row in batch.sample_rows]), logits.device)
            logits = logits.index_select(0, order)  # a Python list as the index would wait for a copy
        t1 = time.perf_counter()
        result = self.sampler.sample(logits, batch.samples, default_logprobs)
        t2 = time.perf_counter()
        self.last_times = {"prepare": self.runner.last_prepare_s, "sample": t2 - t1}
        return result

    @torch.inference_mode()
    def execute_inputs(self, step: StepInputs, route: Route) -> None:
        """A tensor-parallel rank other than 0: rank 0's step on this rank's shard (no logits, no sampling:
        the runner computes none), by rank 0's `route`. A rank that would run it another way (another
        graph, or eagerly where rank 0 replays one) is out of lockstep: a RuntimeError, before any
        collective."""
        if step.copies:
            self.cache.copy_blocks(step.copies)

        def agree(meta: AttentionMetadata) -> None:
            mine = self.dispatch.route(meta, len(step.token_ids))
            if mine != route:
                raise RuntimeError(f"tensor-parallel ranks out of lockstep: rank 0 runs a step by route {route}, "
                                   f"this rank by {mine} (engine/backends/step_dispatch.py)")

        self.runner.run(step, self.dispatch, agree)
