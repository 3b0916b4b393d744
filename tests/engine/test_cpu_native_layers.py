"""The native decoder stack (engine/backends/cpu_layers.py, engine/csrc/decoder_cpu.cpp).

Its logits are the Python path's bit for bit on prefill, mixed and decode steps, in float32,
bfloat16 and float16, on panels and on oneDNN's products, and with linears in GGUF blocks (every
block type, float and int8 inputs, moved q/k outputs, a block LM head); greedy output stays model.generate's; every reason it
declines a model is forced and seen, with the engine then on the Python path; the AVX2 build runs it
too (a child process with CBSERVE_CPU_ISA=avx2).
"""

from __future__ import annotations

import logging

import pytest
import torch

from engine import ContinuousBatchingConfig, LLMEngine
from engine.backends import cpu_layers
from engine.backends.cpu_kernels import cpu_ops
from engine.model_runner import StepInputs
from engine.testing import build_test_model
from tests.engine.conftest import MAX_NEW, model_for, prompts_for, reference
from tests.engine.test_cpu_isa import run_child

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="cbserve's C++ kernels are not built on this host")

NATIVE = ("llama", "qwen2", "mistral")  # mistral: a sliding window of 24; qwen2: q/k/v biases


def engine_for(model, **config) -> LLMEngine:
    return LLMEngine(model, ContinuousBatchingConfig(**{"block_size": 16, "num_blocks": 64, **config}))


def steps(vocab: int) -> list[StepInputs]:
    """Three prompts (the longest past the panels' 64 rows), then decodes of two with a chunk of the
    third's continuation (history in the cache), then a decode of all three."""
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(4, vocab, (n,), generator=g).tolist()  # noqa: E731
    tables = [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 16], [10, 11, 12, 13, 14, 15]]
    return [
        StepInputs(ids(5 + 70 + 17), [5, 70, 17], [0, 0, 0], tables, [0, 1, 2], []),
        StepInputs(ids(1 + 1 + 23), [1, 1, 23], [5, 70, 17], tables, [0, 1, 2], []),
        StepInputs(ids(3), [1, 1, 1], [6, 71, 40], tables, [0, 1, 2], []),
    ]


