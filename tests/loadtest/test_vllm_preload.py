"""benchmarks/vllm_peer.py's preload variants: the libraries found, the LD_PRELOAD built, the faster
kept; and serve_compare's calibration, run on two real stand-in servers (no vLLM here)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest

from loadtest.cli import parse_compare_args
from loadtest.target import Target, free_port

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
STANDIN = Path(__file__).with_name("openai_standin.py")


def load(name: str, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def peer(tmp_path, monkeypatch):
    monkeypatch.setenv("CBSERVE_VLLM_VENV", str(tmp_path / "venv"))
    return load("vllm_peer", monkeypatch)


@pytest.fixture
def libs(tmp_path) -> tuple[Path, tuple[str, ...]]:
    """A stand-in venv with intel-openmp's libiomp5.so, and a stand-in TCMalloc among the candidates."""
    (tmp_path / "venv" / "lib").mkdir(parents=True)
    (tmp_path / "venv" / "lib" / "libiomp5.so").write_bytes(b"")
    (tmp_path / "sys").mkdir()
    (tmp_path / "sys" / "libtcmalloc_minimal.so.4").write_bytes(b"")
    return tmp_path / "venv", (str(tmp_path / "nowhere" / "libtcmalloc_minimal.so.4"),
                               str(tmp_path / "sys" / "libtcmalloc_minimal.so.4"))  # fmt: skip


