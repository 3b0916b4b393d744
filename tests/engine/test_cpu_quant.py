"""GGUF-quantized weights kept in their blocks (engine/backends/cpu_quant.py, engine/csrc/quant_cpu.cpp,
engine/gguf_loader.py).

The default product keeps x in float32 against the dequantized blocks: it equals x times the
dequantized weight (float64) to float rounding, |error| <= 1e-5 |x| |w_j| (measured 3e-8). The
int8 product quantizes each row of x to int8 blocks of 32 (a float scale each) and takes integer
dot products: against the same computation in float64 (x quantized the same way) it agrees to float
rounding, |error| <= 1e-5 |x| |w_j|; against the plain product it differs by x's quantization,
|error| <= 5e-3 |x| |w_j| (measured at most 1.7e-3 on these shapes). The int8 bounds hold with
VNNI's vpdpbusd and without it (vpmaddubsw); everything holds in the AVX2 build too (a child
process with CBSERVE_CPU_ISA=avx2).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402

from engine.backends import cpu_quant  # noqa: E402
from engine.backends.cpu_quant import QuantizedEmbedding, QuantizedLinear, dequantize  # noqa: E402


def cpu_isa_of(ops) -> str:
    """The ISA of the loaded kernel build: its cache folder's name starts with it."""
    from pathlib import Path

    return Path(ops.__file__).parent.name.split("-")[0]
from tests.engine.forced_isa import run_with_isa  # noqa: E402

TYPES = [T.Q8_0, T.Q4_0, T.Q4_1]
# (rows of x, outputs, inputs): outputs not a multiple of the 4- and 16-row tiles (the int8 product's
# 16-row tiles leave 1-15 rows to its one-row path), rows of x not a multiple of 4 or 8, inputs of
# 2 to 64 blocks, odd and even
SHAPES = [(1, 37, 64), (3, 129, 576), (7, 64, 1536), (33, 5, 96), (17, 35, 160), (16, 48, 2048)]
EXACT, QUANTIZED = 1e-5, 5e-3