def both_ways(engine: LLMEngine, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's logits from the native stack and from the Python path (each writes the same keys)."""
    runner = engine.executor.runner
    native = runner.native
    assert native is not None
    ids, positions, meta, rows = runner.build_metadata(step)
    with torch.inference_mode():
        got = runner.forward(ids, positions, meta, rows)
        runner.native = None
        try:
            want = runner.forward(ids, positions, meta, rows)
        finally:
            runner.native = native
    return got, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", NATIVE)
def test_logits_equal_the_python_paths_bit_for_bit(arch: str, dtype: torch.dtype) -> None:
    model = build_test_model(arch, vocab_size=512).to(dtype)
    engine = engine_for(model)
    for step in steps(512):
        got, want = both_ways(engine, step)
        assert got.dtype == dtype and got.shape == want.shape == (3, 512)
        assert torch.equal(got, want)


def test_many_decodes_and_shared_blocks_equal_the_python_path() -> None:
    """Forty decode tokens (whole cache rows per work item) of which thirty share a prompt's blocks
    (cascade attention), as n > 1 sampling makes them."""
    engine = engine_for(build_test_model("llama", vocab_size=512), num_blocks=256)
    prompt = torch.randint(4, 512, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    shared = [0, 1]
    tables = [shared + [2 + i] for i in range(30)] + [[40 + 3 * i, 41 + 3 * i, 42 + 3 * i] for i in range(10)]
    prefill = StepInputs(prompt[:32] + prompt * 10, [32] + [40] * 10, [0] * 11, [tables[0]] + tables[30:], [], [])
    got, want = both_ways(engine, prefill)
    assert got.shape == want.shape == (0, 512)  # no row samples: the head multiplies nothing
    decode = StepInputs(list(range(4, 44)), [1] * 40, [32 + i % 5 for i in range(30)] + [40] * 10, tables,
                        list(range(40)), [])  # fmt: skip
    got, want = both_ways(engine, decode)
    assert torch.equal(got, want)
    engine.backend.cascade_min_seqs = 0  # cascade off: both paths read the setting each step
    got_apart, want_apart = both_ways(engine, decode)
    assert torch.equal(got_apart, want_apart)
    assert torch.allclose(got_apart, got, atol=1e-3) and not torch.equal(got_apart, got)  # another summation


@pytest.mark.parametrize("arch", NATIVE)
def test_greedy_output_is_model_generates(arch: str, caplog) -> None:
    prompts = prompts_for()[:8]
    with caplog.at_level(logging.INFO, logger="cbserve.engine"):
        engine = engine_for(model_for(arch), num_blocks=512, max_batch_tokens=64)
    assert engine.executor.runner.native is not None
    assert "2 decoder layers in one native call per step" in caplog.text
    reqs = [engine.make_request(list(p), max_new_tokens=MAX_NEW, ignore_eos=True) for p in prompts]
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
    assert [tuple(r.generated_ids) for r in reqs] == [reference(arch, p) for p in prompts]


def _hooked_model():
    model = build_test_model("llama", vocab_size=512)
    model.model.layers[1].mlp.register_forward_hook(lambda module, args, out: None)
    return model


def _gelu_model():
    return build_test_model("llama", vocab_size=512, hidden_act="gelu")


def _block_linear_without_kernels():
    model = build_test_model("llama", vocab_size=512, **WIDE)
    _in_blocks(model, BLOCK_TYPES, int8=False)
    model.model.layers[0].self_attn.k_proj.ops = None  # its forward dequantizes in torch: not the stack's product
    return model


DECLINED = {
    # what is forced: (the model, the engine's config, the reason logged)
    "switched off": (lambda: model_for("llama"), {}, "CBSERVE_CPU_NATIVE_LAYERS=0"),
    "qwen3 (q/k norms)": (lambda: model_for("qwen3"), {}, "Qwen3ForCausalLM is not a Llama, Mistral or Qwen2"),
    "weights not packed": (lambda: model_for("llama"), {"cpu_packed_weights": False}, "linear weights not packed"),
    "a forward hook": (_hooked_model, {}, "a forward hook on model.layers.1.mlp"),
    "a GELU MLP": (_gelu_model, {}, "layer 0's norms or MLP have no fused pass"),
    "a block linear without the kernels": (_block_linear_without_kernels, {},
                                           "layer 0's q/k/v are not one packed product or three in GGUF blocks"),
    "head_dim 8": (lambda: build_test_model("llama", vocab_size=512, num_attention_heads=8, num_key_value_heads=2),
                   {}, "head_dim 8"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(DECLINED))
def test_each_model_it_declines_keeps_the_python_path_and_says_why(case: str, monkeypatch, caplog) -> None:
    make, config, why = DECLINED[case]
    if case == "switched off":
        monkeypatch.setenv(cpu_layers.ENV, "0")
    model = make()
    with caplog.at_level(logging.INFO, logger="cbserve.engine"):
        engine = engine_for(model, **config)
    assert engine.executor.runner.native is None
    assert f"decoder layers through transformers' modules ({why}" in caplog.text
    prompts = prompts_for()[:3]
    reqs = [engine.make_request(list(p), max_new_tokens=8, ignore_eos=True) for p in prompts]
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
    with torch.no_grad():
        for p, r in zip(prompts, reqs):
            out = model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=3)
            assert r.generated_ids == out[0, len(p) :].tolist()


def test_kernels_off_and_tensor_parallel_are_declined() -> None:
    model = model_for("llama")
    assert cpu_layers.why_not(model, None, None, None, torch.float32) == "cbserve's C++ kernels are off"
    engine = engine_for(model)
    ex = engine.executor
    args = (model, ex.packed_linears, ex.fused_modules, ex.backend.ops, torch.float32)
    assert cpu_layers.why_not(*args) is None
    assert cpu_layers.why_not(*args, tensor_parallel=True) == "tensor parallel"
    assert cpu_layers.why_not(model, ex.packed_linears, ex.fused_modules, ex.backend.ops, torch.int8) == "dtype torch.int8"


def test_the_avx2_build_runs_it_and_matches_the_python_path() -> None:
    code = """
        import torch
        from tests.engine.test_cpu_native_layers import BLOCK_TYPES, WIDE, _in_blocks, both_ways, engine_for, steps
        from engine.testing import build_test_model
        models = {dtype: build_test_model("qwen2", vocab_size=512).to(dtype) for dtype in (torch.float32, torch.bfloat16)}
        for int8 in (False, True):  # every GGUF block type on the stack's linears
            models[f"blocks, int8 {int8}"] = model = build_test_model("llama", vocab_size=512, **WIDE)
            _in_blocks(model, BLOCK_TYPES, int8)
        for name, model in models.items():
            engine = engine_for(model)
            assert engine.backend.ops.lanes() == 8 and engine.executor.native_layers is not None
            for step in steps(512):
                got, want = both_ways(engine, step)
                assert torch.equal(got, want), name
        print("same")
    """
    result = run_child(code, CBSERVE_CPU_ISA="avx2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "same"
    assert "2 decoder layers in one native call per step" in result.stderr


def _in_blocks(model: torch.nn.Module, types: dict[str, int], int8: bool) -> None:
    """Each linear named in `types` (by its last name) replaced by a `QuantizedLinear` of that ggml
    type, as engine/gguf_loader.py makes them (q and k with their outputs moved: `out_order`, the
    bias kept), the embedding by a `QuantizedEmbedding`."""
    gguf = pytest.importorskip("gguf")
    from engine.backends.cpu_quant import QuantizedEmbedding, QuantizedLinear
    from tests.engine.kquants import q4_k, q6_k

    ops = cpu_ops()
    encode = {12: q4_k, 14: q6_k}

    def blocks(w: torch.Tensor, qtype: int) -> torch.Tensor:
        w = w.detach().float().numpy()
        raw = encode[qtype](w) if qtype in encode else gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype))
        return torch.from_numpy(raw)

    for name, module in list(model.named_modules()):
        qtype = types.get(name.rsplit(".", 1)[-1])
        if qtype is None or not isinstance(module, torch.nn.Linear):
            continue
        order = torch.randperm(module.out_features, generator=torch.Generator().manual_seed(7))
        q = QuantizedLinear(blocks(module.weight, qtype), qtype, module.in_features,
                            None if module.bias is None else module.bias.detach(), ops,
                            out_order=order if name.endswith(("q_proj", "k_proj")) else None)  # fmt: skip
        q.int8_activations = int8
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        setattr(parent, name.rsplit(".", 1)[-1], q)
    emb = model.model.embed_tokens.weight
    model.model.embed_tokens = QuantizedEmbedding(blocks(emb, 8), 8, emb.shape[1], emb.dtype, ops)


# every block type on the stack's linears: q/k/v Q4_0 (q and k's outputs moved), o Q8_0, gate Q4_K,
# up Q4_1, down and the LM head Q6_K (inputs of 256 and 512: whole K-quant super-blocks)
BLOCK_TYPES = {"q_proj": 2, "k_proj": 2, "v_proj": 2, "o_proj": 8, "gate_proj": 12, "up_proj": 3, "down_proj": 14,
               "lm_head": 14}  # fmt: skip
WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4)


