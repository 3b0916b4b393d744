"""Tensor parallel on the CPU: two gloo ranks, the second spawned by the engine under test.

Greedy output is token-identical to transformers' model.generate (and so to the one-process engine,
which the other engine tests hold to the same reference) for every test architecture, under
chunked prefill, preemption and prefix hits; a rank that dies or never comes ends the engine with an
error that names it, never a hang.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine import ContinuousBatchingConfig, ContinuousBatchingManager, LLMEngine
from engine.backends.executors import make_executor
from engine.backends.memory import CachePlan
from engine.backends.step_dispatch import DECODE_GRAPH, VARLEN, VARLEN_GRAPH, Route
from engine.loader import ModelSource
from engine.model_runner import StepInputs
from engine.request import RequestStatus
from engine.shard_loader import empty_model
from engine.tensor_parallel import resolve_plan, shard_model
from engine.tp_messages import HEADER, body_size, decode_sizes, decode_step, encode_sizes, encode_step
from engine.testing import ARCHITECTURES, build_test_model
from engine.tp_group import GroupBroken, Launch
from tests.engine.conftest import MAX_NEW, VOCAB, model_for, prompts_for, reference

# a small cache and budget: prompts go in chunks, and requests are preempted
TIGHT = dict(block_size=16, num_blocks=16, max_batch_tokens=64, tensor_parallel_size=2)
DEATH_WAIT_S = 60.0  # generous: a rank's death is noticed in well under a second


def run_to_end(engine: LLMEngine, prompts: list[list[int]]) -> list:
    reqs = [engine.make_request(p, max_new_tokens=MAX_NEW, ignore_eos=True) for p in prompts]
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
    return reqs


def check_two_ranks(model, arch: str) -> None:
    engine = LLMEngine(model, ContinuousBatchingConfig(**TIGHT))
    try:
        assert engine.tp is not None and engine.tp.world == 2
        assert engine.cache.k[0].shape[2] == 1  # one of the two KV heads on this rank
        prompts = [list(p) for p in prompts_for()]
        for p, r in zip(prompts, run_to_end(engine, prompts)):
            assert tuple(r.generated_ids) == reference(arch, tuple(p)), r.request_id
        # a shared prefix of three full blocks, asked again after the first request that wrote it
        shared = list(prompts_for(1, 48, 48, seed=7)[0])
        tails = [list(t) for t in prompts_for(3, 2, 9, seed=8)]
        later = [shared + t for t in tails]
        for group in ([later[0]], later[1:]):
            for p, r in zip(group, run_to_end(engine, group)):
                assert tuple(r.generated_ids) == reference(arch, tuple(p)), r.request_id
        stats = engine.stats()
        assert stats["num_preemptions_total"] > 0
        assert stats["prefix_cache_hits_total"] > 0
        assert stats["num_free_blocks"] == stats["num_blocks"]
    finally:
        engine.close()
    assert all(p.exitcode == 0 for _, p in engine.tp.processes)  # told to stop, and stopped


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_two_ranks_match_model_generate_with_chunks_preemption_and_prefix_hits(arch: str) -> None:
    check_two_ranks(model_for(arch), arch)


def test_a_model_without_transformers_plan_is_split_by_projection_names() -> None:
    model = build_test_model("llama", vocab_size=VOCAB, base_model_tp_plan={})
    plan, source = resolve_plan(model)
    assert source == "cbserve"
    assert plan["model.layers.0.self_attn.o_proj"] == "rowwise" and plan["model.layers.1.mlp.up_proj"] == "colwise"
    assert resolve_plan(model_for("llama"))[1] == "transformers"
    check_two_ranks(model, "llama")  # the same weights as model_for("llama"): the same reference


def test_a_shard_holds_its_slice_and_leaves_the_callers_model_whole() -> None:
    model = model_for("qwen2")  # q/k/v biases
    before = {n: p.clone() for n, p in model.named_parameters()}
    shards = [shard_model(model, rank, 2, lambda t: None) for rank in (0, 1)]
    q = "model.layers.0.self_attn.q_proj"
    for rank, shard in enumerate(shards):
        layers = dict(shard.named_modules())
        assert layers[q].weight.shape == (32, 64) and layers[q].out_features == 32
        torch.testing.assert_close(layers[q].weight, model.get_submodule(q).weight[rank * 32 : (rank + 1) * 32])
        torch.testing.assert_close(layers[q].bias, model.get_submodule(q).bias[rank * 32 : (rank + 1) * 32])
        assert layers["model.layers.0.mlp.down_proj"].weight.shape == (64, 64)
        assert shard.lm_head.weight is model.lm_head.weight  # replicated: shared, not copied
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert not model.model.layers[0].mlp.down_proj._forward_hooks  # the hooks are on the shards only


def test_a_step_crosses_as_one_header_and_one_int32_body_without_its_sample_rows() -> None:
    step = StepInputs(token_ids=[5, 6, 7, 8], q_lens=[3, 1], starts=[0, 17], block_tables=[[4], [9, 2]],
                      sample_rows=[0, 1], copies=[(3, 7)])  # fmt: skip
    head, body = encode_step(step, (VARLEN_GRAPH, 64, 4))
    assert head.dtype == torch.int64 and head.shape == (HEADER,) and body.dtype == torch.int32
    assert body.numel() == body_size(head) == 4 + 3 * 2 + 3 + 2  # tokens, 3 per sequence, table entries, a copy
    assert decode_step(head, body) == (dataclasses.replace(step, sample_rows=[]), (VARLEN_GRAPH, 64, 4))
    decode = StepInputs([1, 2], [1, 1], [40, 7], [[3, 1, 4], [5]], [0, 1], [])
    assert decode_step(*encode_step(decode, (DECODE_GRAPH, 2, 0))) == (dataclasses.replace(decode, sample_rows=[]),
                                                                       (DECODE_GRAPH, 2, 0))  # fmt: skip
    sizes = CachePlan(num_blocks=16, block_size=16, max_batch_tokens=64, max_requests=8, bytes_per_block=1 << 20,
                      budget_bytes=1 << 40, free_bytes=3 << 40, activation_peak_bytes=0)  # fmt: skip
    assert decode_sizes(encode_sizes(sizes)) == sizes


def test_rank_0s_messages_cross_a_gloo_group_in_order() -> None:
    """The group's own sending and receiving, two ranks in two threads of this process."""
    from datetime import timedelta

    import torch.distributed as dist

    from engine.tp_group import TPGroup, _groups
    from engine.tp_messages import Kind

    store = dist.HashStore()
    sizes = CachePlan(num_blocks=16, block_size=16, max_batch_tokens=64, max_requests=8, bytes_per_block=4096,
                      budget_bytes=1 << 33, free_bytes=1 << 34, activation_peak_bytes=0)  # fmt: skip
    step = StepInputs([5, 6, 7], [2, 1], [0, 9], [[3], [1, 2]], [0, 1], [(1, 4)])
    got: list = []
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            group = TPGroup(r, 2, store, *_groups(store, r, 2, timedelta(seconds=60), "cpu"))
            if r == 0:
                group.share_sizes(sizes)
                group.send_step(step, (DECODE_GRAPH, 2, 0))
                group.send_warmup()
                group.close()  # a stop
                return
            got.append(group.share_sizes(dataclasses.replace(sizes, num_blocks=1)))
            while (message := group.receive()) is not Kind.STOP:
                got.append(message)
        except BaseException as exc:  # noqa: BLE001 - reported below, on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEATH_WAIT_S)
    assert not errors, errors
    assert got == [sizes, (dataclasses.replace(step, sample_rows=[]), (DECODE_GRAPH, 2, 0)), Kind.WARMUP]


