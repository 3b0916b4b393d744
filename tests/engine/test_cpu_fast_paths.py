"""The CPU fast paths: the C++ paged attention kernel, fused element-wise passes, oneDNN-packed linear weights.

Each is checked against the torch path it replaces, and the engine's greedy output stays equal to
model.generate with them on, with them off, and after the weights change in place.
"""

from __future__ import annotations

import re

import pytest
import torch

from transformers.models.llama import modeling_llama as llama

from engine import ContinuousBatchingConfig, LLMEngine, generate_batch
from engine.backends.cpu import CASCADE_MIN_SEQS, SDPABackend
from engine.backends.cpu_kernels import cpu_ops
from engine.backends.cpu_linear import PackedLinears
from engine.testing import build_test_model
from tests.engine.conftest import MAX_NEW, model_for, prompts_for, reference


def reference_attention(q, k_cache, v_cache, tables, k_lens, q_start, scale, window):
    """One sequence at a time, in float64, straight from the definition (causal, sliding window)."""
    out = torch.empty(q.shape[0], q.shape[1], v_cache.shape[3], dtype=torch.float64)
    bs, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    for b in range(len(k_lens)):
        n, s0, s1 = int(k_lens[b]), int(q_start[b]), int(q_start[b + 1])
        blocks = tables[b, : -(-n // bs)].long()
        k = k_cache[blocks].reshape(-1, *k_cache.shape[2:])[:n].double().repeat_interleave(group, 1)
        v = v_cache[blocks].reshape(-1, *v_cache.shape[2:])[:n].double().repeat_interleave(group, 1)
        q_pos, k_pos = torch.arange(n - (s1 - s0), n)[:, None], torch.arange(n)[None]
        allowed = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
        scores = torch.einsum("qhd,thd->hqt", q[s0:s1].double(), k) * scale
        out[s0:s1] = torch.einsum("hqt,thd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)
    return out


def random_step(q_lens, k_lens, heads, kv_heads, dim, dtype, seed):
    """A cache of random blocks and a step with these query and key counts per sequence."""
    g = torch.Generator().manual_seed(seed)
    bs, num_blocks = 16, 256
    k_cache = torch.randn(num_blocks, bs, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, bs, kv_heads, dim, generator=g).to(dtype)
    width = max(-(-n // bs) for n in k_lens)
    tables = torch.randperm(num_blocks, generator=g)[: len(k_lens) * width].view(len(k_lens), width).int()
    q = torch.randn(sum(q_lens), heads, dim, generator=g).to(dtype)
    q_start = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_cache, v_cache, tables.contiguous(), torch.tensor(k_lens, dtype=torch.int32), q_start


STEPS = {
    "one decode": ([1], [37]),
    "three decodes": ([1, 1, 1], [1, 16, 95]),
    "forty decodes": ([1] * 40, list(range(2, 82, 2))),  # enough to give each item whole cache rows
    "mixed": ([1, 1, 7, 40, 1], [3, 90, 7, 60, 17]),  # decodes, a fresh prompt, a chunk with history
    "long prompt": ([93], [93]),
}


def sharing_step(dtype, heads=8, kv_heads=2, dim=64, seed=0):
    """Decode tokens of ten sequences: six share their first three blocks (two of them a fourth too),
    three share one block, one shares nothing; lengths end inside, and exactly at, a shared block."""
    k_lens = [49, 64, 65, 80, 71, 100, 40, 17, 33, 50]
    q, k_cache, v_cache, tables, lens, starts = random_step([1] * 10, k_lens, heads, kv_heads, dim, dtype, seed)
    tables[:6, :3] = tables[0, :3]
    tables[4:6, 3] = tables[4, 3]
    tables[6:9, 0] = tables[6, 0]
    return q, k_cache, v_cache, tables, lens, starts


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 64), (9, 3, 32), (4, 4, 128)])
@pytest.mark.parametrize("min_seqs", [-1, 0, 2, 3, 4, 20])
def test_kernel_attends_shared_blocks_together(dtype, tol, heads, kv_heads, dim, min_seqs) -> None:
    """Cascade attention (the shared blocks for all sharers at once, merged by log-sum-exp) gives
    the definition's answer whatever the groups it finds; windows and prefill chunks keep it off."""
    q, k_cache, v_cache, tables, lens, starts = sharing_step(dtype, heads, kv_heads, dim)
    out = torch.empty_like(q)
    cpu_ops().paged_attention(out, q, k_cache, v_cache, tables, lens, starts, dim**-0.5, 0, min_seqs)
    expected = reference_attention(q, k_cache, v_cache, tables, lens, starts, dim**-0.5, 0)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    cpu_ops().paged_attention(out, q, k_cache, v_cache, tables, lens, starts, dim**-0.5, 7, min_seqs)
    expected = reference_attention(q, k_cache, v_cache, tables, lens, starts, dim**-0.5, 7)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


def test_kernel_default_for_cascade_is_the_engines() -> None:
    """The binding's default (for direct calls) and the engine's setting are one number."""
    default = re.search(r"cascade_min_seqs: [^=]*= (\d+)", cpu_ops().paged_attention.__doc__)
    assert default is not None and int(default.group(1)) == CASCADE_MIN_SEQS
    assert SDPABackend().cascade_min_seqs == CASCADE_MIN_SEQS


def test_cascade_merges_parts_whose_scores_differ_by_far_more_than_exp_can_hold() -> None:
    """One part's scores dwarf the other's (exp(-200) is 0 in float32): the merge rescales to the
    larger max instead of overflowing."""
    q, k_cache, v_cache, tables, lens, starts = sharing_step(torch.float32)
    shared = tables[0, :3].long()
    k_cache[shared] *= 40.0  # the shared keys score far above the own ones
    out, expected = torch.empty_like(q), reference_attention(q, k_cache, v_cache, tables, lens, starts, 0.125, 0)
    cpu_ops().paged_attention(out, q, k_cache, v_cache, tables, lens, starts, 0.125, 0, 2)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_kernel_is_built_here() -> None:
    assert cpu_ops() is not None, "the C++ CPU kernels did not build (see the warning in the log)"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1), (9, 3)])
