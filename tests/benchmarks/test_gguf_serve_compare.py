"""benchmarks/gguf_serve_compare.py's pure parts: the shapes, the files' names, the Q4_0 copy gguf-py
makes, the weights a step reads, the bound, the KV and RSS arithmetic, the verdict and the table."""

from __future__ import annotations

import math
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest


@pytest.fixture
def gsc(bench_script):
    return bench_script("gguf_serve_compare")


def test_the_shapes_are_llama_3_2_1b_and_llama_3_8b_with_the_smollm2_vocabulary(gsc) -> None:
    one, eight = gsc.SHAPES["1b"], gsc.SHAPES["8b"]
    assert (one.hidden, one.layers, one.heads, one.kv_heads, one.intermediate, one.tied) == (
        2048, 16, 32, 8, 8192, True)  # fmt: skip
    assert (eight.hidden, eight.layers, eight.heads, eight.kv_heads, eight.intermediate, eight.tied) == (
        4096, 32, 32, 8, 14336, False)  # fmt: skip
    assert one.head_dim == 64 and eight.head_dim == 128 and one.vocab == eight.vocab == 49152
    # 1B: embedding (tied) + 16 x (q, k, v, o, gate, up, down, 2 norms) + the final norm
    layer = 2 * 2048 * 2048 + 2 * 512 * 2048 + 3 * 8192 * 2048 + 2 * 2048
    assert one.params() == 49152 * 2048 + 16 * layer + 2048
    assert "lm_head.weight" not in dict(one.tensors()) and dict(eight.tensors())["lm_head.weight"] == (49152, 4096)
    assert 7.3e9 < eight.params() < 7.5e9  # Llama-3-8B less the vocabulary it does not have here
    tiny = gsc.SHAPES["tiny"]
    assert tiny.params() * 2 < 64 << 20 and not tiny.tied  # some tens of MB in bfloat16; untied, as the 8B


def test_the_config_is_one_transformers_reads_as_the_shape(gsc) -> None:
    from transformers import LlamaConfig

    for shape in gsc.SHAPES.values():
        cfg = LlamaConfig(**shape.config())
        assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim) == (
            shape.hidden, shape.layers, shape.kv_heads, shape.head_dim)  # fmt: skip
        assert cfg.tie_word_embeddings is shape.tied and cfg.vocab_size == 49152


def test_the_8b_is_written_in_shards_of_at_most_2_gib_each_holding_every_tensor_once(gsc) -> None:
    shape = gsc.SHAPES["8b"]
    groups = gsc.shards(shape)
    assert all(sum(2 * math.prod(d) for _, d in g) <= gsc.SHARD_BYTES for g in groups)
    assert [t for g in groups for t in g] == shape.tensors()
    assert 7 <= len(groups) <= 9  # about 14.8 GB of bfloat16


def test_files_are_named_by_shape_and_quantization_in_the_cache(gsc) -> None:
    path = gsc.gguf_file(gsc.SHAPES["8b"], "q4_0")
    assert path == Path.home() / ".cache/cbserve/gguf-peer/8b/llama-3-8b-shaped-random-q4_0.gguf"
    assert gsc.gguf_file(gsc.SHAPES["1b"], "q8_0").name == "llama-3.2-1b-shaped-random-q8_0.gguf"
    assert gsc.tool_note(path).name == "llama-3-8b-shaped-random-q4_0.gguf.tool"
    assert gsc.gguf_file(gsc.SHAPES["1b"], "q4_k_m").name == "llama-3.2-1b-shaped-random-q4_k_m.gguf"
    with pytest.raises(ValueError, match="quant must be one of"):
        gsc.gguf_file(gsc.SHAPES["1b"], "q4_k")


