"""Sampling on the model's device, through the engine, each parameter by a property it must have.

- top_k=1, top_p near 0 and min_p=1 at temperature 1 leave one token: equal to greedy (in half
  precision: every token the model's argmax or a near-tie, by teacher forcing as the equality row does,
  since tied bfloat16 logits may leave two tokens);
- a seed gives the same tokens twice, alone or batched with unseeded requests; another seed differs;
- top_k=5 at temperature 1.5: every sampled token is among the 5 most likely (logprobs=5 lists them;
  one tied with the fifth counts);
- logit_bias +100 on one token: every token is that one;
- repetition, presence and frequency penalties and a negative bias, greedy: each token the argmax of
  a loop written here that applies them to the full forward's logits over the engine's own history
  (bias, repetition over prompt and output, presence and frequency over the output, as
  engine/sampler.py documents), or a near-tie within common.NEAR_TIE_TOLERANCE (teacher forcing, as the
  equality row does); in float32 also equal to that loop's own greedy tokens;
- logprobs=2 greedy: each token's logprob equals log_softmax of that loop's logits, and is the top one.
Exact on the CPU in float32; in half precision the seeded rows still exact (the same engine, the same
logits) and logprobs within 0.5 (a bfloat16 logit of 30 is
rounded to 0.125).
"""

from __future__ import annotations

from collections import Counter

import torch

from scripts.gpu_checks.common import NEAR_TIE_TOLERANCE, Context, matches, serve_all, teacher_forced
from scripts.gpu_checks.report import require

NAME = "sampling on the device"
TIMEOUT_S = 90
PENALTIES = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.7, logit_bias={7: -5.0, 11: -3.0})


