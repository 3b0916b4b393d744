"""benchmarks/gguf_native.py's `kernels`: every GGUF type it is asked for is timed on the path the
engine takes for it (float, bfloat16 and int8 inputs), and its random blocks are ones the kernels read
as the reference does (finite values, whatever the random bytes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")


@pytest.fixture
def native(bench_script):
    return bench_script("gguf_native")


def native_ops_repack() -> bool:
    """Whether this tree's kernel build repacks weights for its int8 tiles (not AVX-512 without VNNI)."""
    from engine.backends.cpu_kernels import cpu_ops

    return cpu_ops().quant_repack_rows() > 0


@pytest.fixture(scope="module")
def ops():
    from engine.backends.cpu_kernels import cpu_ops

    ops = cpu_ops()
    assert ops is not None, "the C++ kernels must build here (a compiler is part of the dev setup)"
    return ops


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_random_blocks_hold_finite_weights_the_kernels_multiply_as_the_reference(native, ops, name) -> None:
    from engine.backends.cpu_quant import NAMES, dequantize, linear

    code = {v: k for k, v in NAMES.items()}[name]
    blocks = native.random_blocks(code, 8, 512, np.random.default_rng(0))
    w = dequantize(blocks, code, 512)
    assert torch.isfinite(w).all() and w.abs().max() > 0
    x = torch.randn(3, 512)
    torch.testing.assert_close(linear(ops, x, blocks, code, None), x @ w.T, rtol=1e-4, atol=1e-4)


def test_kernels_times_k_quants_with_each_input_kind_and_leaves_out_shapes_they_do_not_fit(native, monkeypatch,
                                                                                       capsys) -> None:  # fmt: skip
    monkeypatch.setitem(native.SHAPES, "test", {"fits": (32, 512), "odd": (32, 96)})
    rows = native.kernels([1, 2], 1, "test", ["Q4_0", "Q4_K", "Q6_K"], [1], dense=False)
    paths = {(r["shape"], r["rows"], r["path"]) for r in rows}
    # the weights repacked as --quantized-activations int8 multiplies them, where the build repacks
    repacked = " int8 x repacked" if native_ops_repack() else None
    for m in (1, 2):
        assert {p for s, r, p in paths if s == "fits" and r == m} == {
            "Q4_0 float x", "Q4_0 bf16 x", "Q4_0 int8 x", "Q4_K float x", "Q4_K bf16 x", "Q4_K int8 x",
            "Q6_K float x", "Q6_K bf16 x", "Q6_K int8 x",
            *([q + repacked for q in ("Q4_0", "Q4_K", "Q6_K")] if repacked else [])}  # fmt: skip
        assert {p for s, r, p in paths if s == "odd" and r == m} == {
            "Q4_0 float x", "Q4_0 bf16 x", "Q4_0 int8 x", *(["Q4_0" + repacked] if repacked else [])}  # fmt: skip
    assert "odd: 96 inputs are not whole K-quant super-blocks of 256: Q4_K, Q6_K left out" in capsys.readouterr().out
    assert all(r["best_us"] > 0 for r in rows)


def test_kernels_can_time_a_build_of_the_cache_by_name_and_an_unknown_one_is_a_clear_error(native, monkeypatch) -> None:
    from engine.backends.cpu_kernels import build_directory

    monkeypatch.setitem(native.SHAPES, "test_build", {"fits": (32, 512)})
    rows = native.kernels([1], 1, "test_build", ["Q4_K"], [1], dense=False, build=build_directory().name)
    repacked = ["Q4_K int8 x repacked"] if native_ops_repack() else []
    assert [r["path"] for r in rows] == ["Q4_K float x", "Q4_K bf16 x", "Q4_K int8 x", *repacked]
    assert all(r["best_us"] > 0 for r in rows)
    with pytest.raises(FileNotFoundError, match="no kernel build 'avx512-000000000000'"):
        native.kernels([1], 1, "test_build", ["Q4_K"], [1], dense=False, build="avx512-000000000000")


def test_a_build_older_than_the_k_quants_int8_product_times_their_other_paths(native, monkeypatch) -> None:
    """An earlier build (--build) whose kquant_linear takes no int8 flag: its K-quant int8 lines are
    left out, the rest timed."""
    from engine.backends import cpu_kernels

    ops = cpu_kernels.cpu_ops()

    class Older:  # the kernels as they were: kquant_linear(x, w, qtype, bias), nothing more
        def __getattr__(self, name):
            return getattr(ops, name)

        @staticmethod
        def kquant_linear(x, w, qtype, bias):
            return ops.kquant_linear(x, w, qtype, bias)

    monkeypatch.setattr(cpu_kernels, "ops_of_build", lambda tag: Older())
    monkeypatch.setitem(native.SHAPES, "test_older", {"fits": (32, 512)})
    rows = native.kernels([1], 1, "test_older", ["Q4_0", "Q4_K"], [1], dense=False, build="avx512-older")
    assert [r["path"] for r in rows] == ["Q4_0 float x", "Q4_0 bf16 x", "Q4_0 int8 x", "Q4_K float x", "Q4_K bf16 x"]


def test_step_times_the_linears_and_a_decode_step_of_the_embedded_model(native) -> None:
    out = native.step(None, rows=2, repeats=2, activations="int8")
    assert out["rows"] == 2 and out["linears"] > 0 and out["activations"] == "int8"
    assert 0 < out["linears_best_ms"] <= out["linears_median_ms"] and 0 < out["step_best_ms"] <= out["step_median_ms"]


def test_cold_calls_take_a_weight_copy_not_read_since_the_others(native, monkeypatch) -> None:
    """--cold: copies of each weight beyond twice the last-level cache, called in turn, so every call
    reads its weight from memory; the dense paths (no copies) are left out and each line says so."""
    import machine_limits

    monkeypatch.setattr(machine_limits, "last_level_cache_bytes", lambda: 4096)
    w = torch.zeros(32, 64, dtype=torch.uint8)  # 2 KiB: 5 copies exceed 8 KiB
    turns = native._Rotating(w, cold=True)
    seen = [turns().data_ptr() for _ in range(2 * len(turns.copies))]
    assert len(turns.copies) == 5 and len(set(seen)) == 5 and seen[:5] == seen[5:]
    assert native._Rotating(w, cold=False)() is w
    monkeypatch.setitem(native.SHAPES, "test", {"fits": (32, 512)})
    rows = native.kernels([1], 1, "test", ["Q8_0"], [1], dense=True, cold=True)
    assert {r["path"] for r in rows} == {"Q8_0 float x", "Q8_0 bf16 x", "Q8_0 int8 x",
                                         *(["Q8_0 int8 x repacked"] if native_ops_repack() else [])}  # fmt: skip
    assert all(r["weights from"] == "memory" for r in rows)

