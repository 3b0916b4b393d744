"""No host sync inside decode steps but the one that brings the sampled tokens back.

A warmed engine serves 8 requests, with decode graphs when the attention backend supports them
(then replays are required too), else eager; once every one is decoding, each step runs
under `torch.cuda.set_sync_debug_mode("warn")`, which makes every synchronizing CUDA call (a
device-to-host read, a blocking host-to-device copy from pageable memory, a stream synchronize)
raise a warning attributed to the Python line that made it. The warnings are recorded per step.
A step waits for the GPU once, for its sampled tokens (the scheduler needs them on the host before the
next step): since 2026-11-30 as an event's wait after a non-blocking copy into pinned memory
(`PendingSample` in engine/sampler.py), which the debug mode does not report (it reports stream and
device synchronizes and blocking copies, not `cudaEventSynchronize`), so a step shows none; before, the
tokens' `.tolist()`, one sync in engine/sampler.py. Asserted: at most one sync per step, in
engine/sampler.py. Greedy steps and sampled steps (temperature, top-p, half the rows seeded) are checked apart.
"warn" rather than "error": an error would stop the step at the intended sync, and counting is what
tells the one intended sync from another.

On the CPU the steps run (the code path), but nothing can be observed: skipped with that reason.
"""

from __future__ import annotations

import threading
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

from scripts.gpu_checks.common import Context
from scripts.gpu_checks.report import Skipped, require

NAME = "no host sync inside decode steps"
TIMEOUT_S = 90
ALLOWED_FILE = "engine/sampler.py"
# c10's warning for a sync. Not "synchroniz" alone: torch's once-per-process notice when the mode is
# first set ("Synchronization debug mode is a prototype feature and does not yet detect all
# synchronizing operations", from set_sync_debug_mode itself) matched that on the H200 and was
# counted as a sync at torch/cuda/__init__.py.
SYNC_WARNING = "called a synchronizing CUDA operation"
ROOT = Path(__file__).resolve().parents[2]
ENGINE_DIR = ROOT / "engine"
STACKS: dict[str, str] = {}  # a sync site outside ALLOWED_FILE -> the stack that made it (the first time)


def is_sync(message: object) -> bool:
    """Whether a warning is c10's report of a synchronizing CUDA call (not torch's notice about the mode)."""
    return SYNC_WARNING in str(message)


def sync_site() -> str:
    """Where a sync warning came from: the innermost frame of this repository's engine/ (the line the
    engine wrote), with the innermost frame of all (torch's own line) in brackets when that is elsewhere.
    Called from `warnings.showwarning`, so the stack is the warning's."""
    frames = [f for f in traceback.extract_stack()[:-2] if Path(f.filename).name != "warnings.py"]
    ours = [f for f in frames if Path(f.filename).resolve().is_relative_to(ENGINE_DIR)]
    inner = frames[-1] if frames else None
    where = ours[-1] if ours else inner
    if where is None:
        return "?"
    site = f"{Path(where.filename).resolve().relative_to(ROOT) if ours else Path(where.filename).name}:{where.lineno}"
    if inner is not None and inner is not where:
        site += f" [{Path(inner.filename).parent.name}/{Path(inner.filename).name}:{inner.lineno}]"
    if not site.startswith(ALLOWED_FILE) and site not in STACKS:  # the report shows where it came from
        STACKS[site] = f"thread {threading.current_thread().name}:\n" + "".join(traceback.format_list(frames[-14:]))
    return site


def decode_steps(ctx: Context, engine, prompts, steps: int, per_prompt: list[dict]) -> list[list[str]]:
    """Add the requests, step until all decode, then `steps` steps each under the sync debug mode:
    per step, the file:line of every sync."""
    from engine.request import RequestStatus

    reqs = [engine.make_request(p, max_new_tokens=steps + 64, ignore_eos=True, **kw) for p, kw in zip(prompts, per_prompt)]
    for r in reqs:
        engine.add_request(r)
    per_step = []
    with torch.inference_mode():
        while engine.scheduler.waiting or any(r.status != RequestStatus.DECODING for r in reqs):
            engine.step()
        for _ in range(steps):
            sites: list[str] = []
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = lambda message, *a, **kw: sites.append(sync_site()) if is_sync(message) else None
                if ctx.cuda:
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    engine.step()
                finally:
                    if ctx.cuda:
                        torch.cuda.set_sync_debug_mode(0)
            per_step.append(sites)
    for r in reqs:
        engine.abort_request(r.request_id)
    return per_step


def run(ctx: Context) -> dict:
    from engine.llm_engine import LLMEngine
    from engine.testing import random_prompts

    model = ctx.test_model("llama")
    engine = LLMEngine(model, ctx.config(max_requests_per_batch=8, num_blocks=64, use_cuda_graph=(False, ctx.graphs)))
    engine.warmup()
    prompts = random_prompts(8, 20, 200, 512, seed=31)
    steps = 4 if ctx.quick else 8
    try:
        greedy = decode_steps(ctx, engine, prompts, steps, [dict(temperature=0.0)] * len(prompts))
        sampled = decode_steps(ctx, engine, prompts, steps, [dict(temperature=0.8, top_p=0.9, seed=i) if i % 2 else
                                                             dict(temperature=0.8, top_p=0.9) for i in range(len(prompts))])
        replays = engine.executor.dispatch.replays
    finally:
        engine.close()
    figures: dict = {}
    for name, per_step in (("greedy", greedy), ("sampled", sampled)):
        sites = Counter(site for step in per_step for site in step)
        figures[f"{name} steps"] = len(per_step)
        figures[f"{name} most syncs in a step"] = max(map(len, per_step), default=0)
        figures[f"{name} sync sites"] = ", ".join(f"{s} x{n}" for s, n in sites.most_common()) or "none"
    figures["graph replays"] = replays
    figures["steps"] = "decode graphs" if ctx.graphs else ("eager: " + ctx.no_graphs_reason() if ctx.cuda else "eager")
    if not ctx.cuda:
        raise Skipped("torch.cuda.set_sync_debug_mode needs CUDA: the steps ran on the CPU, no sync can be seen", figures)
    if STACKS:
        figures["_detail"] = "### Syncs outside engine/sampler.py, where they came from\n\n" + "\n".join(
            f"{site}\n```\n{stack}```\n" for site, stack in STACKS.items())
    bad = [site for per_step in (greedy, sampled) for step in per_step for site in step
           if not site.startswith(ALLOWED_FILE)]  # fmt: skip
    require(replays > 0 or not ctx.graphs, "no decode step replayed a graph", figures)
    require(not bad, f"syncs outside {ALLOWED_FILE}: {sorted(set(bad))}", figures)
    require(all(len(step) <= 1 for per_step in (greedy, sampled) for step in per_step),
            "a decode step synchronised more than once", figures)  # fmt: skip
    return figures