def test_q4_k_m_is_offered_not_run_by_default_and_needs_llama_quantize(gsc, monkeypatch, tmp_path) -> None:
    assert "q4_k_m" in gsc.QUANTS and gsc.own_flags(["--shape", "1b"])[0].quants == ["q8_0", "q4_0"]
    assert gsc.own_flags(["--shape", "1b", "--quants", "q4_k_m"])[0].quants == ["q4_k_m"]
    monkeypatch.setattr(gsc, "cache_dir", lambda shape: tmp_path)
    monkeypatch.setattr(gsc, "checkpoint_dir", lambda shape: tmp_path / "checkpoint")
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "config.json").write_text("{}")
    monkeypatch.setattr(gsc.llama_cpp_peer, "quantize_binary", lambda: None)
    with pytest.raises(SystemExit, match="llama-quantize, which is not built: .*--build-quantize"):
        gsc.prepare(gsc.SHAPES["tiny"], ["q4_k_m"])  # before any conversion starts
    assert list(tmp_path.glob("*.gguf")) == []


def _write_f16_gguf(path: Path) -> dict[str, np.ndarray]:
    import gguf

    rng = np.random.default_rng(0)
    tensors = {"token_embd.weight": rng.normal(0, 0.08, (96, 64)).astype(np.float16),
               "blk.0.attn_q.weight": rng.normal(0, 0.08, (64, 64)).astype(np.float16),
               "blk.0.attn_norm.weight": np.ones(64, dtype=np.float32),
               "output.weight": rng.normal(0, 0.08, (96, 64)).astype(np.float16)}  # fmt: skip
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
    writer.add_block_count(1)
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def test_the_q4_0_copy_quantizes_every_2d_weight_keeps_the_rest_and_says_q4_0(gsc, tmp_path) -> None:
    import gguf

    source, target = tmp_path / "m-f16.gguf", tmp_path / "m-q4_0.gguf"
    original = _write_f16_gguf(source)
    gsc.requantize_q4_0(source, target, chunk_rows=40)  # chunks that do not divide the rows
    reader = gguf.GGUFReader(target)
    assert reader.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_Q4_0)
    assert reader.fields["llama.block_count"].contents() == 1
    for t in reader.tensors:
        if t.name == "blk.0.attn_norm.weight":
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
            np.testing.assert_array_equal(t.data, original[t.name])
            continue
        assert t.tensor_type == gguf.GGMLQuantizationType.Q4_0
        back = gguf.dequantize(t.data, t.tensor_type)
        want = original[t.name].astype(np.float32)
        assert back.shape == want.shape
        # Q4_0: 16 levels over [-max, max] per 32 values, so an error of at most a level (max / 8)
        scale = np.abs(want.reshape(-1, 32)).max(axis=1, keepdims=True) / 8
        assert (np.abs(back - want).reshape(-1, 32) <= scale * 1.01).all()
    # a step reads every tensor but the token embedding (the file has its own output tensor)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    counts = {t.name: int(t.n_elements) for t in reader.tensors}
    assert gsc.step_weights(target) == (sum(sizes.values()) - sizes["token_embd.weight"],
                                        sum(counts.values()) - counts["token_embd.weight"])  # fmt: skip
    assert gsc.q4_0_eligible("blk.0.attn_q.weight", (64, 64))
    assert not gsc.q4_0_eligible("blk.0.attn_q.weight", (64, 48)) and not gsc.q4_0_eligible("x.bias", (8, 64))


def test_the_bound_is_the_weights_over_the_bandwidth_and_the_kv_cache_is_f16_slots(gsc) -> None:
    assert gsc.weight_bound_s(2 * 10**9, 10.0) == pytest.approx(0.2)
    # the products: 8e9 parameters, 16 users, 2 ops each, at 1,600 GOP/s
    assert gsc.compute_bound_s(8 * 10**9, 16, 1600.0) == pytest.approx(0.16)
    # 8B at 16 users x 1024 tokens: 2 x 32 layers x 8 heads x 128 x 2 bytes = 128 KiB per token
    assert gsc.llama_cpp_kv_bytes(gsc.SHAPES["8b"], 16, 1024) == 2 << 30
    assert gsc.SHAPES["1b"].kv_bytes_per_token(4) == 2 * 16 * 8 * 64 * 4


def test_each_system_is_held_against_the_product_it_runs(gsc) -> None:
    from types import SimpleNamespace

    limits = SimpleNamespace(peak_gflops={"float32": 400.0, "bfloat16": 900.0}, int8_gops=1600.0)
    assert gsc.system_peak(limits, "cbserve") == (400.0, "float32")  # float inputs, dequantised blocks
    assert gsc.system_peak(limits, "cbserve-int8") == gsc.system_peak(limits, "llama.cpp") == (1600.0, "int8")
    assert gsc.system_peak(SimpleNamespace(peak_gflops={"float32": 400.0}, int8_gops=None), "llama.cpp") is None


