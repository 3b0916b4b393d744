"""benchmarks/machine_limits.py: the bound arithmetic, the weights a step reads, a tiny real
measurement, and the lines benchmarks/throughput.py prints beside its table."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from engine.backends.cpu_isa import capabilities
from engine.testing import build_test_model
from tests.benchmarks.conftest import BENCHMARKS


@pytest.fixture
def limits_module(bench_script):
    return bench_script("machine_limits")


def fake_limits(limits_module, bf16_native: bool = True):
    return limits_module.Limits(host="test CPU", threads=2, array_mib=4.0, copy_gbs=8.0, triad_gbs=10.0,
                                peak_gflops={"float32": 200.0, "bfloat16": 800.0 if bf16_native else 50.0},
                                native={"float32": True, "bfloat16": bf16_native},
                                matmul_n={"float32": 64, "bfloat16": 64 if bf16_native else 32})  # fmt: skip


def test_a_step_is_bound_by_its_weights_over_the_bandwidth_and_its_flops_over_the_peak(limits_module) -> None:
    # 1e9 parameters in bf16 (2e9 bytes), a decode batch of 64, 100 GB/s, 1 TFLOP/s
    bounds = limits_module.step_bounds(10**9, 2 * 10**9, 64, bandwidth_gbs=100.0, peak_gflops=1000.0)
    assert bounds.weights_s == pytest.approx(0.02)  # 2e9 B / 1e11 B/s
    assert bounds.compute_s == pytest.approx(0.128)  # 2 * 1e9 * 64 / 1e12
    assert bounds.bound_s == bounds.compute_s
    one = limits_module.step_bounds(10**9, 2 * 10**9, 1, bandwidth_gbs=100.0, peak_gflops=1000.0)
    assert one.bound_s == one.weights_s == pytest.approx(0.02)  # batch 1: reading the weights is the limit


def test_an_emulated_bf16_product_is_bounded_by_the_float32_peak(limits_module) -> None:
    assert fake_limits(limits_module).peak("bfloat16") == 800.0
    assert fake_limits(limits_module, bf16_native=False).peak("bfloat16") == 200.0
    assert fake_limits(limits_module).peak("float32") == 200.0


def test_an_emulated_product_is_measured_at_half_n_and_at_most_512(limits_module) -> None:
    assert limits_module.matmul_size(True, 4096) == 4096
    assert limits_module.matmul_size(False, 64) == 32
    assert limits_module.matmul_size(False, 4096) == 512  # ~1 GFLOP/s emulated: 2048 took minutes on AVX2


@pytest.mark.parametrize("tied", [True, False])
def test_a_step_reads_every_weight_but_an_input_embedding_that_is_not_the_head(limits_module, tied: bool) -> None:
    model = build_test_model("llama", tie_word_embeddings=tied)
    embedding = model.get_input_embeddings().weight
    total = sum(p.numel() for p in model.parameters())  # a tied weight counted once
    params, weight_bytes = limits_module.weights_read(model)
    assert params == (total if tied else total - embedding.numel())
    assert weight_bytes == 4 * params
    assert limits_module.weights_read(model.to(torch.bfloat16)) == (params, 2 * params)


@pytest.mark.parametrize("native", [True, False], ids=["bf16-dot-products", "emulated"])
def test_a_tiny_measurement_gives_positive_figures_and_says_how_bf16_is_multiplied(limits_module, monkeypatch,
                                                                                   capsys, native: bool) -> None:  # fmt: skip
    monkeypatch.setattr(limits_module, "dot_product_instructions", lambda dtype: native)  # the CPU's answer, forced
    limits = limits_module.measure(threads=1, array_mib=2, repeats=2, matmul_n=64)
    assert limits.copy_gbs > 0 and limits.triad_gbs > 0 and min(limits.peak_gflops.values()) > 0
    assert limits.native == {"float32": True, "bfloat16": native}
    assert limits.matmul_n == {"float32": 64, "bfloat16": 64 if native else 32}
    text = limits_module.describe(limits)
    assert text.startswith(f"host: {capabilities().describe()}\n") and "triad  a = b + s*c" in text
    assert ("emulated" in text) is not native
    # float32 from whichever of the two products was faster; an emulated bf16 product is not packed
    assert limits.peak_source["float32"] in {"torch.matmul", "oneDNN packed"}
    assert limits.peak_source["bfloat16"] in ({"torch.matmul", "oneDNN packed"} if native else {"torch.matmul"})
    assert f"({limits.peak_source['float32']})" in text
    assert limits.int8_gops > 0 and f"int8      n=64    {limits.int8_gops:8.1f} GOP/s" in text


def test_a_torch_without_a_cpu_int8_product_leaves_its_peak_unmeasured(limits_module, monkeypatch) -> None:
    def no_int8(*args):
        raise RuntimeError("_int_mm: no CPU kernel")

    monkeypatch.setattr(torch, "_int_mm", no_int8)
    assert limits_module.int8_gops(64, 1) is None
    limits = limits_module.measure(threads=1, array_mib=2, repeats=2, matmul_n=64)
    assert limits.int8_gops is None and limits_module.describe(limits).endswith("int8      not measured "
                                                                               "(no CPU int8 product in this torch)")


def test_without_onednn_packing_the_peak_is_torch_matmul(limits_module, monkeypatch) -> None:
    monkeypatch.setattr(limits_module, "packing_available", lambda: False)  # a torch without oneDNN's packing
    gflops, source = limits_module.product_peak(torch.float32, 64, 2, native=True)
    assert source == "torch.matmul" and gflops > 0


def test_limits_written_before_the_source_was_recorded_still_load(limits_module, tmp_path) -> None:
    old = {"host": "h", "threads": 2, "array_mib": 2.0, "copy_gbs": 1.0, "triad_gbs": 1.0,
           "peak_gflops": {"float32": 100.0}, "native": {"float32": True}, "matmul_n": {"float32": 64}}  # fmt: skip
    (tmp_path / "old.json").write_text(json.dumps(old))
    limits = limits_module.load(str(tmp_path / "old.json"))
    assert limits.peak_source == {} and limits.int8_gops is None
    assert "(" not in limits_module.describe(limits).splitlines()[-2]


def test_the_script_prints_json_that_loads_back(limits_module, tmp_path) -> None:
    run = subprocess.run([sys.executable, str(BENCHMARKS / "machine_limits.py"), "--threads", "1", "--array-mib", "2",
                          "--repeats", "1", "--matmul-n", "32", "--json"],
                         capture_output=True, text=True, timeout=240)  # fmt: skip
    assert run.returncode == 0, run.stderr
    figures = json.loads(run.stdout)
    assert figures["threads"] == 1 and figures["array_mib"] == 2.0
    assert figures["copy_gbs"] > 0 and figures["triad_gbs"] > 0
    assert set(figures["peak_gflops"]) == {"float32", "bfloat16"} and min(figures["peak_gflops"].values()) > 0
    assert figures["int8_gops"] > 0
    assert figures["host"] == capabilities().describe()  # the host line throughput.py prints
    path = tmp_path / "limits.json"
    path.write_text(run.stdout)
    assert limits_module.load(str(path)).triad_gbs == figures["triad_gbs"]


def test_throughput_prints_each_systems_step_as_a_multiple_of_both_bounds(limits_module, monkeypatch) -> None:
    import throughput

    monkeypatch.setattr(throughput, "NEW", 4)
    assert throughput.distinct_tokens([[1, 2, 3], [1, 2, 4], [5], [1, 2]]) == 5  # 1-2-3, 1-2-4, 5
    model = build_test_model("llama")
    params, weight_bytes = limits_module.weights_read(model)
    prompts = [[1, 2, 3, 4], [1, 2, 3, 5]]  # 5 distinct prompt tokens, 8 output tokens: 13 over 4 steps
    limits = fake_limits(limits_module)
    text = throughput.limits_report(model, prompts, "float32", limits, {"cbserve": 0.4, "peer": 0.8})
    weights_s = weight_bytes / 10e9
    compute_s = 2 * params * 13 / 4 / 200e9
    assert f"reading the {weight_bytes / 1e6:.1f} MB of weights takes at least {1000 * weights_s:.2f} ms" in text
    assert f"multiplying them {1000 * compute_s:.2f} ms" in text
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()[-2:]}
    assert rows["cbserve"] == ["100.00", f"{0.1 / weights_s:.1f}x", f"{0.1 / compute_s:.1f}x"]
    assert rows["peer"] == ["200.00", f"{0.2 / weights_s:.1f}x", f"{0.2 / compute_s:.1f}x"]