@dataclasses.dataclass
class RankOneOfTwo:
    """The peers of a rank other than 0, with no group behind them (its steps are given to it here)."""

    rank: int = 1
    world: int = 2

    def share_sizes(self, sizes: CachePlan) -> CachePlan:
        return sizes

    def send_step(self, step: StepInputs, route: Route) -> None:
        raise AssertionError("only rank 0 sends steps")

    def send_warmup(self) -> None:
        raise AssertionError("only rank 0 sends a warm-up")


def test_a_rank_other_than_0_runs_the_lm_head_on_no_row() -> None:
    shard = shard_model(model_for("llama"), 1, 2, lambda t: None)
    executor = make_executor(shard, ContinuousBatchingConfig(block_size=16, num_blocks=16, tensor_parallel_size=2),
                             RankOneOfTwo())  # fmt: skip
    rows: list[int] = []
    hook = shard.lm_head.register_forward_hook(lambda mod, args, out: rows.append(out.shape[:-1].numel()))
    step = StepInputs([5, 6, 7, 8, 9], [3, 2], [0, 0], [[0], [1]], sample_rows=[0, 1], copies=[])
    try:
        executor.execute_inputs(step, (VARLEN, 0, 0))
        assert rows == [0]  # even for a step that names rows to sample
        executor.runner.computes_logits = True  # as on rank 0
        executor.execute_inputs(step, (VARLEN, 0, 0))
        assert rows == [0, 2]
    finally:
        hook.remove()


