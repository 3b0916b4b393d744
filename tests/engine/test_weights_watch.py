"""The engine's watch over in-place weight changes (engine/weights_watch.py): the kernels' one-call sum
of the version counters and the Python sum agree, and both grow with each kind of in-place change."""

from __future__ import annotations

import pytest
import torch

from engine.testing import build_test_model
from engine.weights_watch import WeightsWatch


@pytest.fixture(params=["kernels", "python"])
def watch_of(request, ops):
    """WeightsWatch over a module's parameters, read by the kernels' VersionWatch or from Python."""
    if request.param == "kernels" and ops is None:
        pytest.fail("cbserve's CPU kernels did not load: the native watch cannot be tested")

    def make(module: torch.nn.Module) -> WeightsWatch:
        watch = WeightsWatch(module.parameters(), ops if request.param == "kernels" else None)
        assert (watch.native is not None) == (request.param == "kernels" and watch.tracked)
        return watch

    return make


def test_every_in_place_change_moves_the_version(watch_of) -> None:
    model = build_test_model("llama", vocab_size=128, seed=0)
    watch = watch_of(model)
    seen = [watch.version()]
    assert seen[0] == sum(p._version for p in model.parameters())
    with torch.no_grad():
        model.lm_head.weight.mul_(0.5)  # an optimizer step's kind of change
        seen.append(watch.version())
        next(model.parameters()).copy_(torch.zeros_like(next(model.parameters())))
        seen.append(watch.version())
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
        seen.append(watch.version())
    assert seen == sorted(set(seen)), seen  # each change made it grow
    assert seen[-1] == sum(p._version for p in model.parameters())
    assert watch.version() == seen[-1]  # reading it changes nothing


def test_the_two_reads_agree_on_a_model(ops) -> None:
    model = build_test_model("qwen2", vocab_size=128, seed=1)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            for _ in range(i % 3):
                p.add_(1.0)
    native, python = WeightsWatch(model.parameters(), ops), WeightsWatch(model.parameters())
    assert native.native is not None and len(native.native) == len(list(model.parameters()))
    assert native.version() == python.version() == sum(p._version for p in model.parameters())


def test_inference_tensors_have_nothing_to_watch(watch_of) -> None:
    with torch.inference_mode():
        layer = torch.nn.Linear(4, 4)
    assert layer.weight.is_inference()
    watch = watch_of(layer)
    assert not watch.tracked and watch.version() is None
