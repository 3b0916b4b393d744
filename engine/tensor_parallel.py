"""Tensor parallel sharding: one rank's copy of a model, its linear layers split across ranks.

The plan is transformers' own (`model.tp_plan`: module-name patterns to styles, from the config's
`base_model_tp_plan`); a model without one gets cbserve's, by the usual projection names. Styles:

- column-parallel ("colwise", "packed_colwise"): the rank keeps its slice of the output features
  (weight rows and bias); q/k/v projections thereby give the rank its own attention heads, and
  gate/up projections their own slice of the MLP;
- row-parallel ("rowwise", "rowwise_split_input", "packed_rowwise"): the rank keeps its slice of the
  input features; its output is a partial sum, all-reduced across ranks by a forward hook (the bias,
  kept on rank 0 only, is added once);
- everything else a dense model's plan names ("replicate", norms, "embedding_rowwise",
  "colwise_gather_output" of the LM head) stays whole on every rank. The embedding and the LM head are
  replicated rather than split across the vocabulary: the logits are computed on rank 0 only.

Styles for experts and latent attention (MoE, MLA) are refused with an error that names them.
`shard_model` builds the copy without touching the caller's model: replicated weights are shared
with it, split weights are new tensors of the rank's slice. engine/shard_loader.py builds the same
shard from a checkpoint's files, reading only the rank's slices.
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Callable

import torch

COLUMN = {"colwise", "packed_colwise"}
ROW = {"rowwise", "rowwise_rep", "rowwise_split_input", "packed_rowwise"}
WHOLE = {"replicate", "colwise_rep", "replicated_with_grad_allreduce", "sequence_parallel", "embedding_rowwise",
         "embedding_colwise", "colwise_gather_output"}  # fmt: skip
# cbserve's plan for a model without transformers' one: Llama-style projection names
OWN_PLAN = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise",
            "gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}  # fmt: skip

AllReduce = Callable[[torch.Tensor], None]  # sums a tensor across the ranks, in place


def head_counts(config) -> tuple[int, int]:
    """(attention heads, KV heads) of a transformers config."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    return heads, getattr(config, "num_key_value_heads", None) or heads


def check_divisible(config, world: int) -> None:
    """A ValueError unless `world` ranks split the model's heads and KV heads evenly."""
    heads, kv_heads = head_counts(config)
    if heads % world or kv_heads % world:
        raise ValueError(
            f"tensor_parallel_size {world} must divide the model's attention heads ({heads}) and KV heads "
            f"({kv_heads}): each rank holds whole heads and their KV cache"
        )


def resolve_plan(model: torch.nn.Module) -> tuple[dict[str, str], str]:
    """{module name: style} for every module the plan splits, and where the plan came from
    ("transformers" or "cbserve"). A ValueError names a style cbserve does not run."""
    patterns = dict(getattr(model, "tp_plan", None) or {})
    source = "transformers"
    if not any(style in COLUMN | ROW for style in patterns.values()):
        patterns = {f"*.{name}": style for name, style in OWN_PLAN.items()}
        source = "cbserve"
    plan: dict[str, str] = {}
    for name, module in model.named_modules():
        for pattern, style in patterns.items():
            if fnmatch.fnmatchcase(name, pattern):
                if style in WHOLE:
                    break
                if style not in COLUMN | ROW:
                    raise ValueError(f"tensor parallel: {name} has the plan style {style!r}, which cbserve does "
                                     "not run (it runs dense models: column- and row-parallel linear layers)")
                if not isinstance(module, torch.nn.Linear):
                    raise ValueError(f"tensor parallel: {name} is a {type(module).__name__}, not a linear layer; "
                                     f"cbserve splits only torch.nn.Linear (plan style {style!r})")
                plan[name] = style
                break
    if not any(style in ROW for style in plan.values()):
        raise ValueError(f"tensor parallel: {type(model).__name__} has no tensor-parallel plan (transformers' "
                         "tp_plan) and no Llama-style q/k/v/o and gate/up/down projections to split")
    return plan, source