@pytest.mark.parametrize(
    ("model", "config", "message"),
    [
        (lambda: model_for("llama"), dict(tensor_parallel_size=3), "must divide the model's attention heads"),
        (lambda: model_for("llama"), dict(tensor_parallel_size=2, cpu_offload_space=0.01), "cpu_offload_space"),
        (lambda: __import__("transformers").AutoModelForCausalLM.from_config(__import__("transformers").GPT2Config(
            n_layer=1, n_embd=32, n_head=2, vocab_size=100, bos_token_id=0, eos_token_id=0)),
         dict(tensor_parallel_size=2), "no tensor-parallel plan"),
    ],
    ids=["heads-do-not-divide", "swap-pool", "no-plan-no-projections"],
)
def test_what_cannot_be_split_is_refused_before_any_rank_starts(model, config, message) -> None:
    with pytest.raises(ValueError, match=message):
        LLMEngine(model(), ContinuousBatchingConfig(block_size=16, num_blocks=16, **config))


def test_tensor_parallel_size_is_checked_as_a_setting() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ContinuousBatchingConfig(tensor_parallel_size=0)


@pytest.mark.parametrize(("arch", "overrides"), [("qwen2", {}), ("llama", {"tie_word_embeddings": True})],
                         ids=["qwen2-biases", "llama-tied-lm-head"])  # fmt: skip
def test_a_rank_reads_only_its_slices_of_a_safetensors_checkpoint(tmp_path, arch: str, overrides: dict) -> None:
    model = build_test_model(arch, vocab_size=VOCAB, **overrides)
    model.save_pretrained(tmp_path)
    for rank in (0, 1):
        shard = ModelSource(str(tmp_path), "float32").shard(rank, 2, lambda t: None, torch.device("cpu"))
        expected = shard_model(model, rank, 2, lambda t: None)
        got = dict(shard.named_parameters(remove_duplicate=False))
        assert got.keys() == dict(expected.named_parameters(remove_duplicate=False)).keys()
        for name, p in expected.named_parameters(remove_duplicate=False):
            assert torch.equal(got[name], p), name
            assert got[name].untyped_storage().nbytes() == p.numel() * p.element_size(), name  # no whole tensor behind
        for name, b in expected.named_buffers():
            torch.testing.assert_close(dict(shard.named_buffers())[name], b)
        assert (shard.lm_head.weight is shard.model.embed_tokens.weight) == bool(overrides)
        assert shard.model.layers[0].self_attn.o_proj._forward_hooks  # it all-reduces as a shard made in memory does
    split = sum(p.numel() for n, p in shard.named_parameters() if "proj" in n)
    assert split * 2 == sum(p.numel() for n, p in model.named_parameters() if "proj" in n)


PEAK_SCRIPT = """
import sys, torch
from engine.loader import ModelSource
def peak():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) << 10
ModelSource(sys.argv[2], "float32").shard(1, 2, lambda t: None, torch.device("cpu"))  # imports everything once
before = peak()
shard = ModelSource(sys.argv[1], "float32").shard(1, 2, lambda t: None, torch.device("cpu"))
print(peak() - before, sum(p.numel() * p.element_size() for p in shard.parameters()))
"""


def test_a_rank_loading_its_shard_peaks_near_the_shards_size_not_the_models(tmp_path) -> None:
    import subprocess
    import sys

    big = build_test_model("llama", vocab_size=4096, hidden_size=1024, intermediate_size=4096, num_hidden_layers=4)
    whole = sum(p.numel() * p.element_size() for p in big.parameters())  # 272 MiB; its shard 152 MiB
    big.save_pretrained(tmp_path / "big")
    del big
    model_for("llama").save_pretrained(tmp_path / "small")
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(tmp_path / "big"), str(tmp_path / "small")],
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    assert out.returncode == 0, out.stderr
    growth, shard = map(int, out.stdout.split())
    largest = 4096 * 1024 * 4  # the embedding: one tensor's pages are mapped while it is copied
    assert growth <= shard + 2 * largest < 0.8 * whole, (growth, shard, whole)


