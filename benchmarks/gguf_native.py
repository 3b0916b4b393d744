"""A GGUF model served in its blocks (quantization gguf) against the same file dequantised.

    python benchmarks/gguf_native.py agreement [--prompts 64] [--tokens 32] [--model file.gguf]
    python benchmarks/gguf_native.py memory [--model file.gguf]
    python benchmarks/gguf_native.py kernels [--shapes smollm2|1b|8b] [--rows 1,16,128] [--repeats 20]
        [--types Q8_0,Q4_0,Q4_1,Q4_K,Q6_K] [--threads 1,2] [--no-dense] [--build avx512-5e344599a33f] [--cold]
    python benchmarks/gguf_native.py probe [--model file.gguf] [--dtype bfloat16]
    python benchmarks/gguf_native.py step [--model file.gguf] [--rows 16] [--repeats 20] [--activations int8]

`agreement`: greedy output of cbserve's engine on the native model (Q4_1/Q8_0 blocks) against transformers' `generate` on the dequantised float32 weights, over a fixed set
of chat prompts: how many of the outputs are identical, and the mean length of the common prefix.
The engine's own output is also checked against `generate` on the native model (must be identical).
`memory`: resident memory (RSS) after loading each way and after one short generate (a mapped
safetensors checkpoint is resident only once read), each in a fresh process.
`kernels`: time of one product per linear shape (SmolLM2-135M's, or Llama-3.2-1B's / Llama-3-8B's
with `--shapes 1b|8b`) for the quantized kernel (float activations, bfloat16 activations, and int8
activations; K-quants, `--types Q4_K,Q6_K`, need inputs in whole super-blocks of 256, so
SmolLM2's shapes leave them out), the weight dequantised for the call plus
torch's product (what steps of more than
cpu_quant.DEQUANTIZE_ROWS rows do), cbserve's float32 panel kernel and oneDNN's float32 product
(and its bfloat16 one where the CPU multiplies bfloat16 natively: the dense path `quantization auto`
weighs the blocks against on such a host; `--no-dense` leaves the dense paths out), at each row
count and thread count, all in one process, one shape after another. Each line gives the fastest
and the median of `--repeats` calls, and from the fastest the weight bytes read per second (GB/s,
the quantity a decode step is bound by) and GFLOP/s (2 x rows x out x in). The same weight called
again is read from the cache wherever it fits in the last-level cache (a Zen 3's 32 MiB holds every
1B-shaped matrix but the head): `--cold` keeps copies of each block weight that together exceed
twice that cache and calls them in turn, so each call reads its weight from memory as a decode step
does (block paths only: the dense ones are left out).
`step`: a decode at `--rows` users in this process (`--quantization gguf`, the given inputs): every
`QuantizedLinear` of the model once on that many random rows, then the engine's decode step with
that many requests, each the best and median of `--repeats` (the first of `--rows` is taken).
`probe`: `quantization auto`'s load-time probe (engine/backends/quant_auto.py, one thread) on the
model's LM head and largest layer matrix, then the same timing on all of torch's threads, and each
way's choice: whether the one-thread probe decides as the cores the engine uses would.
The embedded SmolLM2-135M-Instruct unless --model names a GGUF file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOPICS = ["the sea", "a mountain village", "bread", "the moon", "rivers", "bees", "winter", "a library", "trains",
          "the desert", "owls", "gardens", "rain", "a lighthouse", "chess", "volcanoes"]  # fmt: skip
TEMPLATES = ["Write a short poem about {}.", "Explain {} to a child in two sentences.",
             "List three facts about {}.", "What is the most surprising thing about {}?"]  # fmt: skip


def prompts(n: int) -> list[str]:
    """n fixed prompts: every template over every topic, in a fixed order (64 in all)."""
    out = [t.format(topic) for topic in TOPICS for t in TEMPLATES]
    if n > len(out):
        raise SystemExit(f"at most {len(out)} prompts")
    return out[:n]


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)  # fmt: skip


def agreement(model_path: str | None, n: int, tokens: int) -> dict:
    import torch

    from engine import generate_batch
    from engine.loader import load_model

    native = load_model(model_path, "float32", quantization="gguf")
    reference = load_model(model_path, "float32", quantization="none")
    ids = [list(chat_ids(native.tokenizer, p)) for p in prompts(n)]
    out = generate_batch(native.model, ids, max_new_tokens=tokens, ignore_eos=True, progress_bar=False)
    engine = [list(o.generated_tokens) for o in out.values()]
    same_as_generate = identical = prefix = 0
    for i, prompt in enumerate(ids):
        x = torch.tensor([prompt])
        kw = {"attention_mask": torch.ones_like(x), "max_new_tokens": tokens, "do_sample": False, "eos_token_id": None}
        own = native.model.generate(x, **kw)[0, len(prompt):]
        ref = reference.model.generate(x, **kw)[0, len(prompt):]
        mine = engine[i]
        same_as_generate += mine == own.tolist()
        common = next((j for j, (a, b) in enumerate(zip(mine, ref.tolist())) if a != b), min(len(mine), len(ref)))
        identical += common == len(mine)
        prefix += common
    return {"prompts": n, "tokens": tokens, "engine_equals_generate_on_native": same_as_generate,
            "identical_to_dequantised": identical, "mean_common_prefix": prefix / n}  # fmt: skip


MEMORY_CHILD = """
import gc, json, sys, psutil, torch
from engine.loader import load_model
before = psutil.Process().memory_info().rss
loaded = load_model(sys.argv[1] or None, "float32", quantization=sys.argv[2])
gc.collect()
after_load = psutil.Process().memory_info().rss
loaded.model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)  # every weight read once
print(json.dumps({"before_mib": before / 2**20, "after_load_mib": after_load / 2**20,
                  "after_forward_mib": psutil.Process().memory_info().rss / 2**20}))
