"""Models, prompts and model.generate references shared by the engine tests."""

from __future__ import annotations

import functools

import pytest
import torch

from engine.testing import ARCHITECTURES, build_test_model, random_prompts

VOCAB = 512
MAX_NEW = 24


@functools.lru_cache(maxsize=None)
def model_for(arch: str):
    return build_test_model(arch, vocab_size=VOCAB)


@functools.lru_cache(maxsize=None)
def prompts_for(n: int = 32, min_len: int = 3, max_len: int = 90, seed: int = 0) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(p) for p in random_prompts(n, min_len, max_len, VOCAB, seed=seed))


@functools.lru_cache(maxsize=None)
def reference(arch: str, prompt: tuple[int, ...], max_new_tokens: int = MAX_NEW) -> tuple[int, ...]:
    """Greedy tokens from transformers' own model.generate, one prompt at a time, EOS ignored."""
    model = model_for(arch)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=3
        )
    return tuple(out[0, len(prompt) :].tolist())


@pytest.fixture(params=ARCHITECTURES)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def ops():
    """cbserve's C++ CPU kernels for this host's ISA (built once, cached)."""
    from engine.backends.cpu_kernels import cpu_ops

    ops = cpu_ops()
    assert ops is not None, "the C++ kernels must build here (a compiler is part of the dev setup)"
    return ops


@pytest.fixture(autouse=True)
def async_batching_on_the_cpu(monkeypatch):
    """An engine asked for async batching runs it here too (on the CPU it is turned down, with a warning,
    unless this is set): the engine tests hold its pipeline to one step at a time."""
    from engine.backends.cpu_executor import ASYNC_ON_CPU_ENV

    monkeypatch.setenv(ASYNC_ON_CPU_ENV, "1")
