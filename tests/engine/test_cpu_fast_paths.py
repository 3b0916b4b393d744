"""The CPU fast paths: the C++ paged decode kernel and oneDNN-packed linear weights.

Each is checked against the torch path it replaces, and the engine's greedy output stays equal to
model.generate with them on, with them off, and after the weights change in place.
"""

from __future__ import annotations

import pytest
import torch

from engine import ContinuousBatchingConfig, LLMEngine, generate_batch
from engine.backends.cpu import SDPABackend
from engine.backends.cpu_kernels import cpu_ops
from engine.backends.cpu_linear import PackedLinears
from tests.engine.conftest import MAX_NEW, model_for, prompts_for, reference


def reference_decode(q, k_cache, v_cache, tables, lens, scale, window):
    """One sequence at a time, in float64, straight from the definition."""
    out = []
    bs = k_cache.shape[1]
    for b in range(q.shape[0]):
        n = int(lens[b])
        blocks = tables[b, : -(-n // bs)].long()
        k = k_cache[blocks].reshape(-1, *k_cache.shape[2:])[:n].double()
        v = v_cache[blocks].reshape(-1, *v_cache.shape[2:])[:n].double()
        first = max(0, n - window) if window else 0
        group = q.shape[1] // k_cache.shape[2]
        k, v = k[first:].repeat_interleave(group, 1), v[first:].repeat_interleave(group, 1)
        scores = torch.einsum("hd,thd->ht", q[b].double(), k) * scale
        out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v))
    return torch.stack(out)


def test_kernel_is_built_here() -> None:
    assert cpu_ops() is not None, "the C++ CPU kernels did not build (see the warning in the log)"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("num_seqs", [1, 3, 40])  # few sequences split by KV head, many by sequence
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("window", [0, 5, 37])
@pytest.mark.parametrize("dim", [32, 128])
def test_decode_kernel_matches_definition(dtype, tol, num_seqs, heads, kv_heads, window, dim) -> None:
    g = torch.Generator().manual_seed(num_seqs * 100 + heads + window + dim)
    bs, num_blocks = 16, 256
    k_cache = torch.randn(num_blocks, bs, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, bs, kv_heads, dim, generator=g).to(dtype)
    lens = torch.randint(1, 6 * bs, (num_seqs,), generator=g)
    tables = torch.randperm(num_blocks, generator=g)[: num_seqs * 6].view(num_seqs, 6).int().contiguous()
    q = torch.randn(num_seqs, heads, dim, generator=g).to(dtype)
    out = torch.empty_like(q)
    cpu_ops().paged_decode_attention(out, q, k_cache, v_cache, tables, lens, dim**-0.5, window)
    expected = reference_decode(q, k_cache, v_cache, tables, lens, dim**-0.5, window)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


