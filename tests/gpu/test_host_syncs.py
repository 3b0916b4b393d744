"""No host read inside a step's forward: the step runs on torch's meta device, where any read of a
tensor's value on the host (`.item()`, `bool(tensor)`, `.tolist()`) raises. On a GPU each such read is
a sync that stalls the host until the device catches up, and breaks graph capture; the GPU row
"no host sync inside decode steps" (scripts/gpu_checks/sync.py) counts them on the device itself.

Every test architecture, and a Llama with dynamic-NTK RoPE, through the model runner with
flash-attn's backend (its kernels stubbed to return a tensor of the right shape): a decode step
replayed from a decode graph (the eager stand-in), the same step eagerly, and a mixed step. The
sampler's own test is tests/engine/test_sampling.py (meta logits reach its one copy-out).
"""

from __future__ import annotations

import pytest
import torch

from engine.backends.cuda import FlashAttnBackend
from engine.backends.step_dispatch import StepDispatcher
from engine.kv_cache import PagedKVCache, kv_geometry
from engine.model_runner import ModelRunner, StepInputs
from engine.testing import ARCHITECTURES, build_test_model
from tests.gpu.helpers import EagerCapturer

DYNAMIC = dict(max_position_embeddings=512, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
BS = 256


def _same_shape(q, *args, **kwargs):
    return torch.empty_like(q)


def meta_runner(arch: str) -> ModelRunner:
    name, _, variant = arch.partition("-")
    model = build_test_model(name, **(DYNAMIC if variant == "dynamic" else {}))
    model = model.to(device="meta", dtype=torch.bfloat16)
    layers, hkv, hd = kv_geometry(model.config)
    cache = PagedKVCache(layers, 8, BS, hkv, hd, torch.bfloat16, "meta")
    return ModelRunner(model, cache, FlashAttnBackend(varlen_fn=_same_shape, kvcache_fn=_same_shape))


@pytest.mark.parametrize("arch", [*ARCHITECTURES, "llama-dynamic"])
def test_a_steps_forward_reads_nothing_back_from_the_device(arch) -> None:
    runner = meta_runner(arch)
    vocab = runner.model.config.vocab_size
    dispatch = StepDispatcher(runner.forward, graph_flags=(False, True), device="meta", max_requests=4,
                              max_batch_tokens=64, max_blocks_per_seq=4, block_size=BS, pad_block=7,
                              capturer=EagerCapturer())  # fmt: skip
    dispatch.warmup()
    decode = StepInputs(token_ids=[7, 8, 9], q_lens=[1, 1, 1], starts=[300, 40, 511], block_tables=[[3, 5], [2], [1, 4]],
                        sample_rows=[0, 1, 2], copies=[])  # fmt: skip
    assert runner.run(decode, dispatch).shape == (3, vocab)
    assert dispatch.replays == 1
    assert runner.run(decode).shape == (3, vocab)  # eagerly
    mixed = StepInputs(token_ids=[7, 8, 9, 10, 11], q_lens=[1, 4], starts=[20, 16], block_tables=[[3], [2]],
                       sample_rows=[0, 1], copies=[])  # fmt: skip
    assert runner.run(mixed, dispatch).shape == (2, vocab)
