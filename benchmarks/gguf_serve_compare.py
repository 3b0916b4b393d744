"""GGUF where quantization matters: cbserve and llama.cpp's `llama-server` on the same Q8_0 and Q4_0
files of a Llama-3.2-1B- or Llama-3-8B-shaped model with random weights, at 1 and 16 users.

    python benchmarks/gguf_serve_compare.py --shape 1b|8b|tiny [--quants q8_0,q4_0,q4_k_m] [--users 1,16]
        [--systems cbserve,llama.cpp] [--ctx-per-slot 1024] [--limits limits.json] [--prepare-only]
        [--keep-f16] [python -m loadtest compare flags: --duration, --rounds, --input-len, ...]

The model: a Llama checkpoint of the shape's dimensions (SHAPES) with the SmolLM2 tokenizer
(vocab 49152, which llama.cpp's converter knows), normal random weights scaled as engine/testing.py
scales its test models (so greedy paths vary), written in bfloat16 safetensors one tensor at a time,
a shard at a time (the 8B never exists whole in memory). Then llama.cpp's own tools make the files:
`convert_hf_to_gguf.py --outtype q8_0` the Q8_0 file; `--outtype f16` an F16 file that
`llama-quantize --pure ... Q4_0` turns into the Q4_0 file when that binary is built
(`python benchmarks/llama_cpp_peer.py --build-quantize`), else gguf-py's reference quantizer
(`gguf.quants.quantize`, llama.cpp's own Python package, vendored with its sources) does, every
2-D weight in Q4_0 as `--pure` would. `--quants q4_k_m` adds llama-quantize's Q4_K_M mix of the
F16 file (Q4_K and Q6_K; only that binary makes it). Each file's `.tool` note says which tool made it. All of it
is cached in ~/.cache/cbserve/gguf-peer/SHAPE/ (the F16 file is deleted unless --keep-f16).

Each file is served in turn, alone on the machine, by `cbserve serve --model FILE --quantization
gguf` (every weight in the file's blocks; `--cbserve-quantization auto` lets auto's probe dequantise
a kind it times faster dense, which the memory budget below does not allow for) and by `llama-server -m FILE` (one slot per user), both with --ctx-per-slot
tokens of context per user, and measured with the same seeded Locust load (loadtest's run_locust:
same prompts, same output lengths, completions endpoint). For each file and user count the servers
run one after another, and with --rounds N that N times, the order turning by one each round (A B,
then B A), each round a fresh start: this host's speed moves by a tenth or more within minutes, so
only servers measured in one command, in alternation, compare. A server's row pools its rounds
(latencies over all their requests, output tokens/s the mean of the rounds'). While a server runs, a
thread samples the resident memory (RSS) of its process tree; the peak over the server's starts
(loading included; the peak once ready is shown beside it) is held against the file
plus the KV cache the server allocated (cbserve's /v1/models says it; llama.cpp's is 2 x layers x
KV heads x head_dim x context x 2 bytes, its default F16 cache): at most RSS_BUDGET times. The
decode step (time per output token, TPOT p50; at 1 user the batch-1 step; llama-server streams
tokens in bursts, so its inter-token p50 is no step time) is held against the weight-bandwidth
bound: the bytes of the tensors a step reads (every one but an untied token embedding) over the
STREAM triad bandwidth (benchmarks/machine_limits.py, measured at the start unless --limits gives
its --json), and against the compute bound of a decode step of one token a user: 2 x the weights'
parameters x users operations at the host's 8-bit product peak (machine_limits' int8 figure; both
cbserve-int8 and llama.cpp multiply 8-bit inputs) or, for cbserve's float inputs, its float32 peak.
The step's bound is the larger: the weights at one user, the products at 16. If llama-server stops
with SIGILL before it is ready (a build with ggml's AMX kernels did on the Xeon here;
llama_cpp_peer.py now leaves them out), it is restarted with --no-repack and the report says so.
The table goes to reports/gguf-peer/SHAPE/gguf_serve_compare.md (and results.json) and is printed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

import llama_cpp_peer  # noqa: E402

from engine.config import DEFAULT_BLOCK_SIZE  # noqa: E402

VOCAB = 49152  # SmolLM2's tokenizer
INIT_STD = 0.02  # transformers' Llama init ...
SCALE = 4.0  # ... scaled as engine/testing.build_test_model scales it
SHARD_BYTES = 2 << 30
RSS_BUDGET = 1.2  # peak RSS at most this times the file plus the KV cache
LLAMA_CPP_KV_BYTES = 2  # llama-server's default cache type, F16
BLOCK_SIZE = DEFAULT_BLOCK_SIZE["cpu"]  # cbserve's CPU default, said explicitly so the context matches
QUANTS = ("q8_0", "q4_0", "q4_k_m")  # q4_k_m only by llama-quantize (gguf-py cannot make K-quants)
DEFAULT_QUANTS = ("q8_0", "q4_0")
SYSTEMS = ("cbserve", "cbserve-int8", "llama.cpp")  # cbserve-int8: --quantized-activations int8, llama.cpp's arithmetic
DEFAULT_SYSTEMS = ("cbserve", "llama.cpp")
GIB = 1 << 30
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@dataclass(frozen=True)
class Shape:
    name: str
    model: str  # the files' stem
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    tied: bool
    rope_theta: float = 500000.0
    vocab: int = VOCAB

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """The checkpoint's tensors (transformers' names) and shapes, in file order."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        out = [("model.embed_tokens.weight", (self.vocab, h))]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (h, h)),
                    (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                    (p + "self_attn.o_proj.weight", (h, h)), (p + "post_attention_layernorm.weight", (h,)),
                    (p + "mlp.gate_proj.weight", (self.intermediate, h)),
                    (p + "mlp.up_proj.weight", (self.intermediate, h)),
                    (p + "mlp.down_proj.weight", (h, self.intermediate))]  # fmt: skip
        out.append(("model.norm.weight", (h,)))
        if not self.tied:
            out.append(("lm_head.weight", (self.vocab, h)))
        return out

    def params(self) -> int:
        return sum(math.prod(s) for _, s in self.tensors())

    def kv_bytes_per_token(self, bytes_per_value: int) -> int:
        """Keys and values of one token across all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_value

    def config(self) -> dict:
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": self.vocab,
                "hidden_size": self.hidden, "intermediate_size": self.intermediate,
                "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim, "hidden_act": "silu",
                "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
                "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
                "tie_word_embeddings": self.tied, "attention_bias": False, "mlp_bias": False,
                "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "dtype": "bfloat16",
                "use_cache": True}  # fmt: skip


SHAPES = {
    # untied, as the 8B: the smoke run goes through its LM head and its step bytes (the tied path is the 1B's
    # and the embedded SmolLM2's)
    "tiny": Shape("tiny", "llama-tiny-random", hidden=256, layers=4, heads=4, kv_heads=2, intermediate=512,
                  tied=False),
    "1b": Shape("1b", "llama-3.2-1b-shaped-random", hidden=2048, layers=16, heads=32, kv_heads=8,
                intermediate=8192, tied=True),
    "8b": Shape("8b", "llama-3-8b-shaped-random", hidden=4096, layers=32, heads=32, kv_heads=8,
                intermediate=14336, tied=False),
}  # fmt: skip

# the load each shape gets unless flags say otherwise: the 8B on 2 cores prefills slowly, so shorter prompts
LOAD_DEFAULTS = {
    "tiny": ["--duration", "10s", "--rounds", "1", "--input-len", "16:64", "--output-len", "32"],
    # 1B: at 16 users a 60 s run of 64-256 words in and 128 out saw no llama-server request finish here
    "1b": ["--duration", "150s", "--rounds", "1", "--input-len", "16:64", "--output-len", "64"],
    # 8B: at 16 users a decode step takes 1.5-2.6 s here, so 64 tokens out in 180 s saw no request finish
    "8b": ["--duration", "300s", "--rounds", "1", "--input-len", "16:64", "--output-len", "32",
           "--ready-timeout", "900"],
}


def cache_dir(shape: Shape) -> Path:
    return Path.home() / ".cache" / "cbserve" / "gguf-peer" / shape.name


def checkpoint_dir(shape: Shape) -> Path:
    return cache_dir(shape) / "checkpoint"


def gguf_file(shape: Shape, quant: str) -> Path:
    """The file of one quantization: <cache>/<model>-<quant>.gguf (quant: q8_0, q4_0, q4_k_m, f16)."""
    if quant not in (*QUANTS, "f16"):
        raise ValueError(f"quant must be one of {', '.join((*QUANTS, 'f16'))}, got {quant!r}")
    return cache_dir(shape) / f"{shape.model}-{quant}.gguf"


def tool_note(path: Path) -> Path:
    return path.with_name(path.name + ".tool")


# -- the checkpoint ---------------------------------------------------------------------------------------------


def shards(shape: Shape, limit: int = SHARD_BYTES) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The tensors grouped into shards of at most `limit` bfloat16 bytes (a larger tensor alone)."""
    out: list[list] = [[]]
    size = 0
    for name, dims in shape.tensors():
        nbytes = 2 * math.prod(dims)
        if out[-1] and size + nbytes > limit:
            out.append([])
            size = 0
        out[-1].append((name, dims))
        size += nbytes
    return out


