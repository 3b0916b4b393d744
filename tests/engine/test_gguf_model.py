"""The embedded SmolLM2 GGUF loaded in its blocks (quantization gguf), by kind as the probe chose
(auto), and the setting's rules.

The blocks the loader keeps are the file's; Llama's q/k modules move their outputs as transformers
moves the rows of its dequantised weights, so dequantised, the weights equal transformers' float32
weights bit for bit. The engine's greedy output on the native model equals `model.generate` on it; against transformers on
the dequantised weights it differs by the order of float sums only (benchmarks/gguf_native.py
agreement states it over 64 prompts).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")

from engine import generate_batch  # noqa: E402
from engine.backends.cpu_quant import QuantizedEmbedding, QuantizedLinear  # noqa: E402
from engine.loader import embedded_folder, load_model, resolve_quantization  # noqa: E402

PROMPTS = ["Write a short poem about the sea.", "List three facts about bees.", "What is 7 times 6?",
           "Explain rain to a child in two sentences."]  # fmt: skip


@pytest.fixture(scope="module")
def native():
    return load_model(None, "float32", quantization="gguf")


def chat(tokenizer, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))  # fmt: skip


def test_the_reader_parses_the_file_as_gguf_s_own_reader_does() -> None:
    import gguf
    import numpy as np

    from engine.gguf_loader import open_reader, shared_reader
    from engine.loader import embedded_gguf

    theirs, ours = gguf.GGUFReader(embedded_gguf()), open_reader(embedded_gguf())
    assert list(ours.fields) == list(theirs.fields) and len(ours.fields) > 30
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.data, mine.types) == (field.offset, field.data, field.types), name
        assert len(mine.parts) == len(field.parts) and all(
            a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(mine.parts, field.parts)), name  # fmt: skip
    assert ours.fields["tokenizer.ggml.tokens"].contents() == theirs.fields["tokenizer.ggml.tokens"].contents()
    assert [(t.name, t.tensor_type, t.data_offset) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.data_offset) for t in theirs.tensors]  # fmt: skip
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors))
    assert isinstance(ours.data.base, np.memmap)  # the file's mapping, seen as a plain array
    assert all(np.shares_memory(t.data, ours.data) for t in ours.tensors[:3])  # tensors are views of it, not copies
    with shared_reader(embedded_gguf()) as reader:  # what transformers' loaders get during a load
        assert gguf.GGUFReader(embedded_gguf()) is reader and isinstance(reader, type(ours))


def test_blocks_are_the_dequantised_weights_bit_for_bit(native) -> None:
    from transformers import AutoModelForCausalLM

    model = native.model
    reference = AutoModelForCausalLM.from_pretrained(embedded_folder(), dtype=torch.float32).state_dict()
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) == 30 * 7 + 1  # every projection of the 30 layers, and the LM head
    assert isinstance(model.get_input_embeddings(), QuantizedEmbedding)
    assert model.lm_head.blocks is model.get_input_embeddings().blocks  # tied: one copy of the bytes
    for name, m in linears:
        assert torch.equal(m.dequantized(), reference[f"{name}.weight"]), name
        # q/k keep the file's rows and move their outputs instead
        assert (m.out_order is not None) == name.endswith(("q_proj", "k_proj")), name
    emb = model.get_input_embeddings()
    assert torch.equal(emb(torch.arange(emb.num_embeddings)), reference["model.embed_tokens.weight"])
    for name, p in model.named_parameters():  # the norms: float32 as in the file
        assert torch.equal(p, reference[name]), name


def test_engine_equals_generate_on_the_native_model(native, caplog) -> None:
    """Every linear in blocks runs in the native decoder stack (engine/backends/cpu_layers.py)."""
    import logging

    ids = [chat(native.tokenizer, p) for p in PROMPTS]
    with caplog.at_level(logging.INFO, logger="cbserve.engine"):
        out = generate_batch(native.model, ids, max_new_tokens=16, ignore_eos=True, progress_bar=False)
    assert "30 decoder layers in one native call per step" in caplog.text
    for prompt, o in zip(ids, out.values()):
        # the mask is given: SmolLM2's pad id is <|im_end|>, which chat prompts contain
        want = native.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                     max_new_tokens=16, do_sample=False, eos_token_id=None)  # fmt: skip
        assert o.generated_tokens == want[0, len(prompt):].tolist()


def test_native_output_reads_as_the_dequantised_models(native) -> None:
    """Same tokens as transformers on the dequantised weights for these prompts (the 64-prompt
    agreement is benchmarks/gguf_native.py's)."""
    reference = load_model(None, "float32", quantization="none").model
    for text in PROMPTS:
        prompt = chat(native.tokenizer, text)
        x = torch.tensor([prompt])
        mask = torch.ones_like(x)
        mine = native.model.generate(x, attention_mask=mask, max_new_tokens=8, do_sample=False)[0, len(prompt):]
        ref = reference.generate(x, attention_mask=mask, max_new_tokens=8, do_sample=False)[0, len(prompt):]
        assert mine.tolist() == ref.tolist(), text


@pytest.mark.parametrize(
    "setting, dtype, path, device, world, want",
    [
        ("auto", "auto", None, "cpu", 1, ("auto", None)),  # the embedded model: the probe chooses, dtype auto's
        ("auto", "float32", None, "cpu", 1, ("none", None)),  # an explicit dtype dequantises
        ("auto", "auto", None, "cuda", 1, ("none", None)),
        ("auto", "auto", None, "cpu", 2, ("none", None)),  # tensor parallel: dequantised
        ("auto", "auto", "some/folder", "cpu", 1, ("none", None)),
        ("gguf", "bfloat16", None, "cpu", 1, ("gguf", None)),  # blocks, the rest in bfloat16
        ("gguf", "auto", None, "cpu", 1, ("gguf", None)),  # blocks, the rest in dtype auto's choice
        ("none", "auto", None, "cpu", 1, ("none", None)),
    ],
)
def test_which_loads_keep_the_blocks(setting, dtype, path, device, world, want) -> None:
    assert resolve_quantization(setting, dtype, path, device, world) == want


def test_gguf_refused_where_it_cannot_run(tmp_path) -> None:
    with pytest.raises(ValueError, match="needs a GGUF file"):
        resolve_quantization("gguf", "auto", str(tmp_path), "cpu")
    with pytest.raises(ValueError, match="runs on the CPU with one rank"):
        resolve_quantization("gguf", "auto", None, "cuda")
    with pytest.raises(ValueError, match="quantization must be one of auto, none, gguf"):
        resolve_quantization("int4", "auto", None, "cpu")


def test_a_gguf_file_by_path_keeps_its_blocks_and_its_name() -> None:
    from engine.loader import embedded_gguf

    path = str(embedded_gguf())
    assert resolve_quantization("auto", "auto", path, "cpu") == ("auto", None)
    loaded = load_model(path, "float32", quantization="gguf")
    assert loaded.name == "SmolLM2-135M-Instruct.Q4_1" and loaded.max_model_len == 8192
    assert isinstance(loaded.model.model.layers[0].mlp.down_proj, QuantizedLinear)


def kinds_in_blocks(model) -> dict[str, bool]:
    layers = [m for n, m in model.named_modules() if ".layers." in n and isinstance(m, (torch.nn.Linear, QuantizedLinear))]
    assert len(layers) == 30 * 7 and len({type(m) for m in layers}) == 1  # one choice for every layer's linears
    head, emb = model.lm_head, model.get_input_embeddings()
    assert isinstance(head, QuantizedLinear) == isinstance(emb, QuantizedEmbedding)  # tied: one choice
    return {"layers": isinstance(layers[0], QuantizedLinear), "head": isinstance(head, QuantizedLinear)}


def test_auto_keeps_the_blocks_of_the_kinds_the_probe_timed_faster() -> None:
    from engine.backends.quant_auto import MARGIN

    model = load_model(None, "bfloat16", quantization="auto").model
    info = model.cbserve_quantization  # what the engine's placement shows
    assert info["setting"] == "auto" and set(info["probe"]) == {"layers", "head"}
    for kind, probe in info["probe"].items():
        assert info["blocks"][kind] == (sum(probe["blocks_us"]) < MARGIN * sum(probe["dense_us"])), kind
    assert info["probe"]["head"]["type"] == "Q8_0" and info["probe"]["head"]["shape"] == [49152, 576]
    assert kinds_in_blocks(model) == info["blocks"]
    assert model.model.norm.weight.dtype == torch.bfloat16  # the rest in the dtype asked for


def test_a_split_choice_serves_as_generate_does(monkeypatch) -> None:
    """The split the probe can make, forced (its timing stood in for): dense layers and the LM head in
    blocks, all in the native stack; the engine's greedy output equals `model.generate` on the model loaded
    so, and the placement shows the split. (All blocks: quantization gguf, above; none: dense.)"""
    blocks = {"layers": False, "head": True}
    from engine import ContinuousBatchingConfig, LLMEngine, gguf_loader
    from engine.backends.quant_auto import BlockChoice

    monkeypatch.setattr(gguf_loader, "choose", lambda samples, dtype, ops, dense_bytes=None: BlockChoice("auto", dict(blocks), dtype))
    loaded = load_model(None, "float32", quantization="auto")
    assert kinds_in_blocks(loaded.model) == blocks
    ids = [chat(loaded.tokenizer, p) for p in PROMPTS[:2]]
    out = generate_batch(loaded.model, ids, max_new_tokens=8, ignore_eos=True, progress_bar=False)
    for prompt, o in zip(ids, out.values()):
        want = loaded.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                     max_new_tokens=8, do_sample=False, eos_token_id=None)  # fmt: skip
        assert o.generated_tokens == want[0, len(prompt):].tolist()
    engine = LLMEngine(loaded.model, ContinuousBatchingConfig(block_size=16, num_blocks=16))
    assert engine.placement()["quantization"]["blocks"] == blocks
    assert engine.executor.native_layers is not None  # packed layers and a head in blocks: the native stack


