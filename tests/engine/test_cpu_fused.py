"""Fused C++ element-wise passes (RMSNorm, rotary embedding, SiLU-gated MLP) against transformers' code.

The rotary pass must equal transformers' bit for bit, SiLU-times-up in bfloat16 too; RMSNorm sums its
squares in another order, so float32 agrees to the last bit or two. Which modules get the fused code
is decided by comparing bytecode: anything that is not Llama's own code keeps its own.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama import modeling_llama as llama
from transformers.models.llama.configuration_llama import LlamaConfig

from engine.backends.cpu_fused import FusedModules
from tests.engine.conftest import model_for

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rotary_inputs(dtype, tokens, heads, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    # as LlamaAttention makes them: a projection's [1, T, H * D] viewed as [1, H, T, D]
    x = torch.randn(1, tokens, heads * dim, generator=g).to(dtype).view(1, tokens, heads, dim).transpose(1, 2)
    angles = torch.randn(1, tokens, dim // 2, generator=g) * 20
    angles = torch.cat([angles, angles], dim=-1)
    return x, angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 128, 40, 6])
def test_rotary_equals_transformers_bit_for_bit(ops, dtype, dim) -> None:
    q, cos, sin = rotary_inputs(dtype, 37, 8, dim)
    k, _, _ = rotary_inputs(dtype, 37, 2, dim, seed=1)
    want_q, want_k = llama.apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = ops.rotary(q, cos, sin), ops.rotary(k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert got_q.stride() == q.stride()  # [1, T, H, D] in memory, as the projection's view is


def test_rotary_takes_a_slice_of_a_packed_projection(ops) -> None:
    """With q/k/v packed into one product, k is a strided slice of its output."""
    qkv = torch.randn(1, 9, 3 * 4 * 16, generator=torch.Generator().manual_seed(2))
    k = qkv[..., 64:128].view(1, 9, 4, 16).transpose(1, 2)
    _, cos, sin = rotary_inputs(torch.float32, 9, 1, 16)
    assert torch.equal(ops.rotary(k, cos, sin), llama.apply_rotary_pos_emb(k, k, cos, sin)[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [512, 520, 7])
def test_rms_norm_equals_transformers_to_the_last_bits(ops, dtype, width) -> None:
    norm = llama.LlamaRMSNorm(width, eps=1e-5).to(dtype)
    torch.nn.init.normal_(norm.weight, generator=torch.Generator().manual_seed(0))
    x = (torch.randn(2, 33, width, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    want, got = norm(x), ops.rms_norm(x, norm.weight, 1e-5)
    assert got.shape == want.shape and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=4e-6, atol=4e-6)
    else:  # rounded to 8 or 11 bits: the sum's order changes a rare element by one unit
        assert (got == want).float().mean() > 0.999
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_equals_transformers(ops, dtype) -> None:
    g = torch.Generator().manual_seed(0)
    gate = (torch.randn(19, 1376, generator=g) * 12).to(dtype)
    up = torch.randn(19, 1376, generator=g).to(dtype)
    want, got = F.silu(gate) * up, ops.silu_mul(gate, up)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=2e-3 if dtype == torch.float16 else 1e-6, atol=1e-6)


def test_silu_mul_reads_the_halves_of_one_packed_product(ops) -> None:
    gate_up = torch.randn(7, 2 * 40, generator=torch.Generator().manual_seed(3))
    gate, up = gate_up[:, :40], gate_up[:, 40:]  # strided rows: the halves of one gate/up product
    torch.testing.assert_close(ops.silu_mul(gate, up), F.silu(gate) * up, rtol=1e-6, atol=1e-6)


def test_silu_mul_tails_do_not_overflow(ops) -> None:
    gate = torch.tensor([[-1e4, -300.0, -120.0, -88.0, -87.5, -20.0, 20.0, 95.0, 300.0, 3e38] + [1.0] * 6])
    got, want = ops.silu_mul(gate, torch.ones_like(gate)), F.silu(gate)
    assert torch.isfinite(got).all()
    assert (got[0, :3] == 0).all() and got[0, 3:5].abs().max() < 1e-36  # torch: 0, and under 1e-36
    torch.testing.assert_close(got[0, 5:], want[0, 5:], rtol=1e-6, atol=0)


def test_fused_kernels_refuse_what_they_cannot_do(ops) -> None:
    x = torch.randn(4, 16)
    with pytest.raises(RuntimeError, match="rms_norm: weight"):
        ops.rms_norm(x, torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="rms_norm: weight"):
        ops.rms_norm(x, torch.ones(16, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="rms_norm: float32"):
        ops.rms_norm(x.double(), torch.ones(16, dtype=torch.float64), 1e-6)
    with pytest.raises(RuntimeError, match="rms_norm: a contiguous"):
        ops.rms_norm(x.t(), torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="silu_mul: gate and up must have the same"):
        ops.silu_mul(x, torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="silu_mul: gate and up must be CPU"):
        ops.silu_mul(x[None], x[None])
    q, cos, sin = rotary_inputs(torch.float32, 5, 2, 8)
    with pytest.raises(RuntimeError, match="rotary: cos and sin"):
        ops.rotary(q, cos[:, :4], sin[:, :4])
    with pytest.raises(RuntimeError, match="rotary: cos and sin"):
        ops.rotary(q, cos.bfloat16(), sin.bfloat16())
    with pytest.raises(RuntimeError, match="rotary: x must be"):
        ops.rotary(q[..., :7], cos[..., :7], sin[..., :7])


def test_llama_code_gets_the_fused_passes_and_nothing_else(ops) -> None:
    model = model_for("llama")
    layers = model.config.num_hidden_layers
    fused = FusedModules(model, ops)
    names = [name for _, name, _ in fused.swaps]
    assert names.count("forward") == 3 * layers + 1  # two norms and an MLP per layer, the final norm
    assert names.count("apply_rotary_pos_emb") == 1  # modeling_llama's
    # other code is left alone: Gemma's norm (1 + weight), a GELU MLP
    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, hidden_act="gelu")
    gelu_mlp = llama.LlamaMLP(config)
    other = FusedModules(torch.nn.Sequential(GemmaRMSNorm(16), gelu_mlp), ops)
    assert [name for _, name, _ in other.swaps if name == "forward"] == []


def test_swaps_hold_only_inside_active_and_fall_back_on_other_inputs(ops) -> None:
    model = model_for("llama")
    original_rotary = llama.apply_rotary_pos_emb
    fused = FusedModules(model, ops)
    norm = model.model.norm
    x = torch.randn(3, model.config.hidden_size)
    with fused.active():
        assert "forward" in norm.__dict__ and llama.apply_rotary_pos_emb is not original_rotary
        torch.testing.assert_close(norm(x), llama.LlamaRMSNorm.forward(norm, x), rtol=4e-6, atol=4e-6)
        x64 = x.double()  # not the weight's dtype: transformers' own code runs (and promotes)
        assert torch.equal(norm(x64), llama.LlamaRMSNorm.forward(norm, x64))
        q, cos, sin = rotary_inputs(torch.float32, 4, 2, 8)
        q = q.transpose(1, 2)  # [1, T, H, D], as unsqueeze_dim=2 expects: not the fused layout
        got = llama.apply_rotary_pos_emb(q, q, cos, sin, unsqueeze_dim=2)
        want = original_rotary(q, q, cos, sin, unsqueeze_dim=2)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert "forward" not in norm.__dict__ and llama.apply_rotary_pos_emb is original_rotary


def test_overlapping_activations_in_any_order_leave_transformers_code(ops) -> None:
    """Two engines on one model, on two threads, enter and leave in crossed order: the last to leave
    puts transformers' own code back (not the other's fused code it found when it entered)."""
    model = model_for("llama")
    original_rotary = llama.apply_rotary_pos_emb
    a, b = FusedModules(model, ops), FusedModules(model, ops)
    norm = model.model.norm
    enter_a, enter_b = a.active(), b.active()
    enter_a.__enter__()
    enter_b.__enter__()
    enter_a.__exit__(None, None, None)  # a leaves first: b's forwards are still needed
    assert "forward" in norm.__dict__ and llama.apply_rotary_pos_emb is not original_rotary
    enter_b.__exit__(None, None, None)
    assert "forward" not in norm.__dict__ and llama.apply_rotary_pos_emb is original_rotary
