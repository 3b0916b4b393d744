"""cbserve's CPU fast paths measured one at a time, on the workloads of throughput.py.

    python benchmarks/cpu_paths.py ab --what fused|grouped|cascade|panels [--dtype bfloat16] [--workload W1] [--runs 3]
    python benchmarks/cpu_paths.py split [--dtype bfloat16] [--workload W1]
    python benchmarks/cpu_paths.py products [--dtype bfloat16]
    python benchmarks/cpu_paths.py steps [--dtype bfloat16] [--model embedded] [--runs 3] [--batches 1,8,16]
                                         [--paths native] [--lone-prompt 580] [--context 300]
    python benchmarks/cpu_paths.py mixed [--model embedded] [--dtype float32] [--decodes 15]
                                         [--chunks 0,8,16,32,64,128,192] [--runs 6]
    python benchmarks/cpu_paths.py prompt [--model embedded] [--dtype float32] [--tokens 8000] [--runs 2]

`--model embedded` runs `ab` and `split` on the real SmolLM2-135M-Instruct instead of the random
model (throughput.py's `--model`); W4 is its workload of mixed prompt lengths.

`ab` runs the workload on engines with the path off and on, alternating in one process after a
warm-up run, and prints output tokens/s per run, the medians and how many greedy outputs the two
agree on. `fused` is the C++ RMSNorm/rotary/SiLU-mul passes (engine/backends/cpu_fused.py);
`grouped` is q/k/v and gate/up packed into one product each (engine/backends/cpu_linear.py);
`cascade` is the attention kernel's shared-prefix pass for decode tokens (engine/backends/cpu.py,
CASCADE_MIN_SEQS; it acts on W2); `panels` is cbserve's panel kernel for the linear layers against
oneDNN's packed product alone (engine/backends/cpu_linear.py).

`split` times the packed linear calls and the attention kernel calls inside each `LLMEngine.step`
(second of two runs) and prints, per step kind (steps with prompt tokens, decode-only steps), the
milliseconds per step in linear layers, attention and the rest.

Every engine here has a 65,536-token KV cache in blocks of the engine's CPU default (`--block-size`).

`steps` times decode steps (`LLMEngine.step`, after the prompts' steps; `--context` tokens each, 64
unless said) at batch 1 and 16 (`--batches`) with the
decoder layers through transformers' modules and in one native call (engine/backends/cpu_layers.py),
alternating (`--paths native` for one), and prints per run the milliseconds per decode step and the busy cores (the process's
CPU seconds over the wall seconds of those steps; threads spinning at a barrier count as busy),
then the medians and whether the greedy tokens agree; on the native path, also how much of the
step is the native call (the rest is the engine's Python between forwards). `--lone-prompt N`
also times the step that takes one N-token prompt whole, each run. `ab`, `split` and `products` time the Python
path's pieces: they turn the native stack off (`split`, and `ab` for the pieces it replaces).

`mixed` times what a prompt chunk adds to a step of running decodes, as `max_decode_stall` budgets
it: `--decodes` requests decoding, then steps that also take a new prompt of k tokens whole, for
each k of `--chunks` (0: the decodes alone), `--runs` times each in a shuffled order (the decodes'
contexts grow meanwhile); it prints each k's median and best milliseconds and the median's
milliseconds per prompt token above the decodes alone.

`prompt` times one long prompt (`--tokens` random ids, one token out) through an engine with the
default config but the cache (so in 1,024-token steps, as `cbserve serve` takes it), `--runs` times
after a short warm-up request, the prefix cache emptied between runs: seconds to the first token,
and the median. Long prompts are where the attention kernel's share of a step grows.

`products` times linear products on packed weights, best of three rounds, microseconds per call:
the W1 model's q/k/v (512 + 256 + 256 outputs) and gate/up (2 x 1376) for 64 and 1,024 rows on
oneDNN, separately and as one grouped product; then SmolLM2-135M's shapes (q/k/v 960 x 576, gate
1536 x 576, down 576 x 1536) for 1 to 1,024 rows on oneDNN and on cbserve's panels, each call on
the next of 10 copies of the weight so that it comes from memory, as in a model's forward.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import throughput as workloads  # benchmarks/throughput.py: the workloads' model and prompts
import torch

import engine.backends.cpu_linear as cpu_linear
import engine.backends.cpu_executor as cpu_executor
from engine import ContinuousBatchingConfig, LLMEngine
from engine.backends.cpu_kernels import cpu_ops


BLOCK_SIZE = workloads.BLOCK_SIZE  # --block-size; every engine's cache holds workloads.CACHE_TOKENS


def cache(**config) -> ContinuousBatchingConfig:
    return ContinuousBatchingConfig(block_size=BLOCK_SIZE, num_blocks=workloads.CACHE_TOKENS // BLOCK_SIZE, **config)


def make_engine(model, fused: bool = True, cascade: bool = True, native: bool = True) -> LLMEngine:
    engine = LLMEngine(model, cache(max_batch_tokens=1024))
    if not native or not fused:  # the native stack runs the fused passes itself
        engine.runner.native = None
    if not fused:
        engine.runner.module_swaps.remove(engine.fused_modules)
    if not cascade:
        engine.backend.cascade_min_seqs = 0
    return engine


def run(engine: LLMEngine, prompts, new_tokens: int, on_step=None) -> tuple[float, list[list[int]]]:
    reqs = [engine.make_request(p, max_new_tokens=new_tokens, ignore_eos=True) for p in prompts]
    for r in reqs:
        engine.add_request(r)
    start = time.perf_counter()
    while engine.has_unfinished():
        prefill = any(r.num_computed < r.num_prompt_tokens for r in reqs)
        t0 = time.perf_counter()
        engine.step()
        if on_step:
            on_step(prefill, time.perf_counter() - t0)
    return len(prompts) * new_tokens / (time.perf_counter() - start), [r.generated_ids for r in reqs]


def ab(model, prompts, new_tokens: int, what: str, runs: int) -> None:
    groups, plan = cpu_linear.GROUPS, cpu_executor.linear_plan
    rates: dict[bool, list[float]] = {False: [], True: []}
    outputs: dict[bool, list] = {}
    run(make_engine(model), prompts, new_tokens)  # warm-up: the first full-size run pays for fresh memory
    for i in range(runs):
        for on in (False, True):
            cpu_linear.GROUPS = groups if (on or what != "grouped") else ()  # read when the engine packs
            cpu_executor.linear_plan = plan if (on or what != "panels") else (lambda ops: cpu_linear.LinearPlan())
            # the packed layouts and groups are the native stack's too: what is measured is the Python path
            engine = make_engine(model, fused=on or what != "fused", cascade=on or what != "cascade",
                                 native=what in ("fused", "cascade"))
            rate, outputs[on] = run(engine, prompts, new_tokens)
            rates[on].append(rate)
            print(f"run {i + 1} {what} {'on' if on else 'off'}: {rate:.1f} tok/s", flush=True)
    cpu_linear.GROUPS, cpu_executor.linear_plan = groups, plan
    same = sum(a == b for a, b in zip(outputs[False], outputs[True]))
    off, on = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"\n{what}: off {off:.1f}, on {on:.1f} output tok/s (median of {runs}); same greedy outputs {same}/{len(prompts)}")


def split(model, prompts, new_tokens: int) -> None:
    timers = {"linear": 0.0, "attention": 0.0}
    packed_linear = cpu_linear._packed_linear

    def timed_linear(*args):
        t0 = time.perf_counter()
        out = packed_linear(*args)
        timers["linear"] += time.perf_counter() - t0
        return out

    cpu_linear._packed_linear = timed_linear
    try:
        for attempt in range(2):
            engine = make_engine(model, native=False)  # the pieces are timed between Python calls
            ops = engine.backend.ops

            class TimedOps:
                def __getattr__(self, name):
                    return getattr(ops, name)

                def paged_attention(self, *args):
                    t0 = time.perf_counter()
                    ops.paged_attention(*args)
                    timers["attention"] += time.perf_counter() - t0

            engine.backend.ops = TimedOps()
            kinds = {True: [0, 0.0, 0.0, 0.0], False: [0, 0.0, 0.0, 0.0]}

            def on_step(prefill: bool, seconds: float) -> None:
                k = kinds[prefill]
                k[0] += 1
                k[1] += seconds
                k[2] += timers["linear"]
                k[3] += timers["attention"]
                timers["linear"] = timers["attention"] = 0.0

            run(engine, prompts, new_tokens, on_step)
        for prefill, (n, total, linear, attention) in kinds.items():
            if n:
                name = "with prompt tokens" if prefill else "decode only"
                print(f"{name}: {n} steps, {1e3 * total / n:.1f} ms per step: linear {1e3 * linear / n:.1f}, "
                      f"attention {1e3 * attention / n:.1f}, rest {1e3 * (total - linear - attention) / n:.1f}")  # fmt: skip
    finally:
        cpu_linear._packed_linear = packed_linear


def long_prompt(model, tokens: int, runs: int) -> list[float]:
    """Seconds from adding one `tokens`-token prompt (one token out) to its end, per run."""
    engine = LLMEngine(model, cache())
    ids = torch.randint(100, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    warm = engine.make_request(ids[:64], max_new_tokens=2, ignore_eos=True)
    engine.add_request(warm)
    while engine.has_unfinished():
        engine.step()
    seconds = []
    for i in range(runs):
        engine.reset_prefix_cache()
        engine.add_request(engine.make_request(ids, max_new_tokens=1, ignore_eos=True))
        start, steps = time.perf_counter(), 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        seconds.append(time.perf_counter() - start)
        print(f"run {i + 1}: a {tokens}-token prompt in {seconds[-1]:.3f} s ({steps} steps)", flush=True)
    print(f"median {statistics.median(seconds):.3f} s")
    return seconds


def prompt_step(model, native: bool, prompt: list[int]) -> float:
    """Milliseconds of the one step that takes a lone prompt whole (no decodes beside it)."""
    engine = LLMEngine(model, cache(max_batch_tokens=len(prompt)))
    if not native:
        engine.runner.native = None
    engine.add_request(engine.make_request(prompt, max_new_tokens=1, ignore_eos=True))
    start = time.perf_counter()
    engine.step()
    return 1e3 * (time.perf_counter() - start)


class _Timed:
    """The native decoder call with its wall seconds summed: the rest of a step is the engine's Python
    (scheduling, inputs, sampling, outputs), what async scheduling could overlap with the forward."""

    def __init__(self, call) -> None:
        self.call, self.seconds = call, 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.call(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def decode_steps(model, runs: int, batches=(1, 16), steps: int = 32, prompt_len: int = 64,
                 paths: tuple[bool, ...] = (False, True), lone_prompt: int = 0) -> None:  # fmt: skip
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    results: dict[tuple[int, bool], list[tuple[float, float]]] = {}
    tokens: dict[tuple[int, bool], list] = {}
    for i in range(runs + 1):  # the first round warms up: fresh memory, first-touch pages
        if lone_prompt:
            prompt = torch.randint(4, vocab, (lone_prompt,), generator=g).tolist()
            for native in paths:
                ms = prompt_step(model, native, prompt)
                if i:
                    print(f"run {i} prompt {lone_prompt} {'native' if native else 'python'}: {ms:.1f} ms per "
                          f"prompt step", flush=True)  # fmt: skip
        for batch in batches:
            prompts = [torch.randint(4, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
            for native in paths:
                engine = make_engine(model, native=native)
                assert (engine.runner.native is not None) == native, "the native stack does not take this model"
                reqs = [engine.make_request(p, max_new_tokens=steps + 8, ignore_eos=True) for p in prompts]
                for r in reqs:
                    engine.add_request(r)
                while not all(r.num_computed >= prompt_len for r in reqs):  # the prompts (one step at 64 x 16)
                    engine.step()
                call = None
                if native:  # the native call timed inside each step
                    call = engine.runner.native = _Timed(engine.runner.native)
                wall, cpu = time.perf_counter(), time.process_time()
                for _ in range(steps):
                    engine.step()
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                if i == 0:
                    continue
                results.setdefault((batch, native), []).append((1e3 * wall / steps, cpu / wall))
                tokens[(batch, native)] = [r.generated_ids for r in reqs]
                inside = (f", {1e3 * call.seconds / steps:.2f} ms of it in the native call and "
                          f"{1e3 * (wall - call.seconds) / steps:.2f} outside it" if call else "")  # fmt: skip
                print(f"run {i} batch {batch:2d} {'native' if native else 'python'}: {1e3 * wall / steps:.2f} ms per "
                      f"decode step{inside}, {cpu / wall:.2f} cores busy", flush=True)  # fmt: skip
    print()
    for batch in batches:
        line = []
        for native in paths:
            ms = statistics.median(r[0] for r in results[(batch, native)])
            busy = statistics.median(r[1] for r in results[(batch, native)])
            line.append(f"{'native' if native else 'python'} {ms:.2f} ms, {busy:.2f} cores")
        same = f"; same greedy tokens: {tokens[(batch, False)] == tokens[(batch, True)]}" if len(paths) == 2 else ""
        print(f"batch {batch}: " + "; ".join(line) + f" (median of {runs}){same}")


def mixed_steps(model, decodes: int = 15, chunks: tuple[int, ...] = (0, 8, 16, 32, 64, 128, 192), runs: int = 6,
                context: int = 150) -> dict[int, float]:  # fmt: skip
    """Median seconds of a step of `decodes` running decodes (each after a `context`-token prompt) that
    also takes a new prompt of k tokens whole, for each k of `chunks`; printed with the per-token cost."""
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    config = cache(max_decode_stall=0, max_batch_tokens=max(decodes * context, decodes + max(chunks)))
    engine = LLMEngine(model, config)
    order = [k for k in chunks for _ in range(runs)]
    random.Random(0).shuffle(order)
    for _ in range(decodes):  # decoding through every timed step
        prompt = torch.randint(4, vocab, (context,), generator=g).tolist()
        engine.add_request(engine.make_request(prompt, max_new_tokens=len(order) + 8, ignore_eos=True))
    for _ in range(3):  # the prompts, then decode steps: warm
        engine.step()
    times: dict[int, list[float]] = {k: [] for k in chunks}
    for k in order:
        if k:  # one token out: the request ends in the step that takes its prompt
            prompt = torch.randint(4, vocab, (k,), generator=g).tolist()
            engine.add_request(engine.make_request(prompt, max_new_tokens=1, ignore_eos=True))
        start = time.perf_counter()
        engine.step()
        times[k].append(time.perf_counter() - start)
    medians = {k: statistics.median(t) for k, t in times.items()}
    alone = medians.get(0)
    for k in chunks:
        extra = f", {1e3 * (medians[k] - alone) / k:.2f} ms a prompt token above the decodes alone" if k and alone else ""
        print(f"{decodes} decodes + {k:4d} prompt tokens: median {1e3 * medians[k]:7.1f} ms, best "
              f"{1e3 * min(times[k]):7.1f} ms{extra}", flush=True)  # fmt: skip
    return medians


def _best_us(fn, calls: int) -> float:
    best = 1e9
    for _ in range(3):
        fn()
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def products(dtype: torch.dtype) -> None:
    plan = cpu_linear.LinearPlan()
    g = torch.Generator().manual_seed(0)
    for rows in (64, 1024):
        x = torch.randn(rows, 512, generator=g).to(dtype)
        for name, widths in (("q/k/v", (512, 256, 256)), ("gate/up", (1376, 1376))):
            weights = [torch.randn(n, 512, generator=g).to(dtype) for n in widths]
            apart = [plan.pack(w) for w in weights]
            grouped = plan.pack(torch.cat(weights))
            calls = 200 if rows == 64 else 20
            t_apart = _best_us(lambda: [cpu_linear._packed_linear(x, p, None) for p in apart], calls)
            t_grouped = _best_us(lambda: cpu_linear._packed_linear(x, grouped, None), calls)
            print(f"{rows} rows, {name}: apart {t_apart:.0f} us, grouped {t_grouped:.0f} us")
    ops = cpu_ops()
    if ops is None:
        return print("panels: cbserve's CPU kernels are not available here (make kernels)")
    layouts = {"oneDNN": cpu_linear.LinearPlan(), "panels": cpu_linear.LinearPlan(ops=ops, onednn=False)}
    for n, k in ((960, 576), (1536, 576), (576, 1536)):
        weights = [(torch.randn(n, k, generator=g) * 0.02).to(dtype) for _ in range(10)]
        packed = {name: [plan.pack(w) for w in weights] for name, plan in layouts.items()}
        for rows in (1, 4, 16, 64, 256, 1024):
            x = torch.randn(rows, k, generator=g).to(dtype)
            line = []
            for name in layouts:
                us = _best_us(lambda: [cpu_linear._packed_linear(x, p, None) for p in packed[name]], 1) / 10
                line.append(f"{name} {us:.0f} us ({2 * rows * n * k / us / 1e3:.0f} GFLOP/s)")
            print(f"{n} x {k}, {rows} rows: " + ", ".join(line), flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["ab", "split", "products", "steps", "mixed", "prompt"])
    parser.add_argument("--what", default="fused", choices=["fused", "grouped", "cascade", "panels"])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--workload", default="W1", choices=["W1", "W2", "W3", "W4"])
    parser.add_argument("--model", default="random", choices=["random", "embedded"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--batches", default="1,16", help="steps: decode batch sizes (default 1,16)")
    parser.add_argument("--paths", default="python,native", help="steps: python, native or both (default both)")
    parser.add_argument("--context", type=int, default=64, metavar="N",
                        help="steps: prompt tokens of each decoding request (default 64)")
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE,
                        help=f"KV block size of every engine (default: the engine's CPU default, {BLOCK_SIZE})")
    parser.add_argument("--lone-prompt", type=int, default=0, metavar="N",
                        help="steps: also time the step of a lone N-token prompt on each path")
    parser.add_argument("--decodes", type=int, default=15, help="mixed: running decodes (default 15)")
    parser.add_argument("--chunks", default="0,8,16,32,64,128,192",
                        help="mixed: prompt tokens a step takes beside the decodes (default 0,8,16,32,64,128,192)")
    parser.add_argument("--tokens", type=int, default=8000, help="prompt: its length in tokens (default 8000)")
    args = parser.parse_args(argv)
    if args.tokens < 1:
        parser.error(f"--tokens must be at least 1, got {args.tokens}")
    if error := workloads.block_size_error(args.block_size):
        parser.error(error)
    if args.context < 1:
        parser.error(f"--context must be at least 1, got {args.context}")
    try:
        args.chunks = tuple(int(k) for k in args.chunks.split(","))
        assert all(k >= 0 for k in args.chunks) and args.decodes > 0
    except (ValueError, AssertionError):
        parser.error(f"--chunks takes integers >= 0 separated by commas and --decodes one > 0, got {args.chunks!r}, "
                     f"{args.decodes}")  # fmt: skip
    try:
        args.batches = tuple(int(b) for b in args.batches.split(","))
        assert all(b > 0 for b in args.batches)
    except (ValueError, AssertionError):
        parser.error(f"--batches takes positive integers separated by commas, got {args.batches!r}")
    names = args.paths.split(",")
    if not names or any(p not in ("python", "native") for p in names):
        parser.error(f"--paths takes python, native or python,native, got {args.paths!r}")
    args.paths = tuple(dict.fromkeys(p == "native" for p in names))
    return args


def main() -> None:
    global BLOCK_SIZE
    args = parse_args()
    BLOCK_SIZE = args.block_size
    torch.set_num_threads(args.threads)
    if args.mode == "products":
        return products(getattr(torch, args.dtype))
    dtype = getattr(torch, args.dtype)
    model = workloads.build_embedded(dtype) if args.model == "embedded" else workloads.build_model(dtype)
    prompts = workloads.build_prompts(args.workload, vocab=model.config.vocab_size)
    new_tokens = workloads.NEW_TOKENS[args.workload]
    if make_engine(model).backend.ops is None:
        raise SystemExit(f"{args.mode}: cbserve's CPU kernels are not available here (make kernels)")
    if args.mode == "prompt":
        long_prompt(model, args.tokens, args.runs)
    elif args.mode == "mixed":
        mixed_steps(model, args.decodes, args.chunks, args.runs)
    elif args.mode == "steps":
        decode_steps(model, args.runs, args.batches, prompt_len=args.context, paths=args.paths,
                     lone_prompt=args.lone_prompt)
    elif args.mode == "ab":
        ab(model, prompts, new_tokens, args.what, args.runs)
    else:
        split(model, prompts, new_tokens)


if __name__ == "__main__":
    main()
