"""Engine greedy tokens against transformers' model, on the test architectures.

On CUDA: prompts of 300-1,500 tokens (half of them sharing a 512-token prefix), a token budget of
512 (prompts arrive in chunks with history), a KV cache too small for all of them at once (forced
preemption), n = 2 on half the prompts (both siblings are checked) with a request cap of 4; CUDA
graphs off, and on when the attention backend supports them. Asserted besides the tokens:
preemptions happened, the shared prefix was hit, and with graphs on graphs replayed and no decode
batch was above the largest bucket (the buckets reach the request cap, and the scheduler counts a
request's siblings against it).

The tokens, by teacher forcing: each sequence's prompt and generated tokens go through one full
forward of the model, and every generated token must be the model's argmax at its position, or a
token whose logit is within `NEAR_TIE_TOLERANCE` of the top one, as a share of the position's largest
|logit| (3e-2 in bfloat16, 1e-2 in float16: a near-tie that rounding can flip, whatever its rank; a
diverged token's rank and gap are listed). Every position is checked
against the engine's own history, so one flipped near-tie does not fail the tokens after it. In
float32 on the CPU the tokens must besides equal `model.generate`'s exactly; on CUDA the count of
sequences equal to `model.generate`'s is reported.
"""

from __future__ import annotations

import random

from scripts.gpu_checks.common import (
    NEAR_TIE_TOLERANCE,
    Context,
    StepWatch,
    add_counts,
    matches,
    reference_tokens,
    serve_all,
    teacher_forced,
)
from scripts.gpu_checks.report import require, table

NAME = "greedy equality with the model (teacher-forced)"
TIMEOUT_S = 150


def sizes(ctx: Context) -> dict:
    if ctx.cuda:
        # Room for 1.3 of the longest sequences: four running ones must preempt. 16 blocks of 256 held
        # them all on an H200 (no preemption): the cache is sized from the block size now.
        return dict(prompts=8, lengths=(300, 1500), prefix=512, new=32, max_batch_tokens=512,
                    num_blocks=-(-int(1.3 * (1500 + 32)) // ctx.block_size))  # fmt: skip
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
    forced: dict = {}
    for prompt, seqs in zip(prompts, out):
        for seq in seqs:
            forced = add_counts(forced, teacher_forced(model, prompt, seq, NEAR_TIE_TOLERANCE[ctx.dtype]))
    row["forced"] = forced
    row.update(graphs=graphs, preemptions=stats["num_preemptions_total"], prefix_hits=stats["prefix_cache_hits_total"],
               largest_decode_batch=max(watch.decode_batches, default=0),
               largest_bucket=graph_batch_sizes(engine.sizes.max_requests)[-1], replays=watch.replays)  # fmt: skip
    return row


def run(ctx: Context) -> dict:
    s = sizes(ctx)
    rows, problems = [], []
    graph_settings = (False, True) if ctx.graphs else (False,)  # graphs.py has the CPU's stand-in
    for i, arch in enumerate(ctx.archs):
        model = ctx.test_model(arch)
        prompts = prompts_with_shared_prefix(s["prompts"], s["lengths"], s["prefix"], 512, seed=i)
        expected = reference_tokens(model, prompts, s["new"])
        for graphs in graph_settings:
            row = one_run(ctx, model, prompts, expected, graphs, s)
            rows.append((arch, row))
            label = f"{arch} graphs {'on' if graphs else 'off'}"
            if row["forced"]["diverged"]:
                problems.append(f"{label}: {row['forced']['diverged']} of {row['forced']['positions']} tokens are not "
                                f"the model's argmax nor a near-tie")  # fmt: skip
            if ctx.exact_required and row["exact"] < row["total"]:
                problems.append(f"{label}: {row['exact']}/{row['total']} equal to model.generate (float32: all)")
            if not row["preemptions"] or not row["prefix_hits"]:
                problems.append(f"{arch}: {row['preemptions']} preemptions, {row['prefix_hits']} prefix hits (both needed)")
            # the decode buckets reach the request cap, and the scheduler counts n > 1 siblings against it:
            # no step is above the largest bucket, and the largest ran as a graph
            if graphs and (row["largest_decode_batch"] > row["largest_bucket"] or not row["replays"]):
                problems.append(f"{arch}: a decode batch of {row['largest_decode_batch']} above the largest bucket "
                                f"{row['largest_bucket']}, or no replay")
        del model
    detail = table(["arch", "CUDA graphs", "argmax / near-tie / diverged tokens", "sequences equal to generate",
                    "mean common prefix", "preemptions", "prefix hits", "largest decode batch / bucket", "replays"],
                   [[a, "on" if r["graphs"] else "off",
                     f"{r['forced']['argmax']} / {r['forced']['near_ties']} / {r['forced']['diverged']}",
                     f"{r['exact']}/{r['total']}", f"{r['mean_prefix']:.1f}/{s['new']}",
                     str(r["preemptions"]), str(r["prefix_hits"]), f"{r['largest_decode_batch']}/{r['largest_bucket']}",
                     str(r["replays"])] for a, r in rows])  # fmt: skip
    forced: dict = {}
    for _, r in rows:
        forced = add_counts(forced, r["forced"])
    figures = {"tokens": forced["positions"], "argmax": forced["argmax"], "near-ties": forced["near_ties"],
               "diverged": forced["diverged"], "largest near-tie gap": forced["largest_gap"],
               "near-tie tolerance": NEAR_TIE_TOLERANCE[ctx.dtype],
               "diverged tokens": "; ".join(forced["diverged_at"][:8]) or "none",
               "sequences": sum(r["total"] for _, r in rows), "equal to generate": sum(r["exact"] for _, r in rows),
               "graphs": "off and on" if ctx.graphs else ("off: " + ctx.no_graphs_reason() if ctx.cuda else "off (CPU)"),
               "prompt lengths": "-".join(map(str, s["lengths"])), "new tokens": s["new"],
               "_detail": f"### Greedy equality ({str(ctx.dtype).removeprefix('torch.')})\n\n{detail}"}  # fmt: skip
    require(not problems, "; ".join(problems), figures)
    return figures