def write_checkpoint(shape: Shape, folder: Path, seed: int = 0) -> None:
    """The random-weight checkpoint in bfloat16 safetensors, one shard in memory at a time; norms ones."""
    import torch
    from safetensors.torch import save_file

    from engine.loader import embedded_folder

    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    groups = shards(shape)
    weight_map = {}
    for k, group in enumerate(groups):
        tensors = {}
        for name, dims in group:
            if len(dims) == 1:
                tensors[name] = torch.ones(dims, dtype=torch.bfloat16)
                continue
            g = torch.Generator().manual_seed(seed * 100003 + len(weight_map) + len(tensors))
            value = torch.empty(dims, dtype=torch.bfloat16)
            for r in range(0, dims[0], 1024):  # float32 a slab at a time
                rows = min(1024, dims[0] - r)
                value[r : r + rows] = torch.randn((rows, dims[1]), generator=g).mul_(INIT_STD * SCALE)
            tensors[name] = value
        file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(tensors, partial / file, metadata={"format": "pt"})
        weight_map.update({name: file for name in tensors})
        print(f"  shard {k + 1}/{len(groups)}: {len(tensors)} tensors", flush=True)
        del tensors
    total = 2 * shape.params()
    (partial / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (partial / "config.json").write_text(json.dumps(shape.config(), indent=2))
    (partial / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    source = embedded_folder()
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, partial / name)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)


