"""Engine greedy tokens against transformers' `model.generate`, on the test architectures.

On CUDA: prompts of 300-1,500 tokens (half of them sharing a 512-token prefix), a token budget of
512 (prompts arrive in chunks with history), a KV cache too small for all of them at once (forced
preemption), n = 2 on half the prompts (both siblings must equal the reference) with a request cap
of 4; CUDA graphs off and on. Asserted besides the tokens: preemptions happened, the shared prefix was
hit, and with graphs on graphs replayed and no decode batch was above the largest bucket (the
buckets reach the request cap, and the scheduler counts a request's siblings against it). In float32 on the CPU tokens must be equal; in half
precision a row passes at --min-exact exact matches (two near-equal logits may flip).
"""

from __future__ import annotations

import random

from scripts.gpu_checks.common import Context, StepWatch, matches, reference_tokens, serve_all
from scripts.gpu_checks.report import require, table

NAME = "greedy equality with model.generate"


def sizes(ctx: Context) -> dict:
    if ctx.cuda:
        return dict(prompts=8, lengths=(300, 1500), prefix=512, new=32, num_blocks=16, max_batch_tokens=512)
    if ctx.quick:
        return dict(prompts=4, lengths=(30, 90), prefix=32, new=6, num_blocks=8, max_batch_tokens=48)
    return dict(prompts=6, lengths=(30, 120), prefix=48, new=8, num_blocks=16, max_batch_tokens=64)


def prompts_with_shared_prefix(n: int, lengths: tuple[int, int], prefix_len: int, vocab: int, seed: int) -> list[list[int]]:
    """`n` random prompts, the even ones starting with one common prefix."""
    rng = random.Random(seed)
    prefix = [rng.randrange(4, vocab) for _ in range(prefix_len)]
    out = []
    for i in range(n):
        length = rng.randint(*lengths)
        body = [rng.randrange(4, vocab) for _ in range(length)]
        out.append((prefix + body)[:length] if i % 2 == 0 else body)
    return out


def one_run(ctx: Context, model, prompts, expected, graphs: bool, s: dict) -> dict:
    from engine.backends.cuda.graphs import graph_batch_sizes
    from engine.llm_engine import LLMEngine

    config = ctx.config(num_blocks=s["num_blocks"], max_batch_tokens=s["max_batch_tokens"], max_requests_per_batch=4,
                        use_cuda_graph=graphs)  # fmt: skip
    engine = LLMEngine(model, config)
    try:
        engine.warmup()
        watch = engine.executor.dispatch = StepWatch(engine.executor.dispatch)
        n = [{"num_return_sequences": 2 if i % 2 == 0 else 1} for i in range(len(prompts))]  # even prompts: n = 2
        out = serve_all(engine, prompts, s["new"], per_prompt=n)
        stats = engine.stats()
    finally:
        engine.close()
    got = [seq for seqs in out for seq in seqs]
    want = [ref for seqs, ref in zip(out, expected) for _ in seqs]
    row = matches(got, want)
    row.update(graphs=graphs, preemptions=stats["num_preemptions_total"], prefix_hits=stats["prefix_cache_hits_total"],
               largest_decode_batch=max(watch.decode_batches, default=0),
               largest_bucket=graph_batch_sizes(engine.sizes.max_requests)[-1], replays=watch.replays)  # fmt: skip
    return row


def run(ctx: Context) -> dict:
    s = sizes(ctx)
    rows, problems = [], []
    for i, arch in enumerate(ctx.archs):
        model = ctx.test_model(arch)
        prompts = prompts_with_shared_prefix(s["prompts"], s["lengths"], s["prefix"], 512, seed=i)
        expected = reference_tokens(model, prompts, s["new"])
        for graphs in ((False, True) if ctx.cuda else (False,)):  # graphs need CUDA (graphs.py has the stand-in)
            row = one_run(ctx, model, prompts, expected, graphs, s)
            rows.append((arch, row))
            need = row["total"] if ctx.exact_required else ctx.min_exact * row["total"]
            if row["exact"] < need:
                problems.append(f"{arch} graphs {'on' if graphs else 'off'}: {row['exact']}/{row['total']} exact")
            if not row["preemptions"] or not row["prefix_hits"]:
                problems.append(f"{arch}: {row['preemptions']} preemptions, {row['prefix_hits']} prefix hits (both needed)")
            # the decode buckets reach the request cap, and the scheduler counts n > 1 siblings against it:
            # no step is above the largest bucket, and the largest ran as a graph
            if graphs and (row["largest_decode_batch"] > row["largest_bucket"] or not row["replays"]):
                problems.append(f"{arch}: a decode batch of {row['largest_decode_batch']} above the largest bucket "
                                f"{row['largest_bucket']}, or no replay")
        del model
    detail = table(["arch", "CUDA graphs", "exact", "mean common prefix", "preemptions", "prefix hits",
                    "largest decode batch / bucket", "replays"],
                   [[a, "on" if r["graphs"] else "off", f"{r['exact']}/{r['total']}", f"{r['mean_prefix']:.1f}/{s['new']}",
                     str(r["preemptions"]), str(r["prefix_hits"]), f"{r['largest_decode_batch']}/{r['largest_bucket']}",
                     str(r["replays"])] for a, r in rows])  # fmt: skip
    figures = {"sequences": sum(r["total"] for _, r in rows), "exact": sum(r["exact"] for _, r in rows),
               "prompt lengths": "-".join(map(str, s["lengths"])), "new tokens": s["new"],
               "_detail": f"### Greedy equality ({str(ctx.dtype).removeprefix('torch.')})\n\n{detail}"}  # fmt: skip
    require(not problems, "; ".join(problems), figures)
    return figures
