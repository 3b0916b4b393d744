"""The ranks of a tensor-parallel engine: rank 0's start, and the loop of every other rank.

`start_tensor_parallel` is rank 0's (the engine's process): it checks that the model splits, starts
and meets the other ranks (engine/tp_group.py) and takes rank 0's shard (engine/tensor_parallel.py).

`run_rank` is what every other rank runs: spawned by rank 0 on its own host (`spawned`), or started
by `cbserve worker` on another host. It joins the group, takes its shard (from a checkpoint's
safetensors files it reads only its slices: `ShardSource`), builds the executor as rank 0 does (the
same start-up forward, then rank 0's cache sizes), and runs each step rank 0 sends until told to
stop. It returns 0 on a stop, and any failure (rank 0 gone, a failed collective) ends the process
with status 1: nothing waits on a broken group.

The group drives the executors: an executor (engine/backends/executor.py) runs one rank and is
handed the group only as its `RankPeers`.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from engine import tp_group
from engine.backends.executors import make_executor
from engine.tensor_parallel import AllReduce, check_divisible, resolve_plan, shard_model
from engine.tp_group import Launch, TPGroup
from engine.tp_messages import Kind

logger = logging.getLogger("cbserve.engine")


@dataclass
class ModelCopy:
    """A model object sent to a spawned rank: its class, config and tensors (their memory shared with
    the caller's through torch.multiprocessing), rebuilt there without running its initialisation.
    Pickling the module itself would also send whatever the caller hung on it."""

    cls: type
    config: Any
    tensors: dict[str, torch.Tensor]  # parameters (tied ones under each name) and buffers, by name

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelCopy:
        tensors = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
        tensors.update((n, b) for n, b in model.named_buffers(remove_duplicate=False))
        return cls(type(model), model.config, tensors)

    def __call__(self) -> torch.nn.Module:
        with torch.device("meta"):
            model = self.cls._from_config(self.config)
        params = dict(model.named_parameters(remove_duplicate=False))
        for name, t in self.tensors.items():
            owner, _, leaf = name.rpartition(".")
            module = model.get_submodule(owner)
            if name in params:
                module._parameters[leaf] = torch.nn.Parameter(t, requires_grad=False)
            else:
                module._buffers[leaf] = t
        return model.eval()


def rank_device(device_type: str, rank: int, ranks_per_node: int) -> torch.device:
    """The rank's device: its own GPU on its host (cuda:<rank within the host>), or the CPU."""
    return torch.device("cuda", rank % ranks_per_node) if device_type == "cuda" else torch.device("cpu")


@runtime_checkable
class ShardSource(Protocol):
    """A `Launch.load` that can give one rank's shard without the whole model (engine/loader.ModelSource
    reads only the rank's slices of a safetensors checkpoint)."""

    def shard(self, rank: int, world: int, all_reduce: AllReduce, device: torch.device) -> torch.nn.Module: ...


def run_rank(source: Callable[[], torch.nn.Module], config, rank: int, world: int, addr: str,
             port: int, device_type: str, ranks_per_node: int) -> int:  # fmt: skip
    device = rank_device(device_type, rank, ranks_per_node)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = tp_group.join(rank, world, addr, port, config.cpu_group_timeout, device.type)
    if isinstance(source, ShardSource):
        shard = source.shard(rank, world, group.all_reduce, device)
    else:
        model = source()
        shard = shard_model(model, rank, world, group.all_reduce, device)
        del model
    del source
    executor = make_executor(shard, config, group)
    logger.info("cbserve: tensor-parallel rank %d of %d ready on %s", rank, world, device)
    while (message := group.receive()) is not Kind.STOP:
        if isinstance(message, tuple):
            executor.execute_inputs(*message)  # the step, by rank 0's route
        elif message is Kind.WARMUP:
            executor.warmup()  # rank 0 captures the same graphs, in the same order, now
    return 0


def exit_with_parent(rank: int) -> None:
    """End this spawned rank when the process that started it is gone (SIGKILL, the OOM killer), whatever
    the rank is waiting on: joining a group whose rank 0 never listens would otherwise hold the model's
    memory until the join times out (30 minutes). multiprocessing's parent sentinel is a pipe whose
    other end only the parent holds, so it reads EOF when the parent dies."""
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        logger.error("tensor-parallel rank %d stops: the process that started it (pid %s) is gone", rank, parent.pid)
        sys.stderr.flush()
        os._exit(1)

    threading.Thread(target=watch, name=f"cbserve-tp-rank-{rank}-parent", daemon=True).start()
    logger.info("cbserve: tensor-parallel rank %d started; it ends with the process that started it (pid %s)",
                rank, parent.pid)


def spawned(source, config, rank: int, world: int, addr: str, port: int, device_type: str,
            ranks_per_node: int, log_level: int) -> None:  # fmt: skip
    """The target of a rank spawned by rank 0 (engine/tp_group.py) or by `cbserve worker`: exit 0 on a
    stop, 1 on a failure. Ctrl-C and SIGTERM reach a terminal's or a timeout's whole process group:
    a rank leaves its stop to rank 0 (which drains its requests first) or to the group breaking."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")
    exit_with_parent(rank)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # one "Loading weights" bar per rank says nothing new
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_per_node))
    try:
        code = run_rank(source, config, rank, world, addr, port, device_type, ranks_per_node)
    except Exception as exc:  # noqa: BLE001 - a rank's failure is its exit status and one log line
        logger.error("tensor-parallel rank %d stops: %s: %s", rank, type(exc).__name__, exc)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: a broken group's threads must not hold the exit


def start_tensor_parallel(model: torch.nn.Module, config: Any, launch: Launch) -> tuple[TPGroup, torch.nn.Module]:
    """Rank 0 of an engine with config.tensor_parallel_size ranks: check that the model splits, start
    and meet the other ranks, and return the group and rank 0's shard: split from `model`, or, when
    its parameters are on the meta device (`cbserve serve` reads no weights for rank 0), read by
    `launch.load`. Each rank of a host gets an equal share of its CPU threads."""
    world = config.tensor_parallel_size
    check_divisible(model.config, world)  # before any process starts: the errors are the caller's
    _, plan_source = resolve_plan(model)
    if launch.nnodes < 1 or world % launch.nnodes:
        raise ValueError(f"tensor_parallel_size {world} must be a multiple of the number of nodes ({launch.nnodes})")
    if config.cpu_offload_space:
        raise ValueError("cpu_offload_space needs tensor_parallel_size 1: preempted requests are recomputed "
                         "under tensor parallel (each rank would swap its own share)")
    per_node = world // launch.nnodes
    unread = next(model.parameters()).is_meta  # cbserve serve's: the checkpoint's model, its weights not read
    shards = launch.load if isinstance(launch.load, ShardSource) else None
    if unread and shards is None:
        raise ValueError("a model on the meta device needs a Launch.load that reads each rank's shard")
    device_type = launch.device or ("cpu" if unread else next(model.parameters()).device.type)
    source = launch.load or ModelCopy.of(model)
    ctx = torch.multiprocessing.get_context("spawn")
    level = logging.getLogger("cbserve").getEffectiveLevel()

    def spawn(rank: int, addr: str, port: int) -> Any:
        p = ctx.Process(target=spawned, name=f"cbserve-tp-rank-{rank}", daemon=True,
                        args=(source, config, rank, world, addr, port, device_type, per_node, level))  # fmt: skip
        p.start()
        return p

    group = tp_group.start(world, launch, config.cpu_group_timeout, device_type, spawn)
    try:
        if device_type == "cpu":
            group.threads_before = torch.get_num_threads()
            threads = max(1, group.threads_before // per_node)
            torch.set_num_threads(threads)
            logger.info("cbserve: %d CPU thread(s) per rank", threads)
        device = rank_device(device_type, 0, per_node)
        if unread and shards is not None:  # rank 0 reads its shard as the others do
            shard = shards.shard(0, world, group.all_reduce, device)
        else:
            shard = shard_model(model, 0, world, group.all_reduce, device)
    except BaseException:
        group.close()
        raise
    logger.info("cbserve: shards split by %s's tensor-parallel plan", "cbserve" if plan_source == "cbserve" else "the model")
    return group, shard