# -- the files ----------------------------------------------------------------------------------------------------


def _timed(what: str, step):
    print(f"{what} ...", flush=True)
    start = time.perf_counter()
    result = step()
    print(f"{what}: done in {time.perf_counter() - start:.1f} s", flush=True)
    return result


def _note(path: Path, tool: str) -> None:
    tool_note(path).write_text(tool + "\n")


def prepare(shape: Shape, quants: list[str], keep_f16: bool = False) -> dict[str, Path]:
    """The checkpoint and the GGUF files, each made only if missing."""
    cache_dir(shape).mkdir(parents=True, exist_ok=True)
    folder = checkpoint_dir(shape)
    if not (folder / "config.json").is_file():
        _timed(f"write the {shape.name} checkpoint ({shape.params() / 1e9:.2f} B parameters, bfloat16) to {folder}",
               lambda: write_checkpoint(shape, folder))  # fmt: skip
    files, f16, used_f16 = {}, gguf_file(shape, "f16"), False
    for quant in quants:
        target = gguf_file(shape, quant)
        files[quant] = target
        if target.is_file():
            note = tool_note(target)
            print(f"{target.name}: there ({note.read_text().strip() if note.is_file() else 'tool not noted'})")
            continue
        if quant == "q8_0":
            _timed(f"convert to {target.name}", lambda: llama_cpp_peer.convert(folder, target, "q8_0"))
            _note(target, "convert_hf_to_gguf.py --outtype q8_0")
            continue
        if quant == "q4_k_m" and llama_cpp_peer.quantize_binary() is None:
            raise SystemExit("q4_k_m files are made by llama-quantize, which is not built: "
                             "python benchmarks/llama_cpp_peer.py --build-quantize")  # fmt: skip
        if not f16.is_file():
            _timed(f"convert to {f16.name}", lambda: llama_cpp_peer.convert(folder, f16, "f16"))
            _note(f16, "convert_hf_to_gguf.py --outtype f16")
        used_f16 = True
        if quant == "q4_k_m":
            _timed(f"quantize {f16.name} to {target.name}", lambda: quantize_q4_k_m(f16, target))
        else:
            _timed(f"quantize {f16.name} to {target.name}", lambda: quantize_q4_0(f16, target))
    if used_f16 and not keep_f16:  # after every file made from it
        f16.unlink()
        tool_note(f16).unlink(missing_ok=True)
    return files


def quantize_q4_0(source: Path, target: Path) -> None:
    """llama-quantize --pure if built, else gguf-py's reference quantizer (in a child with llama.cpp's
    vendored gguf-py on the path, as the converter runs)."""
    partial = target.with_name(target.name + ".partial")
    binary = llama_cpp_peer.quantize_binary()
    if binary is not None:
        subprocess.run([str(binary), "--pure", str(source), str(partial), "Q4_0", str(os.cpu_count() or 1)],
                       check=True)  # fmt: skip
        tool = f"llama-quantize --pure {source.name} Q4_0 (from {source.name}: convert_hf_to_gguf.py --outtype f16)"
    else:
        subprocess.run([sys.executable, __file__, "--q4-0", str(source), str(partial)], check=True,
                       env=llama_cpp_peer.converter_env())  # fmt: skip
        tool = (f"gguf-py's reference quantizer gguf.quants.quantize (llama.cpp's vendored gguf-py), every 2-D "
                f"weight Q4_0 (from {source.name}: convert_hf_to_gguf.py --outtype f16)")
    partial.rename(target)
    _note(target, tool)


