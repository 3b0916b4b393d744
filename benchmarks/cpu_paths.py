"""cbserve's CPU fast paths measured one at a time, on the workloads of throughput.py.

    python benchmarks/cpu_paths.py ab --what fused|grouped|cascade [--dtype bfloat16] [--workload W1] [--runs 3]
    python benchmarks/cpu_paths.py split [--dtype bfloat16] [--workload W1]
    python benchmarks/cpu_paths.py products [--dtype bfloat16]

`ab` runs the workload on engines with the path off and on, alternating in one process after a
warm-up run, and prints output tokens/s per run, the medians and how many greedy outputs the two
agree on. `fused` is the C++ RMSNorm/rotary/SiLU-mul passes (engine/backends/cpu_fused.py);
`grouped` is q/k/v and gate/up packed into one product each (engine/backends/cpu_linear.py);
`cascade` is the attention kernel's shared-prefix pass for decode tokens (engine/backends/cpu.py,
CASCADE_MIN_SEQS; it acts on W2).

`split` times the packed linear calls and the attention kernel calls inside each `LLMEngine.step`
(second of two runs) and prints, per step kind (steps with prompt tokens, decode-only steps), the
milliseconds per step in linear layers, attention and the rest.

`products` times the W1 model's q/k/v (512 + 256 + 256 outputs) and gate/up (2 x 1376) products on
oneDNN-packed weights for 64 and 1,024 rows: separately and as one grouped product (best of three
rounds of 200 or 20 calls, microseconds per call group).
"""

from __future__ import annotations

import argparse
import statistics
import time

import throughput as workloads  # benchmarks/throughput.py: the workloads' model and prompts
import torch

import engine.backends.cpu_linear as cpu_linear
from engine import ContinuousBatchingConfig, LLMEngine


def make_engine(model, fused: bool = True, cascade: bool = True) -> LLMEngine:
    engine = LLMEngine(model, ContinuousBatchingConfig(block_size=16, num_blocks=4096, max_batch_tokens=1024))
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
    groups = cpu_linear.GROUPS
    rates: dict[bool, list[float]] = {False: [], True: []}
    outputs: dict[bool, list] = {}
    run(make_engine(model), prompts, new_tokens)  # warm-up: the first full-size run pays for fresh memory
    for i in range(runs):
        for on in (False, True):
            cpu_linear.GROUPS = groups if (on or what != "grouped") else ()  # read when the engine packs
            engine = make_engine(model, fused=on or what != "fused", cascade=on or what != "cascade")
            rate, outputs[on] = run(engine, prompts, new_tokens)
            rates[on].append(rate)
            print(f"run {i + 1} {what} {'on' if on else 'off'}: {rate:.1f} tok/s", flush=True)
    cpu_linear.GROUPS = groups
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
            engine = make_engine(model)
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


def products(dtype: torch.dtype) -> None:
    def linear(x, packed):
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    g = torch.Generator().manual_seed(0)
    for rows in (64, 1024):
        x = torch.randn(rows, 512, generator=g).to(dtype)
        for name, widths in (("q/k/v", (512, 256, 256)), ("gate/up", (1376, 1376))):
            weights = [torch.randn(n, 512, generator=g).to(dtype) for n in widths]
            apart = [cpu_linear._pack(w) for w in weights]
            grouped = cpu_linear._pack(torch.cat(weights))
            calls = 200 if rows == 64 else 20
            best = {}
            for label, fn in (("apart", lambda: [linear(x, p) for p in apart]), ("grouped", lambda: linear(x, grouped))):
                for _ in range(3):
                    fn()
                for _ in range(3):
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        fn()
                    best[label] = min(best.get(label, 1e9), (time.perf_counter() - t0) / calls * 1e6)
            print(f"{rows} rows, {name}: apart {best['apart']:.0f} us, grouped {best['grouped']:.0f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["ab", "split", "products"])
    parser.add_argument("--what", default="fused", choices=["fused", "grouped", "cascade"])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--workload", default="W1", choices=["W1", "W2", "W3"])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.mode == "products":
        return products(getattr(torch, args.dtype))
    model = workloads.build_model(getattr(torch, args.dtype))
    prompts, new_tokens = workloads.build_prompts(args.workload), workloads.NEW_TOKENS[args.workload]
    if make_engine(model).backend.ops is None:
        raise SystemExit(f"{args.mode}: cbserve's CPU kernels are not available here (make kernels)")
    if args.mode == "ab":
        ab(model, prompts, new_tokens, args.what, args.runs)
    else:
        split(model, prompts, new_tokens)


if __name__ == "__main__":
    main()
