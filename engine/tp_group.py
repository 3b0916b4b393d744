"""The ranks of one tensor-parallel engine, and what crosses between them.

Rank 0 is the engine itself (scheduler, sampling, the server); ranks 1..N-1 run `engine.tp_worker`,
spawned on this host or started by `cbserve worker` on others. They meet at a torch.distributed
TCPStore on rank 0 and open two process groups over it:

- "step": the all-reduce after each row-parallel layer of every forward (gloo on the CPU, NCCL on
  GPUs), with `cpu_group_timeout` as its timeout;
- "control" (gloo, no practical timeout: ranks wait there while the server is idle): rank 0's
  messages as tensors (engine/tp_messages.py): the KV-cache sizes once at start-up, then each
  step's inputs, a warm-up (capture the graphs) and a stop.

`TPGroup` is what an executor of a rank is handed as its `RankPeers` (engine/backends/executor.py);
engine/tp_worker.py starts the ranks and runs their executors.

A rank that dies closes its sockets, and the next collective on the others fails at once; rank 0
also watches the processes it spawned, so a death while idle is noticed too. Either way the group is
broken for good: `GroupBroken` from then on, and the server exits non-zero.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from engine import tp_messages as messages
from engine.backends.memory import CachePlan
from engine.backends.step_dispatch import Route
from engine.model_runner import StepInputs

logger = logging.getLogger("cbserve.engine")

IDLE_TIMEOUT = timedelta(days=365)  # the control group: an idle server sends nothing for hours
JOIN_POLL_S = 0.2  # while waiting for ranks to join, how often rank 0 looks at the processes it spawned
# how long ranks wait for each other to come: pods of a group start apart (scheduling, image pulls)
JOIN_TIMEOUT = timedelta(minutes=30)


class GroupBroken(RuntimeError):
    """A rank of the tensor-parallel group is gone (or never came): the engine cannot step any more."""


@dataclass
class Launch:
    """How rank 0 starts and meets the other ranks (`ContinuousBatchingManager(..., tensor_parallel=)`).

    `load`: a picklable callable that returns the model in a spawned rank (the server passes its
    loader: each rank reads the checkpoint itself); None sends the model's class, config and tensors
    (through shared memory: engine/tp_worker.ModelCopy). `nnodes` > 1: ranks beyond this host's come
    from `cbserve worker` on other hosts, which reach rank 0 at `addr:port`. `device`: "cpu" or "cuda"
    for the ranks' shards; None: the model's device type."""

    load: Callable[[], torch.nn.Module] | None = None
    nnodes: int = 1
    addr: str = "127.0.0.1"
    port: int = 0  # 0: any free port (one host only)
    device: str | None = None


@dataclass
class TPGroup:
    rank: int
    world: int
    store: Any
    step_group: Any
    control: Any
    processes: list[Any] = field(default_factory=list)  # spawned by rank 0, with their ranks
    failure: str | None = None
    on_failure: list[Callable[[str], None]] = field(default_factory=list)
    threads_before: int | None = None  # rank 0's torch threads before the group took its share
    closing: bool = False

    # -- collectives --------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum `t` across the ranks, in place (a row-parallel layer's partial outputs)."""
        try:
            self.step_group.allreduce([t]).wait()
        except RuntimeError as exc:
            raise self.broken(f"an all-reduce failed: {exc}") from None

    # -- rank 0's messages (engine/tp_messages.py) -------------------------------------------
    def _send(self, *tensors: torch.Tensor) -> None:
        try:
            for t in tensors:
                self.control.broadcast(t, 0).wait()
        except RuntimeError as exc:
            raise self.broken(f"a message from rank 0 failed: {exc}") from None

    def _receive(self, t: torch.Tensor) -> torch.Tensor:
        try:
            self.control.broadcast(t, 0).wait()
        except RuntimeError as exc:
            raise self.broken(f"a message from rank 0 failed: {exc}") from None
        return t

    def share_sizes(self, sizes: CachePlan) -> CachePlan:
        """Rank 0's KV-cache sizes, on every rank."""
        if self.rank == 0:
            self._send(messages.encode_sizes(sizes))
            return sizes
        return messages.decode_sizes(self._receive(torch.empty(messages.HEADER, dtype=torch.int64)))

    def send_step(self, step: StepInputs, route: Route) -> None:
        """Rank 0: the step the other ranks run with it, and its route (a header, then one int32 body)."""
        self.check()
        self._send(*messages.encode_step(step, route))

    def send_warmup(self) -> None:
        """Rank 0: the other ranks capture their graphs now, with it."""
        self.check()
        self._send(messages.header(messages.Kind.WARMUP))

    def receive(self) -> tuple[StepInputs, Route] | messages.Kind:
        """A rank other than 0: rank 0's next message, a step and its route, or its kind (WARMUP, STOP)."""
        head = self._receive(torch.empty(messages.HEADER, dtype=torch.int64))
        kind = messages.Kind(int(head[0]))
        if kind != messages.Kind.STEP:
            return kind
        body = self._receive(torch.empty(messages.body_size(head), dtype=torch.int32))
        return messages.decode_step(head, body)

    # -- failure ------------------------------------------------------------------------------
    def broken(self, reason: str) -> GroupBroken:
        """Record the first failure, tell whoever listens, and return the error to raise. A failed
        collective names the spawned rank that exited, when one did."""
        reason = reason.split(". This is typically")[0]  # gloo's advice after its one-line cause
        # a peer that closed its sockets is exiting: its exit code names the cause (on a loaded host
        # the exit can follow the closed socket by seconds, so wait for the first one, up to 10 s)
        running = {p.sentinel: (rank, p) for rank, p in self.processes if p.exitcode is None}
        exited = [(rank, p) for rank, p in self.processes if p.exitcode is not None]
        if not exited and running:
            exited = [running[s] for s in multiprocessing.connection.wait(list(running), timeout=10.0)]
        if exited:
            rank, p = exited[0]
            p.join(1.0)
            reason = f"rank {rank} exited with code {p.exitcode} ({reason})"
        if self.failure is None:
            self.failure = reason
            logger.error("tensor-parallel group broken: %s", reason)
            for callback in self.on_failure:
                callback(reason)
        return GroupBroken(f"tensor-parallel group broken: {self.failure}")

    def check(self) -> None:
        if self.failure is not None:
            raise GroupBroken(f"tensor-parallel group broken: {self.failure}")

    def close(self, wait_s: float = 30.0) -> None:
        """Rank 0: tell the other ranks to stop and wait for the ones it spawned (killed after `wait_s`)."""
        if self.rank != 0 or self.closing:
            return
        self.closing = True
        if self.failure is None and self.control is not None:
            try:
                self._send(messages.header(messages.Kind.STOP))
            except GroupBroken:
                pass
        for _, p in self.processes:
            p.join(wait_s)
            if p.exitcode is None:
                p.kill()
                p.join()
        if self.threads_before is not None:
            torch.set_num_threads(self.threads_before)