def quantize_q4_k_m(source: Path, target: Path) -> None:
    """llama-quantize's Q4_K_M mix (Q4_K, with Q6_K where its rules choose, e.g. some V and FFN-down
    weights and the output), not --pure: the file llama.cpp users download."""
    partial = target.with_name(target.name + ".partial")
    subprocess.run([str(llama_cpp_peer.quantize_binary()), str(source), str(partial), "Q4_K_M",
                    str(os.cpu_count() or 1)], check=True)  # fmt: skip
    partial.rename(target)
    _note(target, f"llama-quantize {source.name} Q4_K_M (from {source.name}: convert_hf_to_gguf.py --outtype f16)")


def q4_0_eligible(name: str, np_shape: tuple[int, ...]) -> bool:
    """A tensor `--pure` Q4_0 quantizes: a 2-D weight whose rows are whole 32-value blocks."""
    return name.endswith(".weight") and len(np_shape) == 2 and np_shape[-1] % 32 == 0


def requantize_q4_0(source: Path, target: Path, chunk_rows: int = 512) -> None:
    """Copy a GGUF with every eligible F16/F32 weight quantized to Q4_0 by gguf-py, the metadata kept
    (general.file_type set to MOSTLY_Q4_0). Runs with whatever `gguf` is importable."""
    import gguf
    import numpy as np

    q4 = gguf.GGMLQuantizationType.Q4_0
    floats = (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32)
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(target, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = int(gguf.LlamaFileType.MOSTLY_Q4_0)
        writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
    plan = []
    for t in reader.tensors:
        quantize = t.tensor_type in floats and q4_0_eligible(t.name, tuple(t.data.shape))
        plan.append(quantize)
        if quantize:
            byte_shape = gguf.quant_shape_to_byte_shape(tuple(t.data.shape), q4)
            writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), raw_dtype=q4)
        else:
            writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t, quantize in zip(reader.tensors, plan):
        if not quantize:
            writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
            continue
        data = t.data
        out = np.empty(gguf.quant_shape_to_byte_shape(tuple(data.shape), q4), dtype=np.uint8)
        for r in range(0, data.shape[0], chunk_rows):
            out[r : r + chunk_rows] = gguf.quantize(np.asarray(data[r : r + chunk_rows], dtype=np.float32), q4)
        writer.write_tensor_data(out)
    writer.close()


