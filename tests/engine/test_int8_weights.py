"""`quantization: int8`: any checkpoint's linear layers made int8 at load, per-channel scales.

The rows' error is at most half a step of their scale; the engine's greedy output on the int8 model
equals `model.generate` on it, for plain and biased projections, float and int8 activations, with
preemption; the loader takes a checkpoint folder to it; the setting's rules refuse what cannot run.
"""

from __future__ import annotations

import pytest
import torch

from engine import ContinuousBatchingConfig, generate_batch
from engine.backends.cpu_kernels import cpu_ops
from engine.backends.cpu_quant import Q8_0, QuantizedLinear, dequantize
from engine.int8_weights import quantize_model, quantize_rows
from engine.loader import load_model, resolve_quantization
from engine.testing import build_test_model, random_prompts, save_test_model


def test_each_row_is_int8_with_one_scale_within_half_a_step() -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 96) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different sizes
    w[5] = 0  # an all-zero row stays zero
    blocks = quantize_rows(w)
    assert blocks.dtype == torch.uint8 and blocks.shape == (48, 96 // 32 * 34)
    scales = blocks.view(48, 3, 34)[..., :2].contiguous().view(torch.float16).view(48, 3)
    assert torch.equal(scales, scales[:, :1].expand(48, 3))  # every block of a row: the row's one scale
    step = scales[:, 0].float()
    err = (dequantize(blocks, Q8_0, 96) - w).abs()
    assert torch.all(err <= step[:, None] * 0.5 * (1 + 1e-3) + 1e-12)
    assert torch.equal(dequantize(blocks, Q8_0, 96)[5], torch.zeros(96))
    q = blocks.view(48, 3, 34)[..., 2:].contiguous().view(torch.int8)
    assert q.min() >= -127 and q.abs().amax(dim=(1, 2))[torch.arange(48) != 5].min() >= 126  # the range is used
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_rows(torch.randn(4, 40))


@pytest.mark.parametrize("arch, int8_activations", [("llama", False), ("qwen2", True)])  # qwen2: biased q/k/v
def test_engine_equals_generate_on_the_int8_model(arch, int8_activations) -> None:
    model = build_test_model(arch, seed=3)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert quantize_model(model, cpu_ops()) == len(linears)  # the LM head too
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            m.int8_activations = int8_activations
    prompts = random_prompts(6, 5, 40, 512, seed=4)
    config = ContinuousBatchingConfig(block_size=16, num_blocks=12, max_batch_tokens=48)  # prompts in chunks
    out = generate_batch(model, prompts, generation_config=config, max_new_tokens=12, ignore_eos=True,
                         progress_bar=False)  # fmt: skip
    for prompt, o in zip(prompts, out.values()):
        want = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
        assert o.generated_tokens == want[0, len(prompt):].tolist()


def test_a_checkpoint_folder_loads_in_int8(tmp_path) -> None:
    folder = save_test_model(tmp_path / "m", "llama", seed=5)
    loaded = load_model(str(folder), "float32", quantization="int8")
    layers = [m for m in loaded.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 2 * 7 + 1 and all(m.qtype == Q8_0 for m in layers)
    assert not any(type(m) is torch.nn.Linear for m in loaded.model.modules())
    assert loaded.model.cbserve_quantization == {"setting": "int8", "layers": 15}  # GET /v1/models shows it
    reference = load_model(str(folder), "float32", quantization="none").model
    x = torch.tensor([random_prompts(1, 30, 30, 512, seed=6)[0]])
    with torch.inference_mode():
        a, b = loaded.model(x).logits, reference(x).logits
    assert (a - b).abs().max() < 0.05 * b.abs().max()  # close to the float model, not equal to it


def test_int8_runs_on_the_cpu_with_one_rank() -> None:
    assert resolve_quantization("int8", "auto", "some/folder", "cpu") == ("int8", None)
    assert resolve_quantization("int8", "bfloat16", None, "cpu") == ("int8", None)
    with pytest.raises(ValueError, match="int8 runs on the CPU with one rank"):
        resolve_quantization("int8", "auto", "some/folder", "cuda")
    with pytest.raises(ValueError, match="int8 runs on the CPU with one rank"):
        resolve_quantization("int8", "auto", "some/folder", "cpu", 2)
