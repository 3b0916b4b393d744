"""KV sizing arithmetic with injected device figures (engine/backends/memory.py)."""

from __future__ import annotations

import pytest
import torch

from engine.backends.memory import (
    CPU_CACHE_CAP_BYTES,
    GiB,
    MiB,
    cap_layer_elements,
    cpu_memory,
    kv_bytes_per_block,
    plan_for_device,
    plan_kv_cache,
    profile_activation_peak,
    read_device_memory,
)


def test_bytes_per_block_counts_keys_values_layers_heads_and_dtype():
    # Llama-3-8B-like: 32 layers, 8 kv heads, head_dim 128, bf16, 256 tokens: 32 MiB a block
    assert kv_bytes_per_block(32, 8, 128, 256, torch.bfloat16) == 2 * 32 * 256 * 8 * 128 * 2 == 32 * MiB
    assert kv_bytes_per_block(2, 2, 16, 16, torch.float32) == 2 * 2 * 16 * 2 * 16 * 4


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "block_size"])
def test_bytes_per_block_rejects_non_positive(field):
    args = dict(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16)
    args[field] = 0
    with pytest.raises(ValueError, match=field):
        kv_bytes_per_block(dtype=torch.float16, **args)


def test_cuda_plan_takes_percent_of_free_memory_less_activation_peak():
    # an 80 GiB card with 60 GiB free after the model, 0.9 of it, 2 GiB of activations
    bpb = 32 * MiB
    plan = plan_kv_cache(60 * GiB, 0.9, bpb, 256, activation_peak_bytes=2 * GiB)
    budget = int(60 * GiB * 0.9) - 2 * GiB
    assert plan.budget_bytes == budget
    assert plan.num_blocks == budget // bpb == 1664
    assert plan.cache_bytes <= budget < plan.cache_bytes + bpb
    assert plan.num_tokens == 1664 * 256
    assert plan.max_batch_tokens == 8192  # the CUDA default
    assert plan.max_requests == 256


def test_reserved_blocks_come_out_of_the_budget():
    plan = plan_kv_cache(10 * GiB, 1.0, GiB, 256, reserved_blocks=1)
    assert plan.num_blocks == 9


def test_explicit_sizes_win():
    plan = plan_kv_cache(10 * GiB, 0.5, MiB, 16, num_blocks=7, max_batch_tokens=64, max_requests=3)
    assert (plan.num_blocks, plan.max_batch_tokens, plan.max_requests) == (7, 64, 3)


def test_default_request_cap_never_exceeds_blocks():
    plan = plan_kv_cache(100 * MiB, 1.0, 10 * MiB, 16)
    assert plan.num_blocks == 10 and plan.max_requests == 10


def test_not_one_block_is_a_clear_error_with_the_figures():
    with pytest.raises(ValueError, match=r"not enough memory for one KV block: 1024 MiB free .* activation peak 1000 MiB"):
        plan_kv_cache(1 * GiB, 1.0, 32 * MiB, 256, activation_peak_bytes=1000 * MiB)
    with pytest.raises(ValueError, match="not enough memory"):
        plan_kv_cache(1 * GiB, 0.5, 32 * MiB, 256, activation_peak_bytes=2 * GiB)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(free_bytes=-1), "free_bytes"),
        (dict(max_memory_percent=0), "max_memory_percent"),
        (dict(max_memory_percent=1.5), "max_memory_percent"),
        (dict(max_memory_percent=True), "max_memory_percent"),
        (dict(bytes_per_block=0), "bytes_per_block"),
        (dict(activation_peak_bytes=-5), "activation_peak_bytes"),
        (dict(max_batch_tokens=0), "max_batch_tokens"),
        (dict(reserved_blocks=-1), "reserved_blocks"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, field):
    args = dict(free_bytes=GiB, max_memory_percent=0.9, bytes_per_block=MiB, block_size=16)
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        plan_kv_cache(**args)


def test_cpu_figures_are_capped_and_a_fraction_of_the_machine():
    # 24 GiB machine with 20 GiB available: at most half the machine, the cache at most 1 GiB
    mem = cpu_memory(available_bytes=20 * GiB, total_bytes=24 * GiB)
    assert mem.free_bytes == 12 * GiB and mem.cap_bytes == CPU_CACHE_CAP_BYTES
    plan = plan_for_device(mem, 0.9, MiB, 16)
    assert plan.cache_bytes == CPU_CACHE_CAP_BYTES and plan.max_batch_tokens == 1024
    # a busy machine: 600 MiB available
    busy = plan_for_device(cpu_memory(600 * MiB, 24 * GiB), 0.5, MiB, 16)
    assert busy.num_blocks == 300


def test_the_cpu_cache_cap_is_the_cpu_kv_cache_space_setting():
    from engine import ContinuousBatchingConfig
    from engine.backends.executors import make_executor
    from engine.testing import build_test_model

    assert read_device_memory("cpu", cpu_cap_bytes=64 * MiB).cap_bytes == 64 * MiB
    executor = make_executor(build_test_model(), ContinuousBatchingConfig(cpu_kv_cache_space=1 / 1024))
    assert 0 < executor.sizes.num_blocks * executor.sizes.bytes_per_block <= MiB