def step_weights(path: Path) -> tuple[int, int]:
    """Bytes and parameters of the tensors a decode step reads: all of them but the token embedding
    when the file has its own output (LM head) tensor (a lookup reads only its tokens' rows)."""
    from gguf import GGUFReader

    tensors = {t.name: (int(t.n_bytes), int(t.n_elements)) for t in GGUFReader(path).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(b for b, _ in tensors.values()), sum(n for _, n in tensors.values())


# -- the arithmetic the table states ------------------------------------------------------------------------------


def weight_bound_s(weight_bytes: int, bandwidth_gbs: float) -> float:
    """The least time of a decode step: its weights read once at the bandwidth."""
    return weight_bytes / (bandwidth_gbs * 1e9)


def compute_bound_s(params: int, users: int, peak_gops: float) -> float:
    """The least time of a decode step of one token for each of `users`: 2 operations a parameter a
    token at the product peak."""
    return 2 * params * users / (peak_gops * 1e9)


def system_peak(limits, system: str) -> tuple[float, str] | None:
    """The product peak a system's decode step runs at (GOP/s) and its name: cbserve's float inputs
    multiply in float32; cbserve-int8 and llama.cpp multiply 8-bit inputs. None: not measured."""
    if system == "cbserve":
        return limits.peak_gflops["float32"], "float32"
    return (limits.int8_gops, "int8") if limits.int8_gops else None


def llama_cpp_kv_bytes(shape: Shape, users: int, ctx_per_slot: int) -> int:
    """llama-server's KV cache: `users` slots of `ctx_per_slot` tokens, F16 keys and values."""
    return shape.kv_bytes_per_token(LLAMA_CPP_KV_BYTES) * users * ctx_per_slot


def rss_ratio(peak_rss: int, file_bytes: int, kv_bytes: int) -> float:
    return peak_rss / (file_bytes + kv_bytes)


def within_rss_budget(peak_rss: int, file_bytes: int, kv_bytes: int, budget: float = RSS_BUDGET) -> bool:
    return rss_ratio(peak_rss, file_bytes, kv_bytes) <= budget


def verdict(cbserve: dict, llama: dict) -> str:
    """Must-show 3's test for one file and one load: cbserve >= 1.0x llama.cpp's output tok/s, TTFT p50
    and inter-token p99 no worse."""
    checks = [("tok/s", cbserve["output_tok_s"] >= llama["output_tok_s"]),
              ("TTFT p50", cbserve["ttft_p50_ms"] <= llama["ttft_p50_ms"]),
              ("ITL p99", cbserve["itl_p99_ms"] <= llama["itl_p99_ms"])]  # fmt: skip
    failed = [name for name, ok in checks if not ok]
    return "met" if not failed else "not met (" + ", ".join(failed) + ")"


# -- serving and measuring ----------------------------------------------------------------------------------------


class PeakRss:
    """The largest summed RSS of a process and its descendants, sampled every `interval` seconds: over
    its whole life (`peak`) and since `serving()` was called (`serving_peak`: after loading)."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        self.pid, self.interval, self.peak, self.serving_peak = pid, interval, 0, 0
        self._serving = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def current(self) -> int:
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def _run(self) -> None:
        while not self._done.wait(self.interval):
            self._sample()

    def _sample(self) -> int:
        now = self.current()
        self.peak = max(self.peak, now)
        if self._serving:
            self.serving_peak = max(self.serving_peak, now)
        return now

    def serving(self) -> int:
        """From now on count the serving peak too; returns the RSS now."""
        self._serving = True
        return self._sample()

    def start(self) -> PeakRss:
        self._thread.start()
        return self

    def stop(self) -> int:
        """The peak: the samples', or the kernel's high-water mark of the root (VmHWM) if higher."""
        self._sample()
        self.peak = max(self.peak, high_water_mark(self.pid))
        self._done.set()
        self._thread.join()
        return self.peak


def high_water_mark(pid: int) -> int:
    try:
        found = re.search(r"^VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    except OSError:
        return 0
    return int(found.group(1)) * 1024 if found else 0


def cbserve_target(gguf: Path, users: int, ctx_per_slot: int, quantization: str = "gguf", activations: str = "float",
                   extra: list[str] | None = None):  # fmt: skip
    from loadtest.target import Target, cbserve_command, free_port

    port = free_port()
    per_request = math.ceil(ctx_per_slot / BLOCK_SIZE)
    command = cbserve_command(port, str(gguf)) + [
        "--block-size", str(BLOCK_SIZE), "--num-blocks", str(users * per_request),
        "--max-blocks-per-request", str(per_request), "--quantization", quantization,
        "--quantized-activations", activations, *(extra or [])]  # fmt: skip
    name = "cbserve" if activations == "float" else f"cbserve-{activations}"
    return Target(name, f"http://127.0.0.1:{port}", command=command)


def llama_cpp_target(gguf: Path, users: int, ctx_per_slot: int, extra: list[str] | None = None):
    from loadtest.target import Target, free_port

    port = free_port()
    command = llama_cpp_peer.serve_command(port, gguf, parallel=users, ctx_per_slot=ctx_per_slot)
    return Target("llama.cpp", f"http://127.0.0.1:{port}", command=command + (extra or []))


NO_REPACK_NOTE = ("llama-server ran with --no-repack: with weight repacking on (its AMX and repacked CPU kernels) "
                  "it stopped with SIGILL before it was ready, so ggml's plain CPU kernels served these files")


def stopped_by_sigill(target) -> bool:
    return target.proc is not None and target.proc.poll() == -signal.SIGILL


def cbserve_kv_bytes(url: str) -> int | None:
    import requests

    try:
        return int(requests.get(url + "/v1/models", timeout=10).json()["data"][0]["engine"]["kv_cache_bytes"])
    except (requests.RequestException, KeyError, IndexError, TypeError, ValueError):
        return None


def measure_system(target, kv_bytes: int | None, users: int, args: argparse.Namespace, out: Path, rnd: int) -> dict:
    """Start one server alone, ready and warm it, run round `rnd` of the load, stop it: that run, the
    server's peak RSS (and once ready, and while serving) and its KV cache bytes."""
    from loadtest.compare import warm_up
    from loadtest.run import run_locust

    print(f"starting {target.name}: {' '.join(target.command)}", flush=True)
    target.start(out / f"server-round{rnd + 1}.log")
    rss = PeakRss(target.proc.pid).start()
    try:
        target.wait_ready(args.ready_timeout)
        warm_up(target, args.endpoint)
        if kv_bytes is None:
            kv_bytes = cbserve_kv_bytes(target.url)
        ready_rss = rss.serving()
        result = run_locust(target, out / f"round{rnd + 1}", users, args, seed=args.seed + rnd)
        s = result.summary
        print(f"  round {rnd + 1} {target.name:<10} {s['output_throughput']:8.1f} output tok/s, "
              f"{s['completed']} requests, {s['failed']} failed", flush=True)  # fmt: skip
    finally:
        peak = rss.stop()
        target.stop()
    return {"run": result, "peak_rss": peak, "serving_peak_rss": rss.serving_peak, "ready_rss": ready_rss,
            "kv_bytes": kv_bytes or 0}  # fmt: skip


def pool_rounds(parts: list[dict], slos: dict) -> dict:
    """One server's rounds (measure_system's answers) as one row: latencies over every round's requests,
    throughput the mean of the rounds', memory the largest any start reached."""
    from loadtest.compare import pooled

    summary = pooled([part["run"] for part in parts], slos)
    return {"output_tok_s": summary["output_throughput"], "ttft_p50_ms": summary["p50_ttft_ms"],
            "tpot_p50_ms": summary["p50_tpot_ms"], "itl_p99_ms": summary["p99_itl_ms"],
            "held_token_share": summary["held_token_share"], "completed": summary["completed"],
            "failed": summary["failed"], "rounds_output_tok_s": summary["rounds_output_throughput"],
            "peak_rss": max(part["peak_rss"] for part in parts),
            "serving_peak_rss": max(part["serving_peak_rss"] for part in parts),
            "ready_rss": max(part["ready_rss"] for part in parts),
            "kv_bytes": max(part["kv_bytes"] for part in parts)}  # fmt: skip


def rotation(systems: list[str], rnd: int) -> list[str]:
    """The order the servers run in round `rnd`: the list turned by one a round, so none always runs
    first (the host's speed moves within minutes)."""
    k = rnd % len(systems)
    return systems[k:] + systems[:k]


def host_limits(limits_path: str | None):
    import machine_limits

    return machine_limits.load(limits_path) if limits_path else _timed(
        "measure the memory bandwidth and product peaks (machine_limits)", lambda: machine_limits.measure(repeats=5))


def gib(n: float) -> str:
    return f"{n / GIB:.3g}"


def bounds(row: dict) -> str:
    """The bound column: the weights' read and the step's products (ms), the larger in bold."""
    weights = 1e3 * row.get("weights_bound_s", row["bound_s"])
    if "compute_bound_s" not in row:
        return f"{weights:.1f}; n/a"
    compute = 1e3 * row["compute_bound_s"]
    w, c = f"{weights:.1f}", f"{compute:.1f} ({row['compute_peak']})"
    return f"**{w}**; {c}" if weights >= compute else f"{w}; **{c}**"


def markdown(shape: Shape, rows: list[dict], gbs: float, host: str, tools: dict[str, str], load: str,
             notes: list[str] | None = None, peaks: str = "") -> str:  # fmt: skip
    lines = [f"## {shape.model}: cbserve against llama-server, same GGUF files", "",
             f"host: {host}; STREAM triad {gbs:.1f} GB/s{'; ' + peaks if peaks else ''}; load: {load}", ""]  # fmt: skip
    lines += [f"- `{q}`: {tool}" for q, tool in tools.items()]
    lines += [f"- {note}" for note in notes or []]
    lines += ["", "| file | users | server | output tok/s | TTFT p50 ms | TPOT p50 ms | ITL p99 ms | "
              "peak RSS GiB (serving) | file + KV GiB | RSS ratio (<= 1.2) | weights read GiB | "
              "bound ms: weights; compute | TPOT p50 / bound |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['quant']} | {r['users']} | {r['system']} | failed: {r['error']} |" + " |" * 9)
            continue
        ratio = rss_ratio(r["peak_rss"], r["file_bytes"], r["kv_bytes"])
        lines.append(f"| {r['quant']} | {r['users']} | {r['system']} | {r['output_tok_s']:.1f} | "
                     f"{r['ttft_p50_ms']:.0f} | {r['tpot_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | "
                     f"{gib(r['peak_rss'])} ({gib(r['serving_peak_rss'])}) | "
                     f"{gib(r['file_bytes'])} + {gib(r['kv_bytes'])} | {ratio:.2f} "
                     f"{'ok' if ratio <= RSS_BUDGET else 'over'} | {gib(r['weight_bytes'])} | "
                     f"{bounds(r)} | {r['tpot_p50_ms'] / (1e3 * r['bound_s']):.2f}x |")  # fmt: skip
    lines += ["", "cbserve against llama.cpp (tok/s >= 1.0x, TTFT p50 and ITL p99 no worse):", ""]
    by_key: dict[tuple, dict] = {}
    for r in rows:
        if "error" not in r:
            by_key.setdefault((r["quant"], r["users"]), {})[r["system"]] = r
    for (quant, users), pair in by_key.items():
        for name in ("cbserve", "cbserve-int8"):
            if name not in pair or "llama.cpp" not in pair:
                continue
            c, l = pair[name], pair["llama.cpp"]
            lines.append(f"- {quant}, {users} user{'s' if users > 1 else ''}, {name}: "
                             f"{c['output_tok_s'] / l['output_tok_s']:.2f}x tok/s, "
                             f"TTFT p50 {c['ttft_p50_ms']:.0f} vs {l['ttft_p50_ms']:.0f} ms, ITL p99 "
                             f"{c['itl_p99_ms']:.1f} vs {l['itl_p99_ms']:.1f} ms{held(c, l)}: {verdict(c, l)}")  # fmt: skip
    return "\n".join(lines) + "\n"


def held(c: dict, l: dict) -> str:
    """The share of tokens each server held back for the next (loadtest's held_tokens), where either did:
    near 1% they make part of an inter-token p99 (a pair's gap spans two steps), and their number
    follows the tokens each server's arithmetic drew, not its speed."""
    shares = (c.get("held_token_share"), l.get("held_token_share"))
    if None in shares or not any(shares):  # (an older results.json has none)
        return ""
    return f" (tokens held with the next {shares[0]:.2%} vs {shares[1]:.2%})"


def own_flags(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--quants", default=",".join(DEFAULT_QUANTS),
                   help=f"a subset of {','.join(QUANTS)} (q4_k_m needs llama-quantize: llama_cpp_peer.py "
                        "--build-quantize)")  # fmt: skip
    p.add_argument("--users", default="1,16", help="concurrent users, comma-separated (llama.cpp: as many slots)")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"a subset of {','.join(SYSTEMS)} (cbserve-int8: --quantized-activations int8)")
    p.add_argument("--ctx-per-slot", type=int, default=1024, help="tokens of context per user, both servers")
    p.add_argument("--limits", help="machine_limits.py --json output (default: measure the bandwidth here)")
    p.add_argument("--prepare-only", action="store_true", help="make the checkpoint and files, serve nothing")
    p.add_argument("--cbserve-quantization", default="gguf", choices=("gguf", "auto"),
                   help="cbserve's --quantization: gguf keeps every weight in the file's blocks (default: the "
                        "memory budget is the file's); auto lets its load-time probe dequantise a kind")  # fmt: skip
    p.add_argument("--cbserve-args", default="", help="more `cbserve serve` flags, one string (e.g. "
                   "'--max-decode-stall 1.5'); the report's load line names them")  # fmt: skip
    p.add_argument("--keep-f16", action="store_true", help="keep the F16 conversion the Q4_0 file is made from")
    opts, rest = p.parse_known_args(argv)
    opts.quants = [q for q in opts.quants.split(",") if q]
    opts.systems = [s for s in opts.systems.split(",") if s]
    opts.users = [int(u) for u in opts.users.split(",") if u]
    if not opts.quants or set(opts.quants) - set(QUANTS):
        p.error(f"--quants takes a subset of {','.join(QUANTS)}")
    if not opts.systems or set(opts.systems) - set(SYSTEMS):
        p.error(f"--systems takes a subset of {','.join(SYSTEMS)}")
    if not opts.users or min(opts.users) < 1:
        p.error("--users takes positive counts")
    return opts, rest


