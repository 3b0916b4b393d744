"""Placement: the device and dtype rules with torch's answers forced, the CPU load, and what the engine
reports (one start-up line, the server's /v1/models)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys

import pytest
import torch

from engine import ContinuousBatchingConfig, ContinuousBatchingManager
from engine.device import Accelerator, probe, resolve_device, resolve_dtype
from engine.loader import load_model
from engine.testing import build_test_model, build_test_tokenizer, save_test_model

NO_GPU_CPU_BUILD = Accelerator(cuda_available=False, cuda_build=None)
NO_GPU_CUDA_BUILD = Accelerator(cuda_available=False, cuda_build="12.8")
ONE_BF16_GPU = Accelerator(cuda_available=True, device_count=1, bf16_supported=True, cuda_build="12.8")
ONE_FP16_GPU = Accelerator(cuda_available=True, device_count=1, bf16_supported=False, cuda_build="12.8")  # a T4, a V100


@pytest.mark.parametrize(("requested", "acc", "device"), [
    ("auto", NO_GPU_CPU_BUILD, "cpu"),
    ("auto", ONE_BF16_GPU, "cuda"),
    ("cpu", ONE_BF16_GPU, "cpu"),
    ("cuda", ONE_FP16_GPU, "cuda"),
    ("cuda:0", ONE_BF16_GPU, "cuda:0"),
])
def test_the_device_resolves(requested: str, acc: Accelerator, device: str) -> None:
    assert resolve_device(requested, acc) == device


@pytest.mark.parametrize(("requested", "acc", "words"), [
    ("cuda", NO_GPU_CPU_BUILD, r"^device cuda: CUDA is not available \(torch .*, a CPU-only build\); use --device cpu"),
    ("cuda:0", NO_GPU_CUDA_BUILD, r"^device cuda:0: CUDA is not available \(torch .*, built for CUDA 12.8, but it sees "
                                  r"no GPU\)"),
    ("cuda:1", ONE_BF16_GPU, r"^device cuda:1: torch sees 1 GPU\(s\), cuda:0 to cuda:0$"),
    ("tpu", ONE_BF16_GPU, r"^device must be auto, cpu, cuda or cuda:N, got 'tpu'$"),
])
def test_a_device_that_is_not_there_is_refused_saying_why(requested: str, acc: Accelerator, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        resolve_device(requested, acc)


@pytest.mark.parametrize(("requested", "device", "acc", "dtype"), [
    ("auto", "cpu", NO_GPU_CPU_BUILD, "float32"),  # an AVX2-only CPU
    ("auto", "cpu", dataclasses.replace(NO_GPU_CPU_BUILD, cpu_bf16_dot=True), "bfloat16"),  # AVX-512 BF16, AMX
    ("auto", "cpu", ONE_BF16_GPU, "float32"),  # --device cpu on a GPU machine: the CPU's rule
    ("auto", "cuda", ONE_BF16_GPU, "bfloat16"),
    ("auto", "cuda:0", ONE_FP16_GPU, "float16"),
    ("float32", "cuda", ONE_BF16_GPU, "float32"),  # named: kept (the attention backend refuses what it cannot run)
    ("bfloat16", "cpu", NO_GPU_CPU_BUILD, "bfloat16"),
])
def test_the_dtype_follows_the_device(requested: str, device: str, acc: Accelerator, dtype: str) -> None:
    assert resolve_dtype(requested, device, acc) == dtype


def test_the_cpu_dtype_probe_follows_a_forced_avx2() -> None:
    """CBSERVE_CPU_ISA=avx2 makes any host an AVX2-only one: no bfloat16 dot products, float32 by default."""
    import subprocess
    import sys

    code = "from engine.device import probe, resolve_dtype; print(resolve_dtype('auto', 'cpu', probe()))"
    forced = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={**os.environ, "CBSERVE_CPU_ISA": "avx2"})  # fmt: skip
    assert forced.stdout.strip() == "float32"


def test_probe_reports_this_machine() -> None:
    acc = probe()
    assert acc.cuda_available == torch.cuda.is_available() and acc.cuda_build == torch.version.cuda
    assert resolve_device("auto", acc) == ("cuda" if acc.cuda_available else "cpu")


def test_the_cpu_load_takes_the_cpus_dtype_and_host_memory(tmp_path) -> None:
    folder = save_test_model(tmp_path / "tiny")
    auto = load_model(str(folder), "auto", device="cpu")
    param = next(auto.model.parameters())
    assert param.device.type == "cpu" and param.dtype == (torch.bfloat16 if probe().cpu_bf16_dot else torch.float32)
    assert next(load_model(str(folder), "float32", device="cpu").model.parameters()).dtype == torch.float32
    assert next(load_model(str(folder), "bfloat16", device="cpu").model.parameters()).dtype == torch.bfloat16


def test_the_engine_reports_its_placement_in_one_line_and_on_v1_models(caplog) -> None:
    from starlette.testclient import TestClient

    from engine.server.app import build_state, create_app

    with caplog.at_level(logging.INFO, logger="cbserve.engine"):
        manager = ContinuousBatchingManager(build_test_model(), continuous_batching_config=ContinuousBatchingConfig(
            block_size=16, num_blocks=64))  # fmt: skip
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cbserve engine:")]
    assert len(lines) == 1
    assert lines[0].startswith("cbserve engine: device cpu, dtype float32, attention cpu; KV cache 64 blocks x 16 tokens")
    placement = manager.engine.placement()
    assert placement["kv_cache_tokens"] == 64 * 16 and placement["kv_cache_bytes"] > 0
    with TestClient(create_app(build_state(manager, build_test_tokenizer(), "tiny", 256))) as client:
        model = client.get("/v1/models").json()["data"][0]
    assert model["engine"] == placement
    assert {k: model["engine"][k] for k in ("device", "dtype", "attn_backend", "block_size", "kv_cache_blocks")} == {
        "device": "cpu", "dtype": "float32", "attn_backend": "cpu", "block_size": 16, "kv_cache_blocks": 64}


def _step():
    from engine.model_runner import StepInputs

    # a decode, then a prompt chunk with history; blocks of 16
    return StepInputs(token_ids=[7, 8, 9, 10, 11], q_lens=[1, 4], starts=[20, 16], block_tables=[[3, 5], [2, 4]],
                      sample_rows=[0, 1], copies=[])  # fmt: skip


def _runner(model):
    from engine.backends import get_backend
    from engine.kv_cache import PagedKVCache
    from engine.model_runner import ModelRunner

    return ModelRunner(model, PagedKVCache(0, 8, 16, 1, 8, torch.float32), get_backend("cpu"))


def test_a_steps_tensors_reach_an_accelerator_in_one_copy_with_the_host_paths_values() -> None:
    """On torch's meta device (no GPU needed), a tensor left on the host or made on it and mixed in
    would show: every tensor of the step is on the model's device, in the CPU path's shapes and dtypes."""
    host = _runner(build_test_model("llama"))
    away = _runner(build_test_model("llama").to("meta"))
    for a, b in zip(host.build_metadata(_step()), away.build_metadata(_step())):
        pairs = [(getattr(a, f), getattr(b, f)) for f in ("slot_mapping", "cu_seqlens_q", "seq_lens_k",
                 "block_tables")] if hasattr(a, "slot_mapping") else [(a, b)]  # fmt: skip
        for x, y in pairs:
            assert y.device.type == "meta" and (x.shape, x.dtype) == (y.shape, y.dtype)
    input_ids, positions, meta, rows = host.build_metadata(_step())
    assert positions.tolist() == [20, 16, 17, 18, 19] and meta.slot_mapping.tolist() == [84, 64, 65, 66, 67]
    assert rows.tolist() == [0, 4] and meta.seq_lens_k.tolist() == [21, 20]


class LaggingDevice:
    """A stand-in device that runs behind the host: a copy is queued and reads its host buffer only
    when the queue runs, up to a fence being waited on or at the end."""

    def __init__(self) -> None:
        self.queue: list = []  # callables, in stream order
        self.waits = 0  # fences waited on before they had passed

    def run(self, upto: int | None = None) -> None:
        n = len(self.queue) if upto is None else upto
        for op in self.queue[:n]:
            op()
        del self.queue[:n]

    def copy(self, host: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(host)
        self.queue.append(lambda: out.copy_(host))
        return out

    def fence(self):
        device = self

        class Fence:
            passed = True

            def record(self) -> None:
                self.passed = False
                device.queue.append(lambda: setattr(self, "passed", True))

            def synchronize(self) -> None:
                if not self.passed:
                    device.waits += 1
                    while not self.passed:
                        device.run(1)

        return Fence()


def test_staging_never_refills_a_buffer_that_a_pending_copy_still_reads() -> None:
    """Steps that end in no host sync (prompt chunks) follow each other while the device lags: each
    step's values arrive as they were packed, however far behind the device runs, and the host waits
    only for the buffer it is about to refill."""
    from engine.staging import HostStaging

    device = LaggingDevice()
    staging = HostStaging(torch.device("cpu"), copy=device.copy, new_fence=device.fence)
    steps = [[torch.arange(n) * (i + 1), torch.full((2, 3), i)] for i, n in enumerate([5, 3, 40, 7, 2, 9])]
    sent = [staging.send(parts) for parts in steps]  # the device has run nothing yet
    device.run()
    for parts, moved in zip(steps, sent):
        assert all(torch.equal(p, m) for p, m in zip(parts, moved))
    assert device.waits == len(steps) - 2  # two buffers: from the third step on, the one two steps back
    assert len([b for b in staging.buffers if b is not None]) == 2
    # a device that keeps up: no wait at all, and the buffers are reused, not reallocated
    again = [b.data_ptr() for b in staging.buffers]
    for parts in steps[:2] * 3:
        moved = staging.send(parts)
        device.run()
        assert all(torch.equal(p, m) for p, m in zip(parts, moved))
    assert device.waits == len(steps) - 2 and [b.data_ptr() for b in staging.buffers] == again


def test_one_buffer_without_fences_would_lose_a_pending_copy() -> None:
    """The stand-in device is strict enough to catch the fault the fences prevent: with the fences
    left out, a lagging copy reads the next step's values."""
    from engine.staging import HostStaging

    device = LaggingDevice()
    staging = HostStaging(torch.device("cpu"), slots=1, copy=device.copy)
    first = staging.send([torch.arange(4)])
    staging.send([torch.arange(4) + 10])
    device.run()
    assert first[0].tolist() == [10, 11, 12, 13]