def _watch(ref: weakref.ref, processes: list[tuple[int, Any]]) -> None:
    """Rank 0's watcher thread: the first spawned rank that exits breaks the group. It holds the group
    weakly, so an engine dropped without close() can still be collected (and its ranks killed)."""
    sentinels = {p.sentinel: (rank, p) for rank, p in processes}
    ready = multiprocessing.connection.wait(list(sentinels))
    group = ref()
    if group is None or group.closing:
        return
    rank, p = sentinels[ready[0]]
    p.join(1.0)
    group.broken(f"rank {rank} exited with code {p.exitcode}")


def _kill(processes: list[Any]) -> None:
    for p in processes:
        if p.exitcode is None:
            p.kill()


def _gloo(store: Any, rank: int, world: int, timeout: timedelta) -> Any:
    """A gloo group on the interface GLOO_SOCKET_IFNAME names (torch's variable), else on the address
    this host's name resolves to (gloo's default)."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if not interface:
        return dist.ProcessGroupGloo(store, rank, world, timeout)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(interface=name) for name in interface.split(",")]
    return dist.ProcessGroupGloo(store, rank, world, options)


def _groups(store: Any, rank: int, world: int, timeout: timedelta, device_type: str) -> tuple[Any, Any]:
    control = _gloo(dist.PrefixStore("control", store), rank, world, IDLE_TIMEOUT)
    if device_type == "cuda":  # lazy: NCCL only on GPUs
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        step = dist.ProcessGroupNCCL(dist.PrefixStore("step", store), rank, world, options)
    else:
        step = _gloo(dist.PrefixStore("step", store), rank, world, timeout)
    return step, control


def join(rank: int, world: int, addr: str, port: int, timeout_s: float | None, device_type: str) -> TPGroup:
    """A rank other than 0: meet rank 0's store and open the groups."""
    timeout = timedelta(seconds=timeout_s or 1800)
    store = dist.TCPStore(addr, port, world, False, timeout=JOIN_TIMEOUT)
    store.set(f"joined/{rank}", "1")
    step, control = _groups(store, rank, world, timeout, device_type)
    return TPGroup(rank, world, store, step, control)