def main(argv: list[str]) -> int:
    if argv[:1] == ["--q4-0"]:  # the child quantize_q4_0 starts
        requantize_q4_0(Path(argv[1]), Path(argv[2]))
        return 0
    from loadtest.cli import parse_compare_args
    from loadtest.target import UsageError

    opts, rest = own_flags(argv)
    shape = SHAPES[opts.shape]
    if not llama_cpp_peer.built():
        print("llama.cpp is not set up: python benchmarks/llama_cpp_peer.py --setup", file=sys.stderr)
        return 2
    try:
        args = parse_compare_args(["--endpoint", "completions", "--out", f"reports/gguf-peer/{shape.name}",
                                   *LOAD_DEFAULTS[shape.name], *rest], targets=[])  # fmt: skip
    except UsageError as exc:
        print(f"gguf_serve_compare: error: {exc}", file=sys.stderr)
        return exc.status
    args.cbserve_quantization, args.cbserve_args = opts.cbserve_quantization, opts.cbserve_args
    files = prepare(shape, opts.quants, opts.keep_f16)
    if opts.prepare_only:
        return 0
    limits = host_limits(opts.limits)
    gbs, host = limits.triad_gbs, limits.host
    peaks = f"float32 {limits.peak_gflops['float32']:.0f} GFLOP/s" + (
        f", int8 {limits.int8_gops:.0f} GOP/s" if limits.int8_gops else ", int8 not measured")
    print(f"host: {host}; STREAM triad {gbs:.1f} GB/s; {peaks}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tools = {q: tool_note(p).read_text().strip() for q, p in files.items() if tool_note(p).is_file()}
    load = (f"completions, {args.input_len} words in, {args.output_len} tokens out, {args.duration_s:.0f} s x "
            f"{args.rounds} rounds per server (the servers alternating, each alone), {opts.ctx_per_slot} tokens of "
            "context per user; "
            f"cbserve --quantization {opts.cbserve_quantization}" + (f" {opts.cbserve_args}" if opts.cbserve_args else ""))
    rows: list[dict] = []
    text = ""
    llama_extra: list[str] = []
    notes: list[str] = []
    for quant, path in files.items():
        weight_bytes, params = step_weights(path)
        for users in opts.users:
            parts: dict[str, list[dict]] = {system: [] for system in opts.systems}
            errors: dict[str, str] = {}
            for rnd in range(args.rounds):
                for system in rotation(opts.systems, rnd):
                    if system in errors:
                        continue
                    print(f"\n{quant}, {users} users, {system}, round {rnd + 1} of {args.rounds}", flush=True)
                    try:
                        parts[system].append(serve_and_measure(system, path, shape, users, opts.ctx_per_slot, args,
                                                               out / quant / f"u{users}" / system, llama_extra, notes,
                                                               rnd))  # fmt: skip
                    except UsageError as exc:  # this server failed (the log says why); the others still run
                        print(f"{system} failed: {exc}", flush=True)
                        errors[system] = str(exc)
            for system in opts.systems:
                row = {"quant": quant, "users": users, "system": system, "file_bytes": path.stat().st_size,
                       "weight_bytes": weight_bytes, "params": params,
                       "weights_bound_s": weight_bound_s(weight_bytes, gbs)}  # fmt: skip
                peak = system_peak(limits, system)
                if peak:
                    row |= {"compute_bound_s": compute_bound_s(params, users, peak[0]), "compute_peak": peak[1]}
                row["bound_s"] = max(row["weights_bound_s"], row.get("compute_bound_s", 0.0))
                if system in errors:
                    row["error"] = errors[system]
                else:
                    row |= pool_rounds(parts[system], args.slos)
                    if not row["completed"]:  # nothing to compare: a row, not a ratio
                        row["error"] = f"no request completed in {args.rounds} x {args.duration_s:.0f} s"
                rows.append(row)
            text = markdown(shape, rows, gbs, host, tools, load, notes, peaks)  # written after every file and count
            (out / "gguf_serve_compare.md").write_text(text)
            (out / "results.json").write_text(json.dumps({"shape": asdict(shape), "bandwidth_gbs": gbs,
                                                          "products": peaks, "host": host, "tools": tools, "load": load,
                                                          "notes": notes, "rows": rows}, indent=2))  # fmt: skip
    print("\n" + text)
    print(f"written: {out / 'gguf_serve_compare.md'}, {out / 'results.json'}")
    return 0 if all(r.get("completed") for r in rows) else 1


def serve_and_measure(system: str, path: Path, shape: Shape, users: int, ctx_per_slot: int, args: argparse.Namespace,
                      where: Path, llama_extra: list[str], notes: list[str], rnd: int) -> dict:  # fmt: skip
    """One server on one file at one user count, for round `rnd`. A llama-server stopped by SIGILL before it
    was ready is restarted with --no-repack, which `llama_extra` then keeps for the later runs and `notes`
    records."""
    from loadtest.target import UsageError

    if system.startswith("cbserve"):
        activations = "int8" if system == "cbserve-int8" else "float"
        target = cbserve_target(path, users, ctx_per_slot, args.cbserve_quantization, activations,
                                shlex.split(args.cbserve_args))  # fmt: skip
        return measure_system(target, None, users, args, where, rnd)
    kv = llama_cpp_kv_bytes(shape, users, ctx_per_slot)
    target = llama_cpp_target(path, users, ctx_per_slot, llama_extra)
    try:
        return measure_system(target, kv, users, args, where, rnd)
    except UsageError:
        if llama_extra or not stopped_by_sigill(target):
            raise
    print(NO_REPACK_NOTE, flush=True)
    llama_extra.append("--no-repack")
    notes.append(NO_REPACK_NOTE)
    return measure_system(llama_cpp_target(path, users, ctx_per_slot, llama_extra), kv, users, args, where, rnd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
