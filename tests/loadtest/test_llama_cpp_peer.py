"""benchmarks/llama_cpp_peer.py: where it installs, and the llama-server command line (nothing built)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "llama_cpp_peer.py"


@pytest.fixture
def peer(tmp_path, monkeypatch):
    monkeypatch.setenv("CBSERVE_LLAMA_CPP_DIR", str(tmp_path / "llama-cpp"))
    spec = importlib.util.spec_from_file_location("llama_cpp_peer", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "llama_cpp_peer", module)
    spec.loader.exec_module(module)
    return module


def flag(cmd: list[str], name: str) -> str:
    assert cmd.count(name) == 1, f"{name} once in {cmd}"
    return cmd[cmd.index(name) + 1]


def test_nothing_built_yet(peer, tmp_path) -> None:
    assert peer.install_dir() == tmp_path / "llama-cpp"
    assert peer.server_binary() is None
    assert peer.gguf_path() is None
    assert peer.gguf_path(tmp_path / "other-model") is None
    assert not peer.built()


def test_found_once_there(peer, tmp_path) -> None:
    binary = tmp_path / "llama-cpp" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    (tmp_path / "llama-cpp" / "smollm2-135m-instruct-f32.gguf").write_bytes(b"GGUF")
    assert peer.server_binary() == binary
    assert peer.gguf_path() == tmp_path / "llama-cpp" / "smollm2-135m-instruct-f32.gguf"
    assert peer.gguf_path(Path("/somewhere/smollm2-135m-instruct")) == peer.gguf_path()
    assert peer.gguf_path(Path("/somewhere/other")) is None


def test_serve_command(peer, tmp_path) -> None:
    gguf = tmp_path / "smollm2-135m-instruct-f32.gguf"
    cmd = peer.serve_command(8123, gguf, parallel=16)
    assert cmd[0] == str(tmp_path / "llama-cpp" / "bin" / "llama-server")
    assert flag(cmd, "--model") == str(gguf)
    assert flag(cmd, "--alias") == "smollm2-135m-instruct"
    assert flag(cmd, "--host") == "127.0.0.1"
    assert flag(cmd, "--port") == "8123"
    assert flag(cmd, "--parallel") == "16"
    assert flag(cmd, "--ctx-size") == str(16 * 2048)
    assert int(flag(cmd, "--threads")) >= 1
    for switch in ("--cont-batching", "--metrics", "--no-webui"):
        assert cmd.count(switch) == 1


def test_serve_command_options(peer, tmp_path) -> None:
    cmd = peer.serve_command(9000, tmp_path / "tiny-llama-f32.gguf", parallel=3, ctx_per_slot=512, host="0.0.0.0")
    assert flag(cmd, "--ctx-size") == "1536"
    assert flag(cmd, "--host") == "0.0.0.0"
    assert flag(cmd, "--alias") == "tiny-llama"
    with pytest.raises(ValueError):
        peer.serve_command(9000, tmp_path / "x-f32.gguf", parallel=0)


def test_changelog_commit(peer) -> None:
    version = peer.LLAMA_CPP_PYTHON_VERSION
    changelog = f"## [Unreleased]\n\n## [{version}]\n\n- feat: update llama.cpp to ggml-org/llama.cpp@0c1e57098\n\n"
    changelog += "## [0.0.1]\n\n- feat: update llama.cpp to ggml-org/llama.cpp@4df29be4f\n"
    assert peer._changelog_commit(changelog) == "0c1e57098"
    assert peer._changelog_commit("## [0.0.1]\n- llama.cpp@4df29be4f\n") == "unknown"


def test_help_runs(peer, capsys) -> None:
    peer.main([])
    assert "--setup" in capsys.readouterr().out


def test_llama_quantize_is_found_once_built_and_needs_the_sources_to_build(peer, tmp_path) -> None:
    assert peer.quantize_binary() is None
    with pytest.raises(FileNotFoundError, match="run --setup first"):
        peer.build_quantize()
    binary = tmp_path / "llama-cpp" / "bin" / "llama-quantize"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    assert peer.quantize_binary() is None  # not executable
    binary.chmod(0o755)
    assert peer.quantize_binary() == binary
    assert peer.build_quantize() == binary  # there: nothing built


def test_isa_flags_follow_the_cpu_and_leave_amx_out(peer) -> None:
    zen3 = peer.isa_flags({"avx", "avx2", "fma", "f16c", "bmi2"})
    assert "-DGGML_AVX2=ON" in zen3 and "-DGGML_AVX512=OFF" in zen3 and "-DGGML_AVX512_VNNI=OFF" in zen3
    xeon = peer.isa_flags({"avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8",
                           "amx_tile", "avx_vnni"})  # fmt: skip
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AVX_VNNI=ON"} <= set(xeon)
    assert not any("AMX" in f for f in xeon)  # _build turns AMX off explicitly
    assert "-DGGML_NATIVE=OFF" in peer.CMAKE_FLAGS
    here = peer.isa_flags()  # this machine's /proc/cpuinfo: x86-64 with AVX2 at least
    assert "-DGGML_AVX2=ON" in here


def test_a_binary_built_another_way_is_not_taken(peer, tmp_path) -> None:
    source = peer.source_dir()
    source.mkdir(parents=True)
    (source / "convert_hf_to_gguf.py").write_text("")
    binary = tmp_path / "llama-cpp" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    peer._stamp().write_text(peer.LLAMA_CPP_PYTHON_VERSION + "\n")  # an earlier GGML_NATIVE build
    assert not peer.built()
    peer._stamp().write_text(f"{peer.LLAMA_CPP_PYTHON_VERSION} {peer.BUILD_FLAVOUR}\n")
    assert peer.built()
