"""engine/backends/cuda/flex.py on the CPU: FlexAttention over the paged cache, and the choice of backend.

flex_attention runs here eagerly (torch's unfused reference of the same call: it applies the
mask_mod to every slot and ignores the BlockMask's tiles), so the BlockMask, which the compiled GPU
kernel follows, is checked on its own against what the mask allows. (inductor's CPU template of
flex_attention does not compile this mask in torch 2.13: its generated C++ fails to build.) The
engine tests serve through the flex backend with CUDA graphs replayed by the eager stand-in
(tests/gpu/helpers.py).
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from engine.backends import cuda
from engine.backends.cpu import SDPABackend
from engine.backends.cuda import flex
from engine.backends.cuda.flex import TILE, FlexAttnBackend, decode_layout, logical_blocks, prefill_layout
from engine.config import ContinuousBatchingConfig
from engine.testing import build_test_model, random_prompts
from tests.gpu.helpers import make_step, meta_for, run_backend
from tests.gpu.test_engine_with_graphs import NEW, graphed_engine, run_engine, serve

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

MIXED = [(300, 1), (17, 1), (600, 1), (40, 40), (700, 200), (5, 3)]  # decodes, a prompt, chunks with history
DECODE = [(300, 1), (17, 1), (600, 1), (1, 1), (513, 1)]
PREFILL = [(130, 130), (400, 129), (7, 2)]  # chunks crossing query tiles


def eager_flex() -> FlexAttnBackend:
    return FlexAttnBackend(flex_attention)


def test_module_imports_without_triton_or_cuda():
    code = ("import sys, engine.backends.cuda.flex as f, torch; assert 'triton' not in sys.modules; "
            "assert not torch.cuda.is_initialized(); print(f.FlexAttnBackend.name)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cuda-flex"]


def test_logical_blocks_map_each_held_block_to_its_index():
    tables = torch.tensor([[5, 2, 7], [2, 0, 0], [9, 9, 9]], dtype=torch.int32)  # row 2: two blocks of padding
    logical = logical_blocks(tables, torch.tensor([300, 10, 1], dtype=torch.int32), 128, num_blocks=10)
    assert logical.shape == (3, 11)
    assert logical[0, :10].tolist() == [-1, -1, 1, -1, -1, 0, -1, 2, -1, -1]
    assert logical[1, :10].tolist() == [-1, -1, 0, -1, -1, -1, -1, -1, -1, -1]  # its table's zeros are padding
    assert logical[2, :10].tolist() == [-1] * 9 + [0]


@pytest.mark.parametrize("window", [None, 100, 300])
@pytest.mark.parametrize("block_size", [128, 256])
@pytest.mark.parametrize("seqs", [MIXED, DECODE, PREFILL])
def test_block_mask_tiles_hold_every_allowed_key_and_only_the_sequences_own(seqs, block_size, window):
    """What the GPU kernel relies on: a query tile visits every key tile its queries may see (else
    keys are lost), and only tiles of its own sequence's blocks (else it wastes work); with a
    sliding window, none wholly before it."""
    *_, k_cache, _, meta = make_step(seqs, block_size=block_size, num_blocks=4096 // block_size + 2, seed=3)
    key_tiles = k_cache.shape[0] * block_size // TILE
    per_block = block_size // TILE
    nd, T = meta.num_decodes, sum(meta.q_lens)

    def check(seq: int, first: int, last: int, visited: list[int]) -> None:
        table = meta.block_tables[seq].tolist()[: -(-meta.k_lens[seq] // block_size)]
        tile_of = [table[p // block_size] * per_block + p % block_size // TILE for p in range(meta.k_lens[seq])]
        lo = 0 if window is None else max(0, first - window + 1)
        last = min(last, meta.k_lens[seq] - 1)
        assert set(tile_of[lo : last + 1]) <= set(visited) <= set(tile_of), (seq, first, last)
        assert len(visited) == len(set(visited))  # no tile twice
        if window is not None:
            assert tile_of[lo // TILE * TILE] == visited[0]  # starts at the window's first tile

    if nd:
        num, indices = decode_layout(meta, nd, key_tiles).blocks(window)
        assert indices.shape == (nd, 1, 1, key_tiles)
        for i in range(nd):
            pos = meta.k_lens[i] - 1
            check(i, pos, pos, indices[i, 0, 0, : int(num[i, 0, 0])].tolist())
    if nd < meta.num_seqs:
        pre = prefill_layout(meta, nd, T - nd, key_tiles)
        num, indices = pre.blocks(window)
        assert pre.rows % TILE == 0 and num.shape == (1, 1, pre.rows // TILE)
        assert len(set(pre.dest.tolist())) == T - nd  # every token its own row
        cu = meta.cu_seqlens_q.tolist()
        tiles_used: dict[int, list[int]] = {}
        for t in range(T - nd):
            row = int(pre.dest[t])
            seq = int(pre.row_seq[row])
            assert cu[seq] <= t + nd < cu[seq + 1]
            assert int(pre.row_pos[row]) == meta.k_lens[seq] - meta.q_lens[seq] + (t + nd - cu[seq])
            tiles_used.setdefault(row // TILE, []).append(int(pre.row_pos[row]))
        for tile in range(pre.rows // TILE):
            visited = indices[0, 0, tile, : int(num[0, 0, tile])].tolist()
            if tile in tiles_used:
                seq = int(pre.row_seq[tile * TILE])
                check(seq, min(tiles_used[tile]), max(tiles_used[tile]), visited)
            else:
                assert visited == []  # spare tiles visit nothing


@pytest.mark.parametrize("seqs", [MIXED, DECODE, PREFILL])
@pytest.mark.parametrize("kw", [{}, {"sliding_window": 7}, {"sliding_window": 200}, {"softcap": 5.0}])
def test_flex_equals_the_cpu_backend(seqs, kw):
    step = make_step(seqs, block_size=128, num_blocks=24, num_heads=8, num_kv_heads=2, seed=2)
    out, k_cache, v_cache = run_backend(eager_flex(), step, **kw)
    expected, k_exp, v_exp = run_backend(SDPABackend(), step, **kw)
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp)  # written by slot mapping
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_flex_in_bfloat16_with_blocks_of_256():
    step = make_step(MIXED, block_size=256, num_blocks=12, dtype=torch.bfloat16, seed=4)
    out, *_ = run_backend(eager_flex(), step)
    expected, *_ = run_backend(SDPABackend(), step)
    torch.testing.assert_close(out, expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("block_size", [16, 64, 200, 320])
def test_flex_wants_blocks_of_whole_key_tiles(block_size):
    with pytest.raises(ValueError, match=rf"block_size must be a multiple of 128 .* got {block_size}"):
        eager_flex().check_config(block_size)
    eager_flex().check_config(256)


# -- the choice of backend ------------------------------------------------------------------------


@pytest.mark.parametrize("cap, archs, runs", [((9, 0), [90], True), ((9, 0), [80], False), ((8, 0), [90], False),
                                              ((8, 6), [80], True), ((8, 9), [80, 90], True), ((8, 0), [86], False),
                                              ((10, 0), [90], False), ((12, 0), [80, 90, 100, 120], True)])  # fmt: skip
def test_arch_runs_same_major_and_a_minor_at_least_the_built_one(cap, archs, runs):
    assert cuda.arch_runs(cap, archs) is runs


def test_flash_archs_parse():
    assert cuda.flash_archs("90") == [90]
    assert cuda.flash_archs("80;90") == [80, 90]
    assert cuda.flash_archs(" 80, 90 ") == [80, 90]
    assert cuda.flash_archs(None) is None and cuda.flash_archs("") is None
    with pytest.raises(ValueError, match="CBSERVE_FLASH_ATTN_ARCHS must list compute capabilities"):
        cuda.flash_archs("sm_90")


def _choose(flash=True, cap=(9, 0), archs="90", flex_missing=None):
    return cuda.choose_backend("cuda:0", flash_installed=flash, capability=cap if flash else None,
                               flash_archs_value=archs, flex_missing=flex_missing)  # fmt: skip


def test_flash_attn_first_where_installed_and_built_for_this_gpu():
    assert _choose().kernel == "flash-attn" and not _choose().warn
    assert _choose(archs="80;90").kernel == "flash-attn"
    assert _choose(archs=None).kernel == "flash-attn"  # nothing recorded: nothing to check


def test_flash_attn_built_for_another_arch_falls_back_to_flex_in_one_clear_line():
    choice = _choose(cap=(8, 0), archs="90")
    assert choice.kernel == "flex" and choice.warn
    assert choice.line == (
        "attention on cuda:0: FlexAttention (compiled, with CUDA graphs); not flash-attn: it was built for compute "
        "capability 9.0 (CBSERVE_FLASH_ATTN_ARCHS=90) and this GPU is 8.0; an image built with "
        "--build-arg FLASH_ATTN_CUDA_ARCHS=80 runs it"
    )
    assert "flash-attn 2 has no build for it" in _choose(cap=(7, 5), archs="80;90").line


def test_without_flash_attn_flex_serves_and_sdpa_is_the_last_resort():
    choice = _choose(flash=False)
    assert choice.kernel == "flex" and not choice.warn and "flash-attn is not installed" in choice.line
    sdpa = _choose(flash=False, flex_missing="triton is not installed")
    assert sdpa.kernel == "sdpa" and sdpa.warn
    assert "torch SDPA" in sdpa.line and "FlexAttention cannot run: triton is not installed" in sdpa.line
    assert _choose(cap=(8, 0), flex_missing="no triton").kernel == "sdpa"


def _fake_cuda(monkeypatch, capability=(8, 0)):
    """CUDA faked; flex's start-up self-check runs for real, on the CPU with eager flex_attention."""
    real_check = flex.self_check
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(flex, "flex_unavailable", lambda: None)
    monkeypatch.setattr(flex, "self_check", lambda device, backend=None: real_check("cpu", flex_attention))


