"""A tensor-parallel rank other than 0: its shard of the model, its share of the KV cache, and a loop
that runs rank 0's steps.

`run_rank` is what every such rank runs: spawned by rank 0 on its own host (`spawned`), or started by
`cbserve worker` on another host. It joins the group (engine/tp_group.py), takes its shard
(engine/tensor_parallel.py), builds the executor as rank 0 does (the same start-up forward, then rank
0's cache sizes), and runs each step rank 0 sends until told to stop. It returns 0 on a stop, and any
failure (rank 0 gone, a failed collective) ends the process with status 1: nothing waits on a broken
group.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

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


def run_rank(source: Callable[[], torch.nn.Module], config, rank: int, world: int, addr: str,
             port: int, device_type: str, ranks_per_node: int) -> int:  # fmt: skip
    from engine import tp_group
    from engine.backends import make_executor
    from engine.tensor_parallel import shard_model

    device = rank_device(device_type, rank, ranks_per_node)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = tp_group.join(rank, world, addr, port, config.cpu_group_timeout, device.type)
    model = source()
    shard = shard_model(model, rank, world, group.all_reduce, device)
    del model, source
    executor = make_executor(shard, config, group)
    logger.info("cbserve: tensor-parallel rank %d of %d ready on %s", rank, world, device)
    while (step := group.broadcast()) is not None:
        executor.execute_inputs(step)
    return 0


def spawned(source, config, rank: int, world: int, addr: str, port: int, device_type: str,
            ranks_per_node: int, log_level: int) -> None:  # fmt: skip
    """The target of a rank spawned by rank 0 (engine/tp_group.py) or by `cbserve worker`: exit 0 on a
    stop, 1 on a failure. Ctrl-C and SIGTERM reach a terminal's or a timeout's whole process group:
    a rank leaves its stop to rank 0 (which drains its requests first) or to the group breaking."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")
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