@pytest.mark.parametrize("window", [0, 5, 37])
@pytest.mark.parametrize("dim", [32, 64, 128])
def test_kernel_matches_definition(dtype, tol, step, heads, kv_heads, window, dim) -> None:
    q_lens, k_lens = STEPS[step]
    q, k_cache, v_cache, tables, lens, starts = random_step(q_lens, k_lens, heads, kv_heads, dim, dtype, seed=dim)
    out = torch.empty_like(q)
    cpu_ops().paged_attention(out, q, k_cache, v_cache, tables, lens, starts, dim**-0.5, window)
    expected = reference_attention(q, k_cache, v_cache, tables, lens, starts, dim**-0.5, window)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


# The kernel takes an item's keys a chunk at a time (256 for decode tokens, 512 for prompt chunks), its
# softmax online: steps whose keys span several chunks, with windows that leave a row no key in some
# chunk (480: a prompt item's 64 queries span 543 keys) and chunks that start mid-block
LONG_STEPS = {
    "long decodes": ([1, 1, 1], [700, 257, 513]),
    "prompt over chunks": ([700], [700]),
    "chunk after history": ([300, 1], [900, 600]),
}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("step", list(LONG_STEPS))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (9, 3)])
@pytest.mark.parametrize("window", [0, 5, 200, 480])
def test_kernel_matches_definition_over_many_key_chunks(dtype, tol, step, heads, kv_heads, window) -> None:
    q_lens, k_lens = LONG_STEPS[step]
    q, k_cache, v_cache, tables, lens, starts = random_step(q_lens, k_lens, heads, kv_heads, 64, dtype, seed=window)
    out = torch.empty_like(q)
    cpu_ops().paged_attention(out, q, k_cache, v_cache, tables, lens, starts, 0.125, window)
    expected = reference_attention(q, k_cache, v_cache, tables, lens, starts, 0.125, window)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("rising", [True, False])
