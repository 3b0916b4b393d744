"""engine/backends/compile.py: transformers' compile configs turned into torch.compile calls."""

from __future__ import annotations

import pytest
import torch
from transformers import CompileConfig

from engine.backends.cpu import SDPABackend
from engine.backends.compile import compile_kwargs, compile_step, uses_cuda_graphs
from engine.kv_cache import PagedKVCache, kv_geometry
from engine.testing import build_test_model
from tests.gpu.helpers import hf_forward, meta_for


def test_transformers_compile_config_maps_to_torch_compile_arguments():
    assert compile_kwargs(None) is None
    cfg = CompileConfig(fullgraph=False, dynamic=True, mode="max-autotune-no-cudagraphs")
    assert compile_kwargs(cfg) == {"fullgraph": False, "dynamic": True, "backend": "inductor",
                                   "mode": "max-autotune-no-cudagraphs"}  # fmt: skip
    from_yaml = {"backend": "eager", "options": {"triton.cudagraphs": False}}
    assert compile_kwargs(from_yaml) == {"fullgraph": False, "dynamic": None, "backend": "eager",
                                         "options": {"triton.cudagraphs": False}}  # fmt: skip


@pytest.mark.parametrize(
    "config, match",
    [({"mode": "default", "options": {"x": 1}}, "not both"), ({"fullgrpah": True}, "unknown compile config field"),
     ("fast", "must be a transformers CompileConfig")],
)  # fmt: skip
def test_bad_compile_configs_are_clear_errors(config, match):
    with pytest.raises(ValueError, match=match):
        compile_kwargs(config)


def test_inductor_cuda_graphs_clash_with_cbserve_graphs():
    assert uses_cuda_graphs({"mode": "reduce-overhead"}) and uses_cuda_graphs({"options": {"triton.cudagraphs": True}})
    assert not uses_cuda_graphs({"mode": "max-autotune-no-cudagraphs"})
    with pytest.raises(ValueError, match="decode_compile_config uses inductor's own CUDA graphs"):
        compile_step(lambda x: x, CompileConfig(), cbserve_graphs=True, name="decode_compile_config")
    assert compile_step(len, None) is len


def test_the_step_forward_compiles_and_gives_the_eager_logits():
    torch.manual_seed(0)
    model = build_test_model("llama", vocab_size=512, num_hidden_layers=1)  # tracing time grows with layers
    layers, hkv, hd = kv_geometry(model.config)
    prompt = list(range(4, 30))
    meta = meta_for([[2, 5]], [len(prompt)], [len(prompt)], 16)
    ids, pos, rows = torch.tensor(prompt), torch.arange(len(prompt)), torch.tensor([len(prompt) - 1])
    results = []
    for config in (None, {"backend": "eager", "dynamic": False}):
        cache = PagedKVCache(layers, 8, 16, hkv, hd, torch.float32)
        forward = compile_step(hf_forward(model, SDPABackend(), cache), config)
        with torch.inference_mode():
            results.append(forward(ids, pos, meta, rows))
        meta.extra.clear()
    torch.testing.assert_close(results[1], results[0])