def test_flex_self_check_passes_and_names_what_fails():
    assert flex.self_check("cpu", flex_attention) is None
    assert flex.self_check("cpu", flex_attention, dtype=torch.float32) is None

    def broken(q, k, v, **kw):
        raise RuntimeError("triton compile error\nmore")

    assert flex.self_check("cpu", broken) == "its self-check on cpu failed: RuntimeError: triton compile error"
    wrong = flex.self_check("cpu", lambda q, k, v, **kw: torch.zeros_like(q))
    assert wrong is not None and wrong.startswith("its self-check on cpu differs from SDPA by")


def test_a_flex_that_fails_its_self_check_leaves_sdpa_with_the_reason(monkeypatch, caplog):
    _fake_cuda(monkeypatch)
    monkeypatch.setattr(cuda, "flash_attn_available", lambda: False)
    monkeypatch.setattr(flex, "self_check", lambda device, backend=None: "its self-check on cuda:0 failed: RuntimeError: boom")
    with caplog.at_level(logging.INFO, logger="cbserve.backends.cuda"):
        assert isinstance(cuda.make_backend("cuda:0"), cuda.SDPACudaBackend)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "FlexAttention cannot run: its self-check on cuda:0 failed: RuntimeError: boom" in record.getMessage()


def test_make_backend_checks_the_compute_capability_at_start_up(monkeypatch, caplog):
    """An image whose flash-attn was built for 9.0, on an 8.0 GPU, serves with flex."""
    _fake_cuda(monkeypatch, (8, 0))
    monkeypatch.setattr(cuda, "flash_attn_available", lambda: True)
    monkeypatch.setenv("CBSERVE_FLASH_ATTN_ARCHS", "90")
    with caplog.at_level(logging.INFO, logger="cbserve.backends.cuda"):
        backend = cuda.make_backend("cuda:0")
    assert isinstance(backend, FlexAttnBackend) and backend.kernel == "flex" and backend.supports_graphs
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and "this GPU is 8.0" in record.getMessage()
    monkeypatch.setattr(cuda, "flash_attn_available", lambda: False)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="cbserve.backends.cuda"):
        assert isinstance(cuda.make_backend("cuda:0"), FlexAttnBackend)
    (record,) = caplog.records
    assert record.levelno == logging.INFO and "FlexAttention" in record.getMessage()


