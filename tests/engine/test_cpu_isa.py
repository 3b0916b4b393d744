"""What the CPU can do, and both answers of every probe on any host.

The probe (engine/backends/cpu_isa.py) decides the kernel build (AVX-512 or AVX2) and whether oneDNN
multiplies bfloat16 itself. Its rules run here on made-up CPUs; the answers it gives are forced on
this host (`CBSERVE_CPU_ISA=avx2` in a child process, `onednn_native` replaced), so an AVX-512 host
proves the AVX2 paths too and an AVX2 host proves the fallbacks that an AVX-512 one never takes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import engine.backends.cpu_linear as cpu_linear
from engine import ContinuousBatchingConfig, LLMEngine, generate_batch
from engine.backends import cpu_isa, cpu_kernels
from engine.backends.cpu_isa import CpuInfo, dot_product_instructions, native_dtypes, read_cpu, resolve_isa
from engine.backends.cpu_kernels import cpu_ops
from engine.testing import build_test_model

ROOT = Path(__file__).resolve().parents[2]
AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
ZEN3 = CpuInfo("AMD EPYC 7B13", "25", "1", AVX2)
ZEN4 = CpuInfo("AMD EPYC 9B14", "25", "17", AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"})
OLD = CpuInfo("Intel Xeon E5-2680", "6", "45", frozenset({"sse4_2", "avx"}))  # AVX, no AVX2
ARROW_LAKE = CpuInfo("Intel Core Ultra", "6", "198", AVX2 | {"avx_ne_convert"})  # AVX2 + AVX-NE-CONVERT
ARM = CpuInfo("Neoverse-V2", "?", "?", frozenset({"asimd", "bf16"}), x86=False)


def run_child(code: str, **env: str) -> subprocess.CompletedProcess:
    """Python code in a fresh process (a kernel build per process: two builds' symbols clash), logging
    at INFO as `cbserve serve` does."""
    code = "import logging; logging.basicConfig(level=logging.INFO)\n" + textwrap.dedent(code)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, **env},
    )  # fmt: skip


# -- the probe's rules, on made-up CPUs -------------------------------------------------------------


@pytest.mark.parametrize(
    "cpu, forced, isa",
    [
        (ZEN4, None, "avx512"), (ZEN4, "auto", "avx512"), (ZEN4, "avx2", "avx2"), (ZEN4, "none", None),
        (ZEN3, None, "avx2"), (ZEN3, "AVX2", "avx2"), (ZEN3, "none", None),
        (ARROW_LAKE, None, "avx2"), (OLD, None, None), (ARM, None, None),
    ],
)  # fmt: skip
def test_the_kernel_isa_is_the_best_the_cpu_has_or_less_when_forced(cpu, forced, isa):
    assert resolve_isa(cpu, forced) == isa


def test_asking_for_more_than_the_cpu_has_names_what_it_lacks():
    with pytest.raises(ValueError, match=r"CBSERVE_CPU_ISA=avx512: this CPU \(AMD EPYC 7B13\) lacks avx512bw, avx512dq"):
        resolve_isa(ZEN3, "avx512")
    with pytest.raises(ValueError, match="lacks avx2, f16c, fma; it can run no kernel ISA"):
        resolve_isa(OLD, "avx2")
    with pytest.raises(ValueError, match="expected one of auto, avx512, avx2, none"):
        resolve_isa(ZEN4, "avx1024")


def test_onednn_multiplies_bf16_itself_only_where_the_cpu_has_the_instructions():
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert native_dtypes(ZEN4) == {fp32, bf16}
    assert native_dtypes(ZEN4, emulate_avx2=True) == {fp32}  # CBSERVE_CPU_ISA=avx2 on an AVX-512 host
    assert native_dtypes(ZEN3) == {fp32}
    assert native_dtypes(ARROW_LAKE) == {fp32, bf16, fp16}
    assert native_dtypes(ARM) == {fp32}


def test_bf16_dot_products_are_avx512_bf16_or_amx_not_conversions():
    bf16, fp16 = torch.bfloat16, torch.float16
    assert dot_product_instructions(bf16, ZEN4)  # vdpbf16ps: a bf16 model's weights go to oneDNN alone
    assert not dot_product_instructions(fp16, ZEN4)
    assert not dot_product_instructions(bf16, ZEN3)
    assert not dot_product_instructions(bf16, ARROW_LAKE)  # AVX-NE-CONVERT converts; it does not multiply
    no_bf16_dot = CpuInfo("Intel Xeon Gold 6148", "6", "85", ZEN4.flags - {"avx512_bf16"})  # Skylake-SP
    assert not dot_product_instructions(bf16, no_bf16_dot)


def test_this_hosts_cpu_is_read_and_described():
    cpu = read_cpu()
    caps = cpu_isa.capabilities()
    assert cpu.model and cpu.best_isa() in ("avx512", "avx2")  # the project's hosts all have AVX2 at least
    text = caps.describe()
    assert cpu.model in text and "avx2" in text and f"{cpu.best_isa()} kernels" in text
    assert "float32" in text.split("oneDNN native ")[1]  # bfloat16 before it on an AVX-512 host


def test_kernel_flags_and_cache_tags_follow_the_isa_and_the_torch_install(monkeypatch):
    assert cpu_kernels.cflags("avx2", "avx2")[-1] == "-march=native"
    assert cpu_kernels.cflags("avx2", "avx512")[-2:] == ["-march=x86-64-v3", "-mtune=native"]
    assert cpu_kernels.cflags("avx512", "avx512")[-1] == "-march=native"
    tags = {cpu_kernels.build_tag("avx2"), cpu_kernels.build_tag("avx512")}
    monkeypatch.setattr(torch, "__file__", "/elsewhere/venv/lib/python3.11/site-packages/torch/__init__.py")
    tags.add(cpu_kernels.build_tag("avx2"))  # another virtualenv's torch: a build of its own
    assert len(tags) == 3 and all(t.startswith(("avx2-", "avx512-")) for t in tags)


# -- the kernels: this host's build, and the AVX2 build on any host ---------------------------------

KERNEL_CHECK = """
    import torch
    from engine.backends.cpu_kernels import cpu_ops
    from tests.engine.test_cpu_fast_paths import LONG_STEPS, STEPS, random_step, reference_attention
    ops = cpu_ops()
    for (q_lens, k_lens), window in [*((s, 0) for s in STEPS.values()), *((s, 200) for s in LONG_STEPS.values())]:
        for dtype in (torch.float32, torch.bfloat16):
            q, kc, vc, t, kl, qs = random_step(q_lens, k_lens, 8, 2, 64, dtype, seed=1)
            out = torch.empty_like(q)
            ops.paged_attention(out, q, kc, vc, t, kl, qs, 0.125, window)
            ref = reference_attention(q, kc, vc, t, kl, qs, 0.125, window)
            assert torch.allclose(out.double(), ref, atol=2e-2 if dtype == torch.bfloat16 else 1e-5), (q_lens, dtype)
    x = torch.randn(5, 72)
    assert torch.equal(ops.argmax_rows(x), x.argmax(-1))
    for dtype in (torch.float32, torch.bfloat16):  # the panel products, remainders of every block
        for rows in (1, 7, 100):
            w, x, b = torch.randn(37, 300).to(dtype), torch.randn(rows, 300).to(dtype), torch.randn(37).to(dtype)
            y = ops.packed_linear(x, ops.pack_linear_weight(w), b, 37)
            ref = x.double() @ w.double().T + b.double()
            assert y.dtype == dtype and torch.allclose(y.double(), ref, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-3)
    from tests.engine.test_sample_race import check_race  # the one-pass race against its definition
    assert check_race(ops) >= 30
    y = torch.randn(3, 1000).bfloat16()
    assert torch.allclose(ops.logsumexp_rows(y), torch.logsumexp(y.float(), -1), rtol=1e-6, atol=1e-5)
    print("lanes", ops.lanes())
"""


def test_this_hosts_kernels_use_the_register_width_of_its_best_isa():
    ops = cpu_ops()
    assert ops is not None
    assert ops.lanes() == (16 if read_cpu().best_isa() == "avx512" else 8)


def test_the_avx2_kernels_run_and_agree_with_the_definition_on_any_host():
    result = run_child(KERNEL_CHECK, CBSERVE_CPU_ISA="avx2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "lanes 8" in result.stdout
    assert "avx2 kernels, forced by CBSERVE_CPU_ISA=avx2" in result.stderr  # the one log line


def test_forcing_an_isa_the_cpu_lacks_is_a_clear_error_at_engine_construction():
    forced = "avx512" if read_cpu().best_isa() == "avx2" else "avx1024"
    code = """
        from engine import LLMEngine
        from engine.testing import build_test_model
        LLMEngine(build_test_model("llama", vocab_size=128))
    """
    result = run_child(code, CBSERVE_CPU_ISA=forced)
    assert result.returncode != 0
    assert f"CBSERVE_CPU_ISA={forced}" in result.stderr.strip().splitlines()[-1]


def test_kernels_off_means_torch_paths_and_the_same_tokens():
    code = """
        from engine import generate_batch
        from engine.testing import build_test_model, random_prompts
        model = build_test_model("llama", vocab_size=128)
        prompts = random_prompts(4, 3, 40, 128, seed=0)
        out = generate_batch(model, prompts, max_new_tokens=8)
        print([o.generated_tokens for o in out.values()])
    """
    on, off = run_child(code), run_child(code, CBSERVE_CPU_ISA="none")
    assert on.returncode == 0 and off.returncode == 0, on.stderr[-2000:] + off.stderr[-2000:]
    assert "no C++ kernels" in off.stderr and "torch-only paths" in off.stderr
    assert on.stdout == off.stdout


# -- the build cache: one builder at a time, never a half-written build -----------------------------

RACER = """
    import sys
    from pathlib import Path
    from engine.backends.cpu_kernels import publish_once
    final, name = Path(sys.argv[1]), sys.argv[2]
    def build(folder):
        print("building", flush=True)
        sys.stdin.readline()  # the test says when this build may finish
        (folder / "cbserve_cpu_ops.so").write_text(f"built by {name}")
        return name
    print(publish_once(final, build, "cbserve_cpu_ops.so"), flush=True)
"""


def test_two_processes_building_one_tag_build_it_once_and_publish_it_whole(tmp_path):
    final = tmp_path / "kernels" / "avx2-abc"
    (final / "half").mkdir(parents=True)  # an interrupted build of an older version: no library in it
    cmd = [sys.executable, "-c", textwrap.dedent(RACER), str(final)]
    pipes = dict(cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    first = subprocess.Popen([*cmd, "first"], **pipes)
    assert first.stdout.readline().strip() == "building"  # it holds the lock now
    assert not final.exists()  # mid-build: the stale folder is gone and nothing is in place to load
    second = subprocess.Popen([*cmd, "second"], **pipes)
    out_first = first.communicate("go\n", timeout=60)[0]
    out_second = second.communicate("", timeout=60)[0]
    assert out_first.strip() == "first"
    assert out_second.strip() == "None"  # it waited for the lock, then found the whole build; never built
    assert (final / "cbserve_cpu_ops.so").read_text() == "built by first" and not (final / "half").exists()
    assert sorted(p.name for p in final.parent.iterdir()) == ["avx2-abc", "avx2-abc.lock"]


# -- packed linear weights: bf16 and fp16 products where oneDNN has them, float32 where not ---------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("native", [False, True])
def test_half_precision_linears_pack_natively_or_as_float32(monkeypatch, caplog, dtype, native):
    monkeypatch.setattr(cpu_linear, "onednn_native", lambda d: native or d == torch.float32)
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48).to(dtype)
    x = torch.randn(7, 64).to(dtype)
    packed = cpu_linear.LinearPlan().pack(layer.weight)
    out = cpu_linear._packed_linear(x, packed, layer.bias)
    assert out.dtype == dtype and out.shape == (7, 48)
    exact = (x.double() @ layer.weight.double().T + layer.bias.double()).to(dtype)
    assert torch.allclose(out.float(), exact.float(), atol=2e-2, rtol=2e-2)
    if not native:
        assert packed.onednn.dtype == torch.float32
    elif packed.onednn.dtype == torch.float32:  # the probe said yes; this host's oneDNN said no: one warning
        assert "packing as float32" in caplog.text


class Lanes:
    """This host's kernels, claiming another register width (the plan's probe, forced)."""

    def __init__(self, ops, lanes: int) -> None:
        self.ops, self._lanes = ops, lanes

    def __getattr__(self, name):
        return getattr(self.ops, name)

    def lanes(self) -> int:
        return self._lanes


@pytest.mark.parametrize("dots", [False, True], ids=["no-bf16-dot-products", "bf16-dot-products"])
@pytest.mark.parametrize("lanes", [None, 8, 16])
def test_the_linear_plan_follows_the_kernel_build_and_each_layout_runs(lanes, dots, monkeypatch):
    """No kernels: oneDNN alone. An AVX2 build: panels alone (in the weight's dtype). An AVX-512
    build: panels for decode-sized steps and oneDNN above PANEL_ROWS, unless the CPU has bf16 dot
    products (AVX-512 BF16): then a bf16 weight goes to oneDNN alone. Both probes are forced, so
    every side runs here."""
    monkeypatch.setattr(cpu_linear, "dot_product_instructions", lambda dtype: dots and dtype == torch.bfloat16)
    ops = None if lanes is None else Lanes(cpu_ops(), lanes)
    plan = cpu_linear.linear_plan(ops)
    assert (plan.ops is not None, plan.onednn) == {None: (False, True), 8: (True, False), 16: (True, True)}[lanes]
    panels = plan.ops is not None and not (dots and plan.onednn)
    assert plan.panels_for(torch.bfloat16) == panels and plan.panels_for(torch.float32) == (plan.ops is not None)
    assert ("dot-product instructions" in plan.describe(torch.bfloat16)) == (plan.ops is not None and not panels)
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 40).to(torch.bfloat16)
    packed = plan.pack(layer.weight)
    assert (packed.panels is not None) == panels
    if panels:
        assert packed.panels.dtype == torch.bfloat16  # half the bytes of a float32 copy
    onednn_bytes = cpu_linear.compute_dtype(torch.bfloat16).itemsize  # 2 where oneDNN has bf16, else 4
    assert plan.nbytes(layer.weight) == 96 * 40 * (2 * panels + onednn_bytes * plan.onednn)
    calls = []
    if panels:
        counting = Lanes(cpu_ops(), lanes)
        counting.packed_linear = lambda *a: calls.append(a[0].shape[0]) or cpu_ops().packed_linear(*a)
        packed = packed._replace(ops=counting)
    for rows in (1, cpu_linear.PANEL_ROWS, cpu_linear.PANEL_ROWS + 1):
        x = torch.randn(rows, 96).to(torch.bfloat16)
        out = cpu_linear._packed_linear(x, packed, layer.bias)
        exact = x.double() @ layer.weight.double().T + layer.bias.double()
        assert out.dtype == torch.bfloat16 and torch.allclose(out.double(), exact, atol=5e-2, rtol=2e-2)
    on_panels = {None: [], 8: [1, 64, 65], 16: [1, 64]}[lanes] if panels else []
    assert calls == on_panels


def test_a_plan_without_any_layout_is_refused():
    with pytest.raises(ValueError, match="panels .* or oneDNN"):
        cpu_linear.LinearPlan(ops=None, onednn=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lanes", [None, 8, 16])
def test_a_half_precision_model_runs_on_any_cpu(monkeypatch, dtype, lanes):
    """The crash of an AVX2 host (bf16 packing refused mid-construction) cannot come back: with the
    probe's answer forced to 'no native product', oneDNN's weights pack as float32, panels keep the
    model's dtype, and under every plan the tokens equal the engine's without packing to within a
    rounding-level tie."""
    monkeypatch.setattr(cpu_linear, "onednn_native", lambda d: d == torch.float32)
    monkeypatch.setattr("engine.backends.cpu_executor.linear_plan",
                        lambda ops: cpu_linear.linear_plan(None if lanes is None else Lanes(ops, lanes)))  # fmt: skip
    model = build_test_model("llama", vocab_size=256).to(dtype)
    prompts = [[5, 9, 13, 200, 17, 3], [1, 2, 3, 4], list(range(10, 60))]
    engine = LLMEngine(model, ContinuousBatchingConfig(num_blocks=64, cpu_packed_weights=True))
    assert engine.packed_linears is not None
    for layer in engine.packed_linears.layers:
        assert layer.packed.onednn is None or layer.packed.onednn.dtype == torch.float32
        assert layer.packed.panels is None or layer.packed.panels.dtype == dtype
    packed = generate_batch(model, prompts, max_new_tokens=12, continuous_batching_config=engine.config)
    plain = generate_batch(model, prompts, max_new_tokens=12,
                           continuous_batching_config=ContinuousBatchingConfig(num_blocks=64, cpu_packed_weights=False))  # fmt: skip
    same = sum(a.generated_tokens == b.generated_tokens for a, b in zip(packed.values(), plain.values()))
    assert same >= 2 and all(len(o.generated_tokens) == 12 for o in packed.values())