def penalized_logits(model, ids: list[int], gen: list[int], p: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The next position's logits after a full forward over `ids` (`gen`: its generated part), raw and
    with bias and penalties applied."""
    with torch.no_grad():
        raw = model(torch.tensor([ids], device=model.device)).logits[0, -1].float()
    x = raw.clone()
    for token, bias in p.get("logit_bias", {}).items():
        x[token] += bias
    rep = p.get("repetition_penalty", 1.0)
    if rep != 1.0:
        seen = torch.tensor(sorted(set(ids)), device=x.device)
        vals = x[seen]
        x[seen] = torch.where(vals > 0, vals / rep, vals * rep)
    for token, count in Counter(gen).items():
        x[token] -= p.get("frequency_penalty", 0.0) * count + p.get("presence_penalty", 0.0)
    return raw, x


def penalized_greedy(model, prompt: list[int], new: int, p: dict) -> tuple[list[int], list[float]]:
    """Greedy tokens of the penalized logits, and each token's raw logprob."""
    gen: list[int] = []
    logprobs: list[float] = []
    for _ in range(new):
        raw, x = penalized_logits(model, prompt + gen, gen, p)
        token = int(x.argmax())
        logprobs.append(float(torch.log_softmax(raw, -1)[token]))
        gen.append(token)
    return gen, logprobs


def penalized_diverged(model, prompt: list[int], got: list[int], p: dict, tolerance: float) -> int:
    """Teacher forcing: the engine's tokens that are neither the penalized argmax over the engine's own
    history nor within `tolerance` x the largest |logit| of it (a near-tie, whatever its rank)."""
    diverged = 0
    for t, token in enumerate(got):
        _, x = penalized_logits(model, prompt + got[:t], got[:t], p)
        gap = float(x.max() - x[token]) / max(float(x.abs().max()), 1e-30)
        if token != int(x.argmax()) and gap > tolerance:
            diverged += 1
    return diverged


def run(ctx: Context) -> dict:
    from engine.llm_engine import LLMEngine
    from engine.testing import random_prompts

    model = ctx.test_model("qwen3")
    prompts = random_prompts(4, 10, 60, 512, seed=21)
    new = 8 if ctx.quick else 16
    engine = LLMEngine(model, ctx.config(max_requests_per_batch=8))
    engine.warmup()
    problems: list[str] = []

    def firsts(out):
        return [seqs[0] for seqs in out]

    try:
        greedy = firsts(serve_all(engine, prompts, new))
        one_token: dict[str, dict] = {"top_k=1": dict(top_k=1), "top_p=1e-6": dict(top_p=1e-6), "min_p=1": dict(min_p=1.0)}
        tolerance = NEAR_TIE_TOLERANCE[ctx.dtype]
        for name, kw in one_token.items():
            got = firsts(serve_all(engine, prompts, new, temperature=1.0, **kw))
            m = matches(got, greedy)
            # half precision: a token other than greedy's must be a near-tie of the model (ties are exact there)
            diverged = sum(teacher_forced(model, p, g, tolerance)["diverged"] for p, g in zip(prompts, got))
            if (m["exact"] < m["total"]) if ctx.exact_required else diverged:
                problems.append(f"{name} is not greedy: {m['exact']}/{m['total']} equal, {diverged} tokens diverged")

        seeded = dict(temperature=1.0, seed=7)
        alone = firsts(serve_all(engine, prompts[:1], new, **seeded))
        again = firsts(serve_all(engine, prompts[:1], new, **seeded))
        batched = firsts(serve_all(engine, prompts, new, per_prompt=[seeded] + [dict(temperature=1.0)] * 3))
        other = firsts(serve_all(engine, prompts[:1], new, temperature=1.0, seed=8))
        if not alone == again == batched[:1]:
            problems.append("a seed's tokens changed between runs or with the batch")
        if other == alone:
            problems.append("seeds 7 and 8 gave the same tokens")

        reqs = [engine.make_request(p, max_new_tokens=new, ignore_eos=True, temperature=1.5, top_k=5, logprobs=5)
                for p in prompts]  # fmt: skip
        for r in reqs:
            engine.add_request(r)
        with torch.inference_mode():
            while engine.has_unfinished():
                engine.step()
        # a token outside the listed 5 is allowed only tied with the 5th (bfloat16 logits tie often)
        outside = sum(tok not in top and lp < min(top.values())
                      for r in reqs for tok, lp, top in zip(r.generated_ids, r.logprobs, r.top_logprobs))  # fmt: skip
        if outside:
            problems.append(f"{outside} top_k=5 tokens outside the 5 most likely")

        biased = firsts(serve_all(engine, prompts, new, temperature=1.0, logit_bias={42: 100.0}))
        if any(t != 42 for seq in biased for t in seq):
            problems.append("logit_bias +100 did not force its token")

        want = [penalized_greedy(model, p, new, PENALTIES) for p in prompts]
        got = firsts(serve_all(engine, prompts, new, temperature=0.0, **PENALTIES))
        pen = matches(got, [w[0] for w in want])
        diverged = sum(penalized_diverged(model, p, g, PENALTIES, NEAR_TIE_TOLERANCE[ctx.dtype]) for p, g in zip(prompts, got))
        if diverged or (ctx.exact_required and pen["exact"] < pen["total"]):
            problems.append(f"penalties: {diverged} tokens not the reference loop's argmax nor a near-tie, "
                            f"{pen['exact']}/{pen['total']} sequences equal to its greedy tokens")  # fmt: skip

        plain = [penalized_greedy(model, p, new, {}) for p in prompts]
        reqs = [engine.make_request(p, max_new_tokens=new, ignore_eos=True, temperature=0.0, logprobs=2) for p in prompts]
        for r in reqs:
            engine.add_request(r)
        with torch.inference_mode():
            while engine.has_unfinished():
                engine.step()
        diffs = [abs(a - b) for r, (toks, lps) in zip(reqs, plain) if r.generated_ids == toks
                 for a, b in zip(r.logprobs, lps)]  # fmt: skip
        worst = max(diffs, default=float("nan"))
        # the greedy token has the largest logprob (tied ones are equal: bfloat16 logits tie often)
        tops = all(top.get(tok) == max(top.values()) for r in reqs for tok, top in zip(r.generated_ids, r.top_logprobs))
        if not diffs or not worst <= (1e-3 if ctx.dtype == torch.float32 else 0.5) or not tops:
            problems.append(f"logprobs: {len(diffs)} compared, largest difference {worst:.3g}, top token first: {tops}")
    finally:
        engine.close()
    changed = sum(w[0] != g[0] for w, g in zip(want, plain))
    figures = {"penalties exact": f"{pen['exact']}/{pen['total']}", "penalised tokens diverged": diverged,
               "prompts the penalties changed": changed,
               "max logprob diff": worst,
               "requests": "greedy, top-k/p, min-p, seeded, biased, penalised, logprobs",
               "device": str(ctx.device)}  # fmt: skip
    require(changed > 0, "the penalties changed no greedy token: the comparison shows nothing", figures)
    require(not problems, "; ".join(problems), figures)
    return figures