def test_flex_needs_triton():
    reason = flex.flex_unavailable()
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        assert reason == "triton is not installed (torch.compile's GPU kernels need it)"
    else:
        assert reason is None


# -- the engine's loop through the flex backend -------------------------------------------------------


def test_decode_graphs_with_flex_in_the_engine_loop_equal_model_generate():
    model = build_test_model("qwen3", vocab_size=512)
    prompts = random_prompts(5, 3, 200, 512, seed=3)
    # prompt chunks fill the budget (no decode-stall cap): the decodes then run steps of their own, graphs
    config = ContinuousBatchingConfig(block_size=128, num_blocks=10, max_batch_tokens=96, max_requests_per_batch=4,
                                      max_decode_stall=0)
    got, dispatch = run_engine(model, eager_flex(), config, prompts, (False, True))
    assert dispatch.graphs.replays > NEW
    with torch.no_grad():
        for p, tokens in zip(prompts, got):
            ref = model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                 pad_token_id=3)  # fmt: skip
            assert tokens == ref[0, len(p) :].tolist()


def test_decode_and_varlen_graphs_with_flex_change_no_token_and_name_the_backend():
    model = build_test_model("llama", vocab_size=512)
    prompts = random_prompts(4, 3, 260, 512, seed=4)
    config = ContinuousBatchingConfig(block_size=128, num_blocks=10, max_batch_tokens=128, max_requests_per_batch=3)
    eager, _ = run_engine(model, eager_flex(), config, prompts, (False, False))
    engine = graphed_engine(model, eager_flex(), config, (True, True))
    assert engine.placement()["attention_backend"] == "flex"  # what /v1/models shows under "engine"
    graphed = serve(engine, prompts)
    dispatch = engine.executor.dispatch
    engine.close()
    assert dispatch.graphs.replays > 0 and dispatch.varlen_graphs.replays > 0
    assert graphed == eager