def test_two_ranks_loading_their_shards_from_a_checkpoint_match_model_generate(tmp_path) -> None:
    """Rank 0 too, given the model with no weights read (as `cbserve serve` gives it)."""
    model_for("llama").save_pretrained(tmp_path)
    unread = empty_model(tmp_path, torch.float32, None)
    assert all(p.is_meta for p in unread.parameters())
    engine = LLMEngine(unread, ContinuousBatchingConfig(**TIGHT),
                       tensor_parallel=Launch(load=ModelSource(str(tmp_path), "float32")))  # fmt: skip
    try:
        assert not any(p.is_meta for p in engine.executor.model.parameters())
        prompts = [list(p) for p in prompts_for()[:6]]
        for p, r in zip(prompts, run_to_end(engine, prompts)):
            assert tuple(r.generated_ids) == reference("llama", tuple(p)), r.request_id
    finally:
        engine.close()
    assert all(p.exitcode == 0 for _, p in engine.tp.processes)


def failing_load() -> torch.nn.Module:
    raise OSError("the checkpoint is unreadable here")


def test_a_rank_that_fails_to_load_ends_the_start_with_an_error_naming_it() -> None:
    with pytest.raises(GroupBroken, match="rank 1"):
        LLMEngine(model_for("llama"), ContinuousBatchingConfig(**TIGHT), tensor_parallel=Launch(load=failing_load))


def kill_rank_1(engine: LLMEngine) -> None:
    (rank, process), = engine.tp.processes
    assert rank == 1
    os.kill(process.pid, signal.SIGKILL)


@contextlib.contextmanager
def two_rank_manager() -> Iterator[tuple[ContinuousBatchingManager, threading.Event]]:
    """A started manager over two ranks, and an event its on_fatal callback sets."""
    manager = ContinuousBatchingManager(model_for("llama"), continuous_batching_config=ContinuousBatchingConfig(**TIGHT))
    died = threading.Event()
    manager.on_fatal.append(lambda exc: died.set())
    manager.start()
    try:
        yield manager, died
    finally:
        manager.stop(block=True, timeout=DEATH_WAIT_S)


def test_a_rank_that_dies_mid_request_fails_it_and_ends_the_manager() -> None:
    with two_rank_manager() as (manager, died):
        rid = manager.add_request([5, 6, 7], max_new_tokens=250, streaming=True, ignore_eos=True)
        outputs = manager.request_id_iter(rid)
        first = next(outputs)
        assert first.status != RequestStatus.FAILED
        kill_rank_1(manager.engine)
        last = list(outputs)[-1]
        assert last.status == RequestStatus.FAILED
        assert "tensor-parallel group broken" in last.error
        assert died.wait(DEATH_WAIT_S)
        manager.join(timeout=DEATH_WAIT_S)
        assert not manager.is_running()  # the server's /ready and /health answer 503 from here
        with pytest.raises(RuntimeError):
            manager.add_request([5, 6, 7], max_new_tokens=2)


def test_a_rank_that_dies_while_idle_ends_the_manager() -> None:
    with two_rank_manager() as (manager, died):
        rid = manager.add_request(list(prompts_for()[1]), max_new_tokens=3)
        assert manager.get_result(rid, timeout=DEATH_WAIT_S).status == RequestStatus.FINISHED
        kill_rank_1(manager.engine)
        assert died.wait(DEATH_WAIT_S)
        assert "rank 1 exited with code -9" in str(manager._fatal)


def test_gloo_socket_ifname_picks_the_interface_the_ranks_talk_on(monkeypatch) -> None:
    """torch's GLOO_SOCKET_IFNAME, as a pod sets it where its hostname resolves to the wrong interface."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    engine = LLMEngine(model_for("llama"), ContinuousBatchingConfig(**TIGHT))
    try:
        prompts = [list(p) for p in prompts_for()[:4]]
        for p, r in zip(prompts, run_to_end(engine, prompts)):
            assert tuple(r.generated_ids) == reference("llama", tuple(p))
    finally:
        engine.close()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-if0")
    with pytest.raises(RuntimeError, match="no-such-if0"):
        LLMEngine(model_for("llama"), ContinuousBatchingConfig(**TIGHT))


def test_an_engine_dropped_without_close_takes_its_ranks_with_it() -> None:
    import gc

    engine = LLMEngine(model_for("llama"), ContinuousBatchingConfig(**TIGHT))
    (_, process), = engine.tp.processes
    del engine
    gc.collect()  # the engine, its shard and group form cycles: a collection finds them
    process.join(DEATH_WAIT_S)
    assert process.exitcode is not None
