#!/usr/bin/env python
"""One command for anyone with an NVIDIA GPU: check cbserve's GPU path and measure it.

    python scripts/gpu_check.py                      # everything, on cuda:0, bfloat16
    python scripts/gpu_check.py --skip-throughput    # equality only (a minute)
    python scripts/gpu_check.py --device cpu --dtype float32 --prompts 4 --w1-prompts 8   # smoke run, no GPU

1. Environment: torch, CUDA, the GPU, flash-attn, the attention backend cbserve picks.
2. Equality: greedy tokens of cbserve's `generate_batch` against transformers' `model.generate`
   (one prompt at a time) on the test architectures, with CUDA graphs off and on.
3. W1 throughput (64 prompts of 16-256 random tokens, 64 new tokens, greedy, EOS ignored, the W1
   Llama): cbserve with graphs off and on against transformers' own `model.generate_batch`.
4. Two GPUs, when there are two (or two CPU ranks with `--device cpu --two-ranks`): tensor parallel
   (tensor_parallel_size=2, NCCL) against one device: greedy tokens on the test Llama, and W1
   throughput of each.

It prints markdown tables to paste into docs/benchmarks.md (with the date and the GPU). Half
precision can flip a greedy choice between two near-equal logits, so equality is reported as exact
matches and the mean length of the common prefix, not as pass/fail alone. Exit status 1 when an
equality check is below --min-exact.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
W1 = dict(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
          num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="gpu_check.py",
        description="Check cbserve's GPU path (equality with model.generate, CUDA graphs on/off) and measure W1.",
    )
    p.add_argument("--device", default="cuda:0", help="torch device (default cuda:0; 'cpu' for a smoke run)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="model dtype (flash-attn needs bfloat16 or float16)")  # fmt: skip
    p.add_argument("--archs", default=",".join(ARCHS), help="test architectures, comma-separated")
    p.add_argument("--prompts", type=int, default=16, help="prompts per architecture for equality")
    p.add_argument("--max-new-tokens", type=int, default=32, help="new tokens per prompt for equality")
    p.add_argument("--block-size", type=int, default=256, help="KV block size (multiple of 256 for flash-attn)")
    p.add_argument("--min-exact", type=float, default=0.9, help="share of exact matches below which the check fails")
    p.add_argument("--skip-equality", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--w1-prompts", type=int, default=64)
    p.add_argument("--w1-new-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3, help="timed runs per system (median reported)")
    p.add_argument("--no-peer", action="store_true", help="skip transformers' generate_batch")
    p.add_argument("--two-ranks", action="store_true", help="with --device cpu: run the two-GPU line on two CPU "
                                                            "ranks (with CUDA it runs whenever two GPUs are there)")
    return p.parse_args(argv)


def environment(device: torch.device) -> list[tuple[str, str]]:
    from engine.backends.cuda import flash_attn_available

    rows = [("date (UTC)", datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")),
            ("python", platform.python_version()), ("torch", torch.__version__),
            ("torch CUDA", str(torch.version.cuda))]  # fmt: skip
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        rows += [("GPU", f"{props.name}, {props.total_memory / (1 << 30):.0f} GiB, sm_{props.major}{props.minor}")]
    else:
        rows += [("CPU", f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")]
    if flash_attn_available():
        import flash_attn

        rows.append(("flash-attn", flash_attn.__version__))
    else:
        rows.append(("flash-attn", "not installed (SDPA on CUDA, no CUDA graphs)"))
    return rows


def cb_config(device: torch.device, block_size: int, graphs: bool):
    from engine import ContinuousBatchingConfig

    if device.type != "cuda":
        return ContinuousBatchingConfig(block_size=16, use_cuda_graph=False)
    return ContinuousBatchingConfig(block_size=block_size, attn_backend="cuda", use_cuda_graph=graphs)


def graph_status(model, device: torch.device, block_size: int) -> str:
    """What an engine built with use_cuda_graph=True actually captured (its step dispatcher's graphs)."""
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(model, cb_config(device, block_size, True))
    try:
        dispatch = engine.executor.dispatch
        runner = dispatch.graphs
        if runner is None or not runner.graphs:
            return f"none captured (flags {dispatch.graph_flags})"
        return f"decode graphs for batch sizes {sorted(runner.graphs)}; varlen graphs on first use: {dispatch.graph_flags[0]}"
    finally:
        engine.close()


def reference_tokens(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=model.device)
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(gen[0, len(prompt) :].tolist())
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@dataclass
class EqualityRow:
    arch: str
    graphs: bool
    exact: int
    total: int
    mean_prefix: float
    max_new_tokens: int

    def cells(self) -> list[str]:
        return [self.arch, "on" if self.graphs else "off", f"{self.exact}/{self.total}",
                f"{self.mean_prefix:.1f}/{self.max_new_tokens}"]  # fmt: skip


def check_equality(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[EqualityRow]:
    from engine import generate_batch
    from engine.testing import build_test_model, random_prompts

    rows = []
    for arch in [a.strip() for a in args.archs.split(",") if a.strip()]:
        model = build_test_model(arch, vocab_size=512).to(device=device, dtype=dtype)
        prompts = random_prompts(args.prompts, 3, 200, 512, seed=0)
        expected = reference_tokens(model, prompts, args.max_new_tokens)
        for graphs in (False, True):
            outs = generate_batch(
                model, prompts, continuous_batching_config=cb_config(device, args.block_size, graphs),
                max_new_tokens=args.max_new_tokens, ignore_eos=True, progress_bar=False,
            )  # fmt: skip
            got = [o.generated_tokens for o in outs.values()]
            prefixes = [common_prefix(g, e) for g, e in zip(got, expected)]
            exact = sum(g == e for g, e in zip(got, expected))
            rows.append(EqualityRow(arch, graphs, exact, len(prompts), statistics.mean(prefixes), args.max_new_tokens))
            if device.type != "cuda":
                break  # graphs need CUDA: one row per architecture on the CPU
    return rows


def w1_model(device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**W1), dtype=torch.float32)
    return model.to(device=device, dtype=dtype).eval()


def _timed(fn, runs: int, device: torch.device) -> float:
    """Median seconds of `runs` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def throughput(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[tuple[str, float]]:
    from transformers import GenerationConfig

    from engine import generate_batch
    from engine.testing import random_prompts

    model = w1_model(device, dtype)
    prompts = random_prompts(args.w1_prompts, 16, 256, W1["vocab_size"], seed=0)
    new = args.w1_new_tokens
    total_tokens = len(prompts) * new
    results = []

    def run_cbserve(graphs: bool):
        def go():
            outs = generate_batch(
                model, prompts, continuous_batching_config=cb_config(device, args.block_size, graphs),
                max_new_tokens=new, ignore_eos=True, progress_bar=False,
            )  # fmt: skip
            assert all(len(o.generated_tokens) == new for o in outs.values()), "a request stopped early"

        return go

    graph_settings = (False, True) if device.type == "cuda" else (False,)
    for graphs in graph_settings:
        seconds = _timed(run_cbserve(graphs), args.runs, device)
        results.append((f"cbserve, CUDA graphs {'on' if graphs else 'off'}", total_tokens / seconds))

    if not args.no_peer:
        gen_cfg = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)

        peer_cfg = None
        if device.type != "cuda":  # its CPU default takes 60% of RAM on every call; its best CPU sizing instead
            from transformers import ContinuousBatchingConfig as PeerConfig

            peer_cfg = PeerConfig(num_blocks=1024, max_batch_tokens=1024, page_size=32)

        def run_peer():
            # transformers' own method, called on the class: `use_cbserve` may have replaced the instance's
            outs = type(model).generate_batch(
                model, prompts, generation_config=gen_cfg, continuous_batching_config=peer_cfg, progress_bar=False
            )
            assert all(len(o.generated_tokens) == new for o in outs.values()), "a peer request stopped early"

        seconds = _timed(run_peer, args.runs, device)
        results.append(("transformers generate_batch", total_tokens / seconds))
    return results


def two_ranks(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> tuple[list[list[str]], bool]:
    """Tensor parallel over two ranks against one: exact greedy matches on the test Llama (and the
    common prefix), and W1 output tok/s of each. Returns the table's rows and whether the equality
    is below --min-exact."""
    import dataclasses

    from engine import generate_batch
    from engine.testing import build_test_model, random_prompts

    def config(ranks: int):
        return dataclasses.replace(cb_config(device, args.block_size, False), tensor_parallel_size=ranks)

    def run(model, prompts, ranks: int, new: int) -> list[list[int]]:
        outs = generate_batch(model, prompts, continuous_batching_config=config(ranks), max_new_tokens=new,
                              ignore_eos=True, progress_bar=False)  # fmt: skip
        return [o.generated_tokens for o in outs.values()]

    model = build_test_model("llama", vocab_size=512).to(device=device, dtype=dtype)
    prompts = random_prompts(args.prompts, 3, 200, 512, seed=0)
    one, two = run(model, prompts, 1, args.max_new_tokens), run(model, prompts, 2, args.max_new_tokens)
    exact = sum(a == b for a, b in zip(one, two))
    prefix = statistics.mean(common_prefix(a, b) for a, b in zip(one, two))
    rows = [["greedy tokens, 2 ranks against 1 (test Llama)", f"{exact}/{len(prompts)} exact",
             f"mean common prefix {prefix:.1f}/{args.max_new_tokens}"]]  # fmt: skip
    if not args.skip_throughput:
        w1 = w1_model(device, dtype)
        w1_prompts = random_prompts(args.w1_prompts, 16, 256, W1["vocab_size"], seed=0)
        tokens = len(w1_prompts) * args.w1_new_tokens
        rates = {ranks: tokens / _timed(lambda r=ranks: run(w1, w1_prompts, r, args.w1_new_tokens), args.runs, device)
                 for ranks in (1, 2)}  # fmt: skip
        rows.append(["W1 output tok/s (engine start-up timed too)", f"1 rank {rates[1]:.0f}, 2 ranks {rates[2]:.0f}",
                     f"2 ranks are {rates[2] / rates[1]:.2f}x"])  # fmt: skip
    return rows, exact < args.min_exact * len(prompts)


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if device.type == "cuda":
        from engine.backends.cuda import require_cuda

        require_cuda()
    failed = False
    print("## cbserve GPU check\n")
    print(table(["what", "value"], [[k, v] for k, v in environment(device)]))
    if not args.skip_equality:
        from engine.testing import build_test_model

        status = graph_status(build_test_model("llama", vocab_size=512).to(device=device, dtype=dtype), device, args.block_size)
        print(f"\nCUDA graphs with use_cuda_graph=True: {status}")
        rows = check_equality(args, device, dtype)
        print(f"\n### Equality with model.generate ({args.dtype}, {args.prompts} prompts, greedy)\n")
        print(table(["arch", "CUDA graphs", "exact matches", "mean common prefix"], [r.cells() for r in rows]))
        failed = any(r.exact < args.min_exact * r.total for r in rows)
    if not args.skip_throughput:
        results = throughput(args, device, dtype)
        peer = dict(results).get("transformers generate_batch")
        print(f"\n### W1 throughput ({args.dtype}, {args.w1_prompts} prompts x {args.w1_new_tokens} new tokens, "
              f"median of {args.runs})\n")  # fmt: skip
        cells = [[name, f"{tps:.0f}", f"{tps / peer:.2f}x" if peer else "-"] for name, tps in results]
        print(table(["system", "output tok/s", "vs transformers generate_batch"], cells))
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if gpus >= 2 or (device.type == "cpu" and args.two_ranks):
        rows, below = two_ranks(args, device, dtype)
        where = "two GPUs (NCCL)" if gpus >= 2 else "two CPU ranks (gloo)"
        print(f"\n### Tensor parallel on {where}, {args.dtype}\n")
        print(table(["check", "result", ""], rows))
        failed = failed or below
    elif device.type == "cuda":
        print(f"\nTensor parallel: not checked ({gpus} GPU here; it needs two)")
    if failed:
        print(f"\nFAILED: an equality check is below {args.min_exact:.0%} exact matches", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
