"""`cbserve generate`: a JSONL dataset through the engine, in input order, resumable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


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


# three prompts, one a chunk; float32: bfloat16 sums in another order (two ranks) may flip a near-tie
NUMBERS = "".join(json.dumps({"id": str(i), "prompt": f"Number {i} is"}) + "\n" for i in range(3))
FLAGS = ("--max-new-tokens", "24", "--chunk", "1", "--dtype", "float32")


@pytest.fixture(scope="module")
def one_rank(model_dir, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, list[dict]]:
    """NUMBERS through one rank, no stop string: the run the tests below read (its input, the process, its records)."""
    tmp = tmp_path_factory.mktemp("one-rank")
    src, out = tmp / "in.jsonl", tmp / "out.jsonl"
    src.write_text(NUMBERS)
    r = run("--model", str(model_dir), "--input", str(src), "--output", str(out), *FLAGS)
    assert r.returncode == 0, r.stderr
    return src, r, [json.loads(line) for line in out.read_text().splitlines()]


def test_generate_keeps_one_engine_across_chunks(one_rank) -> None:
    _, r, records = one_rank
    assert [x["id"] for x in records] == ["0", "1", "2"]
    assert r.stderr.count("cbserve engine:") == 1  # the KV cache is sized (and the engine built) once, not per chunk


def test_generate_stop_ends_each_sequence_at_its_stop_string(model_dir, one_rank, tmp_path) -> None:
    src, r, free = one_rank
    assert all(x["finish_reason"] == "length" and x["usage"]["completion_tokens"] == 24 for x in free)
    assert "generated 72 tokens" in r.stderr
    text = free[0]["text"]
    stop = text[5:9]  # four characters from the middle of the first greedy text, spanning tokens
    cut = tmp_path / "cut.jsonl"
    r = run("--model", str(model_dir), "--input", str(src), "--output", str(cut), *FLAGS,
            "--stop", stop, "--stop", "never appears")
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in cut.read_text().splitlines()]
    record = records[0]
    assert record["text"] == text[: text.index(stop)]
    assert record["finish_reason"] == "stop"
    assert 0 < record["usage"]["completion_tokens"] < 24
    for base, other in zip(free[1:], records[1:]):  # the others: cut where their text has the stop string
        if stop in base["text"]:
            assert other["text"] == base["text"][: base["text"].index(stop)] and other["finish_reason"] == "stop"
        else:
            assert other == {**base, "timings": other["timings"]}
    # the engine stopped generating at the token that completed the stop string, before max_new_tokens: its
    # own count of generated tokens (stderr's summary) is the usage reported
    assert f"generated {sum(x['usage']['completion_tokens'] for x in records)} tokens" in r.stderr


def test_generate_over_two_ranks_writes_what_one_rank_writes(model_dir, one_rank, tmp_path) -> None:
    src, _, one = one_rank
    out = tmp_path / "two.jsonl"
    # the engine's flags as `cbserve serve` has them
    r = run("--model", str(model_dir), "--input", str(src), "--output", str(out), *FLAGS,
            "--tensor-parallel-size", "2", "--block-size", "16", "--num-blocks", "64")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("tensor parallel over 2 ranks") == 1  # the ranks start once, not per chunk
    assert [json.loads(line)["text"] for line in out.read_text().splitlines()] == [x["text"] for x in one]
