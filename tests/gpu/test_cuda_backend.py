"""engine/backends/cuda/__init__.py on a machine without CUDA or flash-attn.

The module imports; selecting it says clearly that CUDA is missing; block_size is validated; the
flash-attn calls are checked against torch references of the two kernels; the SDPA fallback equals
the CPU backend.
"""

from __future__ import annotations

import importlib
from pathlib import Path
import subprocess
import sys

import pytest
import torch

from engine.backends import get_backend
from engine.backends.cpu import SDPABackend
from tests.gpu.helpers import FlashReference, make_step, run_backend

from engine.backends import cuda  # noqa: E402  (must import without CUDA or flash-attn)

MIXED = [(300, 1), (17, 1), (600, 1), (40, 40), (700, 200), (5, 3)]  # decodes, a prompt, chunks with history
DECODE = [(300, 1), (17, 1), (600, 1), (1, 1), (513, 1)]


def test_module_imports_without_cuda_or_flash_attn():
    # a fresh interpreter: importing the module must not import flash_attn or initialise CUDA
    code = (
        "import sys, engine.backends.cuda as c, torch; "
        "assert 'flash_attn' not in sys.modules; assert not torch.cuda.is_initialized(); "
        "print(c.FlashAttnBackend.__name__, c.SDPACudaBackend.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["FlashAttnBackend", "SDPACudaBackend"]
    assert cuda.flash_attn_available() is (importlib.util.find_spec("flash_attn") is not None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine-without-CUDA error")
def test_selecting_cuda_without_cuda_is_one_clear_error():
    with pytest.raises(RuntimeError, match=r"attn_backend 'cuda' was selected but CUDA is not available") as err:
        get_backend("cpu", "cuda")
    assert "attn_backend to 'cpu'" in str(err.value)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        cuda.require_cuda()


@pytest.mark.skipif(cuda.flash_attn_available(), reason="checks the error of a machine without flash-attn")
def test_flash_backend_without_flash_attn_fails_at_construction_only():
    with pytest.raises(ImportError, match="flash_attn"):
        cuda.FlashAttnBackend()


@pytest.mark.parametrize("block_size", [16, 128, 384, 100])
def test_flash_rejects_block_sizes_that_are_not_multiples_of_256(block_size):
    ref = FlashReference()
    backend = cuda.FlashAttnBackend(ref.varlen, ref.kvcache)
    with pytest.raises(ValueError, match=rf"block_size must be a multiple of 256 .* got {block_size}"):
        backend.check_config(block_size)


@pytest.mark.parametrize("block_size", [256, 512, 1024])
def test_flash_accepts_multiples_of_256(block_size):
    ref = FlashReference()
    cuda.FlashAttnBackend(ref.varlen, ref.kvcache).check_config(block_size)


def test_flash_window_translation():
    assert cuda.flash_window(None) == (-1, -1)
    assert cuda.flash_window(4096) == (4095, 0)


@pytest.mark.parametrize("seqs, kernel", [(MIXED, "varlen"), (DECODE, "kvcache")])
@pytest.mark.parametrize("kw", [{}, {"sliding_window": 64}, {"softcap": 30.0}])
def test_flash_backend_calls_the_right_kernel_and_matches_the_cpu_backend(seqs, kernel, kw):
    step = make_step(seqs, block_size=256, num_blocks=16, dtype=torch.bfloat16, seed=1)
    ref = FlashReference()
    out, k_cache, v_cache = run_backend(cuda.FlashAttnBackend(ref.varlen, ref.kvcache), step, **kw)
    expected, k_exp, v_exp = run_backend(SDPABackend(), step, **kw)
    assert [name for name, _ in ref.calls] == [kernel]
    args = ref.calls[0][1]
    assert args["causal"] is True
    assert args["window_size"] == ((kw["sliding_window"] - 1, 0) if "sliding_window" in kw else (-1, -1))
    assert args["softcap"] == kw.get("softcap", 0.0)
    if kernel == "varlen":
        assert (args["max_seqlen_q"], args["max_seqlen_k"]) == (200, 700)
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp)  # written by slot mapping
    torch.testing.assert_close(out, expected, atol=3e-2, rtol=3e-2)


def test_flash_backend_refuses_float32_with_a_clear_error():
    step = make_step(DECODE, block_size=256, num_blocks=16, dtype=torch.float32)
    ref = FlashReference()
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        run_backend(cuda.FlashAttnBackend(ref.varlen, ref.kvcache), step)


@pytest.mark.parametrize("seqs", [MIXED, DECODE, [(40, 40)], [(9, 1), (70, 70), (100, 30)]])
@pytest.mark.parametrize("kw", [{}, {"sliding_window": 7}, {"softcap": 5.0}])
def test_sdpa_fallback_equals_the_cpu_backend(seqs, kw):
    step = make_step(seqs, block_size=16, num_blocks=128, seed=2)
    out, k_cache, v_cache = run_backend(cuda.SDPACudaBackend(), step, **kw)
    expected, k_exp, v_exp = run_backend(SDPABackend(), step, **kw)
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


GPU_MODULES = ["engine/backends/cuda/__init__.py", "engine/backends/cuda/flex.py", "engine/backends/cuda/sdpa.py", "engine/backends/cuda/graphs.py", "engine/backends/cuda/varlen_graphs.py",
               "engine/backends/cuda/executor.py", "engine/backends/step_dispatch.py", "engine/backends/memory.py",
               "engine/backends/compile.py", "engine/device.py", "engine/staging.py", "engine/rope.py"]  # fmt: skip


def test_gpu_modules_type_check_without_flash_attn_or_cuda(tmp_path):
    pytest.importorskip("mypy", reason="mypy is not installed: it belongs in the test extra (mypy==2.4.1)")
    root = Path(__file__).resolve().parents[2]
    # imports are resolved but not followed (following torch takes a minute); flash_attn is not installed
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path), "--follow-imports=skip",
         "--ignore-missing-imports", "--no-error-summary", *GPU_MODULES],
        capture_output=True, text=True, timeout=120, cwd=root,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