def start(world: int, launch: Launch, timeout_s: float | None, device_type: str,
          spawn: Callable[[int, str, int], Any]) -> TPGroup:  # fmt: skip
    """Rank 0: open the store, spawn this host's other ranks with `spawn(rank, addr, port)` (a started
    process), wait until every rank has joined (a spawned one that exits first is a GroupBroken
    naming its code; ranks of other hosts get JOIN_TIMEOUT), and open the groups."""
    timeout = timedelta(seconds=timeout_s or 1800)
    host = "0.0.0.0" if launch.nnodes > 1 else launch.addr
    store = dist.TCPStore(host, launch.port, world, True, timeout=JOIN_TIMEOUT, wait_for_workers=False)
    per_node = world // launch.nnodes
    group = TPGroup(0, world, store, None, None)
    group.processes = [(rank, spawn(rank, launch.addr, store.port)) for rank in range(1, per_node)]
    waiting = [f"joined/{rank}" for rank in range(1, world)]
    deadline = JOIN_TIMEOUT.total_seconds()
    waited = 0.0
    while not store.check(waiting):
        dead = [(rank, p) for rank, p in group.processes if p.exitcode is not None]
        if dead:
            rank, p = dead[0]
            group.close()
            raise GroupBroken(f"tensor-parallel rank {rank} exited with code {p.exitcode} before joining")
        if waited >= deadline:
            group.close()
            missing = [key.split("/")[1] for key in waiting if not store.check([key])]
            raise GroupBroken(f"tensor-parallel ranks {', '.join(missing)} did not join within {deadline:.0f} s "
                              f"(rank 0 at {launch.addr}:{store.port})")
        multiprocessing.connection.wait([p.sentinel for _, p in group.processes], timeout=JOIN_POLL_S) \
            if group.processes else threading.Event().wait(JOIN_POLL_S)  # fmt: skip
        waited += JOIN_POLL_S
    try:
        group.step_group, group.control = _groups(store, 0, world, timeout, device_type)
    except RuntimeError:
        group.close(wait_s=0.0)  # the others wait for rank 0 in vain: stop them now
        raise
    if group.processes:
        threading.Thread(target=_watch, args=(weakref.ref(group), list(group.processes)), name="cbserve-tp-watch",
                         daemon=True).start()  # fmt: skip
        # an engine dropped without close(): its ranks go with it, not at interpreter exit
        weakref.finalize(group, _kill, [p for _, p in group.processes])
    logger.info("cbserve: tensor parallel over %d ranks (%d on this host), rank 0 at %s:%d", world, per_node,
                launch.addr, store.port)  # fmt: skip
    return group