def test_summary_is_one_line_with_the_figures():
    line = plan_kv_cache(60 * GiB, 0.9, 32 * MiB, 256, activation_peak_bytes=2 * GiB).summary()
    assert "\n" not in line
    assert "1664 blocks x 256 tokens = 425984 tokens" in line
    assert "max_batch_tokens 8192" in line and "activation peak 2048 MiB" in line


def test_reading_this_machine():
    mem = read_device_memory("cpu")
    assert mem.device_type == "cpu" and 0 < mem.free_bytes <= mem.total_bytes
    assert profile_activation_peak("cpu", lambda: None) == 0
    with pytest.raises(ValueError, match="meta"):
        read_device_memory("meta")


def test_the_profiling_step_stays_within_learned_positions_and_keeps_every_sampled_row():
    """GPT-2 learns 256 positions here; a 1,024-token profile step restarts its positions as separate
    sequences' do, and its LM head runs on the `rows` rows a full step samples."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from engine.backends.memory import profile_forward

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                                        n_positions=256, bos_token_id=0, eos_token_id=0)).eval()
    seen = []
    model.lm_head.register_forward_hook(lambda mod, args, out: seen.append(tuple(out.shape)))
    profile_forward(model, 1024, 96, model.config.n_positions, torch.device("cpu"))()
    assert seen == [(1, 96, 64)]
    with pytest.raises(IndexError):  # what the profile did before: one sequence of all the step's tokens
        with torch.inference_mode():
            model(input_ids=torch.zeros(1, 1024, dtype=torch.long), use_cache=False, logits_to_keep=1)


def test_a_step_reserves_the_forward_the_sampler_and_with_graphs_their_pool():
    from engine.backends.memory import SAMPLER_FLOAT_COPIES, step_reserve_bytes

    sampler = SAMPLER_FLOAT_COPIES * 256 * 128_256 * 4  # 256 sampled rows of a Llama-3 vocabulary: ~788 MB
    assert step_reserve_bytes(2 * GiB, 256, 128_256, graphs=False) == 2 * GiB + sampler
    assert step_reserve_bytes(2 * GiB, 256, 128_256, graphs=True) == 4 * GiB + sampler


def test_a_cgroup_limit_bounds_the_host_memory(tmp_path):
    from engine.backends.memory import cgroup_available_bytes, host_available_bytes

    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{8 * GiB}\n")
    (v2 / "memory.current").write_text(f"{3 * GiB}\n")
    assert cgroup_available_bytes(v2) == 5 * GiB
    assert host_available_bytes(v2) <= 5 * GiB
    (v2 / "memory.current").write_text(f"{9 * GiB}\n")  # over its limit already: nothing left, not less
    assert cgroup_available_bytes(v2) == 0
    (v2 / "memory.max").write_text("max\n")
    assert cgroup_available_bytes(v2) is None
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1 without a limit
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{GiB}\n")
    assert cgroup_available_bytes(v1) is None
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{4 * GiB}\n")
    assert cgroup_available_bytes(v1) == 3 * GiB
    assert cgroup_available_bytes(tmp_path / "none") is None
    import psutil

    assert host_available_bytes(tmp_path / "none") <= psutil.virtual_memory().total


def test_a_cache_past_32_bit_offsets_is_cut_to_what_the_kernels_address():
    """The sampling check's 2-layer test model (2 KV heads of 32) on an H200: 90% of 140 GiB gave one
    layer's cache 1.6e10 elements and FlexAttention's triton kernel an illegal memory access. A cache
    sized from memory is cut, with a line saying why; the graphs' reserved block counts too."""
    limit = 2**31 - 1
    plan = plan_kv_cache(140 * GiB, 0.9, kv_bytes_per_block(2, 2, 32, 256, torch.bfloat16), 256, reserved_blocks=1)
    assert (plan.num_blocks + 1) * 256 * 2 * 32 > limit
    cut, line = cap_layer_elements(plan, limit, 2, 32, reserved_blocks=1)
    assert (cut.num_blocks + 1) * 256 * 2 * 32 <= limit < (cut.num_blocks + 2) * 256 * 2 * 32
    assert cut.max_requests <= cut.num_blocks and "32-bit offsets" in line and f"to {cut.num_blocks} blocks" in line
    # within the limit, or no limit: unchanged
    assert cap_layer_elements(cut, limit, 2, 32, reserved_blocks=1) == (cut, None)
    assert cap_layer_elements(plan, None, 2, 32) == (plan, None)


def test_num_blocks_asked_past_the_kernels_reach_is_an_error_naming_the_most():
    plan = plan_kv_cache(140 * GiB, 0.9, kv_bytes_per_block(2, 2, 32, 256, torch.bfloat16), 256, num_blocks=200_000)
    with pytest.raises(ValueError, match=r"num_blocks=200000 is more than .* set num_blocks to at most 131071"):
        cap_layer_elements(plan, 2**31 - 1, 2, 32, explicit=True)


def test_the_flex_backend_declares_its_32_bit_reach():
    from engine.backends.base import AttentionBackend
    from engine.backends.cuda.flex import FlexAttnBackend

    assert FlexAttnBackend.max_layer_elements == 2**31 - 1
    assert AttentionBackend.max_layer_elements is None