def test_the_rule_and_the_line_of_a_probe() -> None:
    """A kind keeps its blocks only when they win clearly over the two row counts; a near tie stays
    dense; the start-up line says each kind's choice and times."""
    from engine.backends.quant_auto import BlockChoice, Timing

    fast = Timing(8, (49152, 576), (100.0, 300.0), (200.0, 300.0))
    tie = Timing(3, (576, 1536), (100.0, 100.0), (95.0, 110.0))
    assert fast.keeps_blocks and not tie.keeps_blocks
    choice = BlockChoice("auto", {"head": True, "layers": False}, torch.bfloat16, {"head": fast, "layers": tie})
    assert choice.describe() == ("quantization auto: layers dense bfloat16 (blocks 100+100 us against dense 95+110 us "
                                 "at 1+16 rows); head Q8_0 blocks (blocks 100+300 us against dense 200+300 us at 1+16 rows)")
    assert "layers: no Q8_0, Q4_0, Q4_1, Q4_K or Q6_K weights" in BlockChoice("auto", {}, torch.float32).describe()


def test_auto_keeps_blocks_where_the_dense_weights_would_not_fit_in_memory() -> None:
    from engine.backends.quant_auto import MEMORY_SHARE, within_memory

    dense = {"layers": 12 << 30, "head": 1 << 30}
    assert within_memory({"layers": False, "head": False}, dense, 16 << 30) == ()
    assert within_memory({"layers": False, "head": False}, dense, 12 << 30) == ("layers",)  # the largest first
    assert within_memory({"layers": False, "head": False}, dense, 512 << 20) == ("layers", "head")
    assert within_memory({"layers": True, "head": False}, dense, 512 << 20) == ("head",)
    assert 0 < MEMORY_SHARE <= 0.5