def test_kernel_refuses_what_it_cannot_do() -> None:
    """Bad shapes, dtypes or indices are a clear error, never a read outside the cache."""
    ops = cpu_ops()

    def call(q=None, cache=None, tables=None, lens=None):
        q = torch.randn(2, 4, 32) if q is None else q
        cache = torch.randn(8, 16, 4, q.shape[-1], dtype=q.dtype) if cache is None else cache
        tables = torch.zeros(2, 1, dtype=torch.int32) if tables is None else tables
        lens = torch.tensor([3, 4]) if lens is None else lens
        ops.paged_decode_attention(torch.empty_like(q), q, cache, cache, tables, lens, 0.2, 0)

    call()  # the baseline is fine
    with pytest.raises(RuntimeError, match="multiples of 16"):
        call(q=torch.randn(2, 4, 24))
    with pytest.raises(RuntimeError, match="int32"):
        call(tables=torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        call(q=torch.randn(2, 4, 32, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="length outside its block table"):
        call(lens=torch.tensor([3, 17]))  # one block of 16 in the table
    with pytest.raises(RuntimeError, match="block id outside the cache"):
        call(tables=torch.tensor([[0], [8]], dtype=torch.int32))  # the cache has blocks 0..7
    with pytest.raises(RuntimeError, match="one block-table row"):
        call(lens=torch.tensor([3]))


def test_backend_falls_back_to_torch_where_the_kernel_cannot_run() -> None:
    backend = SDPABackend()
    q, cache = torch.randn(2, 4, 32), torch.randn(8, 16, 4, 32)
    assert backend._kernel_fits(q, cache, cache, softcap=None)
    assert not backend._kernel_fits(q, cache, cache, softcap=30.0)
    assert not backend._kernel_fits(q.double(), cache.double(), cache.double(), softcap=None)
    assert not backend._kernel_fits(torch.randn(2, 4, 24), torch.randn(8, 16, 4, 24), torch.randn(8, 16, 4, 24), None)
    assert not SDPABackend(use_kernels=False)._kernel_fits(q, cache, cache, softcap=None)


def run_engine(model, prompts, *, kernels: bool, packed: bool, **cfg):
    engine = LLMEngine(model, ContinuousBatchingConfig(block_size=16, num_blocks=512, cpu_packed_weights=packed, **cfg))
    if not kernels:
        engine.backend.ops = None
    assert (engine.backend.ops is not None) == kernels
    assert (engine.packed_linears is not None) == packed
    reqs = [engine.make_request(list(p), max_new_tokens=MAX_NEW, ignore_eos=True) for p in prompts]
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
    return [tuple(r.generated_ids) for r in reqs]


@pytest.mark.parametrize("kernels,packed", [(False, False), (True, False), (False, True), (True, True)])
def test_every_combination_matches_model_generate(arch: str, kernels: bool, packed: bool) -> None:
    model, prompts = model_for(arch), prompts_for()[:12]
    got = run_engine(model, prompts, kernels=kernels, packed=packed, max_batch_tokens=64)
    assert got == [reference(arch, p) for p in prompts]


def test_packed_weights_leave_the_model_untouched() -> None:
    model = model_for("llama")
    run_engine(model, prompts_for()[:2], kernels=True, packed=True)
    assert not any("forward" in m.__dict__ for m in model.modules())  # no forward left swapped in
    prompt = prompts_for()[0]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=3)  # fmt: skip
    assert tuple(out[0, len(prompt) :].tolist()) == reference("llama", prompt)


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("how", ["in place", "replaced"])
def test_changed_weights_are_used_by_the_next_round(packed: bool, how: str) -> None:
    """An RL trainer updates the weights between rounds: the next round must use the new ones, though
    the same prompts sit in the prefix cache and (packed) in oneDNN's copies. In place the engine
    notices by itself; new tensors are announced with reset_prefix_cache()."""
    from engine.testing import build_test_model

    model = build_test_model("qwen2", vocab_size=512, seed=1)
    engine = LLMEngine(model, ContinuousBatchingConfig(block_size=16, num_blocks=256, cpu_packed_weights=packed))
    prompts = [list(p) for p in prompts_for()[:4]]

    def engine_round():
        reqs = [engine.make_request(p, max_new_tokens=8, ignore_eos=True) for p in prompts]
        for r in reqs:
            engine.add_request(r)
        while engine.has_unfinished():
            engine.step()
        return [r.generated_ids for r in reqs]

    def generate_round():
        out = []
        with torch.no_grad():
            for p in prompts:
                ids = model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                     pad_token_id=3)  # fmt: skip
                out.append(ids[0, len(p) :].tolist())
        return out

    before = engine_round()
    assert before == generate_round()
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("mlp.down_proj"):
                if how == "in place":  # an optimizer step
                    module.weight.mul_(-1.5)
                else:
                    module.weight = torch.nn.Parameter(module.weight * -1.5)
    if how == "replaced":
        engine.reset_prefix_cache()
    after = engine_round()
    assert after == generate_round()
    assert after != before


def test_packed_linear_equals_f_linear_to_rounding() -> None:
    layer = torch.nn.Linear(48, 80, bias=True)
    packed = PackedLinears(torch.nn.Sequential(layer))
    x = torch.randn(3, 5, 48)
    with packed.active():
        y = layer(x)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    assert "forward" not in layer.__dict__


def test_cpu_packed_weights_is_validated() -> None:
    with pytest.raises(ValueError, match="cpu_packed_weights"):
        ContinuousBatchingConfig(cpu_packed_weights="yes")


def test_generate_batch_with_everything_off_still_matches() -> None:
    prompts = [list(p) for p in prompts_for()[:6]]
    cfg = ContinuousBatchingConfig(block_size=16, num_blocks=256, cpu_packed_weights=False)
    out = generate_batch(model_for("mistral"), prompts, continuous_batching_config=cfg, max_new_tokens=MAX_NEW,
                         ignore_eos=True, progress_bar=False)  # fmt: skip
    assert [tuple(out[f"req_{i}"].generated_tokens) for i in range(len(prompts))] == [
        reference("mistral", tuple(p)) for p in prompts
    ]