@pytest.mark.parametrize(("arch", "dtype"), [("llama", torch.float32), ("qwen2", torch.float32), ("llama", torch.bfloat16)],
                         ids=["llama", "qwen2", "llama-bf16"])  # fmt: skip
@pytest.mark.parametrize("int8", [False, True], ids=["float-x", "int8-x"])
def test_gguf_blocks_run_in_the_stack_and_equal_the_python_path(arch: str, dtype: torch.dtype, int8: bool, caplog) -> None:
    """A GGUF model's linears (QuantizedLinear) run inside the stack, the product each forward would
    take: the block kernels up to DEQUANTIZE_ROWS rows (the decodes) and a dequantized copy above
    (the 92-token prompt step), or int8 inputs at every size; logits the Python path's bit for bit."""
    model = build_test_model(arch, vocab_size=512, **WIDE).to(dtype)
    _in_blocks(model, BLOCK_TYPES, int8)
    with caplog.at_level(logging.INFO, logger="cbserve.engine"):
        engine = engine_for(model)
    assert engine.executor.runner.native is not None, caplog.text
    for step in steps(512):
        got, want = both_ways(engine, step)
        assert got.dtype == dtype and got.shape == want.shape == (3, 512)
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_layers_with_a_gguf_head_and_embedding_equal_the_python_path(dtype: torch.dtype) -> None:
    """quantization auto's split (engine/backends/quant_auto.py): packed dense layers, the LM head and
    the embedding in GGUF blocks; logits the Python path's."""
    model = build_test_model("llama", vocab_size=512).to(dtype)
    _in_blocks(model, {"lm_head": 8}, int8=False)
    engine = engine_for(model)
    assert engine.executor.native_layers is not None
    for step in steps(512):
        got, want = both_ways(engine, step)
        assert got.dtype == dtype and got.shape == want.shape == (3, 512)
        assert torch.equal(got, want)
