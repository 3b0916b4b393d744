"""What the checks share: the run's settings, test models on the device, the engine's loop, matching."""

from __future__ import annotations

import dataclasses
import gc
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class Context:
    device: torch.device
    dtype: torch.dtype  # of the models (float32 on the CPU unless asked)
    block_size: int  # on CUDA; the CPU runs blocks of 16
    min_exact: float
    archs: list[str]
    quick: bool = False  # the CPU smoke test's sizes
    small: bool = False  # a smaller throughput model than the 8B shape
    vllm: str = "auto"  # "auto" (install into a venv if the registry has a build), "off", or a venv's python
    two_ranks: bool = False
    work: Path = Path("/tmp")  # the run's scratch folder, shared by its rows' processes
    shared: dict[str, Any] = field(default_factory=dict)  # objects kept within one row's process

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def exact_required(self) -> bool:
        """float32 on the CPU: tokens must be equal; half precision may flip near-ties."""
        return not self.cuda and self.dtype == torch.float32

    def attention(self) -> tuple[str, bool]:
        """The attention backend an engine gets on this device: its name, and whether CUDA graphs can
        capture it (its `supports_graphs`). On the CPU: ("cpu", False) (the checks' graph stand-ins run
        flash-attn's reference kernels)."""
        if "attention" not in self.shared:
            if self.cuda:
                from engine.backends.cuda import make_backend

                backend = make_backend(self.device)
                self.shared["attention"] = (backend.name, bool(getattr(backend, "supports_graphs", False)))
            else:
                self.shared["attention"] = ("cpu", False)
        return self.shared["attention"]

    @property
    def graphs(self) -> bool:
        """CUDA graphs can run here: on CUDA with a backend that supports them."""
        return self.cuda and self.attention()[1]

    def no_graphs_reason(self) -> str:
        return f"the CUDA attention backend '{self.attention()[0]}' cannot be captured in CUDA graphs"

    def earlier(self, check: str) -> dict[str, Any] | None:
        """The row an earlier check of this run wrote (scripts/gpu_check.py keeps them in work/rows/)."""
        path = self.work / "rows" / f"{check}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def test_model(self, arch: str = "llama", **overrides):
        from engine.testing import build_test_model

        return build_test_model(arch, vocab_size=512, **overrides).to(device=self.device, dtype=self.dtype)

    def config(self, **fields: Any):
        """The engine config of a check: the CUDA backend with blocks of `block_size` (flash-attn's
        paged kernels want a multiple of 256), else the CPU's."""
        from engine import ContinuousBatchingConfig

        if self.cuda:
            return ContinuousBatchingConfig(block_size=self.block_size, attn_backend="cuda", **fields)
        return ContinuousBatchingConfig(block_size=16, **fields)

    def release(self, key: str) -> None:
        """Drop a shared object and give its device memory back."""
        self.shared.pop(key, None)
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def serve_all(engine, prompts: list[list[int]], max_new_tokens: int, on_step=None, per_prompt: list[dict] | None = None,
              **request: Any) -> list[list[list[int]]]:
    """Run the engine's own loop over `prompts`, all added at once, until all finish: each prompt's
    sequences' generated ids (n > 1: the request's, then its siblings'). `request` applies to every
    prompt, `per_prompt[i]` to prompt i; `on_step(engine)` runs after every step."""
    from engine.output_processor import family_ids

    per_prompt = per_prompt or [{} for _ in prompts]
    reqs = [engine.make_request(p, max_new_tokens=max_new_tokens, ignore_eos=True, **{**request, **extra})
            for p, extra in zip(prompts, per_prompt)]
    families = [family_ids(r.request_id, 1 + r.num_children) for r in reqs]
    for r in reqs:
        engine.add_request(r)
    finished = {}
    with torch.inference_mode():
        while engine.has_unfinished():
            for r in engine.step():
                if r.is_finished:
                    finished[r.request_id] = r
            if on_step is not None:
                on_step(engine)
    bad = [r for r in finished.values() if r.finish_reason not in ("length", "stop")]
    if bad:
        raise RuntimeError(f"request {bad[0].request_id} ended with {bad[0].finish_reason}: {bad[0].error}")
    return [[finished[i].generated_ids for i in ids] for ids in families]