def slice_ranges(size: int, rank: int, world: int, packed: bool) -> list[tuple[int, int]]:
    """The [start, end) ranges of a dimension of `size` that rank `rank` keeps, in order: one, or one
    per half of a packed tensor (gate and up stacked)."""
    halves = 2 if packed else 1
    part = size // halves
    if size % halves or part % world:
        raise ValueError(f"tensor parallel: a dimension of {part} does not split into {world} ranks")
    step = part // world
    return [(h * part + rank * step, h * part + (rank + 1) * step) for h in range(halves)]


def split_dim(style: str) -> int:
    """The weight dimension a style splits: output features (0) or input features (1)."""
    return 0 if style in COLUMN else 1


def _slice(t: torch.Tensor, dim: int, rank: int, world: int, packed: bool) -> torch.Tensor:
    """The rank's slice of `t` along `dim`, a tensor of its own."""
    ranges = slice_ranges(t.shape[dim], rank, world, packed)
    return torch.cat([t.narrow(dim, a, b - a) for a, b in ranges], dim).contiguous()


def _row_parallel_hooks(module: torch.nn.Linear, all_reduce: AllReduce, split_input: bool, rank: int,
                        world: int) -> None:  # fmt: skip
    if split_input:  # the input arrives whole: take the rank's slice of its features

        def pre(mod, args):
            x = args[0]
            return (x.chunk(world, -1)[rank].contiguous(), *args[1:])

        module.register_forward_pre_hook(pre)

    def post(mod, args, out):
        all_reduce(out)
        return out

    module.register_forward_hook(post)


def shard_model(model: torch.nn.Module, rank: int, world: int, all_reduce: AllReduce,
                device: torch.device | str | None = None) -> torch.nn.Module:  # fmt: skip
    """Rank `rank`'s copy of `model` for `world` ranks: split layers hold the rank's slice, the rest
    shares the model's tensors (copied when `device` differs), and row-parallel layers all-reduce their
    output with `all_reduce`. The copy's config keeps the model's head counts (the attention layers
    reshape by head_dim, so they run on the rank's heads as they are)."""
    check_divisible(model.config, world)
    plan, _ = resolve_plan(model)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    modules = dict(model.named_modules())
    memo: dict[int, object] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        return t if t.device == device else t.to(device)

    for name, style in plan.items():
        layer = modules[name]
        packed = style.startswith("packed_")
        dim = split_dim(style)
        weight = _slice(layer.weight.detach(), dim, rank, world, packed).to(device)
        memo[id(layer.weight)] = torch.nn.Parameter(weight, requires_grad=False)
        if layer.bias is not None:
            if style in COLUMN:
                bias = _slice(layer.bias.detach(), 0, rank, world, packed).to(device)
            else:  # added once, after the sum
                bias = keep(layer.bias.detach()) if rank == 0 else torch.zeros_like(layer.bias, device=device)
            memo[id(layer.bias)] = torch.nn.Parameter(bias, requires_grad=False)
    for p in model.parameters():
        if id(p) not in memo:
            memo[id(p)] = p if p.device == device else torch.nn.Parameter(p.detach().to(device), requires_grad=False)
    for b in model.buffers():
        memo.setdefault(id(b), keep(b))
    shard = copy.deepcopy(model, memo)
    wire_shard(shard, plan, all_reduce, rank, world)
    return shard.eval()


def wire_shard(shard: torch.nn.Module, plan: dict[str, str], all_reduce: AllReduce, rank: int, world: int) -> None:
    """Make a model whose split layers hold the rank's slices run as a shard: the layers' feature
    counts follow their weights, and row-parallel layers all-reduce their output."""
    modules = dict(shard.named_modules())
    for name, style in plan.items():
        layer = modules[name]
        layer.out_features, layer.in_features = layer.weight.shape
        if style in ROW:
            _row_parallel_hooks(layer, all_reduce, style == "rowwise_split_input", rank, world)
