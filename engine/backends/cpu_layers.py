"""A Llama-family model's decoder layers in one native call per engine step (CPU).

On the CPU path each layer of a step runs a dozen kernels (engine/backends/cpu_linear.py's packed
products, engine/backends/cpu_fused.py's passes, the paged attention kernel), and between them
transformers' module calls, views and torch's dispatch, in Python, while the other cores wait at
the kernels' barriers. For the models whose code is known here, `NativeLayers` runs the whole stack
instead in one call to engine/csrc/decoder_cpu.cpp, with the GIL released: per layer RMSNorm, the
q/k/v product, rotary, the new keys and values into the paged cache, paged attention, o_proj and the
residual, RMSNorm, gate/up, SiLU-mul, down and the residual; then the final norm and the LM head on
the rows that sample. Embeddings and the rotary cos/sin stay the model's own modules (one call each
per step). Each stage calls the same kernel on the same shapes as the Python path, so the logits
are that path's bit for bit.

It takes a model when all of this holds, and otherwise the engine keeps the Python path and logs one
line saying why (`why_not`): cbserve's C++ kernels are built; the model is transformers'
Llama, Mistral or Qwen2 causal LM (exactly those classes: their forwards are embed, rotary, the
layers, the norm, the LM head) with those classes' layers and attention; every linear layer of the
layers and the LM head is packed (q/k/v as one product) or a GGUF-quantized `QuantizedLinear` on
cbserve's kernels (q/k/v then three products; the stack calls the product its forward would, int8
inputs and moved outputs included), and the embedding is torch's or a `QuantizedEmbedding` (run as
the model's own module before the stack); every norm, MLP and the rotary got cpu_fused's pass (RMSNorm,
SiLU-gated MLP, full rotary); no forward hooks anywhere in the model (accelerate's offloading,
tensor parallel's all-reduce, anyone's hook); one rank (no tensor parallel); a dtype and head size
the attention kernel takes. `CBSERVE_CPU_NATIVE_LAYERS=0` turns it off.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from types import ModuleType

import torch

from engine.backends.base import AttentionMetadata
from engine.backends.cpu import KERNEL_DTYPES, SDPABackend
from engine.backends.cpu_fused import FusedModules
from engine.backends.cpu_linear import PackedLinears, PackedWeight, _PackedGroup, _PackedLinear
from engine.backends.cpu_quant import DEQUANTIZE_ROWS, QuantizedEmbedding, QuantizedLinear
from engine.kv_cache import PagedKVCache

logger = logging.getLogger("cbserve.engine")

ENV = "CBSERVE_CPU_NATIVE_LAYERS"


def _families() -> dict[type, tuple[type, type, type, Callable[[torch.nn.Module], int | None]]]:
    """Causal LM class -> (its base model, decoder layer and attention classes, the attention's
    sliding window as its forward passes it)."""
    from transformers.models.llama import modeling_llama as llama
    from transformers.models.mistral import modeling_mistral as mistral
    from transformers.models.qwen2 import modeling_qwen2 as qwen2

    return {
        llama.LlamaForCausalLM: (llama.LlamaModel, llama.LlamaDecoderLayer, llama.LlamaAttention, lambda a: None),
        mistral.MistralForCausalLM: (mistral.MistralModel, mistral.MistralDecoderLayer, mistral.MistralAttention,
                                     lambda a: getattr(a.config, "sliding_window", None)),
        qwen2.Qwen2ForCausalLM: (qwen2.Qwen2Model, qwen2.Qwen2DecoderLayer, qwen2.Qwen2Attention,
                                 lambda a: a.sliding_window),
    }  # fmt: skip


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def _hooked(model: torch.nn.Module) -> str | None:
    """The first module with a forward hook (or a replaced forward), by name; global hooks too."""
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return "a global module hook"
    for name, m in model.named_modules():
        if m._forward_hooks or m._forward_pre_hooks:
            return f"a forward hook on {name or 'the model'}"
    return None


def _quantized(m: torch.nn.Module) -> bool:
    """A `QuantizedLinear` on cbserve's kernels whose forward is its class's: the stack runs the
    product that forward would."""
    return type(m) is QuantizedLinear and "forward" not in m.__dict__ and m.ops is not None


def _packed_by_module(packed: PackedLinears | None) -> dict[int, _PackedGroup | _PackedLinear]:
    out: dict[int, _PackedGroup | _PackedLinear] = {}
    for layer in packed.layers if packed is not None else []:
        for m in layer.modules if isinstance(layer, _PackedGroup) else [layer.module]:
            out[id(m)] = layer
    return out


def why_not(model: torch.nn.Module, packed: PackedLinears | None, fused: FusedModules | None,
            ops: ModuleType | None, dtype: torch.dtype, tensor_parallel: bool = False) -> str | None:  # fmt: skip
    """Why the native stack cannot run `model` (None: it can)."""
    if not enabled():
        return f"{ENV}=0"
    if ops is None or not hasattr(ops, "DecoderStack"):
        return "cbserve's C++ kernels are off"
    if tensor_parallel:
        return "tensor parallel"
    family = _families().get(type(model))
    if family is None:
        return f"{type(model).__name__} is not a Llama, Mistral or Qwen2 causal LM"
    base_type, layer_type, attn_type, _ = family
    if fused is None:
        return "no fused passes"
    if dtype not in KERNEL_DTYPES:
        return f"dtype {dtype}"
    base = getattr(model, "model", None)
    if type(base) is not base_type:
        return f"{type(model).__name__}'s base model is not {base_type.__name__}"
    if type(base.embed_tokens) not in (torch.nn.Embedding, QuantizedEmbedding):
        return f"its embedding is a {type(base.embed_tokens).__name__}, not torch's Embedding"
    if (hook := _hooked(model)) is not None:
        return hook
    config = model.config
    layers = base.layers[: config.num_hidden_layers]
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    head_dim = layers[0].self_attn.head_dim if len(layers) else 0
    if not len(layers):
        return "no decoder layers"
    if head_dim % 16:
        return f"head_dim {head_dim} (the attention kernel takes multiples of 16)"
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        return "partial rotary"
    replaced = [m for m in (model, base, *layers, *(layer.self_attn for layer in layers)) if "forward" in m.__dict__]
    if replaced:
        return f"{type(replaced[0]).__name__}'s forward is replaced"
    swapped = {id(ns) for ns, name, _ in fused.swaps if name == "forward"}
    rotary = {id(ns) for ns, name, _ in fused.swaps if name == "apply_rotary_pos_emb"}
    by_module = _packed_by_module(packed)
    linears = [model.lm_head]
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        linears += [getattr(m, name, None) for m, names in ((attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                    (mlp, ("gate_proj", "up_proj", "down_proj"))) for name in names]  # fmt: skip
    if packed is None and not all(_quantized(m) for m in linears):
        return "linear weights not packed"
    if (id(model.lm_head) not in by_module and not _quantized(model.lm_head)) or id(base.norm.__dict__) not in swapped:
        return "the final norm or the LM head has no fused or packed form"
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        if type(layer) is not layer_type or type(attn) is not attn_type:
            return f"layer {i} is not {layer_type.__name__} with {attn_type.__name__}"
        if attn.head_dim != head_dim or attn.num_key_value_groups != heads // kv_heads:
            return f"layer {i}'s heads differ from the config's"
        if not all(id(m.__dict__) in swapped for m in (layer.input_layernorm, layer.post_attention_layernorm, layer.mlp)):
            return f"layer {i}'s norms or MLP have no fused pass"
        modeling = sys.modules.get(type(attn).__module__)
        if modeling is None or id(modeling.__dict__) not in rotary:
            return f"{type(attn).__module__} has no fused rotary"
        group = by_module.get(id(attn.q_proj))
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        if not (isinstance(group, _PackedGroup) and group.modules == qkv) and not all(map(_quantized, qkv)):
            return f"layer {i}'s q/k/v are not one packed product or three in GGUF blocks"
        mlp = layer.mlp
        if not all(isinstance(by_module.get(id(m)), _PackedLinear) or _quantized(m)
                   for m in (attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)):  # fmt: skip
            return f"layer {i}'s o/gate/up/down projections are neither packed nor in GGUF blocks"
        norms = (layer.input_layernorm, layer.post_attention_layernorm, base.norm)
        if any(n.weight.dtype != dtype for n in norms):
            return f"layer {i}'s norm weights are not {dtype}"
    return None


class NativeLayers:
    """The model's decoder stack in engine/csrc/decoder_cpu.cpp; `rebuild()` after weights change."""

    def __init__(self, model: torch.nn.Module, packed: PackedLinears | None, backend: SDPABackend) -> None:
        self.model, self.packed, self.backend = model, packed, backend
        self.ops = backend.ops
        base = model.model
        self.embed, self.rotary = base.embed_tokens, base.rotary_emb
        self.window = _families()[type(model)][3]
        self.stack = self._build()

    def rebuild(self) -> None:
        """Read the weights again (tensors replaced, or packed again by PackedLinears.refresh)."""
        self.stack = self._build()

    def _linear(self, weight: PackedWeight, bias: torch.Tensor | None):
        return self.ops.PackedLinear(weight.panels, weight.onednn, None if bias is None else bias.detach(),
                                     weight.out_features, weight.panel_rows)  # fmt: skip

    def _blocks(self, m: QuantizedLinear):
        """A `QuantizedLinear` as the stack runs it: what its forward reads, read now (`rebuild()` after
        a change)."""
        return self.ops.PackedLinear.blocks(m.blocks, m.qtype, m.in_features, None if m.bias is None else m.bias.detach(),
                                            m.out_order, m.int8_activations, DEQUANTIZE_ROWS)  # fmt: skip

    def _build(self):
        model, base = self.model, self.model.model
        by_module = _packed_by_module(self.packed)
        config = model.config
        layers = base.layers[: config.num_hidden_layers]
        first = layers[0].self_attn
        kv_heads = config.num_attention_heads // first.num_key_value_groups
        stack = self.ops.DecoderStack(config.num_attention_heads, kv_heads, first.head_dim, first.scaling)

        def single(m: torch.nn.Module):
            return self._blocks(m) if isinstance(m, QuantizedLinear) else self._linear(by_module[id(m)].packed, m.bias)

        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            group = by_module.get(id(attn.q_proj))
            qkv = ([self._linear(group.packed, group.bias)] if isinstance(group, _PackedGroup)
                   else [single(attn.q_proj), single(attn.k_proj), single(attn.v_proj)])  # fmt: skip
            stack.add_layer(
                qkv=qkv, o=single(attn.o_proj), gate=single(mlp.gate_proj),
                up=single(mlp.up_proj), down=single(mlp.down_proj),
                input_norm=layer.input_layernorm.weight.detach(), input_eps=layer.input_layernorm.variance_epsilon,
                post_norm=layer.post_attention_layernorm.weight.detach(),
                post_eps=layer.post_attention_layernorm.variance_epsilon, window=self.window(attn) or 0,
            )  # fmt: skip
        stack.set_head(base.norm.weight.detach(), base.norm.variance_epsilon, single(model.lm_head))
        return stack

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 logits_rows: torch.Tensor, cache: PagedKVCache) -> torch.Tensor | None:  # fmt: skip
        """The step's logits [len(logits_rows), vocab]; None when this step's rotary output is not the
        contiguous [1, tokens, head_dim] the stack takes (the Python path runs it)."""
        hidden = self.embed(input_ids)
        cos, sin = self.rotary(hidden[None], positions[None])
        if not (cos.is_contiguous() and sin.is_contiguous() and cos.dtype == sin.dtype == hidden.dtype
                and cos.shape == sin.shape and cos.dim() == 3):  # fmt: skip
            return None
        return self.stack.forward(hidden, cos, sin, cache.k, cache.v, meta.block_tables, meta.seq_lens_k,
                                  meta.cu_seqlens_q, meta.slot_mapping, logits_rows, self.backend.cascade_min_seqs)  # fmt: skip