def reference_tokens(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy `model.generate`, one prompt at a time."""
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=model.device)
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(gen[0, len(prompt) :].tolist())
    return out


# A greedy token may differ from the reference's argmax only where its logit is this close to the top
# one, as a share of the position's largest |logit|: float32 sums in another order (1e-4), float16
# and bfloat16 round each logit to 11 and 8 significant bits (a bfloat16 logit of 8 is rounded to 1/32).
NEAR_TIE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def teacher_forced(model, prompt: list[int], generated: list[int], tolerance: float) -> dict[str, Any]:
    """The engine's greedy tokens fed back through one full forward of the model: at each generated
    position, the model's logits there. A token equal to the model's argmax is a match; another whose
    logit is below the top one by at most `tolerance` x the largest |logit| is a near-tie (whatever its
    rank: in half precision three or more logits can lie within rounding of each other); anything else
    diverged, and its rank and gap are kept. Divergence cannot cascade: every position sees the
    engine's own history."""
    if not generated:
        return {"positions": 0, "argmax": 0, "near_ties": 0, "diverged": 0, "largest_gap": 0.0, "diverged_at": []}
    ids = torch.tensor([prompt + generated[:-1]], device=model.device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 :].float()
    got = torch.tensor(generated, device=logits.device)
    chosen = logits.gather(1, got[:, None])[:, 0]
    top = logits.amax(-1)
    first = logits.argmax(-1) == got
    gap = (top - chosen) / logits.abs().amax(-1).clamp_min(1e-30)
    near = ~first & (gap <= tolerance)
    bad = ~first & ~near
    rank = (logits > chosen[:, None]).sum(-1) + 1
    accepted_gaps = gap[near]
    diverged_at = [f"rank {int(r)}, gap {float(g):.3g}" for r, g in zip(rank[bad], gap[bad])]
    return {"positions": len(generated), "argmax": int(first.sum()), "near_ties": int(near.sum()),
            "diverged": int(bad.sum()),
            "largest_gap": float(accepted_gaps.max()) if accepted_gaps.numel() else 0.0,
            "diverged_at": diverged_at}  # fmt: skip


def add_counts(total: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    """Sum teacher_forced results (the largest gap is the largest)."""
    out = dict(total) if total else {"positions": 0, "argmax": 0, "near_ties": 0, "diverged": 0, "largest_gap": 0.0,
                                     "diverged_at": []}  # fmt: skip
    for key in ("positions", "argmax", "near_ties", "diverged", "diverged_at"):
        out[key] = out[key] + part[key]
    out["largest_gap"] = max(out["largest_gap"], part["largest_gap"])
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def matches(got: list[list[int]], expected: list[list[int]]) -> dict[str, Any]:
    """Exact matches and the mean common prefix of token lists, pairwise."""
    return {"exact": sum(g == e for g, e in zip(got, expected)), "total": len(expected),
            "mean_prefix": statistics.mean(common_prefix(g, e) for g, e in zip(got, expected))}  # fmt: skip


class StepWatch:
    """Stands where the executor keeps its step dispatcher and calls it unchanged, noting each step's
    shape (the executor only calls it; everything else is read through to the dispatcher)."""

    def __init__(self, dispatch) -> None:
        self.dispatch = dispatch
        self.decode_batches: list[int] = []  # sequences of each pure decode step
        self.steps = 0

    def __call__(self, input_ids, positions, meta, logits_rows):
        self.steps += 1
        if meta.num_decodes == meta.num_seqs:
            self.decode_batches.append(meta.num_seqs)
        return self.dispatch(input_ids, positions, meta, logits_rows)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dispatch, name)


def with_fields(config, **fields: Any):
    return dataclasses.replace(config, **fields)
