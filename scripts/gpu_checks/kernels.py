"""The CUDA attention backend's kernels, called as the engine calls them, against the torch reference.

On CUDA the backend under test is the one an engine gets there (`make_backend`: flash-attn's
`flash_attn_varlen_func` and `flash_attn_with_kvcache` when flash-attn is installed, else the
fallback, named in the figures); the reference is `FlashAttnBackend` over tests/gpu/helpers.py's
`FlashReference` (flash-attn 2's documented semantics in float32 loops) on the CPU, from the same
inputs. Random paged steps: decodes over several 256-token pages, prompt chunks with history, mixed
steps; head dims 64, 128 and 256 with GQA (8 query heads over 2 KV heads), alone, with a sliding
window and with a softcap; bfloat16 and float16. When the backend supports CUDA graphs, one decode
call is also captured in a graph, its inputs changed in place, and the replay compared. On the CPU
the reference stands in for the kernels too (and the eager capturer for the graph): the code runs,
nothing about a GPU kernel is shown.
"""

from __future__ import annotations

import dataclasses

import torch

from scripts.gpu_checks.common import Context
from scripts.gpu_checks.report import require

NAME = "attention kernels against the reference"
TIMEOUT_S = 90
BLOCK = 256
# (cache length, query length) per sequence, decodes first: as the engine orders a step
STEPS = {
    "decode": [(700, 1), (300, 1), (1030, 1), (257, 1)],
    "chunks with history": [(700, 200), (530, 256), (1000, 64)],
    "mixed": [(600, 1), (257, 1), (900, 300), (100, 100)],
}
VARIANTS: dict[str, dict] = {"GQA": {}, "GQA + sliding window": {"sliding_window": 128}, "GQA + softcap": {"softcap": 30.0}}
# largest |kernel - reference| accepted: a few units in the last place of an attention output of size ~1
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def meta_on(meta, device: torch.device):
    return dataclasses.replace(meta, slot_mapping=meta.slot_mapping.to(device), cu_seqlens_q=meta.cu_seqlens_q.to(device),
                               seq_lens_k=meta.seq_lens_k.to(device), block_tables=meta.block_tables.to(device),
                               extra={})  # fmt: skip


def backends(ctx: Context):
    """(backend under test, reference): the engine's CUDA backend, or the reference twice on the CPU."""
    from engine.backends.cuda import FlashAttnBackend, make_backend
    from tests.gpu.helpers import FlashReference

    ref = FlashReference()
    reference = FlashAttnBackend(ref.varlen, ref.kvcache)
    if not ctx.cuda:
        return reference, reference
    return make_backend(ctx.device), reference


def attend(backend, tensors, meta, head_dim: int, variant: dict):
    q, k, v, kc, vc = tensors
    backend.prepare(meta)
    return backend.attend(q, k, v, kc, vc, meta, scaling=head_dim**-0.5, **variant)


def one_case(ctx: Context, under_test, reference, seqs, head_dim: int, dtype: torch.dtype, variant: dict, seed: int) -> float:
    from tests.gpu.helpers import make_step

    q, k, v, kc, vc, meta = make_step(seqs, BLOCK, 16, num_kv_heads=2, num_heads=8, head_dim=head_dim, dtype=dtype,
                                      seed=seed)  # fmt: skip
    expected = attend(reference, (q, k, v, kc.clone(), vc.clone()), meta, head_dim, variant)
    on = [t.to(ctx.device) for t in (q, k, v, kc, vc)]
    got = attend(under_test, on, meta_on(meta, ctx.device), head_dim, variant)
    return (got.float().cpu() - expected.float()).abs().max().item()


def graph_case(ctx: Context, under_test, reference, dtype: torch.dtype) -> float:
    """A decode call captured once, then replayed over new queries, keys, values and cache contents."""
    from tests.gpu.helpers import EagerCapturer, make_step

    head_dim, seqs = 128, STEPS["decode"]
    first = make_step(seqs, BLOCK, 16, num_kv_heads=2, num_heads=8, head_dim=head_dim, dtype=dtype, seed=1)
    meta = meta_on(first[5], ctx.device)
    buffers = [t.to(ctx.device) for t in first[:5]]
    if ctx.cuda:
        from engine.backends.cuda.graphs import CudaGraphCapturer

        capturer = CudaGraphCapturer(ctx.device)
    else:
        capturer = EagerCapturer()
    graph = capturer.capture(lambda: attend(under_test, buffers, meta, head_dim, {}))
    second = make_step(seqs, BLOCK, 16, num_kv_heads=2, num_heads=8, head_dim=head_dim, dtype=dtype, seed=2)
    for buf, new in zip(buffers, second[:5]):
        buf.copy_(new)
    graph.replay()
    ctx.sync()
    q, k, v, kc, vc, _ = second
    expected = attend(reference, (q, k, v, kc.clone(), vc.clone()), first[5], head_dim, {})
    return (graph.output.float().cpu() - expected.float()).abs().max().item()


def run(ctx: Context) -> dict:
    under_test, reference = backends(ctx)
    head_dims = (64,) if ctx.quick else (64, 128, 256)
    dtypes = (torch.bfloat16,) if ctx.quick else (torch.bfloat16, torch.float16)
    worst: dict[str, float] = {}
    failures = []
    cases = 0
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        for head_dim in head_dims:
            for step, seqs in STEPS.items():
                for label, variant in VARIANTS.items():
                    err = one_case(ctx, under_test, reference, seqs, head_dim, dtype, variant, seed=cases)
                    cases += 1
                    worst[name] = max(worst.get(name, 0.0), err)
                    if err > TOLERANCE[dtype]:
                        failures.append(f"{name} d={head_dim} {step} {label}: {err:.3g}")
    capturable = ctx.graphs or not ctx.cuda  # on the CPU the eager capturer stands in
    graph_err = graph_case(ctx, under_test, reference, torch.bfloat16) if capturable else None
    figures = {"cases": cases, **{f"max err {k}": v for k, v in worst.items()},
               "max err graph replay (bf16)": graph_err if capturable else "not captured: " + ctx.no_graphs_reason(),
               "head dims": "/".join(map(str, head_dims)),
               "backend": under_test.name if ctx.cuda else "torch reference (CPU)"}  # fmt: skip
    require(not failures, f"{len(failures)} of {cases} cases above tolerance: " + "; ".join(failures[:4]), figures)
    require(graph_err is None or graph_err <= TOLERANCE[torch.bfloat16],
            f"the replayed graph's output is off by {graph_err}", figures)  # fmt: skip
    return figures