def test_auto_on_a_small_machine_loads_the_blocks_and_says_why(monkeypatch, caplog) -> None:
    """The probe's timing aside, a GGUF whose dense weights would pass MEMORY_SHARE of the memory
    available keeps its blocks (here: a machine said to have 64 MiB free)."""
    import logging

    from engine.backends import memory

    monkeypatch.setattr(memory, "host_available_bytes", lambda root=memory.CGROUP_ROOT: 64 << 20)
    with caplog.at_level(logging.INFO, logger="cbserve.loader"):
        loaded = load_model(None, "auto", quantization="auto")
    placement = loaded.model.cbserve_quantization
    assert placement["blocks"] == {"layers": True, "head": True}
    assert placement["kept_for_memory"]  # at least the kinds the probe would have made dense
    assert set(placement["kept_for_memory"]) <= {"layers", "head"}
    assert isinstance(loaded.model.model.layers[0].mlp.down_proj, QuantizedLinear)
    line = next(r.getMessage() for r in caplog.records if "quantization auto" in r.getMessage())
    assert "kept for memory" in line and "of the 0.1 GiB of memory available" in line


def test_int8_activations_are_a_setting_for_the_weights_in_blocks() -> None:
    """quantized_activations int8: every QuantizedLinear takes llama.cpp's arithmetic (its kernels
    are tests/engine/test_cpu_quant.py's), the placement says so; a model with nothing in blocks has
    nothing to change; anything but float and int8 is refused."""
    loaded = load_model(None, "float32", quantization="gguf", activations="int8")
    linears = [m for m in loaded.model.modules() if isinstance(m, QuantizedLinear)]
    assert linears and all(m.int8_activations for m in linears)
    assert loaded.model.cbserve_quantization["activations"] == "int8"
    # a build with int8 tiles repacks the Q4_1 blocks for them, the tied LM head and the
    # embedding on the same repacked bytes (test_cpu_quant.py: the same products bit for bit)
    from engine.backends.cpu_kernels import cpu_ops
    from engine.backends.cpu_quant import REPACKED

    repacked = cpu_ops().quant_repack_rows() > 0
    assert all(bool(m.qtype & REPACKED) == repacked for m in linears)
    embed = loaded.model.model.embed_tokens
    assert embed.blocks.data_ptr() == loaded.model.lm_head.blocks.data_ptr()
    assert loaded.model.cbserve_quantization.get("repacked", 0) == (len(linears) if repacked else 0)
    prompt = chat(loaded.tokenizer, PROMPTS[2])
    out = generate_batch(loaded.model, [prompt], max_new_tokens=6, ignore_eos=True, progress_bar=False, warmup=False)
    assert len(next(iter(out.values())).generated_tokens) == 6
    from engine.backends.cpu_quant import use_int8_activations
    from engine.testing import build_test_model

    dense = build_test_model()
    assert use_int8_activations(dense) == 0 and not hasattr(dense, "cbserve_quantization")
    with pytest.raises(ValueError, match="quantized_activations must be float or int8"):
        load_model(None, "float32", quantization="gguf", activations="int4")


def test_a_conversion_lands_whole_and_a_second_one_keeps_the_first(tmp_path) -> None:
    """The embedded model's conversion writes into a folder of its own and renames it into place;
    a second process finishing after the first (two test workers on a fresh cache) keeps the first
    copy and leaves no partial folder; a failed save leaves nothing."""
    from engine.loader import save_into_place

    target = tmp_path / "model"

    def writer(text: str):
        return lambda folder: (folder / "config.json").write_text(text)

    save_into_place(target, writer("first"))
    save_into_place(target, writer("second"))
    assert (target / "config.json").read_text() == "first"

    def broken(folder):
        (folder / "weights").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_into_place(tmp_path / "other", broken)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
