"""The detokenizer, stop strings and settings, without a server."""

from __future__ import annotations

import random

import pytest

from engine.detokenizer import MAX_HELD, IncrementalDetokenizer, StopStrings, TextStream
from engine.server.settings import SettingsError, load_settings
from engine.testing import build_test_tokenizer

TEXT = "Continuous batching keeps the accelerator busy. The capital of France is Paris. Ünïcödé ✓ works."


@pytest.fixture(scope="module")
def tok():
    return build_test_tokenizer()


def test_incremental_text_equals_a_full_decode(tok) -> None:
    ids = tok(TEXT, add_special_tokens=False).input_ids
    d = IncrementalDetokenizer(tok)
    assert "".join(d.add([t]) for t in ids) == tok.decode(ids) == TEXT


def test_a_text_that_ends_inside_a_character_is_released_whole_at_the_end(tok) -> None:
    """Held back while more tokens could complete it, the last incomplete character is released when
    the sequence ends (a cancelled stream cut one off: the text then fell short of a decode)."""
    ids = tok("Ünïcödé ✓", add_special_tokens=False).input_ids
    for n in range(1, len(ids) + 1):
        s = TextStream(tok)
        out = "".join(s.add([t]) for t in ids[:n]) + s.finish()
        assert out == s.text == tok.decode(ids[:n]), n
    assert any(tok.decode(ids[:n]).endswith("\ufffd") for n in range(1, len(ids)))  # the case is covered
    s = TextStream(tok, ["\ufffd"])  # a stop string still wins over the flush
    assert "".join(s.add([t]) for t in ids[:2]) + s.finish() == tok.decode(ids[:2]).split("\ufffd")[0]


def test_stop_string_spanning_tokens_is_cut_exactly(tok) -> None:
    ids = tok(TEXT, add_special_tokens=False).input_ids
    for stop in ["capital of", "Paris.", "e acc", "✓"]:
        s = TextStream(tok, [stop, "never there"])
        out = "".join(s.add([t]) for t in ids) + s.finish()
        assert out == TEXT[: TEXT.index(stop)], stop
        assert s.stopped
        assert s.num_tokens < len(ids)


def test_held_back_prefix_is_released_when_it_does_not_become_a_stop() -> None:
    s = StopStrings(["Paris!"])
    assert s.feed("The Par") == "The "  # "Par" could still be "Paris!"
    assert s.feed("ty") == "Party"
    assert s.feed(" Pari") == " "
    assert s.flush() == "Pari"


def searched(stops: list[str], chunks: list[str]) -> tuple[list[str], str | None, str]:
    """Stop strings by brute force, fed `chunks`: each time the whole held text is searched for every
    stop string (cut before the one that starts first, the first listed of those starting there), and
    the longest tail that begins some stop string is held back."""
    stops = [s for s in stops if s]
    pending, outs, stopped = "", [], None
    for chunk in chunks:
        if stopped is not None:
            outs.append("")
            continue
        pending += chunk
        hits = sorted((pending.find(s), i) for i, s in enumerate(stops) if s in pending)
        if hits:
            stopped, (out, pending) = stops[hits[0][1]], (pending[: hits[0][0]], "")
        else:
            keep = max((n for n in range(1, len(pending) + 1) if any(s.startswith(pending[-n:]) for s in stops)),
                       default=0)  # fmt: skip
            out, pending = pending[: len(pending) - keep], pending[len(pending) - keep :]
        outs.append(out)
    return outs, stopped, ("" if stopped is not None else pending)


def test_stop_strings_release_and_cut_as_a_search_of_the_whole_held_text_would() -> None:
    """The automaton (engine/detokenizer.py: StopMatcher) against brute force, over stop strings that
    overlap and contain one another (a two- or three-letter alphabet) and text cut into random pieces."""
    rnd = random.Random(0)
    for trial in range(3000):
        alphabet = "ab" if trial % 2 else "abc"
        stops = ["".join(rnd.choices(alphabet, k=rnd.randint(0, 6))) for _ in range(rnd.randint(0, 5))]
        chunks = ["".join(rnd.choices(alphabet, k=rnd.randint(0, 4))) for _ in range(rnd.randint(1, 12))]
        s = StopStrings(stops)
        outs = [s.feed(c) for c in chunks]
        assert (outs, s.stopped, s.flush()) == searched(stops, chunks), (stops, chunks)


