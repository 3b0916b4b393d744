"""GGUF K-quants (Q4_K, Q6_K) kept in their super-blocks (engine/csrc/kquant_cpu.cpp,
engine/backends/cpu_quant.py, engine/gguf_loader.py).

Dequantization, in torch and in the kernel, equals gguf-py's bit for bit. The product keeps x in
float32 against the dequantized super-blocks: within 1e-5 |x| |w_j| of x times the dequantized
weight in float64, and a row's result is the same alone or in a batch. The int8 product (x rounded
to int8 blocks of 32, as quant_linear's) is within 1e-5 |x| |w_j| of that rounded x times the
dequantized weight and within 5e-3 of the plain product, with VNNI's 16-lane tiles and without them
(8-lane vpmaddubsw), a row's result again the same alone or in a batch. All of it holds in the AVX2
build too (a child process with CBSERVE_CPU_ISA=avx2). A GGUF file whose FFN down projections are K-quants
(the embedded model's, re-encoded by tests/engine/kquants.py) loads them in blocks, and the engine's
greedy output equals `model.generate` on it and transformers on its dequantized weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402

from engine import generate_batch  # noqa: E402
from engine.backends import cpu_quant  # noqa: E402
from engine.backends.cpu_quant import DEQUANTIZE_ROWS, QuantizedLinear, dequantize  # noqa: E402
from tests.engine.forced_isa import run_with_isa  # noqa: E402
from tests.engine.kquants import kquant_copy, q4_k, q6_k  # noqa: E402
from tests.engine.test_cpu_quant import check_repacked_refusals, on_each_int8_path  # noqa: E402

ENCODERS = {T.Q4_K: q4_k, T.Q6_K: q6_k}
SHAPES = [(1, 37, 256), (3, 129, 512), (7, 64, 1536), (33, 5, 768)]  # (rows of x, outputs, inputs)
EXACT = 1e-5


def random_blocks(qtype, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K-quant blocks of a random [n, k] weight and gguf-py's float32 dequantization of them."""
    w = (np.random.default_rng(seed).standard_normal((n, k)) * 0.05).astype(np.float32)
    raw = ENCODERS[qtype](w)
    return torch.from_numpy(raw), torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(n, k)).float()