def test_the_rss_budget_is_1_2x_the_file_plus_the_kv_cache(gsc) -> None:
    file, kv = 8 << 30, 2 << 30
    assert gsc.rss_ratio(12 << 30, file, kv) == pytest.approx(1.2)
    assert gsc.within_rss_budget(12 << 30, file, kv)
    assert not gsc.within_rss_budget((12 << 30) + (64 << 20), file, kv)


def test_the_verdict_needs_throughput_ttft_and_itl_p99_all(gsc) -> None:
    llama = {"output_tok_s": 100.0, "ttft_p50_ms": 50.0, "itl_p99_ms": 80.0}
    assert gsc.verdict({"output_tok_s": 100.0, "ttft_p50_ms": 50.0, "itl_p99_ms": 80.0}, llama) == "met"
    assert gsc.verdict({"output_tok_s": 99.0, "ttft_p50_ms": 40.0, "itl_p99_ms": 90.0}, llama) == (
        "not met (tok/s, ITL p99)")  # fmt: skip


def test_the_table_has_a_row_per_run_and_a_verdict_per_pair(gsc) -> None:
    row = {"quant": "q8_0", "users": 1, "file_bytes": 1 << 30, "weight_bytes": 1 << 30, "bound_s": 0.1,
           "output_tok_s": 8.0, "ttft_p50_ms": 300.0, "tpot_p50_ms": 120.0, "itl_p99_ms": 150.0,
           "peak_rss": 1 << 30, "serving_peak_rss": 1 << 29, "kv_bytes": 1 << 28, "completed": 3,
           "failed": 0}  # fmt: skip
    rows = [{**row, "system": "cbserve"}, {**row, "system": "llama.cpp", "output_tok_s": 10.0}]
    text = gsc.markdown(gsc.SHAPES["1b"], rows, 10.0, "test CPU", {"q8_0": "convert_hf_to_gguf.py"}, "a load",
                        ["a note"])  # fmt: skip
    assert text.count("| q8_0 | 1 |") == 2 and "- a note" in text
    assert "1.20x" in text  # TPOT 120 ms against a 100 ms bound
    assert "| 100.0; n/a | 1.20x |" in text  # a row without the product bound (an older results.json)
    assert "held with the next" not in text  # rows without the share (an older results.json)
    held = gsc.markdown(gsc.SHAPES["1b"], [{**r, "held_token_share": share} for r, share in zip(rows, (0.0077, 0.0055))],
                        10.0, "test CPU", {}, "a load")  # fmt: skip
    assert "ITL p99 150.0 vs 150.0 ms (tokens held with the next 0.77% vs 0.55%): not met (tok/s)" in held
    sixteen = {**row, "users": 16, "weights_bound_s": 0.1, "compute_bound_s": 0.3, "compute_peak": "int8",
               "bound_s": 0.3, "tpot_p50_ms": 600.0}  # fmt: skip
    products = gsc.markdown(gsc.SHAPES["1b"], [{**sixteen, "system": "cbserve-int8"}], 10.0, "test CPU", {},
                            "a load", peaks="int8 1600 GOP/s")  # fmt: skip
    assert "| 100.0; **300.0 (int8)** | 2.00x |" in products and "10.0 GB/s; int8 1600 GOP/s;" in products
    assert "0.80x tok/s" in text and "not met (tok/s)" in text and "1 user, cbserve:" in text
    failed = {"quant": "q4_0", "users": 16, "system": "cbserve", "error": "the server exited with status 1"}
    text = gsc.markdown(gsc.SHAPES["1b"], [*rows, failed], 10.0, "test CPU", {}, "a load")
    line = next(x for x in text.splitlines() if x.startswith("| q4_0 | 16 | cbserve |"))
    assert "failed: the server exited with status 1" in line and line.count("|") == text.splitlines()[7].count("|")
    assert "q4_0, 16 users" not in text  # no verdict without both servers' figures