def test_the_samples_of_a_request_share_one_automaton(tok) -> None:
    s = TextStream(tok, ["Paris", "capital"])
    fork = s.fresh()
    assert fork.stops.matcher is s.stops.matcher
    ids = tok(TEXT, add_special_tokens=False).input_ids
    assert "".join(fork.add([t]) for t in ids) == TEXT[: TEXT.index("capital")]
    assert s.text == "" and not s.stopped  # the forks' states are their own


def test_a_run_of_bytes_that_never_makes_a_character_is_released_after_max_held_tokens(tok) -> None:
    """A model made to repeat a lone byte's token (logit_bias): its text ends inside a character at every
    token. It goes out as decoded after MAX_HELD tokens, so no token decodes more than that many held
    before it, and the whole text still equals a decode of every token."""
    byte = next(i for i in range(len(tok)) if tok.decode([i]) == "\ufffd")
    d = IncrementalDetokenizer(tok)
    out, longest = "", 0
    for _ in range(40 * MAX_HELD):
        out += d.add([byte])
        longest = max(longest, len(d.tokens) - d.prefix_offset)
    assert longest <= 2 * MAX_HELD + 2
    assert out + d.flush() == tok.decode([byte] * 40 * MAX_HELD)
    ids = tok("Ünïcödé ✓", add_special_tokens=False).input_ids  # real characters are still held whole
    s = TextStream(tok)
    assert "".join(s.add([t]) for t in ids * 20) + s.finish() == "Ünïcödé ✓" * 20


def test_settings_precedence_and_errors(tmp_path) -> None:
    cfg = tmp_path / "engine.yaml"
    cfg.write_text("block_size: 32\nmax_queue_size: 4\ndtype: float32\nuse_cuda_graph: [false, true]\n")
    s = load_settings({"config": str(cfg)}, environ={"CBSERVE_MAX_QUEUE_SIZE": "9"})
    assert (s.engine.block_size, s.engine.max_queue_size, s.dtype) == (32, 9, "float32")
    assert s.engine.use_cuda_graph == (False, True)
    assert load_settings({"config": str(cfg), "dtype": "bfloat16"}, environ={}).dtype == "bfloat16"
    cases = [
        ("block_size: 24\n", {}, "block_size"),
        ("max_memory_percent: 2\n", {}, "max_memory_percent"),
        ("blocksize: 16\n", {}, "blocksize"),
        ("- a list\n", {}, "mapping"),
        ("dtype: float8\n", {}, "dtype"),
        ("", {"CBSERVE_NOPE": "1"}, "CBSERVE_NOPE"),
        ("", {"CBSERVE_NUM_BLOCKS": "-3"}, "num_blocks"),
    ]
    for text, env, needle in cases:
        cfg.write_text(text)
        with pytest.raises(SettingsError, match=needle):
            load_settings({"config": str(cfg)}, environ=env)
    with pytest.raises(SettingsError, match="no such file"):
        load_settings({"config": str(tmp_path / "missing.yaml")}, environ={})