def relative_error(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> float:
    want = x.double() @ w.double().T + (0 if bias is None else bias.double())
    scale = x.double().norm(dim=1, keepdim=True) * w.double().norm(dim=1)
    return float(((y.double() - want).abs() / scale).max())


@pytest.mark.parametrize("qtype", list(ENCODERS), ids=lambda t: t.name)
def test_dequantisation_is_ggufs_bit_for_bit_in_torch_and_in_the_kernel(ops, qtype) -> None:
    blocks, w = random_blocks(qtype, 19, 1024, seed=3)
    assert torch.equal(dequantize(blocks, int(qtype), 1024), w)
    assert torch.equal(ops.kquant_dequantize(blocks, int(qtype), 1024, None, torch.empty(0)), w)
    rows = torch.tensor([18, 0, 7, 7])
    assert torch.equal(ops.kquant_dequantize(blocks, int(qtype), 1024, rows, torch.empty(0)), w[rows])
    half = ops.kquant_dequantize(blocks, int(qtype), 1024, None, torch.empty(0, dtype=torch.bfloat16))
    assert half.dtype == torch.bfloat16 and torch.equal(half, w.bfloat16())


@pytest.mark.parametrize("qtype", list(ENCODERS), ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_equals_dequantise_then_matmul(ops, qtype, shape) -> None:
    m, n, k = shape
    blocks, w = random_blocks(qtype, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    assert relative_error(ops.kquant_linear(x, blocks, int(qtype), None), x, w, None) <= EXACT
    assert relative_error(ops.kquant_linear(x, blocks, int(qtype), bias), x, w, bias) <= EXACT


@pytest.mark.parametrize("qtype", list(ENCODERS), ids=lambda t: t.name)
def test_a_rows_product_does_not_depend_on_its_batch(ops, qtype) -> None:
    blocks, _ = random_blocks(qtype, 70, 768)
    x = torch.randn(13, 768, generator=torch.Generator().manual_seed(4))
    batch = ops.kquant_linear(x, blocks, int(qtype), None)  # 13 rows: super-blocks dequantized into a buffer
    for r in (0, 6, 12):
        assert torch.equal(ops.kquant_linear(x[r:r + 1], blocks, int(qtype), None)[0], batch[r])
    for rows in (2, 3, 4, 5):  # up to 4: dequantized in registers
        assert torch.equal(ops.kquant_linear(x[3:3 + rows], blocks, int(qtype), None), batch[3:3 + rows])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_give_outputs_of_their_dtype(ops, dtype) -> None:
    blocks, w = random_blocks(T.Q4_K, 33, 512)
    x = torch.randn(4, 512).to(dtype)
    y = ops.kquant_linear(x, blocks, int(T.Q4_K), None)
    assert y.dtype == dtype
    assert torch.allclose(y.float(), x.float() @ w.T, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("qtype", list(ENCODERS), ids=lambda t: t.name)
def test_the_module_on_decode_and_prompt_steps_and_without_the_kernels(ops, qtype) -> None:
    blocks, w = random_blocks(qtype, 48, 512)
    with_ops = QuantizedLinear(blocks, int(qtype), 512, None, ops)
    without = QuantizedLinear(blocks, int(qtype), 512, None, None)
    for rows in (1, DEQUANTIZE_ROWS, DEQUANTIZE_ROWS + 5):  # the block kernel, then a dequantised copy
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        assert relative_error(with_ops(x), x, w, None) <= EXACT
        assert relative_error(without(x), x, w, None) <= EXACT
    assert torch.equal(with_ops.dequantized(), w)
    assert "Q4_K" in repr(with_ops) or "Q6_K" in repr(with_ops)


def test_bad_blocks_are_refused(ops) -> None:
    blocks, _ = random_blocks(T.Q4_K, 4, 512)
    with pytest.raises(ValueError, match="not whole Q4_K blocks of 256"):
        cpu_quant.row_bytes(int(T.Q4_K), 576)
    for int8 in (False, True):
        with pytest.raises(RuntimeError, match="do not hold"):
            ops.kquant_linear(torch.randn(1, 768), blocks, int(T.Q4_K), None, int8=int8)
    with pytest.raises(RuntimeError, match="is not Q4_K"):
        ops.kquant_linear(torch.randn(1, 512), blocks, int(T.Q8_0), None)
    with pytest.raises(ValueError, match="must be uint8"):
        QuantizedLinear(blocks[:, :-1], int(T.Q4_K), 512)


REPACK_SHAPES = [(1, 40, 512), (16, 33, 768), (31, 64, 256), (40, 17, 512), (3, 7, 256)]  # (x rows, outputs, inputs)


def check_repacked_same_bits(ops, qtype, m: int, n: int, k: int) -> None:
    """quant_repack's K-quant layout (kquant_cpu.cpp: a full tile's super-blocks word-major, Q6_K's d
    after them) gives the int8 product of the file's blocks bit for bit, its rows dequantize to the
    file's, and the rows after the last full tile stay as they were."""
    blocks, _ = random_blocks(qtype, n, k)
    tile = ops.quant_repack_rows()
    packed = ops.quant_repack(blocks, int(qtype), k)
    full = n // tile * tile
    assert packed.shape == blocks.shape and torch.equal(packed[full:], blocks[full:])
    assert full == 0 or not torch.equal(packed[:full], blocks[:full])
    t = int(qtype) | cpu_quant.REPACKED
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(n) if m % 2 else None
    want = ops.kquant_linear(x, blocks, int(qtype), bias, int8=True)
    assert torch.equal(ops.kquant_linear(x, packed, t, bias, int8=True), want), (qtype, m, n, k)
    like = torch.empty(0)
    assert torch.equal(ops.kquant_dequantize(packed, t, k, None, like), ops.kquant_dequantize(blocks, int(qtype), k, None, like))
    rows = torch.tensor([n - 1, 0, n // 2, min(17, n - 1)])
    assert torch.equal(ops.kquant_dequantize(packed, t, k, rows, like), ops.kquant_dequantize(blocks, int(qtype), k, rows, like))


@pytest.mark.parametrize("qtype", list(ENCODERS), ids=lambda t: t.name)
@pytest.mark.parametrize("shape", REPACK_SHAPES, ids=str)
def test_a_repacked_k_quant_weight_gives_the_same_bits(ops, qtype, shape) -> None:
    """As Q8_0/Q4_0/Q4_1's (tests/engine/test_cpu_quant.py): 16 rows a tile on AVX512-VNNI, 8 on the
    AVX2 build (its child test below); a build without int8 tiles refuses to repack."""
    if not ops.quant_repack_rows():
        with pytest.raises(RuntimeError, match="no int8 tiles"):
            ops.quant_repack(random_blocks(qtype, 16, 256)[0], int(qtype), 256)
        return
    check_repacked_same_bits(ops, qtype, *shape)


def test_a_repacked_k_quant_weight_refuses_the_other_products(ops) -> None:
    """As Q8_0/Q4_0/Q4_1's (check_repacked_refusals)."""
    check_repacked_refusals(ops, ops.kquant_linear, random_blocks(T.Q6_K, 32, 512)[0], int(T.Q6_K), 512)


AVX2_CHECK = """
import numpy as np, torch, gguf
from engine.backends.cpu_kernels import cpu_ops
from tests.engine.test_kquants import ENCODERS, SHAPES, EXACT, random_blocks, relative_error
from tests.engine.test_kquants import INT8_SHAPES, QUANTIZED, int8_errors, signed_blocks
from tests.engine.test_kquants import REPACK_SHAPES, check_repacked_same_bits
from tests.engine.test_kquants import test_int8_sums_at_the_largest_quants_do_not_overflow as largest_quants_do_not_overflow
ops = cpu_ops()
torch.manual_seed(0)
print("lanes", ops.lanes())
for qtype in ENCODERS:
    for m, n, k in SHAPES:
        blocks, w = random_blocks(qtype, n, k)
        x = torch.randn(m, k)
        assert torch.equal(ops.kquant_dequantize(blocks, int(qtype), k, None, torch.empty(0)), w)
        y = ops.kquant_linear(x, blocks, int(qtype), None)
        assert relative_error(y, x, w, None) <= EXACT, (qtype, m, n, k)
        assert torch.equal(ops.kquant_linear(x[-1:], blocks, int(qtype), None)[0], y[-1])
        assert torch.equal(ops.kquant_linear(x[-3:], blocks, int(qtype), None), y[-3:])
    for m, n, k in INT8_SHAPES:  # int8 inputs: the 8-lane vpmaddubsw tiles, the build's only int8 path
        blocks, w = signed_blocks(qtype, n, k)
        x = torch.randn(m, k)
        y = ops.kquant_linear(x, blocks, int(qtype), None, int8=True)
        exact, plain = int8_errors(y, x, w)
        assert exact <= EXACT and plain <= QUANTIZED, (qtype, m, n, k, exact, plain)
        assert torch.equal(ops.kquant_linear(x[-3:], blocks, int(qtype), None, int8=True), y[-3:])
    largest_quants_do_not_overflow(ops, qtype)  # the 16-bit sums at their bound
    assert ops.quant_repack_rows() == 8
    for m, n, k in REPACK_SHAPES:  # repacked for the 8-row tiles
        check_repacked_same_bits(ops, qtype, m, n, k)
print("ok")
"""


def test_the_avx2_build_too() -> None:
    out = run_with_isa(AVX2_CHECK)
    assert "lanes 8" in out and "ok" in out


@pytest.fixture(scope="module")
def kquant_file(tmp_path_factory) -> Path:
    from engine.loader import embedded_gguf

    path = tmp_path_factory.mktemp("kquants") / "smollm2-kquants.gguf"
    kquant_copy(embedded_gguf(), path)
    return path


def test_a_file_with_k_quants_keeps_them_in_blocks_and_generates_as_transformers(kquant_file) -> None:
    from engine.loader import load_model

    native = load_model(str(kquant_file), "float32", quantization="gguf")
    downs = [layer.mlp.down_proj for layer in native.model.model.layers]
    assert all(isinstance(d, QuantizedLinear) for d in downs)
    assert [d.qtype for d in downs[:4]] == [int(T.Q4_K), int(T.Q6_K), int(T.Q4_K), int(T.Q6_K)]
    from engine.gguf_loader import open_reader

    reader = open_reader(kquant_file)
    blk0 = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    assert torch.equal(downs[0].dequantized(), torch.from_numpy(gguf.quants.dequantize(blk0.data, blk0.tensor_type)))
    reference = load_model(str(kquant_file), "float32", quantization="none").model  # transformers' dequantization
    tok = native.tokenizer
    prompt = list(tok.apply_chat_template([{"role": "user", "content": "List three facts about bees."}],
                                          add_generation_prompt=True, tokenize=True, return_dict=False))  # fmt: skip
    out = generate_batch(native.model, [prompt], max_new_tokens=10, ignore_eos=True, progress_bar=False, warmup=False)
    for o in out.values():
        x = torch.tensor([prompt])
        kwargs = {"attention_mask": torch.ones_like(x), "max_new_tokens": 10, "do_sample": False, "eos_token_id": None}
        mine = native.model.generate(x, **kwargs)[0, len(prompt):].tolist()
        assert o.generated_tokens == mine
        assert reference.generate(x, **kwargs)[0, len(prompt):].tolist() == mine
    # with int8 inputs (quantized_activations int8) the K-quant layers switch too, and the engine
    # still equals model.generate on the same model
    from engine.backends.cpu_quant import use_int8_activations

    assert use_int8_activations(native.model) >= len(downs) and all(d.int8_activations for d in downs)
    if native.model.model.layers[0].mlp.down_proj.ops.quant_repack_rows():  # repacked for the int8 tiles
        assert all(d.qtype & cpu_quant.REPACKED for d in downs)
        assert native.model.cbserve_quantization["repacked"] >= len(downs)
    out = generate_batch(native.model, [prompt], max_new_tokens=10, ignore_eos=True, progress_bar=False, warmup=False)
    x = torch.tensor([prompt])
    mine = native.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False,
                                 eos_token_id=None)[0, len(prompt):].tolist()  # fmt: skip
    assert next(iter(out.values())).generated_tokens == mine


# int8 inputs: x rounded to int8 blocks of 32 as quant_linear's int8 product rounds it. Against that
# rounded x times the dequantized weight (float64) the kernel agrees to float rounding; against the
# plain product it differs by x's rounding. Outputs not a multiple of the 8- and 16-row tiles (the
# last rows go through a padded tile), rows of x over one pass of 16, Q6_K scales of both signs.
INT8_SHAPES = [(1, 37, 256), (3, 129, 512), (7, 64, 1536), (33, 5, 768), (16, 48, 2048), (17, 20, 256)]
QUANTIZED = 5e-3


def signed_blocks(qtype, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """random_blocks with every other Q6_K scale negated (real files have negative ones; the test
    encoder makes them positive): the weights are read back by gguf-py as before."""
    blocks, _ = random_blocks(qtype, n, k, seed)
    if qtype == T.Q6_K:
        raw = blocks.numpy().reshape(n, k // 256, 210).copy()
        scales = raw[..., 192:208].view(np.int8)
        scales[..., ::2] = -scales[..., ::2]
        blocks = torch.from_numpy(raw.reshape(n, -1))
    return blocks, torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), qtype).reshape(n, k)).float()


def int8_errors(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[float, float]:
    from tests.engine.test_cpu_quant import quantized_x

    scale = x.double().norm(dim=1, keepdim=True) * w.double().norm(dim=1)
    exact = quantized_x(x) @ w.double().T
    plain = x.double() @ w.double().T
    return float(((y.double() - exact).abs() / scale).max()), float(((y.double() - plain).abs() / scale).max())


@pytest.mark.parametrize("qtype", list(ENCODERS), ids=lambda t: t.name)
@pytest.mark.parametrize("shape", INT8_SHAPES, ids=str)
def test_int8_inputs_equal_rounded_x_times_the_dequantised_weight(ops, qtype, shape) -> None:
    m, n, k = shape
    blocks, w = signed_blocks(qtype, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(5))
    def both() -> tuple[torch.Tensor, torch.Tensor]:
        return (ops.kquant_linear(x, blocks, int(qtype), None, int8=True),
                ops.kquant_linear(x, blocks, int(qtype), torch.ones(n), int8=True))  # fmt: skip

    for vnni, (y, with_bias) in on_each_int8_path(ops, both).items():
        exact, plain = int8_errors(y, x, w)
        assert exact <= EXACT and plain <= QUANTIZED, (vnni, exact, plain)
        assert torch.allclose(with_bias, y + 1, atol=1e-5)


@pytest.mark.parametrize("qtype", list(ENCODERS), ids=lambda t: t.name)
def test_an_int8_rows_product_does_not_depend_on_its_batch(ops, qtype) -> None:
    """A row gets the same bits alone, in a group of 8 or 16 rows of x, past one pass of 16, and in
    the padded last tile (71 outputs), on each int8 product the build has (16 and 8 lanes)."""
    blocks, _ = signed_blocks(qtype, 71, 512, seed=2)
    x = torch.randn(19, 512, generator=torch.Generator().manual_seed(2))

    def check() -> bool:
        batch = ops.kquant_linear(x, blocks, int(qtype), None, int8=True)
        for rows in ([0], [5, 6, 7], list(range(3, 9)), list(range(2, 19)), [17], list(range(10, 19))):
            assert torch.equal(ops.kquant_linear(x[rows], blocks, int(qtype), None, int8=True), batch[rows]), rows
        return True

    assert all(on_each_int8_path(ops, check).values())


@pytest.mark.parametrize("qtype", list(ENCODERS), ids=lambda t: t.name)
def test_int8_sums_at_the_largest_quants_do_not_overflow(ops, qtype) -> None:
    """Every quant at its top (Q4_K 15, Q6_K 63) against x whose blocks round to +-127 everywhere: the
    8-lane tiles add the pair sums of several groups in 16 bits (Q4_K all 8: 8 x 3,810; Q6_K 2 x
    16,002) before widening, so these are the largest sums they meet; still the exact rounded-x product."""
    n, k = 21, 512
    blocks, _ = signed_blocks(qtype, n, k, seed=3)
    raw = blocks.numpy().reshape(n, k // 256, -1).copy()
    if qtype == T.Q4_K:
        raw[..., 16:144] = 0xFF  # both nibbles 15
    else:
        raw[..., 0:192] = 0xFF  # low nibbles and high bit pairs: 63
    blocks = torch.from_numpy(raw.reshape(n, -1))
    w = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), qtype).reshape(n, k)).float()
    x = torch.stack([torch.ones(k), -torch.ones(k), torch.tensor([1.0, -1.0]).repeat(k // 2)])
    for vnni, y in on_each_int8_path(ops, lambda: ops.kquant_linear(x, blocks, int(qtype), None, int8=True)).items():
        assert int8_errors(y, x, w)[0] <= EXACT, vnni


def test_the_module_multiplies_k_quants_with_int8_inputs_when_switched(ops) -> None:
    from engine.backends.cpu_quant import use_int8_activations

    blocks, w = signed_blocks(T.Q6_K, 40, 512)
    model = torch.nn.Sequential(QuantizedLinear(blocks, int(T.Q6_K), 512, ops=ops))
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(7))
    assert use_int8_activations(model) == 1 and model[0].int8_activations
    assert model.cbserve_quantization["activations"] == "int8"
    assert torch.equal(model(x), ops.kquant_linear(x, blocks, int(T.Q6_K), None, int8=True))
    prompt = torch.randn(DEQUANTIZE_ROWS + 3, 512, generator=torch.Generator().manual_seed(8))  # int8 at any size
    assert int8_errors(model(prompt), prompt, w)[0] <= EXACT
