"""Graphs under tensor parallel: every rank captures the same graphs in the same order when rank 0
warms up, and each step rank 0 names its route (which graph it replays), which the other ranks
check against their own before any collective.

Two ranks' executors in one process, rank 0's messages handed to rank 1 at once through the wire
format (engine/tp_messages.py), graphs captured and replayed by the eager stand-in. Their all-reduce
does nothing here (no process group): the tokens are not the model's, only the lockstep is tested;
tests/engine/test_tensor_parallel.py holds real ranks to model.generate.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.backends.cuda import SDPACudaBackend
from engine.backends.executor import Executor
from engine.backends.executors import make_executor
from engine.backends.memory import CachePlan
from engine.backends.step_dispatch import DECODE_GRAPH, VARLEN_GRAPH, Route, StepDispatcher, graph_table_width
from engine.config import ContinuousBatchingConfig
from engine.kv_cache import PagedKVCache, kv_geometry
from engine.llm_engine import LLMEngine
from engine.model_runner import StepInputs
from engine.tensor_parallel import shard_model
from engine.testing import build_test_model, random_prompts
from engine.tp_messages import decode_step, encode_step
from tests.gpu.helpers import EagerCapturer

CONFIG = ContinuousBatchingConfig(block_size=16, num_blocks=64, max_batch_tokens=96, max_requests_per_batch=4)


@dataclasses.dataclass
class RankPeers:
    """Rank `rank` of two. Rank 0's hands every message to `other` (rank 1's executor) at once."""

    rank: int
    world: int = 2
    other: Executor | None = None
    forward_warmup: bool = True
    routes: list[Route] = dataclasses.field(default_factory=list)

    def share_sizes(self, sizes: CachePlan) -> CachePlan:
        return sizes

    def send_step(self, step: StepInputs, route: Route) -> None:
        step, route = decode_step(*encode_step(step, route))
        self.routes.append(route)
        self.other.execute_inputs(step, route)

    def send_warmup(self) -> None:
        if self.forward_warmup:
            self.other.warmup()


def graphed(executor: Executor) -> Executor:
    """The executor with a cache holding the padding block and both kinds of graphs, captured by the
    eager stand-in, over its runner's own forward (rank 1's computes no logits, in graphs too)."""
    n, bs = executor.sizes.num_blocks, executor.block_size
    layers, hkv, hd = kv_geometry(executor.model.config)
    executor.cache = executor.runner.cache = PagedKVCache(layers, n + 1, bs, hkv // 2, hd, executor.dtype)
    executor.backend = executor.runner.backend = SDPACudaBackend()
    executor.graph_flags = (True, True)
    executor.dispatch = StepDispatcher(
        executor.runner.forward, graph_flags=(True, True), device="cpu", max_requests=executor.sizes.max_requests,
        max_batch_tokens=executor.sizes.max_batch_tokens, max_blocks_per_seq=graph_table_width(n, bs, executor.max_context),
        block_size=bs, pad_block=n, capturer=EagerCapturer(),
    )  # fmt: skip
    return executor


def two_ranks(forward_warmup: bool = True) -> tuple[LLMEngine, RankPeers, Executor, Executor]:
    """An engine whose executor is rank 0's of two, and rank 1's executor behind it."""
    model = build_test_model("llama", vocab_size=512)
    rank1 = graphed(make_executor(shard_model(model, 1, 2, lambda t: None), CONFIG, RankPeers(1)))
    peers = RankPeers(0, other=rank1, forward_warmup=forward_warmup)
    rank0 = graphed(make_executor(shard_model(model, 0, 2, lambda t: None), CONFIG, peers))
    engine = LLMEngine(model, CONFIG)
    engine.executor = rank0
    engine.warmup()
    return engine, peers, rank0, rank1


def serve(engine: LLMEngine) -> None:
    for p in random_prompts(6, 3, 120, 512, seed=3):
        engine.add_request(engine.make_request(p, max_new_tokens=12, ignore_eos=True))
    with torch.inference_mode():
        while engine.has_unfinished():
            engine.step()


def test_ranks_capture_the_same_graphs_in_order_and_replay_the_graph_rank_0_names() -> None:
    engine, peers, rank0, rank1 = two_ranks()
    for kind in ("graphs", "varlen_graphs"):
        keys = list(getattr(rank0.dispatch, kind).graphs)
        assert keys and keys == list(getattr(rank1.dispatch, kind).graphs), kind  # the same keys, in order
    serve(engine)
    kinds = {route[0] for route in peers.routes}
    assert {DECODE_GRAPH, VARLEN_GRAPH} <= kinds  # both kinds of graphs replayed
    replays = sum(route[0] in (DECODE_GRAPH, VARLEN_GRAPH) for route in peers.routes)
    assert rank0.dispatch.replays == rank1.dispatch.replays == replays
    bucket = next(iter(rank1.dispatch.graphs.graphs))
    assert rank1.dispatch.graphs.graphs[bucket].output.shape[0] == 0  # rank 1's graphs compute no logits
    assert rank0.dispatch.graphs.graphs[bucket].output.shape[0] == bucket


def test_a_rank_that_would_run_a_step_another_way_stops_before_its_forward() -> None:
    engine, _, _, rank1 = two_ranks(forward_warmup=False)  # rank 1 captured nothing
    assert not rank1.dispatch.captured
    with pytest.raises(RuntimeError, match="out of lockstep"):
        serve(engine)