def test_cli_bad_setting_is_one_line_and_exit_2(tmp_path) -> None:
    import subprocess
    import sys

    cfg = tmp_path / "engine.yaml"
    cfg.write_text("block_size: 24\n")
    r = subprocess.run([sys.executable, "-m", "engine.cli", "serve", "--config", str(cfg)], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["cbserve: error: engine setting: block_size must be a power of two, got 24"]


def test_startup_objects_are_frozen_out_of_garbage_collection() -> None:
    import gc

    from starlette.testclient import TestClient

    from engine import ContinuousBatchingConfig, ContinuousBatchingManager
    from engine.server.app import build_state, create_app
    from engine.testing import build_test_model

    manager = ContinuousBatchingManager(build_test_model(), continuous_batching_config=ContinuousBatchingConfig(num_blocks=64))
    app = create_app(build_state(manager, build_test_tokenizer(), "test", 256))
    gc.unfreeze()
    try:
        with TestClient(app) as client:  # runs the lifespan: warm-up, start, freeze
            assert client.get("/ready").status_code == 200
            assert gc.get_freeze_count() > 10_000  # torch, transformers and the model, at least
    finally:
        gc.unfreeze()


def test_an_unknown_variable_names_the_nearest_known_one_and_a_service_link_says_so() -> None:
    with pytest.raises(SettingsError, match=r"^CBSERVE_PROT: unknown setting 'prot'; did you mean CBSERVE_PORT\?$"):
        load_settings({}, environ={"CBSERVE_PROT": "8080"})
    with pytest.raises(SettingsError, match=r"unknown setting 'zzz'$"):  # nothing near: no guess
        load_settings({}, environ={"CBSERVE_ZZZ": "1"})
    with pytest.raises(SettingsError, match="Kubernetes service link.*enableServiceLinks: false"):
        load_settings({}, environ={"CBSERVE_PORT": "tcp://10.0.0.7:8000"})
    s = load_settings({"port": 9001}, environ={"CBSERVE_HOST": "127.0.0.1", "CBSERVE_PORT": "8080",
                                               "CBSERVE_LOG_LEVEL": "debug", "CBSERVE_MODEL": "m"})  # fmt: skip
    assert (s.host, s.port, s.log_level, s.model) == ("127.0.0.1", 9001, "debug", "m")  # the flag wins


def test_process_variables_are_not_settings(tmp_path) -> None:
    """CBSERVE_CPU_ISA, CBSERVE_CPU_KERNELS and the like set up the process (the CPU probe, the
    kernels): `cbserve serve` and `cbserve generate` start with them set instead of refusing them."""
    env = {"CBSERVE_CPU_ISA": "avx2", "CBSERVE_CPU_KERNELS": "0", "CBSERVE_CPU_MALLOC_TUNING": "0",
           "CBSERVE_CPU_NATIVE_LAYERS": "0", "CBSERVE_CACHE_DIR": str(tmp_path), "CBSERVE_STEP_LOG": str(tmp_path / "s"),
           "CBSERVE_MAX_QUEUE_SIZE": "5", "CBSERVE_ENGINE_NICE": "0"}  # fmt: skip
    assert load_settings({}, environ=env).engine.max_queue_size == 5


@pytest.mark.parametrize("value", ["-1", "20", "low"])
def test_a_bad_engine_nice_stops_start_up_with_one_line(value) -> None:
    with pytest.raises(SettingsError, match=f"CBSERVE_ENGINE_NICE='{value}': an integer from 0"):
        load_settings({}, environ={"CBSERVE_ENGINE_NICE": value})


def test_a_cpu_isa_the_cpu_cannot_run_stops_start_up_with_one_line() -> None:
    from engine.backends.cpu_isa import read_cpu

    beyond = "avx512" if read_cpu().best_isa() == "avx2" else "avx1024"
    with pytest.raises(SettingsError, match=f"CBSERVE_CPU_ISA={beyond}"):
        load_settings({}, environ={"CBSERVE_CPU_ISA": beyond})
    assert load_settings({}, environ={"CBSERVE_CPU_ISA": "avx2"}) is not None


def test_docs_table_lists_every_request_field_the_server_knows() -> None:
    """docs/server.md's field table and engine/server/protocol.py's HONOURED, REFUSED and IGNORED
    name the same fields."""
    import re
    from pathlib import Path

    from engine.server.protocol import HONOURED, IGNORED, REFUSED

    docs = Path(__file__).resolve().parents[2] / "docs" / "server.md"
    rows = [line for line in docs.read_text().splitlines() if line.startswith("| `")]
    documented = {name for row in rows for name in re.findall(r"`([a-z_]+)`", row.split("|")[1])}
    known = {*HONOURED["both"], *HONOURED["completion"], *HONOURED["chat"], *REFUSED, *IGNORED}
    assert documented == known, (sorted(documented - known), sorted(known - documented))


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_a_cuda_device_without_cuda_exits_2_at_once_with_one_line(command: str, tmp_path) -> None:
    """Before anything loads or binds: the settings are read, the device is resolved, and that is all.
    CUDA_VISIBLE_DEVICES="" hides any GPU, so the rule is tested on every machine."""
    import os
    import subprocess
    import sys

    extra = ["--port", "1"] if command == "serve" else ["--input", str(tmp_path / "in.jsonl"),
                                                         "--output", str(tmp_path / "out.jsonl")]  # fmt: skip
    r = subprocess.run([sys.executable, "-m", "engine.cli", command, "--device", "cuda", *extra], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cbserve: error: device cuda: CUDA is not available"), r.stderr