def random_blocks(qtype, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of a random [n, k] weight (gguf's own quantizer) and their float32 dequantization."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    return torch.from_numpy(raw), torch.from_numpy(gguf.quants.dequantize(raw, qtype)).float()


def quantized_x(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: each block of 32 rounded to multiples of max|x| / 127."""
    xb = x.float().reshape(x.shape[0], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    safe = torch.where(d > 0, d, torch.ones_like(d))
    return (torch.round(xb / safe) * d).reshape(x.shape).double()


def errors(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> tuple[float, float]:
    """Largest error against the exact and the plain reference, in units of |x| |w_j|."""
    b = 0 if bias is None else bias.double()
    scale = x.double().norm(dim=1, keepdim=True) * w.double().norm(dim=1)
    exact = quantized_x(x) @ w.double().T + b
    plain = x.double() @ w.double().T + b
    y = y.double()
    return float(((y - exact).abs() / scale).max()), float(((y - plain).abs() / scale).max())


def on_each_int8_path(ops, product) -> dict[bool, torch.Tensor]:
    """product() on each int8 product this build has, by whether VNNI was on: the 16-lane vpdpbusd
    tiles where the CPU has VNNI, and the 8-lane vpmaddubsw ones; the setting is restored after each."""
    out = {}
    for vnni in [True, False] if ops.quant_vnni_available() else [False]:
        before = ops.set_quant_vnni(vnni)
        try:
            out[vnni] = product()
        finally:
            ops.set_quant_vnni(before)
    return out


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_equals_dequantise_then_matmul(ops, qtype, shape) -> None:
    m, n, k = shape
    blocks, w = random_blocks(qtype, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(n) if m % 2 else None
    assert errors(ops.quant_linear(x, blocks, int(qtype), bias), x, w, bias)[1] <= EXACT  # float x
    for vnni, y in on_each_int8_path(ops, lambda: ops.quant_linear(x, blocks, int(qtype), bias, int8=True)).items():
        exact, plain = errors(y, x, w, bias)
        assert exact <= EXACT and plain <= QUANTIZED, (vnni, exact, plain)


@pytest.mark.parametrize("n", [16, 1], ids=["16-row-tile", "one-row"])
def test_int8_inputs_round_half_to_even(ops, n) -> None:
    """x's quantization rounds as llama.cpp's (nearbyint: ties to even), 8 lanes at a time: with
    max|x| = 127 the scale is 1 and x * (127 / 127) lands on the ties exactly; a Q8_0 weight of all
    ones (scale 1.0) sums the rounded values, every step exact."""
    ties = [2.5, -3.5, 0.5, -0.5, 1.5, -1.5, 126.5, -2.5, 3.49, 4.51]
    x = torch.tensor([[127.0, *ties, *([0.25] * 21)], [-127.0, *[-t for t in ties], *([-0.75] * 21)]])
    blocks = torch.tensor([0x00, 0x3C] + [1] * 32, dtype=torch.uint8).repeat(n, 1)  # d = float16 1.0, q = 1
    expected = torch.round(x).sum(1, keepdim=True).expand(2, n)  # torch.round: ties to even
    assert torch.equal(ops.quant_linear(x, blocks, int(T.Q8_0), None, int8=True), expected)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("int8", [False, True], ids=["float-x", "int8-x"])
def test_a_rows_product_does_not_depend_on_its_batch(ops, qtype, int8) -> None:
    """Each row of a batch (the 512-bit build's tiles and weight buffer above 4 rows, the int8
    product's groups of 8 rows, and above 16 rows its tiles unpacked once for every pass) gets the
    bits it gets alone: the engine's batched decode equals `model.generate`'s one row at a time."""
    blocks, _ = random_blocks(qtype, 71, 576)
    x = torch.randn(19, 576, generator=torch.Generator().manual_seed(2))
    batch = ops.quant_linear(x, blocks, int(qtype), None, int8)
    for rows in ([0], [5, 6, 7], list(range(3, 9)), list(range(2, 12)), [17], list(range(10, 19))):
        assert torch.equal(ops.quant_linear(x[rows], blocks, int(qtype), None, int8), batch[rows]), rows


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_vnni_and_maddubs_agree(ops, qtype) -> None:
    """The AVX-512 build's VNNI product (16 weight rows a tile, one per lane) and its vpmaddubsw one
    (a row at a time) take the same exact integer block sums; only the order of the float sums of
    the scaled blocks differs."""
    if not ops.quant_vnni_available():
        pytest.skip("this build has no VNNI (the AVX2 child test covers this build's only path)")
    blocks, w = random_blocks(qtype, 96, 576)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(4))
    ops.set_quant_vnni(False)
    try:
        slow = ops.quant_linear(x, blocks, int(qtype), None, int8=True)
    finally:
        ops.set_quant_vnni(True)
    fast = ops.quant_linear(x, blocks, int(qtype), None, int8=True)
    scale = x.double().norm(dim=1, keepdim=True) * w.double().norm(dim=1)
    assert float(((fast.double() - slow.double()).abs() / scale).max()) <= EXACT


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [*SHAPES, (40, 50, 256)], ids=str)
def test_a_repacked_weight_gives_the_same_bits(ops, qtype, shape) -> None:
    """quant_repack lays a weight's full tiles of rows out for the build's int8 tiles (16 rows a tile
    on AVX512-VNNI, 8 on AVX2): the int8 product on it is the product on the file's blocks, bit for
    bit (the same block values reach the same sums in the same order), at one pass and several; its
    rows dequantize to the file's; the rows after the last full tile are left as they were. A build
    without int8 tiles (AVX-512 without VNNI) refuses to repack."""
    m, n, k = shape
    blocks, _ = random_blocks(qtype, n, k)
    tile = ops.quant_repack_rows()
    if not tile:
        with pytest.raises(RuntimeError, match="no int8 tiles"):
            ops.quant_repack(blocks, int(qtype), k)
        return
    assert tile == (16 if ops.quant_vnni_available() and cpu_isa_of(ops) == "avx512" else 8)
    packed = ops.quant_repack(blocks, int(qtype), k)
    full = n // tile * tile
    assert packed.shape == blocks.shape and torch.equal(packed[full:], blocks[full:])
    assert full == 0 or not torch.equal(packed[:full], blocks[:full])
    t = int(qtype) | cpu_quant.REPACKED
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(5))
    bias = torch.randn(n) if m % 2 else None
    assert torch.equal(ops.quant_linear(x, packed, t, bias, int8=True), ops.quant_linear(x, blocks, int(qtype), bias, int8=True))
    like = torch.empty(0)
    assert torch.equal(ops.quant_dequantize(packed, t, k, None, like), ops.quant_dequantize(blocks, int(qtype), k, None, like))
    rows = torch.tensor([n - 1, 0, n // 2, min(17, n - 1)])
    assert torch.equal(ops.quant_dequantize(packed, t, k, rows, like), ops.quant_dequantize(blocks, int(qtype), k, rows, like))


def check_repacked_refusals(ops, product, blocks: torch.Tensor, qtype: int, k: int) -> None:
    """Only the int8 tiles read the repacked layout: `product` (quant_linear, kquant_linear) with float
    x, on the AVX-512 build with VNNI turned off (its 8-lane path), or on a build without int8 tiles
    is a clear error, never a product of scrambled bytes; the AVX2 build's tiles do not use VNNI, so
    turning it off changes nothing there."""
    t = qtype | cpu_quant.REPACKED
    x = torch.randn(3, k)
    if not ops.quant_repack_rows():
        with pytest.raises(RuntimeError, match="repacked for the int8 tiles"):
            product(x, blocks, t, None, True)
        return
    packed = ops.quant_repack(blocks, qtype, k)
    with pytest.raises(RuntimeError, match="repacked .* not float x"):
        product(x, packed, t, None, False)
    expected = product(x, blocks, qtype, None, True)
    before = ops.set_quant_vnni(False)
    try:
        if ops.quant_repack_rows() == 16:
            with pytest.raises(RuntimeError, match="not with VNNI off"):
                product(x, packed, t, None, True)
        else:
            assert torch.equal(product(x, packed, t, None, True), expected)
    finally:
        ops.set_quant_vnni(before)


def test_a_repacked_weight_refuses_the_other_products(ops) -> None:
    check_repacked_refusals(ops, ops.quant_linear, random_blocks(T.Q4_0, 32, 64)[0], int(T.Q4_0), 64)


def test_int8_activations_repack_a_tied_head_and_its_embedding_once(ops) -> None:
    """use_int8_activations repacks each weight where the build has int8 tiles (not without the
    tiles; the K-quants too: tests/engine/test_kquants.py): an embedding on the same bytes (a tied LM head's) takes
    the repacked tensor too, so the bytes are held once, and both give what the file's blocks give."""
    blocks, _ = random_blocks(T.Q8_0, 48, 64)
    head = QuantizedLinear(blocks, int(T.Q8_0), 64, None, ops)
    embed = QuantizedEmbedding(blocks, int(T.Q8_0), 64, torch.float32, ops)
    model = torch.nn.ModuleList([embed, head])
    ids = torch.tensor([[3, 47, 16, 0]])
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(6))
    before_rows = embed(ids)
    head.int8_activations = True
    before_y = head(x)
    assert cpu_quant.use_int8_activations(model) == 1 and model.cbserve_quantization["activations"] == "int8"
    repacked = ops.quant_repack_rows() > 0
    assert (head.qtype, embed.qtype) == ((int(T.Q8_0) | cpu_quant.REPACKED,) * 2 if repacked else (int(T.Q8_0),) * 2)
    assert head.blocks.data_ptr() == embed.blocks.data_ptr()
    assert (head.blocks.data_ptr() != blocks.data_ptr()) == repacked
    assert model.cbserve_quantization.get("repacked", 0) == int(repacked)
    assert torch.equal(embed(ids), before_rows) and torch.equal(head(x), before_y)
    assert torch.equal(head.dequantized(), dequantize(blocks, int(T.Q8_0), 64))
    assert ("repacked" in head.extra_repr()) == repacked


def _resident_kib(address: int) -> int:
    """Rss of the mapping that holds `address` (/proc/self/smaps), KiB."""
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            low, high = (int(v, 16) for v in head.split("-"))
            if low <= address < high:
                return next(int(x.split()[1]) for x in lines[i + 1:] if x.startswith("Rss:"))
    raise AssertionError("no mapping holds the address")


def test_a_repacked_file_weight_lets_its_pages_go_and_loses_nothing(tmp_path) -> None:
    """After repacking, a weight read from the mapped file lets its whole pages go from the process
    (MADV_DONTNEED on the read-only mapping: its resident memory drops, the bytes read back the same);
    anonymous memory, where that would zero the pages, is left alone."""
    import warnings

    data = np.random.default_rng(7).integers(0, 256, size=3 * 4096 + 100, dtype=np.uint8)
    (tmp_path / "w.bin").write_bytes(data.tobytes())
    with warnings.catch_warnings():  # torch warns that the read-only array is not writable
        warnings.simplefilter("ignore", UserWarning)
        mapped = torch.from_numpy(np.memmap(tmp_path / "w.bin", dtype=np.uint8, mode="r"))
    assert int(mapped.sum()) == int(data.sum())  # every page read in
    before = _resident_kib(mapped.data_ptr())
    cpu_quant._unmap_file_pages(mapped)
    assert before >= 12 and _resident_kib(mapped.data_ptr()) <= before - 12
    assert torch.equal(mapped, torch.from_numpy(data))
    anonymous = torch.from_numpy(data.copy())
    cpu_quant._unmap_file_pages(anonymous)
    assert torch.equal(anonymous, torch.from_numpy(data))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_give_outputs_of_their_dtype(ops, dtype) -> None:
    blocks, w = random_blocks(T.Q8_0, 40, 128)
    x = torch.randn(3, 128).to(dtype)
    y = ops.quant_linear(x, blocks, int(T.Q8_0), None)
    assert y.dtype == dtype
    want = ops.quant_linear(x.float(), blocks, int(T.Q8_0), None)
    torch.testing.assert_close(y, want.to(dtype))
    torch.testing.assert_close(y.float(), x.float() @ w.T, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantisation_is_ggufs_bit_for_bit_in_torch_and_in_the_kernel(ops, qtype) -> None:
    blocks, w = random_blocks(qtype, 9, 96, seed=3)
    assert torch.equal(dequantize(blocks, int(qtype), 96), w)
    assert torch.equal(ops.quant_dequantize(blocks, int(qtype), 96, None, torch.empty(0)), w)
    rows = torch.tensor([4, 0, 4])
    got = ops.quant_dequantize(blocks, int(qtype), 96, rows, torch.empty(0, dtype=torch.bfloat16))
    assert torch.equal(got, w[rows].bfloat16())


def test_modules_with_and_without_the_kernels(ops) -> None:
    blocks, w = random_blocks(T.Q4_0, 48, 64)
    x = torch.randn(2, 3, 64)
    fast = QuantizedLinear(blocks, int(T.Q4_0), 64, ops=ops)
    slow = QuantizedLinear(blocks, int(T.Q4_0), 64)  # torch: dequantize, then F.linear
    assert fast(x).shape == (2, 3, 48)
    torch.testing.assert_close(slow(x), x @ w.T)
    assert errors(fast(x).reshape(6, 48), x.reshape(6, 64), w, None)[1] <= EXACT
    fast.int8_activations = True
    assert errors(fast(x).reshape(6, 48), x.reshape(6, 64), w, None)[1] <= QUANTIZED
    many = torch.randn(cpu_quant.DEQUANTIZE_ROWS + 3, 64)  # a prompt step: dequantised for the call
    fast.int8_activations = False
    assert errors(fast(many), many, w, None)[1] <= EXACT
    emb = QuantizedEmbedding(blocks, int(T.Q4_0), 64, torch.float32, ops)
    ids = torch.tensor([[3, 1], [47, 3]])
    assert torch.equal(emb(ids), w[ids])
    assert torch.equal(QuantizedEmbedding(blocks, int(T.Q4_0), 64, torch.float32)(ids), w[ids])


def test_an_order_of_outputs_moves_the_rows_on_every_path(ops) -> None:
    """Llama's q/k from a GGUF file: the blocks stay in the file's row order and the module's outputs
    are moved, so each path equals the weight with its rows moved (a bias in the model's order)."""
    blocks, w = random_blocks(T.Q8_0, 48, 64, seed=5)
    order = torch.randperm(48, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(48)
    moved = w[order]
    plain = QuantizedLinear(blocks.index_select(0, order), int(T.Q8_0), 64, bias, ops)  # rows copied: the reference
    ordered = QuantizedLinear(blocks, int(T.Q8_0), 64, bias, ops, out_order=order)
    assert torch.equal(ordered.dequantized(), moved)
    for rows in (1, 5, cpu_quant.DEQUANTIZE_ROWS + 3):  # decode steps (the kernel) and a prompt step (dequantised)
        x = torch.randn(rows, 64)
        assert torch.equal(ordered(x), plain(x)), rows
        assert errors(ordered(x) - bias, x, moved, None)[1] <= EXACT
    ordered.int8_activations = plain.int8_activations = True
    x = torch.randn(3, 64)
    assert torch.equal(ordered(x), plain(x))
    no_kernels = QuantizedLinear(blocks, int(T.Q8_0), 64, bias, None, out_order=order)
    torch.testing.assert_close(no_kernels(x), x @ moved.T + bias)
    with pytest.raises(ValueError, match="out_order must be int64"):
        QuantizedLinear(blocks, int(T.Q8_0), 64, out_order=order[:-1])


def test_bad_blocks_are_refused(ops) -> None:
    blocks, _ = random_blocks(T.Q8_0, 4, 64)
    with pytest.raises(ValueError, match="must be uint8"):
        QuantizedLinear(blocks[:, :-1], int(T.Q8_0), 64)
    with pytest.raises(ValueError, match="not one of"):
        cpu_quant.row_bytes(10, 256)  # Q2_K: not a type cbserve multiplies in blocks
    with pytest.raises(RuntimeError, match="do not hold"):
        ops.quant_linear(torch.randn(1, 96), blocks, int(T.Q8_0), None)


AVX2_CHECK = """
    import torch
    from engine.backends.cpu_kernels import cpu_ops
    from tests.engine.test_cpu_quant import SHAPES, TYPES, errors, random_blocks, EXACT, QUANTIZED
    from tests.engine.test_cpu_quant import test_int8_inputs_round_half_to_even
    ops = cpu_ops()
    torch.manual_seed(0)  # the inputs: the same every run (unseeded, one draw in several hundred went past EXACT)
    print("lanes", ops.lanes(), "vnni", ops.quant_vnni_available())
    for qtype in TYPES:
        for m, n, k in SHAPES:
            blocks, w = random_blocks(qtype, n, k)
            x = torch.randn(m, k)
            assert errors(ops.quant_linear(x, blocks, int(qtype), None), x, w, None)[1] <= EXACT
            exact, plain = errors(ops.quant_linear(x, blocks, int(qtype), None, int8=True), x, w, None)
            assert exact <= EXACT and plain <= QUANTIZED, (qtype, m, n, k, exact, plain)
        blocks, _ = random_blocks(qtype, 71, 576)
        x = torch.randn(19, 576)
        for int8 in (False, True):  # a row alone gets the bits it gets in a batch
            batch = ops.quant_linear(x, blocks, int(qtype), None, int8)
            for rows in ([0], [5, 6, 7], list(range(3, 9))):
                assert torch.equal(ops.quant_linear(x[rows], blocks, int(qtype), None, int8), batch[rows])
    for n in (16, 1):
        test_int8_inputs_round_half_to_even(ops, n)
    print("ok")
"""


def test_the_avx2_build_too() -> None:
    out = run_with_isa(AVX2_CHECK)
    assert "lanes 8 vnni False" in out and "ok" in out
