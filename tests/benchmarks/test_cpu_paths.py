"""benchmarks/cpu_paths.py: its step flags are parsed, and bad values answered with one usage line (the
block-size check is throughput.py's, shared); the mixed-step timing runs on a small model."""

from __future__ import annotations

import pytest


@pytest.fixture
def cpu_paths(bench_script):
    return bench_script("cpu_paths")


def test_step_flags_are_parsed(cpu_paths) -> None:
    args = cpu_paths.parse_args(["steps", "--paths", "native", "--batches", "1,8,16", "--lone-prompt", "580"])
    assert args.paths == (True,) and args.batches == (1, 8, 16) and args.lone_prompt == 580
    assert cpu_paths.parse_args(["steps"]).paths == (False, True)  # both, the Python path first
    args = cpu_paths.parse_args(["steps", "--context", "300", "--block-size", "16"])
    assert (args.context, args.block_size) == (300, 16)
    assert cpu_paths.parse_args(["steps"]).block_size == 64  # the engine's CPU default


@pytest.mark.parametrize("flags,message", [
    (["--paths", "fast"], "--paths takes python, native or python,native"),
    (["--paths", ""], "--paths takes"),
    (["--batches", "1,x"], "--batches takes positive integers"),
    (["--batches", "0"], "--batches takes positive integers"),
    (["--block-size", "24"], "--block-size must be a power of two"),
    (["--context", "0"], "--context must be at least 1"),
])  # fmt: skip
def test_bad_step_flags_are_one_usage_error(cpu_paths, capsys, flags, message) -> None:
    with pytest.raises(SystemExit) as exit_:
        cpu_paths.parse_args(["steps", *flags])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_decode_steps_over_a_longer_context_than_one_step_takes(cpu_paths, capsys) -> None:
    from engine.testing import build_test_model

    cpu_paths.decode_steps(build_test_model("llama"), runs=1, batches=(4,), steps=2, prompt_len=300, paths=(True,))
    assert "batch 4: native" in capsys.readouterr().out


def test_mixed_flags_and_a_small_run(cpu_paths, capsys) -> None:
    from engine.testing import build_test_model

    args = cpu_paths.parse_args(["mixed", "--decodes", "3", "--chunks", "0,4,8"])
    assert (args.decodes, args.chunks) == (3, (0, 4, 8))
    with pytest.raises(SystemExit):
        cpu_paths.parse_args(["mixed", "--chunks", "4,x"])
    medians = cpu_paths.mixed_steps(build_test_model("llama"), decodes=2, chunks=(0, 4), runs=2, context=8)
    assert set(medians) == {0, 4} and min(medians.values()) > 0
    out = capsys.readouterr().out
    assert "2 decodes +    4 prompt tokens" in out and "ms a prompt token above the decodes alone" in out


@pytest.mark.parametrize("block_size", [0, 24, 131072])
def test_the_offline_benchmark_names_a_block_size_that_cannot_cut_its_cache(bench_script, block_size) -> None:
    throughput = bench_script("throughput")
    assert throughput.block_size_error(block_size) == (
        f"--block-size must be a power of two up to {throughput.CACHE_TOKENS}, got {block_size}")
    assert throughput.block_size_error(throughput.BLOCK_SIZE) is None and throughput.block_size_error(16) is None


def test_a_long_prompt_is_timed_to_its_first_token(cpu_paths, capsys) -> None:
    from engine.testing import build_test_model

    assert cpu_paths.parse_args(["prompt", "--tokens", "300"]).tokens == 300
    with pytest.raises(SystemExit):
        cpu_paths.parse_args(["prompt", "--tokens", "0"])
    seconds = cpu_paths.long_prompt(build_test_model("llama"), tokens=40, runs=2)
    assert len(seconds) == 2 and min(seconds) > 0
    out = capsys.readouterr().out
    assert "run 2: a 40-token prompt in" in out and "median" in out