def test_staging_keeps_values_shapes_and_dtypes() -> None:
    from engine.staging import HostStaging

    parts = [torch.arange(5), torch.tensor([[1, 2], [3, 4]], dtype=torch.int32), torch.tensor([], dtype=torch.long)]
    staging = HostStaging(torch.device("cpu"))
    for _ in range(3):
        moved = staging.send(parts)
        for p, m in zip(parts, moved):
            assert torch.equal(p, m) and p.dtype == m.dtype and p.shape == m.shape
    assert staging.send([torch.arange(20)])[0].tolist() == list(range(20))  # a buffer grows when too small


def test_on_device_makes_a_gpu_current_and_is_a_no_op_elsewhere(monkeypatch) -> None:
    from engine import device

    made = []
    monkeypatch.setattr(device.torch.cuda, "device", lambda d: made.append(d) or contextlib.nullcontext())
    with device.on_device(torch.device("cuda", 1)):
        pass
    with device.on_device(torch.device("cpu")), device.on_device(torch.device("meta")):
        pass
    assert made == [torch.device("cuda", 1)]


def test_every_thread_that_runs_the_cuda_executor_makes_the_models_device_current(monkeypatch) -> None:
    """The engine is built on one thread, warmed up on another (`warmup()` steps on a thread of its
    own, whoever calls it: the server calls it through asyncio.to_thread) and stepped on the
    manager's: each enters `on_device` with the model's device before any device work. The CUDA
    executor runs here on a CPU model, its `on_device` recorded."""
    import threading

    from engine.backends.cuda import executor as cuda_executor

    entered: list[tuple[str, str, torch.device]] = []

    def record(device: torch.device):
        caller = sys._getframe(1).f_code.co_name
        entered.append((threading.current_thread().name, caller, device))
        return contextlib.nullcontext()

    monkeypatch.setattr(cuda_executor, "on_device", record)
    monkeypatch.setattr("engine.llm_engine.make_executor", cuda_executor.CUDAExecutor)
    model = build_test_model()
    manager = ContinuousBatchingManager(model, continuous_batching_config=ContinuousBatchingConfig(block_size=16,
                                                                                                   num_blocks=64))
    assert isinstance(manager.engine.executor, cuda_executor.CUDAExecutor)
    warm = threading.Thread(target=manager.warmup, name="warm-up")
    warm.start()
    warm.join()
    manager.start()
    try:
        rid = manager.add_request([5, 6, 7], max_new_tokens=3, ignore_eos=True)
        assert len(manager.get_result(rid, timeout=60).generated_tokens) == 3
    finally:
        manager.stop(block=True, timeout=30)
    me = threading.current_thread().name
    assert (me, "__init__", model.device) in entered
    assert ("cbserve-warmup", "warmup", model.device) in entered
    assert ("cbserve-warmup", "launch", model.device) in entered
    assert not any(name == "warm-up" for name, *_ in entered)  # the caller's thread does no device work
    assert ("cbserve-engine", "launch", model.device) in entered
    assert {device for *_, device in entered} == {model.device}