def test_kernel_rescales_its_sums_when_a_later_chunk_scores_far_higher(rising) -> None:
    """Keys grow (or shrink) block by block, so one chunk's scores lie far above another's (beyond
    what exp can hold in float32): the running sums are rescaled to the new max, never overflow."""
    q, k_cache, v_cache, tables, lens, starts = random_step([1, 200], [900, 900], 8, 2, 64, torch.float32, seed=3)
    for b in range(len(lens)):
        blocks = tables[b, : -(-int(lens[b]) // 16)].tolist()
        for j, block in enumerate(blocks if rising else blocks[::-1]):
            k_cache[block] *= 1 + j / 4
    out, expected = torch.empty_like(q), reference_attention(q, k_cache, v_cache, tables, lens, starts, 0.125, 0)
    cpu_ops().paged_attention(out, q, k_cache, v_cache, tables, lens, starts, 0.125, 0)
    assert torch.isfinite(out).all()
    # scores up to about 100 carry float32 rounding of about 1e-5 into each probability; a sum left
    # at a stale max would be off by orders of magnitude
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)


def test_kernel_refuses_what_it_cannot_do() -> None:
    """Bad shapes, dtypes or indices are a clear error, never a read outside the cache."""
    ops = cpu_ops()

    def call(q=None, cache=None, tables=None, lens=None, starts=None):
        q = torch.randn(2, 4, 32) if q is None else q
        cache = torch.randn(8, 16, 4, q.shape[-1], dtype=q.dtype) if cache is None else cache
        tables = torch.zeros(2, 1, dtype=torch.int32) if tables is None else tables
        lens = torch.tensor([3, 4], dtype=torch.int32) if lens is None else lens
        starts = torch.tensor([0, 1, 2], dtype=torch.int32) if starts is None else starts
        ops.paged_attention(torch.empty_like(q), q, cache, cache, tables, lens, starts, 0.2, 0)

    call()  # the baseline is fine
    with pytest.raises(RuntimeError, match="multiples of 16"):
        call(q=torch.randn(2, 4, 24))
    with pytest.raises(RuntimeError, match="int32"):
        call(tables=torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(RuntimeError, match="int32"):
        call(lens=torch.tensor([3, 4]))
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        call(q=torch.randn(2, 4, 32, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="length outside its block table"):
        call(lens=torch.tensor([3, 17], dtype=torch.int32))  # one block of 16 in the table
    with pytest.raises(RuntimeError, match="block id outside the cache"):
        call(tables=torch.tensor([[0], [8]], dtype=torch.int32))  # the cache has blocks 0..7
    with pytest.raises(RuntimeError, match="one block-table row"):
        call(lens=torch.tensor([3], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="1 to k_len queries"):
        call(starts=torch.tensor([0, 0, 2], dtype=torch.int32))  # a sequence with no query
    with pytest.raises(RuntimeError, match="1 to k_len queries"):
        call(q=torch.randn(6, 4, 32), starts=torch.tensor([0, 4, 6], dtype=torch.int32))  # 4 queries, 3 keys
    with pytest.raises(RuntimeError, match="from 0 to the tokens"):
        call(starts=torch.tensor([0, 1, 3], dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_argmax_kernel_agrees_with_torch(dtype) -> None:
    g = torch.Generator().manual_seed(1)
    wide = (torch.randn(9, 32000, generator=g) * 4).to(dtype)
    edge = torch.zeros(6, 37, dtype=dtype)
    edge[1, 20] = edge[1, 30] = 1  # a tie: the first index wins
    edge[2, 3], edge[2, 36] = 5, float("nan")  # a NaN wins, as in torch
    edge[3] = float("-inf")
    edge[4, 36] = 2  # the largest value in the tail past the last 16 lanes
    edge[5, 7] = float("nan")
    short = torch.randn(3, 5, generator=g).to(dtype)
    for logits in (wide, edge, short, wide[:, :1000]):  # the last one with rows far apart
        assert torch.equal(cpu_ops().argmax_rows(logits), logits.float().argmax(-1))


def test_greedy_argmax_kernel_refuses_what_it_cannot_do() -> None:
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        cpu_ops().argmax_rows(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"\[rows, vocab\]"):
        cpu_ops().argmax_rows(torch.randn(2, 8, 3))
    with pytest.raises(RuntimeError, match=r"\[rows, vocab\]"):
        cpu_ops().argmax_rows(torch.randn(8, 2).t())
    backend = SDPABackend()  # the backend hands the kernel only what it takes
    x = torch.randn(8, 4, dtype=torch.float64)
    assert torch.equal(backend.argmax(x), x.argmax(-1))
    y = torch.randn(8, 4).t()
    assert torch.equal(backend.argmax(y), y.argmax(-1))


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
    if not kernels:  # no attention kernel, no fused element-wise passes: torch alone
        engine.backend.ops = None
        engine.runner.module_swaps.remove(engine.fused_modules)
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
    assert llama.apply_rotary_pos_emb.__module__ == llama.__name__  # transformers' own again
    prompt = prompts_for()[0]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=3)  # fmt: skip
    assert tuple(out[0, len(prompt) :].tolist()) == reference("llama", prompt)


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("how", ["in place", "in place, watched from Python", "replaced"])
def test_changed_weights_are_used_by_the_next_round(packed: bool, how: str) -> None:
    """An RL trainer updates the weights between rounds: the next round must use the new ones, though
    the same prompts sit in the prefix cache and (packed) in oneDNN's copies. In place the engine
    notices by itself (by the kernels' read of the version counters, or Python's where they are not
    loaded); new tensors are announced with reset_prefix_cache()."""
    from engine.testing import build_test_model
    from engine.weights_watch import WeightsWatch

    model = build_test_model("qwen2", vocab_size=512, seed=1)
    engine = LLMEngine(model, ContinuousBatchingConfig(block_size=16, num_blocks=256, cpu_packed_weights=packed))
    assert engine._watch.native is not None  # the CPU kernels are loaded here
    if how == "in place, watched from Python":
        engine._watch = WeightsWatch(model.parameters())
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
                if how.startswith("in place"):  # an optimizer step
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


def test_sibling_linears_share_one_product_and_fall_back_when_called_apart() -> None:
    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(32, n, bias=True) for n in (64, 16, 16))

    attn = Attention()
    packed = PackedLinears(attn)
    assert len(packed.groups) == 1 and len(packed) == 3
    x, other = torch.randn(5, 32), torch.randn(5, 32)
    want = [torch.nn.functional.linear(t, m.weight, m.bias) for t, m in
            ((x, attn.q_proj), (x, attn.k_proj), (other, attn.v_proj), (x, attn.v_proj))]  # fmt: skip
    with packed.active():
        got = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(other), attn.v_proj(x)]  # v first on another input
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert packed.groups[0].pending_input is None  # nothing held after the forward
    with torch.no_grad():
        attn.k_proj.weight.mul_(2)  # a changed member packs the group again
    assert packed.refresh() == 1
    with packed.active():
        attn.q_proj(x)
        torch.testing.assert_close(attn.k_proj(x), torch.nn.functional.linear(x, attn.k_proj.weight, attn.k_proj.bias),
                                   atol=1e-5, rtol=1e-5)  # fmt: skip


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


def test_malloc_settings_apply_once_on_glibc() -> None:
    import platform

    from engine.backends import cpu_malloc

    on_glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert cpu_malloc.tune() is on_glibc  # a CPU engine has already applied them: the same answer
    assert cpu_malloc.tune() is on_glibc


def test_malloc_settings_can_be_switched_off() -> None:
    import os
    import subprocess
    import sys

    code = "from engine.backends import cpu_malloc; print(cpu_malloc.tune())"
    env = {**os.environ, "CBSERVE_CPU_MALLOC_TUNING": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- cbserve's panel kernel for the linear layers (engine/csrc/linear_cpu.cpp) ---------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_products_equal_f_linear_to_rounding_at_every_block_edge(dtype, bias):
    """Rows 1 to past one pass of row blocks (96 or 192 rows), outputs not a multiple of a panel,
    inputs longer than one chunk of k, an input that is a strided view: all as F.linear in float64,
    to the rounding of the dtype."""
    ops = cpu_ops()
    g = torch.Generator().manual_seed(3)
    for n, k in ((37, 300), (64, 64), (130, 520)):
        weight = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
        b = torch.randn(n, generator=g).to(dtype) if bias else None
        panels = ops.pack_linear_weight(weight)
        assert panels.dtype == dtype and panels.shape[1:] == (k, ops.linear_panel_width())
        for rows in (1, 5, 6, 13, 16, 25, 97, 250):  # (16 rows: two blocks of 8 under AVX-512)
            x = torch.randn(rows, 2 * k, generator=g).to(dtype)[:, ::2]  # not contiguous
            y = ops.packed_linear(x, panels, b, n)
            exact = x.double() @ weight.double().T + (b.double() if bias else 0)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            assert y.dtype == dtype and y.shape == (rows, n)
            torch.testing.assert_close(y.double(), exact.to(dtype).double(), atol=tol, rtol=tol)


def test_panel_products_refuse_what_they_do_not_take():
    ops = cpu_ops()
    panels = ops.pack_linear_weight(torch.randn(16, 32))
    with pytest.raises(RuntimeError, match="panels do not match"):
        ops.packed_linear(torch.randn(2, 31), panels, None, 16)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        ops.pack_linear_weight(torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="2-d CPU weight"):
        ops.pack_linear_weight(torch.randn(4))


def test_engine_linears_on_panels_match_generate(arch):
    """The engine of this host (panels under an AVX2 build of the kernels; panels for decode steps
    under an AVX-512 one) gives model.generate's greedy tokens, with a budget small enough that
    prompt steps of under and over PANEL_ROWS rows both occur."""
    prompts = [list(p) for p in prompts_for()[:8]]
    cfg = ContinuousBatchingConfig(block_size=16, num_blocks=256, max_batch_tokens=96, cpu_packed_weights=True)
    out = generate_batch(model_for(arch), prompts, continuous_batching_config=cfg, max_new_tokens=MAX_NEW,
                         ignore_eos=True, progress_bar=False)  # fmt: skip
    assert LLMEngine(model_for(arch), cfg).packed_linears.plan.ops is not None
    assert [tuple(out[f"req_{i}"].generated_tokens) for i in range(len(prompts))] == [
        reference(arch, tuple(p)) for p in prompts
    ]


def test_packed_weights_asked_of_a_model_off_the_cpu_are_refused() -> None:
    model = build_test_model("llama").to("meta")  # any device but the CPU, no GPU needed
    with pytest.raises(ValueError, match="cpu_packed_weights needs a model on the CPU, this one is on meta"):
        LLMEngine(model, ContinuousBatchingConfig(block_size=16, num_blocks=8, cpu_packed_weights=True))