def test_both_variants_preload_what_is_found_ahead_of_the_callers(peer, libs, tmp_path) -> None:
    venv, candidates = libs
    tc, iomp = str(tmp_path / "sys" / "libtcmalloc_minimal.so.4"), str(venv / "lib" / "libiomp5.so")
    assert peer.iomp5() == iomp  # found through $CBSERVE_VLLM_VENV
    assert peer.preload_variants(venv, candidates) == ["tcmalloc", "tcmalloc+iomp5"]
    base = {"PATH": "/bin", "LD_PRELOAD": "/opt/mine.so"}
    plain = peer.peer_env("tcmalloc", base, venv, candidates)
    assert plain["LD_PRELOAD"] == f"{tc}:/opt/mine.so" and plain["PATH"] == "/bin"
    assert plain["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    both = peer.peer_env("tcmalloc+iomp5", {"PATH": "/bin"}, venv, candidates)
    assert both["LD_PRELOAD"] == f"{tc}:{iomp}"
    assert peer.describe_preload("tcmalloc+iomp5", venv, candidates) == f"tcmalloc+iomp5: LD_PRELOAD={tc}:{iomp}"
    assert base == {"PATH": "/bin", "LD_PRELOAD": "/opt/mine.so"}  # the caller's dict untouched
    with pytest.raises(ValueError, match="preload variant"):
        peer.peer_env("jemalloc", base, venv, candidates)


def test_without_libiomp5_or_tcmalloc_the_peer_still_runs_and_says_so(peer, libs, tmp_path) -> None:
    venv, candidates = libs
    (venv / "lib" / "libiomp5.so").unlink()
    assert peer.iomp5(venv) is None and peer.preload_variants(venv, candidates) == ["tcmalloc"]
    missing = (str(tmp_path / "nowhere.so"),)
    assert "LD_PRELOAD" not in peer.peer_env("tcmalloc", {}, venv, missing)
    assert "nothing preloaded" in peer.describe_preload("tcmalloc", venv, missing)


def test_the_faster_variant_is_kept_and_a_tie_keeps_tcmalloc_alone(peer) -> None:
    assert peer.faster_preload({"tcmalloc": 180.0, "tcmalloc+iomp5": 190.5}) == "tcmalloc+iomp5"
    assert peer.faster_preload({"tcmalloc": 181.0, "tcmalloc+iomp5": 180.9}) == "tcmalloc"
    assert peer.faster_preload({"tcmalloc+iomp5": 150.0, "tcmalloc": 150.0}) == "tcmalloc"
    with pytest.raises(ValueError):
        peer.faster_preload({})


def test_calibration_alternates_the_variants_and_takes_the_median(peer) -> None:
    order: list[str] = []
    figures = {"a": iter([10.0, 30.0, 20.0]), "b": iter([5.0, 7.0, 6.0])}

    def run(name: str):
        def go() -> float:
            order.append(name)
            return next(figures[name])

        return go

    settled = []
    result = peer.calibrate({"a": run("a"), "b": run("b")}, rounds=3, before_each=lambda: settled.append(1))
    assert order == ["a", "b", "a", "b", "a", "b"] and len(settled) == 6
    assert result == {"a": 20.0, "b": 6.0}


def test_serve_compare_keeps_the_faster_server_running_and_stops_the_other(monkeypatch, tmp_path) -> None:
    """Two real stand-in servers play the variants: 'tcmalloc+iomp5' streams ten times faster."""
    serve_compare = load("serve_compare", monkeypatch)
    load("vllm_peer", monkeypatch)
    made: dict[str, Target] = {}

    def make(variant: str) -> Target:
        port = free_port()
        ms = "20" if variant == "tcmalloc" else "2"
        command = [sys.executable, str(STANDIN), "--port", str(port), "--token-ms", ms]
        made[variant] = Target("vllm", f"http://127.0.0.1:{port}", command=command)
        return made[variant]

    args = parse_compare_args(["--users", "2", "--output-len", "6", "--input-len", "5:20", "--endpoint",
                               "completions", "--out", str(tmp_path)], targets=[])  # fmt: skip
    chosen, figures, kept = serve_compare.choose_preload(make, ["tcmalloc", "tcmalloc+iomp5"], args, tmp_path, 2.0,
                                                         first_seed=100)  # fmt: skip
    try:
        assert chosen == "tcmalloc+iomp5" and figures["tcmalloc+iomp5"] > 2 * figures["tcmalloc"] > 0
        assert kept is made["tcmalloc+iomp5"] and kept.proc.poll() is None
        assert made["tcmalloc"].proc.poll() is not None  # the slower one was stopped
        assert (tmp_path / "tcmalloc" / "run2" / "summary.json").is_file()
        assert (tmp_path / "tcmalloc+iomp5" / "run2" / "summary.json").is_file()
        for variant in ("tcmalloc", "tcmalloc+iomp5"):  # each run its own prompts, the same for both variants
            seeds = [json.loads((tmp_path / variant / f"run{k}" / "summary.json").read_text())["settings"]["seed"]
                     for k in (1, 2)]  # fmt: skip
            assert seeds == [100, 101]
        note = serve_compare.preload_note(chosen, figures, 2.0)
        assert "tcmalloc+iomp5" in note and f"{figures['tcmalloc']:.1f}" in note and "2 alternating runs" in note
    finally:
        kept.stop()


VLLM_STANDIN = Path(__file__).with_name("vllm_standin")


def test_throughput_keeps_the_faster_offline_peer(monkeypatch, tmp_path, capsys) -> None:
    """throughput.py's vLLM peer, both variants started as real processes of vllm_peer.py --serve
    (the stand-in vLLM of tests/loadtest/vllm_standin answers faster with libiomp5 preloaded)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / "lib" / "libiomp5.so").write_bytes(b"")  # the loader skips it, with a warning; its path is what counts
    monkeypatch.setenv("CBSERVE_VLLM_VENV", str(venv))
    path = (str(VLLM_STANDIN), os.environ.get("PYTHONPATH"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(x for x in path if x))
    throughput = load("throughput", monkeypatch)
    monkeypatch.setattr(throughput, "wait_quiet", lambda: 0.0)  # this test's machine need not be idle
    monkeypatch.setattr(throughput, "NEW", 4)

    class Model:
        def save_pretrained(self, folder: str) -> None:
            Path(folder).mkdir(parents=True, exist_ok=True)

    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    folder = tmp_path / "model"
    peer, run, name = throughput.start_vllm(Model(), prompts, "float32", "W1", str(folder))
    try:
        assert name.endswith(" tcmalloc+iomp5") and peer.preload == "tcmalloc+iomp5"
        elapsed, ids = run(None, prompts)
        assert ids == [[3] * 4, [5] * 4, [9] * 4] and elapsed > 0
        out = capsys.readouterr().out
        assert "vLLM-CPU preload: tcmalloc+iomp5, the faster here" in out
        assert re.search(r"runs: tcmalloc \d+\.\d, tcmalloc\+iomp5 \d+\.\d\)", out)
        assert (folder / "vllm-tcmalloc.log").is_file() and (folder / "vllm-tcmalloc+iomp5.log").is_file()
    finally:
        peer.close()
