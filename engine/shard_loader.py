"""One tensor-parallel rank's shard read straight from a checkpoint's safetensors files.

The model is built on the meta device (its buffers, such as rotary frequencies, on the CPU as usual),
its split layers chosen by the same plan as `tensor_parallel.shard_model`, and each parameter is then
copied from the files' memory maps onto the rank's device: a split layer's weight as the rank's
rows or columns only (`safe_open(...).get_slice`), everything else whole. The rank never holds the
whole model, in host memory or on its device: each tensor is read through a memory map of its own,
unmapped once copied (the pages read stay in the host's page cache, shared by its ranks). The
result is the shard `shard_model` makes of the whole model.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from engine.tensor_parallel import COLUMN, AllReduce, check_divisible, resolve_plan, slice_ranges, split_dim, wire_shard

logger = logging.getLogger("cbserve.loader")


def safetensors_files(folder: Path) -> dict[str, Path] | None:
    """{tensor name: its file} of a checkpoint folder, or None when it has no safetensors weights."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}  # noqa: SIM118 - a safe_open handle, not a dict
    return None


def empty_model(folder: Path, dtype: torch.dtype, attn_implementation: str | None) -> torch.nn.Module:
    """The checkpoint's model with its parameters on the meta device (no memory) and its buffers real."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, **extra)


def load_shard(folder: Path, rank: int, world: int, all_reduce: AllReduce, device: torch.device | str,
               dtype: torch.dtype, attn_implementation: str | None = None) -> torch.nn.Module | None:  # fmt: skip
    """Rank `rank`'s shard of the checkpoint in `folder`, its weights read onto `device` in `dtype`;
    None when the folder has no safetensors weights or they do not name every parameter (the caller
    loads the whole model instead)."""
    from safetensors import safe_open

    files = safetensors_files(folder)
    if files is None:
        return None
    device = torch.device(device)
    model = empty_model(folder, dtype, attn_implementation)
    check_divisible(model.config, world)
    plan, _ = resolve_plan(model)
    styles = {f"{name}.weight": (style, "weight") for name, style in plan.items()}
    styles.update({f"{name}.bias": (style, "bias") for name, style in plan.items()})
    names: dict[int, list[str]] = {}  # a parameter (tied ones share one) and all its names
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    # a parameter under none of its names is a tied one (the LM head, saved as the embedding): tied below
    sources = {key: found[0] for key, aliases in names.items() if (found := [n for n in aliases if n in files])}
    for key, source in sources.items():
        # one opening (one memory map) per tensor: the pages read of the file stay mapped for one tensor only
        with safe_open(files[source], framework="pt") as handle:
            view = _read(handle, source, styles.get(names[key][0]), rank, world)
            loaded = torch.nn.Parameter(torch.empty(view.shape, dtype=dtype, device=device), requires_grad=False)
            loaded.data.copy_(view)  # the rank's slice, from the file's pages straight into its own memory
            del view
        for name in names[key]:
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner)._parameters[leaf] = loaded
    model.tie_weights()
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        logger.info("cbserve: %s is not in %s's safetensors files: loading the whole model", missing[0], folder)
        return None
    for name, b in list(model.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = b.to(device)
    wire_shard(model, plan, all_reduce, rank, world)
    return model.eval()


def _read(handle, name: str, style: tuple[str, str] | None, rank: int, world: int) -> torch.Tensor:
    """A tensor of the checkpoint as the rank keeps it (whole, its slice, or, a row-parallel bias on
    ranks other than 0, zeros: the bias is added once, after the sum), as a view of the file's
    memory map: nothing is read until it is copied."""
    if style is None:
        return handle.get_tensor(name)
    plan_style, kind = style
    piece = handle.get_slice(name)
    shape = piece.get_shape()
    if kind == "bias" and plan_style not in COLUMN:
        return piece[:] if rank == 0 else torch.zeros(shape, dtype=piece[:0].dtype)
    dim = 0 if kind == "bias" else split_dim(plan_style)
    ranges = slice_ranges(shape[dim], rank, world, plan_style.startswith("packed_"))
    parts = [piece[a:b] if dim == 0 else piece[:, a:b] for a, b in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)  # a packed tensor's two halves: the slice only