"""


def memory(model_path: str | None) -> dict:
    out = {}
    for q in ("gguf", "none"):
        r = subprocess.run([sys.executable, "-c", MEMORY_CHILD, model_path or "", q], capture_output=True, text=True,
                           cwd=ROOT, check=True)  # fmt: skip
        out[q] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


SHAPES = {  # (out, in) of each linear kind
    "smollm2": {"qkv": (960, 576), "o": (576, 576), "gate/up": (1536, 576), "down": (576, 1536), "head": (49152, 576)},
    "1b": {"q/o": (2048, 2048), "k/v": (512, 2048), "gate/up": (8192, 2048), "down": (2048, 8192),
           "head": (49152, 2048)},
    "8b": {"q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (14336, 4096), "down": (4096, 14336),
           "head": (49152, 4096)},
}


def random_blocks(qtype: int, n: int, k: int, rng) -> "torch.Tensor":
    """Random GGUF blocks of [n, k] weights (random quants, scales in [0.5, 1) / 64; K-quants:
    super-blocks of 256 with their float16 d, and Q4_K's dmin, set so): the kernels' time does not
    depend on the values, and large shapes would take long through gguf's quantizer."""
    import numpy as np
    import torch

    from engine.backends.cpu_quant import BLOCK, BLOCK_BYTES, K_QUANTS, Q4_1, Q4_K, Q6_K, SUPER

    per = SUPER if qtype in K_QUANTS else BLOCK
    raw = rng.integers(0, 256, size=(n, k // per, BLOCK_BYTES[qtype]), dtype=np.uint8)
    halves = 2 if qtype in (Q4_1, Q4_K) else 1  # Q4_1's minimum, Q4_K's dmin
    scales = ((rng.random((n, k // per, halves)) * 0.5 + 0.5) / 64).astype(np.float16).view(np.uint8)
    if qtype == Q6_K:  # its float16 d is the super-block's last two bytes
        raw[..., -2:] = scales
    else:
        raw[..., : 2 * halves] = scales
    return torch.from_numpy(raw.reshape(n, -1))


def _timed(fn, repeats: int) -> tuple[float, float]:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[0], times[len(times) // 2]


class _FloatKquants:
    """An earlier kernel build whose kquant_linear(x, w, qtype, bias) takes no int8 flag, called as
    cpu_quant.linear calls today's (float inputs only)."""

    def __init__(self, ops) -> None:
        self._ops = ops

    def __getattr__(self, name: str):
        return getattr(self._ops, name)

    def kquant_linear(self, x, w, qtype, bias, int8=False):
        assert not int8, "this build has no int8 product for K-quants"
        return self._ops.kquant_linear(x, w, qtype, bias)


class _Rotating:
    """Copies of a weight that together exceed twice the last-level cache (`cold`), handed out in
    turn: each call gets one not read since the others were."""

    def __init__(self, weight, cold: bool) -> None:
        from machine_limits import last_level_cache_bytes  # benchmarks/, on sys.path as this script's folder

        copies = max(1, -(-2 * last_level_cache_bytes() // max(weight.numel(), 1)) + 1) if cold else 1
        self.copies = [weight] + [weight.clone() for _ in range(copies - 1)]
        self._next = 0

    def __call__(self):
        w = self.copies[self._next]
        self._next = (self._next + 1) % len(self.copies)
        return w


def kernels(rows: list[int], repeats: int, shapes: str = "smollm2", types: list[str] | None = None,
            threads: list[int] | None = None, dense: bool = True, build: str | None = None,
            cold: bool = False) -> list[dict]:  # fmt: skip
    import numpy as np
    import torch

    from engine.backends.cpu_isa import onednn_native
    from engine.backends.cpu_kernels import cpu_ops, ops_of_build
    from engine.backends.cpu_linear import packing_available
    from engine.backends.cpu_quant import K_QUANTS, NAMES, REPACKED, SUPER, dequantize_rows, linear

    ops = cpu_ops() if build is None else ops_of_build(build)
    # an earlier build (--build) may predate the K-quants' int8 product: then its int8 lines are left
    # out and its kquant_linear is called as it was, without the flag
    kquant_int8 = "int8" in (ops.kquant_linear.__doc__ or "")
    if not kquant_int8:
        ops = _FloatKquants(ops)
    codes = {name: code for code, name in NAMES.items()}
    types = types or ["Q8_0", "Q4_0", "Q4_1"]
    results = []
    rng = np.random.default_rng(0)
    for name, (n, k) in SHAPES[shapes].items():
        # K-quants' super-blocks need inputs in 256s (SmolLM2's 576 are not)
        fits = [q for q in types if codes[q] not in K_QUANTS or k % SUPER == 0]
        if len(fits) < len(types):
            print(f"{name}: {k} inputs are not whole K-quant super-blocks of {SUPER}: "
                  f"{', '.join(q for q in types if q not in fits)} left out", flush=True)
        if not fits:
            continue
        blocks = {q: random_blocks(codes[q], n, k, rng) for q in fits}
        turns = {q: _Rotating(b, cold) for q, b in blocks.items()}
        repacked = {}  # the weights as --quantized-activations int8 multiplies them: repacked at load
        for q, b in blocks.items():
            if kquant_int8 and getattr(ops, "quant_repack_rows", lambda: 0)():
                try:
                    repacked[q] = _Rotating(ops.quant_repack(b, codes[q], k), cold)
                except RuntimeError:  # an earlier build that does not repack this type
                    pass
        panels = onednn = onednn_bf16 = None
        if dense and not cold:
            wf = dequantize_rows(ops, blocks[fits[0]], codes[fits[0]], k, None, torch.empty(0))
            panels = ops.pack_linear_weight(wf)
            onednn = torch.ops.mkldnn._reorder_linear_weight(wf, 64) if packing_available() else None
            bf16 = onednn_native(torch.bfloat16) and onednn is not None  # the dense path of a bfloat16 model here
            onednn_bf16 = torch.ops.mkldnn._reorder_linear_weight(wf.bfloat16(), 64) if bf16 else None
            del wf
        for m in rows:
            x = torch.randn(m, k)
            xb = x.bfloat16()
            paths = {}
            for q, b in blocks.items():
                c = codes[q]
                weight_bytes, w = b.numel(), turns[q]
                paths[f"{q} float x"] = (weight_bytes, lambda w=w, c=c: linear(ops, x, w(), c, None))
                paths[f"{q} bf16 x"] = (weight_bytes, lambda w=w, c=c: linear(ops, xb, w(), c, None))
                if c not in K_QUANTS or kquant_int8:
                    paths[f"{q} int8 x"] = (weight_bytes, lambda w=w, c=c: linear(ops, x, w(), c, None, int8=True))
                if q in repacked:
                    paths[f"{q} int8 x repacked"] = (weight_bytes, lambda w=repacked[q], c=c | REPACKED: linear(
                        ops, x, w(), c, None, int8=True))  # fmt: skip
                if dense and not cold:
                    paths[f"{q} dequantise + torch"] = (weight_bytes, lambda b=b, c=c: torch.nn.functional.linear(
                        x, dequantize_rows(ops, b, c, k, None, x)))
            if panels is not None:
                paths["f32 panels"] = (4 * n * k, lambda: ops.packed_linear(x, panels, None, n))
            if onednn is not None:
                paths["f32 oneDNN"] = (4 * n * k, lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""))
            if onednn_bf16 is not None:
                paths["bf16 oneDNN"] = (2 * n * k, lambda: torch.ops.mkldnn._linear_pointwise(
                    xb, onednn_bf16, None, "none", [], ""))  # fmt: skip
            for t in threads or [torch.get_num_threads()]:
                torch.set_num_threads(t)
                for path, (weight_bytes, fn) in paths.items():
                    best, median = _timed(fn, repeats)
                    results.append({"shape": name, "n": n, "k": k, "rows": m, "threads": t, "path": path,
                                    "weights from": "memory" if cold else "wherever they are (cache if they fit)",
                                    "best_us": round(best * 1e6, 1), "median_us": round(median * 1e6, 1),
                                    "GB/s": round(weight_bytes / best / 1e9, 2),
                                    "GFLOP/s": round(2 * m * n * k / best / 1e9, 1)})  # fmt: skip
                    print(json.dumps(results[-1]), flush=True)
    return results


def probe(model_path: str | None, dtype_name: str) -> list[dict]:
    import numpy as np
    import torch

    from engine.backends import quant_auto
    from engine.backends.cpu_kernels import cpu_ops
    from engine.gguf_loader import NATIVE_TYPES, shared_reader
    from engine.loader import DTYPES, embedded_gguf

    path = Path(model_path) if model_path else embedded_gguf()
    dtype, ops = DTYPES[dtype_name], cpu_ops()
    out = []
    with shared_reader(path) as reader:
        native = [t for t in reader.tensors if int(t.tensor_type) in NATIVE_TYPES and len(t.shape) == 2]
        head = [t for t in native if t.name in ("output.weight", "token_embd.weight")]
        layers = [t for t in native if t.name.startswith("blk.")]
        for kind, group in (("head", head), ("layers", layers)):
            if not group:
                continue
            t = max(group, key=lambda t: t.n_elements)
            blocks = torch.from_numpy(np.array(t.data[: quant_auto.PROBE_ROWS], dtype=np.uint8))
            shape = (int(t.shape[1]), int(t.shape[0]))
            one = quant_auto.measure(blocks, int(t.tensor_type), shape, dtype, ops)  # the probe: one thread
            every = quant_auto._measure(blocks, int(t.tensor_type), shape, dtype, ops)  # torch's threads
            for label, timing in (("one thread (the probe)", one), (f"{torch.get_num_threads()} threads", every)):
                out.append({"kind": kind, "tensor": t.name, "how": label, **timing.as_dict(),
                            "keeps_blocks": timing.keeps_blocks})  # fmt: skip
                print(json.dumps(out[-1]), flush=True)
    return out


def step(model_path: str | None, rows: int, repeats: int, activations: str = "int8", context: int = 40) -> dict:
    """A model's decode at `rows` users, in this process: every `QuantizedLinear` of the model once on
    `rows` random rows (best and median of `repeats` passes), then the engine's decode step with `rows`
    requests of `context` prompt tokens (best and median of `repeats` steps, after the prompts and a
    few warm steps)."""
    import random

    import torch

    from engine import ContinuousBatchingConfig, LLMEngine
    from engine.backends.cpu_quant import QuantizedLinear
    from engine.loader import load_model

    loaded = load_model(model_path, "float32", None, "cpu", "gguf", activations)
    linears = [m for m in loaded.model.modules() if isinstance(m, QuantizedLinear)]
    inputs = [torch.randn(rows, m.in_features) for m in linears]

    def all_linears() -> None:
        for m, x in zip(linears, inputs):
            m(x)

    linear_best, linear_median = _timed(all_linears, repeats)
    engine = LLMEngine(loaded.model, ContinuousBatchingConfig(block_size=16, num_blocks=max(64, rows * 16)),
                       tokenizer=loaded.tokenizer)  # fmt: skip
    rng = random.Random(0)
    for _ in range(rows):
        ids = [rng.randrange(100, engine.vocab_size) for _ in range(context)]
        engine.add_request(engine.make_request(ids, max_new_tokens=repeats + 64, ignore_eos=True))
    while any(r.num_computed < r.num_prompt_tokens for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    step_best, step_median = _timed(engine.step, repeats)
    engine.close()
    out = {"model": str(model_path or "embedded"), "activations": activations, "rows": rows, "linears": len(linears),
           "linears_best_ms": round(linear_best * 1e3, 2), "linears_median_ms": round(linear_median * 1e3, 2),
           "step_best_ms": round(step_best * 1e3, 2), "step_median_ms": round(step_median * 1e3, 2),
           "threads": torch.get_num_threads()}  # fmt: skip
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("agreement", "memory", "kernels", "probe", "step"))
    p.add_argument("--dtype", default="bfloat16", help="probe: the dense dtype (bfloat16, float32, float16)")
    p.add_argument("--model", default=None, help="a GGUF file; default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rows", default="1,4,16,64,256")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2", help="kernels: whose linear shapes")
    p.add_argument("--types", default="Q8_0,Q4_0,Q4_1", help="kernels: the GGUF types timed (also Q4_K, Q6_K)")
    p.add_argument("--threads", default=None, help="kernels: torch thread counts to time each path on (1,2)")
    p.add_argument("--no-dense", action="store_true", help="kernels: leave out the dense (float) paths")
    p.add_argument("--build", default=None, help="kernels: an earlier kernel build of the cache, by its folder's name "
                   "(default: this tree's); one build a process")  # fmt: skip
    p.add_argument("--activations", default="int8", choices=("int8", "float"), help="step: the blocks' inputs")
    p.add_argument("--cold", action="store_true", help="kernels: each call reads its weight from memory (copies "
                   "beyond twice the last-level cache, called in turn); block paths only")  # fmt: skip
    args = p.parse_args()
    from engine.backends.cpu_isa import capabilities

    print(capabilities().describe(), f"threads {os.environ.get('OMP_NUM_THREADS', 'default')}", flush=True)
    if args.what == "agreement":
        print(json.dumps(agreement(args.model, args.prompts, args.tokens)))
    elif args.what == "memory":
        print(json.dumps(memory(args.model)))
    elif args.what == "probe":
        probe(args.model, args.dtype)
    elif args.what == "step":
        step(args.model, int(args.rows.split(",")[0]), args.repeats, args.activations)
    else:
        threads = [int(t) for t in args.threads.split(",")] if args.threads else None
        kernels([int(r) for r in args.rows.split(",")], args.repeats, args.shapes, args.types.split(","), threads,
                not args.no_dense, args.build, args.cold)  # fmt: skip


if __name__ == "__main__":
    main()
