"""Dynamic-NTK RoPE in engine steps: transformers' rule applied from the host before each step, the
module's undecorated forward inside steps, its own anywhere else (engine/rope.py)."""

from __future__ import annotations

import torch

from engine import ContinuousBatchingConfig, generate_batch
from engine.attention import engine_step
from engine.rope import DynamicRope
from engine.testing import build_test_model, random_prompts

DYNAMIC = dict(max_position_embeddings=64, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})


def test_the_host_update_follows_transformers_rule_in_one_buffer() -> None:
    """Lengths that grow past the model's 64, fall back under it, and grow again: after each, the
    step's cos/sin and the module's state are those of transformers' own update, always in the same
    tensor, and the original frequencies are never written over."""
    ours, theirs = build_test_model("llama", **DYNAMIC), build_test_model("llama", **DYNAMIC)
    rope = DynamicRope.of(ours)
    module, twin = ours.model.rotary_emb, theirs.model.rotary_emb
    buffer, original = module.inv_freq, module.original_inv_freq.clone()
    x = torch.zeros(1, 1, 8)
    for seq_len in [10, 100, 150, 120, 30, 64, 200, 64, 63]:
        positions = torch.arange(seq_len)[None]
        rope.update(seq_len)
        with engine_step():
            got = module(x, positions)
        want = twin(x, positions)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), seq_len
        assert module.max_seq_len_cached == twin.max_seq_len_cached and torch.equal(module.inv_freq, twin.inv_freq)
        assert module.inv_freq is buffer and torch.equal(module.original_inv_freq, original)


def test_outside_steps_the_module_runs_transformers_update() -> None:
    model = build_test_model("llama", **DYNAMIC)
    DynamicRope.of(model)
    module = model.model.rotary_emb
    module(torch.zeros(1, 1, 8), torch.arange(100)[None])  # a model.generate past the model's length
    assert module.max_seq_len_cached == 100
    with engine_step():
        module(torch.zeros(1, 1, 8), torch.arange(200)[None])  # inside a step: no update of its own
    assert module.max_seq_len_cached == 100


def test_a_dynamic_rope_model_gives_generates_greedy_tokens_even_after_a_long_generate() -> None:
    """The engine stays within the model's length, where dynamic NTK is the original RoPE; a
    model.generate past that length leaves scaled frequencies behind, which the engine's first step
    puts back as transformers' rule says."""
    model, fresh = build_test_model("llama", **DYNAMIC), build_test_model("llama", **DYNAMIC)
    prompts = random_prompts(4, 5, 40, model.config.vocab_size, seed=4)
    with torch.no_grad():
        want = [fresh.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                               pad_token_id=3)[0, len(p):].tolist() for p in prompts]  # fmt: skip
        model.generate(torch.tensor([list(range(5, 95))]), max_new_tokens=4, do_sample=False, eos_token_id=None,
                       pad_token_id=3)  # 94 tokens: past the model's 64  # fmt: skip
    assert model.model.rotary_emb.max_seq_len_cached > 64
    out = generate_batch(model, prompts, max_new_tokens=12, ignore_eos=True, progress_bar=False,
                         continuous_batching_config=ContinuousBatchingConfig(block_size=16, num_blocks=64))
    assert [o.generated_tokens for o in out.values()] == want