def test_tiles_too_big_for_the_gpu_step_down_and_the_self_check_passes(caplog):
    """An H200 refused torch's own bfloat16 tiles for head dim 64 ("No valid triton configs ... out of
    resource"): the backend tries smaller ones, warns once, and keeps them for later calls."""
    seen = []

    def fussy(q, k, v, kernel_options=None, **kw):
        seen.append(kernel_options)
        if not kernel_options or kernel_options["BLOCK_M"] > 32:
            raise RuntimeError("InductorError: boom\nNo valid triton configs. OutOfMemoryError: out of resource: Required: 245760\nSet TORCHDYNAMO_VERBOSE=1")
        return flex_attention(q, k, v, **kw)

    backend = flex.FlexAttnBackend(fussy)
    with caplog.at_level(logging.WARNING, logger="cbserve.backends.cuda"):
        assert flex.self_check("cpu", backend=backend) is None
    assert backend.kernel_options == flex.KERNEL_OPTIONS[-1]
    assert seen[:3] == [None, flex.KERNEL_OPTIONS[1], flex.KERNEL_OPTIONS[2]]
    assert all(o == flex.KERNEL_OPTIONS[2] for o in seen[3:])  # the prefill call starts where decode ended
    assert len(caplog.records) == 2 and "do not fit this GPU" in caplog.records[0].getMessage()
    assert "out of resource: Required: 245760" in caplog.records[0].getMessage()


def test_the_warning_quotes_the_line_that_says_what_did_not_fit():
    exc = RuntimeError("InductorError: LoweringException\nwhile lowering\nOutOfMemoryError: out of resource: Required: 1\nSet TORCHDYNAMO_VERBOSE=1")
    assert flex.resource_line(exc) == "OutOfMemoryError: out of resource: Required: 1"


def test_other_flex_errors_and_the_smallest_tiles_failing_are_raised():
    def broken(q, k, v, kernel_options=None, **kw):
        raise RuntimeError("out of resource: shared memory")

    assert flex.self_check("cpu", broken).startswith("its self-check on cpu failed: RuntimeError: out of resource")
    assert not flex.out_of_resources(RuntimeError("triton compile error"))


def test_each_tile_choice_has_its_own_function_with_its_options_as_constants(monkeypatch):
    """Dynamo caches per code object: one function per tile choice, so that a step-down never changes
    the integers a compiled function saw (automatic dynamic made them symbols, and inductor failed on
    them: "unbacked_bindings" on an H200). Each function passes exactly its entry of KERNEL_OPTIONS."""
    import torch.nn.attention.flex_attention as fa

    seen = []
    monkeypatch.setattr(fa, "flex_attention", lambda q, k, v, kernel_options=None, **kw: seen.append(kernel_options))
    assert len(flex.TILE_FUNCTIONS) == len(flex.KERNEL_OPTIONS)
    assert len({f.__code__ for f in flex.TILE_FUNCTIONS}) == len(flex.TILE_FUNCTIONS)
    for fn in flex.TILE_FUNCTIONS:
        fn(None, None, None)
    assert seen == [o or None for o in flex.KERNEL_OPTIONS]


def test_a_softcap_compiles_with_dynamic_shapes():
    """The compiled function (inductor's flex lowering, here its CPU template) with a softcap: as a Python
    float it failed to lower ("unbacked_bindings": dynamo made it a CPU scalar read with .item(); seen on
    an H200 and reproduced here); as the backend's 0-d tensor it compiles and equals eager flex with the
    float."""
    backend = flex.FlexAttnBackend()
    score_mod = backend._softcap_mod(30.0, torch.device("cpu"))
    assert backend._softcap_mod(30.0, torch.device("cpu")) is score_mod  # made once, reused
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, n, 64, generator=g) * 4 for n in (128, 256, 256))
    got = flex.compiled_flex_attention(0)(q, k, v, score_mod=score_mod)
    want = flex_attention(q, k, v, score_mod=lambda s, b, h, qi, kv: torch.tanh(s / 30.0) * 30.0)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)  # float32: the kernel sums in another order
