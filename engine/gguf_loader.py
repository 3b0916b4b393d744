"""A GGUF file loaded with its quantized weights kept in their blocks (engine/backends/cpu_quant.py).

The model is built empty from the file's config (transformers reads it from the GGUF metadata), then
each tensor of the file goes where transformers' own GGUF loader would put it (its name map and its
tensor processor): a Q8_0, Q4_0, Q4_1, Q4_K or Q6_K weight of a linear layer or of the token
embedding stays in its blocks, in a `QuantizedLinear` / `QuantizedEmbedding` that replaces the
module; every other tensor (norms, a float weight, other K-quants) is dequantized to the model's
dtype as transformers does.
No float copy of the quantized weights is ever made, and the blocks stay in the file's read-only
mapping (no row is copied), so a model loads in about the file's size and its pages count once.

Llama's q and k rows were permuted by llama.cpp's converter; transformers' Llama tensor processor
undoes that on the dequantized weight. The permutation moves whole rows, so the blocks stay in the
file's order and the `QuantizedLinear` moves its outputs instead (`out_order`: a gather of a few
thousand values a row, where moving the rows would copy q and k, 0.7 GiB of an 8B Q8_0 file; tests
check the rows equal transformers' dequantized weights bit for bit). Architectures whose tensor
processor does more than move rows are loaded dequantized.

With tied embeddings the LM head is a `QuantizedLinear` on the embedding's very bytes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from types import ModuleType

import numpy as np
import torch

from engine.backends.cpu_quant import (BLOCK_BYTES, NAMES, QuantizedEmbedding, QuantizedLinear, dequantize_rows,
                                       quantized_bytes)  # fmt: skip
from engine.backends.quant_auto import PROBE_ROWS, BlockChoice, choose

logger = logging.getLogger("cbserve.loader")

NATIVE_TYPES = frozenset(BLOCK_BYTES)  # ggml type numbers of Q8_0, Q4_0, Q4_1, Q4_K, Q6_K


def is_gguf(path: Path | str | None) -> bool:
    return path is not None and str(path).lower().endswith(".gguf") and Path(path).is_file()


@functools.cache
def _reader_class() -> type:
    """gguf's reader over a plain array view of the file's mapping. gguf maps the file as an
    `np.memmap` and parses the metadata a value at a time, each slice of the memmap going through its
    Python-level `__getitem__` and `__array_finalize__`: two thirds of a parse (SmolLM2's 49,152-token
    vocabulary, 5.3 s here) that the same slices of an `ndarray` view of the same pages skip (1.8 s).
    The fields and tensors are the same values; a tensor's data is an ndarray on the file's pages."""
    from gguf.gguf_reader import GGUFReader  # the class itself, whatever shared_reader has put in its place

    class Reader(GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._pages

        @data.setter
        def data(self, value: np.ndarray) -> None:  # gguf's __init__ sets its memmap here
            self._pages = value.view(np.ndarray)

    return Reader


def open_reader(path: Path | str) -> object:
    """The file's metadata and tensors, parsed as gguf's `GGUFReader` does (faster: `_reader_class`)."""
    return _reader_class()(path)


@contextlib.contextmanager
def shared_reader(path: Path) -> Iterator[object]:
    """One parse of the file's metadata (tens of seconds for a large vocabulary) for all of the
    load: transformers' config and tokenizer readers get this one instead of parsing it again. And
    one name table per architecture: transformers' GGUF weight loader builds gguf's table again for
    every module it walks (about 400 for a 30-layer model, 10 s of a 135M model's load)."""
    import gguf

    cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    reader = open_reader(path)

    def reuse(p, *args, **kwargs):
        if Path(p).resolve() == Path(path).resolve() and not args and not kwargs:
            return reader
        return open_reader(p) if not args and not kwargs else cls(p, *args, **kwargs)

    gguf.GGUFReader, gguf.get_tensor_name_map = reuse, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield reader
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = cls, name_map


def _architecture(reader) -> str:
    field = reader.fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def _processor(reader, config):
    """transformers' tensor processor for the file's architecture, or None when it does more than
    move whole rows (its effect on blocks would not be its effect on the weights)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, LlamaTensorProcessor, TensorProcessor

    cls = TENSOR_PROCESSORS.get(_architecture(reader), TensorProcessor)
    return cls(config=config.to_dict()) if cls in (TensorProcessor, LlamaTensorProcessor) else None


def _names(reader, model: torch.nn.Module) -> dict[str, str] | None:
    """{GGUF tensor name: the model's parameter name}, by gguf's own name table for the file's
    architecture (what transformers' GGUF loader uses, made once instead of once per module)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next((a for a, name in MODEL_ARCH_NAMES.items() if name == _architecture(reader)), None)
    if arch is None:
        return None
    table = get_tensor_name_map(arch, model.config.get_text_config().num_hidden_layers)
    names = {}
    for hf_name in model.state_dict(keep_vars=True):
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = table.get_name(base)
        if gguf_name is None and "." in base:  # some tables know the names without the model's prefix
            gguf_name = table.get_name(base.split(".", 1)[1])
        if gguf_name is not None:
            names.setdefault(f"{gguf_name}.{suffix}", hf_name)
    return names


def load_gguf(path: Path, dtype: torch.dtype, attn_implementation: str | None, quantization: str,
              ops: ModuleType | None) -> tuple[torch.nn.Module, object]:  # fmt: skip
    """The file's causal LM and tokenizer. `quantization` gguf: its Q8_0/Q4_0/Q4_1/Q4_K/Q6_K weights in their
    blocks and the rest in `dtype`; auto: blocks for the kinds of weights where the block kernel
    measured faster (engine/backends/quant_auto.py), the rest dequantized to `dtype`; both need `ops`
    and are dequantized instead when the architecture cannot be loaded so. none: all of it
    dequantized to `dtype` by transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    native = quantization in ("gguf", "auto") and ops is not None
    with shared_reader(path) as reader:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = _load_native(path, reader, dtype, attn_implementation, ops, quantization) if native else None
        if model is None:
            if native:
                logger.info("cbserve: %s's architecture is loaded dequantized (its tensor processor does more "
                            "than move rows)", path.name)  # fmt: skip
            extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype, **extra)
    _release_heap()  # the metadata's parse left many small freed objects behind
    return model.eval(), tokenizer


def _release_heap() -> None:
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _kind(model: torch.nn.Module, owner: torch.nn.Module, tied: bool) -> str:
    """quant_auto's kind of a weight: the LM head (and a tied embedding) `head`, an untied
    embedding `embedding`, the rest `layers`."""
    if owner is model.get_output_embeddings():
        return "head"
    if owner is model.get_input_embeddings():
        return "head" if tied else "embedding"
    return "layers"


def _choice(model: torch.nn.Module, reader, names: dict[str, str], tied: bool, dtype: torch.dtype,
            ops: ModuleType, quantization: str) -> BlockChoice:  # fmt: skip
    """gguf: blocks everywhere; auto: the probe on each kind's largest block-kept matrix."""
    if quantization == "gguf":
        return BlockChoice.everywhere(dtype)
    largest: dict[str, Any] = {}  # kind -> gguf's ReaderTensor
    dense_bytes: dict[str, int] = {}  # kind -> its weights' bytes in `dtype`, were they dequantised
    for tensor in reader.tensors:
        hf_name = names.get(tensor.name)
        if hf_name is None or int(tensor.tensor_type) not in NATIVE_TYPES or not hf_name.endswith(".weight"):
            continue
        owner = model.get_submodule(hf_name.rsplit(".", 1)[0])
        if not isinstance(owner, (torch.nn.Linear, torch.nn.Embedding)):
            continue
        kind = _kind(model, owner, tied)
        if kind == "embedding":
            continue
        dense_bytes[kind] = dense_bytes.get(kind, 0) + int(tensor.n_elements) * dtype.itemsize
        if kind not in largest or tensor.n_elements > largest[kind].n_elements:
            largest[kind] = tensor
    samples = {kind: (torch.from_numpy(np.array(t.data[:PROBE_ROWS], dtype=np.uint8)), int(t.tensor_type),
                      (int(t.shape[1]), int(t.shape[0])))  # gguf's shape is [in, out]
               for kind, t in largest.items()}  # fmt: skip
    return choose(samples, dtype, ops, dense_bytes)


def _mapped_blocks(data: np.ndarray) -> torch.Tensor:
    """A uint8 tensor on the blocks' bytes. A view of the file's read-only mapping where the tensor is
    already in place (no copy: its pages count once, as the file's, and the kernels only read them);
    a copy where the loader moved rows (Llama's q/k) or the bytes are not contiguous."""
    arr = np.ascontiguousarray(data, dtype=np.uint8)
    if arr.flags.writeable:
        return torch.from_numpy(arr)
    with warnings.catch_warnings():  # torch warns that it cannot write to the mapping: it never does
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def _row_order(processor, name: str, rows: int) -> torch.Tensor | None:
    """Where the tensor processor moves the weight's rows (Llama's q/k): output i is the file's row
    order[i]; None where it moves none."""
    moved = processor.process(weights=np.arange(rows, dtype=np.int64).reshape(rows, 1), name=name).weights.reshape(-1)
    return None if np.array_equal(moved, np.arange(rows)) else torch.from_numpy(np.ascontiguousarray(moved))


def _tied(config) -> bool:
    return bool(getattr(config, "tie_word_embeddings", False) or getattr(config.get_text_config(), "tie_word_embeddings", False))


def _load_native(path: Path, reader, dtype: torch.dtype, attn_implementation: str | None,
                 ops: ModuleType, quantization: str) -> torch.nn.Module | None:  # fmt: skip
    from accelerate import init_empty_weights
    from gguf import dequantize
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    processor = _processor(reader, config)
    if processor is None:
        return None
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **extra)
    names = _names(reader, model)
    if names is None:
        return None
    embedding = model.get_input_embeddings()
    tied = _tied(config)
    choice = _choice(model, reader, names, tied, dtype, ops, quantization)
    for tensor in reader.tensors:
        hf_name = names.get(tensor.name)
        if hf_name is None:
            logger.info("cbserve: GGUF tensor %s has no place in %s; skipped", tensor.name, type(model).__name__)
            continue
        owner_name, attr = hf_name.rsplit(".", 1)
        owner = model.get_submodule(owner_name)
        qtype = int(tensor.tensor_type)
        native = qtype in NATIVE_TYPES and attr == "weight" and isinstance(owner, (torch.nn.Linear, torch.nn.Embedding))
        dense, order = None, None
        if native:  # the blocks stay where the file has them; q/k's un-permutation is an order of outputs
            blocks = _mapped_blocks(tensor.data)
            order = _row_order(processor, tensor.name, blocks.shape[0])
            k = owner.embedding_dim if isinstance(owner, torch.nn.Embedding) else owner.in_features
            if not choice.keeps(_kind(model, owner, tied)):  # auto: dense, by the kernel in one pass
                dense, native = dequantize_rows(ops, blocks, qtype, k, order, torch.empty(0, dtype=dtype)), False
            elif order is not None and isinstance(owner, torch.nn.Embedding):  # looked up by row: copy them moved
                blocks, order = blocks.index_select(0, order), None  # (no tensor processor moves an embedding's today)
        else:
            data = processor.process(weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name).weights
        if native:
            if isinstance(owner, torch.nn.Embedding):
                module = QuantizedEmbedding(blocks, qtype, owner.embedding_dim, dtype, ops)
            else:
                bias = owner.bias if owner.bias is not None and owner.bias.device.type != "meta" else None
                module = QuantizedLinear(blocks, qtype, owner.in_features, bias, ops, out_order=order)
            model.set_submodule(owner_name, module)
        else:
            param = getattr(owner, attr)
            shape = param.shape if param is not None else (-1,)  # a bias of a QuantizedLinear made before it
            value = dense if dense is not None else torch.from_numpy(np.array(data)).to(dtype)  # a copy: the file is mapped read-only
            value = value.reshape(shape)
            setattr(owner, attr, torch.nn.Parameter(value, requires_grad=False))
    if tied:
        _tie_head(model, model.get_input_embeddings(), ops)
    elif model.get_input_embeddings() is embedding and embedding.weight.device.type == "meta":
        raise ValueError(f"{path}: no token embedding found in the file")
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise ValueError(f"{path}: no tensor in the file for {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
    model.generation_config = GenerationConfig.from_model_config(config)
    counts: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, (QuantizedLinear, QuantizedEmbedding)):
            counts[NAMES[m.qtype]] = counts.get(NAMES[m.qtype], 0) + 1
    if counts:
        logger.info("cbserve: %s loaded with %s in their GGUF blocks (%.0f MiB of blocks; the rest %s)", path.name,
                    ", ".join(f"{n} {k} weights" for k, n in sorted(counts.items())),
                    quantized_bytes(model) / 2**20, str(dtype).removeprefix("torch."))  # fmt: skip
    else:
        logger.info("cbserve: %s loaded dequantised to %s", path.name, str(dtype).removeprefix("torch."))
    model.cbserve_quantization = choice.as_dict()  # the engine's placement shows it (GET /v1/models)
    return model.eval()


def _tie_head(model: torch.nn.Module, embedding: torch.nn.Module, ops: ModuleType | None) -> None:
    """The LM head of a tied model: on the embedding's blocks, or its float weight."""
    head = model.get_output_embeddings()
    if isinstance(embedding, QuantizedEmbedding):
        module = QuantizedLinear(embedding.blocks, embedding.qtype, embedding.embedding_dim, None, ops)
        for name, m in model.named_modules():
            if m is head:
                model.set_submodule(name, module)
                break
    else:
        head.weight = embedding.weight
