"""`cbserve generate`: a JSONL dataset through the engine, in input order, resumable."""

from __future__ import annotations

import json
import subprocess
import sys


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.cli", "generate", *args], capture_output=True, text=True,
                          timeout=300)


def test_generate_writes_results_in_order_and_resumes(model_dir, tmp_path) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    items = [{"id": "a", "prompt": "The capital of"}, {"id": "b", "messages": [{"role": "user", "content": "hi"}]},
             {"id": "c", "prompt": "Once upon a time"}]
    src.write_text("\n".join(json.dumps(i) for i in items[:2]) + "\n")
    r = run("--model", str(model_dir), "--input", str(src), "--output", str(out), "--max-new-tokens", "6")
    assert r.returncode == 0, r.stderr
    first = [json.loads(line) for line in out.read_text().splitlines()]
    assert [x["id"] for x in first] == ["a", "b"]
    assert all(x["usage"]["completion_tokens"] <= 6 and x["usage"]["prompt_tokens"] > 0 for x in first)
    # a third line appears: only it runs; the first two are not redone
    src.write_text("\n".join(json.dumps(i) for i in items) + "\n")
    r = run("--model", str(model_dir), "--input", str(src), "--output", str(out), "--max-new-tokens", "6")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [x["id"] for x in lines] == ["a", "b", "c"] and lines[:2] == first
    r = run("--model", str(model_dir), "--input", str(src), "--output", str(out))
    assert r.returncode == 0 and "nothing to do" in r.stdout


def test_generate_bad_input_line_is_one_clear_error(model_dir, tmp_path) -> None:
    src = tmp_path / "bad.jsonl"
    src.write_text('{"id": "a", "prompt": "ok"}\n{"id": "b"}\n')
    r = run("--model", str(model_dir), "--input", str(src), "--output", str(tmp_path / "o.jsonl"))
    assert r.returncode == 2
    assert r.stderr.strip() == f"cbserve: error: {src}:2: each line needs 'prompt' or 'messages'"


def test_generate_keeps_one_engine_across_chunks(model_dir, tmp_path) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": str(i), "prompt": f"Number {i} is"}) + "\n" for i in range(3)))
    r = run("--model", str(model_dir), "--input", str(src), "--output", str(out), "--max-new-tokens", "3",
            "--chunk", "1")
    assert r.returncode == 0, r.stderr
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["0", "1", "2"]
    assert r.stderr.count("cbserve engine:") == 1  # the KV cache is sized (and the engine built) once, not per chunk


def test_generate_stop_ends_each_sequence_at_its_stop_string(model_dir, tmp_path) -> None:
    src, free, cut = tmp_path / "in.jsonl", tmp_path / "free.jsonl", tmp_path / "cut.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt": "Once upon a time"}) + "\n")
    r = run("--model", str(model_dir), "--input", str(src), "--output", str(free), "--max-new-tokens", "24")
    assert r.returncode == 0, r.stderr
    base = json.loads(free.read_text())
    assert base["finish_reason"] == "length" and base["usage"]["completion_tokens"] == 24
    assert "generated 24 tokens" in r.stderr
    text = base["text"]
    stop = text[5:9]  # four characters from the middle of the greedy text, spanning tokens
    r = run("--model", str(model_dir), "--input", str(src), "--output", str(cut), "--max-new-tokens", "24",
            "--stop", stop, "--stop", "never appears")
    assert r.returncode == 0, r.stderr
    record = json.loads(cut.read_text())
    assert record["text"] == text[: text.index(stop)]
    assert record["finish_reason"] == "stop"
    # the engine stopped generating at the token that completed the stop string, before max_new_tokens: its
    # own count of generated tokens (stderr's summary) is the usage reported
    assert 0 < record["usage"]["completion_tokens"] < 24
    assert f"generated {record['usage']['completion_tokens']} tokens" in r.stderr


def test_generate_over_two_ranks_writes_what_one_rank_writes(model_dir, tmp_path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": str(i), "prompt": f"Number {i} is"}) + "\n" for i in range(3)))
    texts = {}
    # the engine's flags as `cbserve serve` has them
    for name, extra in (("one", []), ("two", ["--tensor-parallel-size", "2", "--block-size", "16", "--num-blocks", "64"])):
        out = tmp_path / f"{name}.jsonl"  # float32: bfloat16 sums in another order may flip a near-tie
        r = run("--model", str(model_dir), "--input", str(src), "--output", str(out), "--max-new-tokens", "8",
                "--chunk", "1", "--dtype", "float32", *extra)
        assert r.returncode == 0, r.stderr
        texts[name] = [json.loads(line)["text"] for line in out.read_text().splitlines()]
        if name == "two":
            assert r.stderr.count("tensor parallel over 2 ranks") == 1  # the ranks start once, not per chunk
    assert texts["two"] == texts["one"]