def test_peak_rss_sums_the_process_tree(gsc) -> None:
    # a shell (the root) whose child holds 256 MiB, touched, until its stdin closes
    child = "import sys; b = bytearray(256 << 20); print('ready', flush=True); sys.stdin.read()"
    proc = subprocess.Popen(["sh", "-c", f"{shlex.quote(sys.executable)} -c {shlex.quote(child)}; true"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "ready"
        rss = gsc.PeakRss(proc.pid, interval=0.05).start()
        assert rss.current() >= 256 << 20
        assert rss.serving() >= 256 << 20
        assert rss.stop() >= 256 << 20 and rss.serving_peak >= 256 << 20
        assert 0 < gsc.high_water_mark(proc.pid) < 64 << 20  # the shell's own: the child's is not in it
    finally:
        proc.stdin.close()
        proc.wait(30)


def test_cbserve_serves_the_files_blocks_unless_told_auto(gsc, tmp_path) -> None:
    gguf = tmp_path / "m-q4_0.gguf"
    command = gsc.cbserve_target(gguf, users=16, ctx_per_slot=1024).command
    assert command[command.index("--quantization") + 1] == "gguf"
    assert command[command.index("--model") + 1] == str(gguf)
    assert int(command[command.index("--num-blocks") + 1]) == 16 * math.ceil(1024 / gsc.BLOCK_SIZE)
    assert command[command.index("--quantized-activations") + 1] == "float"
    auto = gsc.cbserve_target(gguf, users=1, ctx_per_slot=1024, quantization="auto").command
    assert auto[auto.index("--quantization") + 1] == "auto"
    int8 = gsc.cbserve_target(gguf, users=1, ctx_per_slot=1024, activations="int8")
    assert int8.name == "cbserve-int8" and int8.command[int8.command.index("--quantized-activations") + 1] == "int8"
    opts, _ = gsc.own_flags(["--shape", "1b"])
    assert opts.cbserve_quantization == "gguf" and opts.systems == ["cbserve", "llama.cpp"]
    assert gsc.own_flags(["--shape", "1b", "--systems", "cbserve-int8,llama.cpp"])[0].systems == ["cbserve-int8", "llama.cpp"]


def test_the_servers_alternate_round_by_round_so_none_always_runs_first(gsc) -> None:
    systems = ["cbserve", "cbserve-int8", "llama.cpp"]
    assert [gsc.rotation(systems, r) for r in range(4)] == [
        ["cbserve", "cbserve-int8", "llama.cpp"], ["cbserve-int8", "llama.cpp", "cbserve"],
        ["llama.cpp", "cbserve", "cbserve-int8"], ["cbserve", "cbserve-int8", "llama.cpp"]]  # fmt: skip
    assert gsc.rotation(["llama.cpp"], 5) == ["llama.cpp"]


def test_a_servers_rounds_pool_into_one_row(gsc) -> None:
    from loadtest.run import RunResult
    from loadtest.report import summarize

    def part(gaps: list[float], tokens_s: float, peak: int) -> dict:
        rows = [{"ok": True, "prompt_tokens": 8, "output_tokens": len(gaps) + 1, "ttft_ms": 100.0, "e2e_ms": 100.0 + sum(gaps),
                 "tpot_ms": sum(gaps) / len(gaps), "itl_ms": gaps}]  # fmt: skip
        summary = {**summarize(rows, 10.0, {}), "output_throughput": tokens_s, "load_generator_cpu_s": 0.5}
        return {"run": RunResult(summary, rows, [], 0.0), "peak_rss": peak, "serving_peak_rss": peak - 1,
                "ready_rss": peak - 2, "kv_bytes": 64}  # fmt: skip

    row = gsc.pool_rounds([part([10.0] * 99, 30.0, 1000), part([20.0] * 99, 40.0, 900)], {})
    assert row["output_tok_s"] == 35.0 and row["rounds_output_tok_s"] == [30.0, 40.0]
    assert row["completed"] == 2 and row["failed"] == 0
    assert row["itl_p99_ms"] == 20.0  # the percentiles are over both rounds' gaps
    assert (row["peak_rss"], row["serving_peak_rss"], row["ready_rss"], row["kv_bytes"]) == (1000, 999, 998, 64)
    assert row["held_token_share"] == 0.0
