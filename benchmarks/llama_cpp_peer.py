"""llama.cpp's `llama-server` as a benchmark peer, built here from source (no prebuilt binary).

    python benchmarks/llama_cpp_peer.py --setup                 # once: about 20 minutes on 2 cores
    python benchmarks/llama_cpp_peer.py --setup --model FOLDER  # also converts another checkpoint
    python benchmarks/serve_compare.py                          # then finds it and serves it alongside
    python benchmarks/llama_cpp_peer.py --build-quantize        # llama-quantize alone, if --setup predates it

`--setup` downloads the `llama-cpp-python==0.3.36` sdist with pip (PyPI is the one registry this
project reaches; the sdist vendors llama.cpp's sources), extracts its `vendor/llama.cpp` into
`$CBSERVE_LLAMA_CPP_DIR` (default `~/.cache/cbserve/llama-cpp`), builds the one target
`llama-server` and `llama-quantize` in one cmake tree (Release, static, ggml's ISA options set from
this CPU's flags with the AMX kernels off, see ISA_OPTIONS; no curl, OpenSSL or web UI) and installs
them in `<dir>/bin/`. The build tree is then removed; the sources stay, for the converter.

It then converts the model cbserve serves by default (its converted float32 checkpoint folder, made
by `engine.loader.embedded_folder()` on first use) to `<dir>/smollm2-135m-instruct-f32.gguf` with
the vendored `convert_hf_to_gguf.py --outtype f32`, run by this interpreter (the project venv has
torch, transformers and numpy) with the vendored `gguf-py` first on PYTHONPATH: llama.cpp runs the
same weights at the same precision as cbserve's float32. The one package the converter needs that
the venv lacks, sentencepiece (a wheel), goes into `<dir>/converter-packages`, not the venv.
`--model FOLDER` converts that checkpoint folder instead, to `<dir>/<folder name>-f32.gguf`.

Each step is skipped when its result is there (a binary built from the pinned version, the GGUF), so
a second `--setup` is a quick no-op; a binary built another way (the stamp's BUILD_FLAVOUR) is
rebuilt. `--build-quantize` builds `llama-quantize` alone the same way, for an install that lacks it
(benchmarks/gguf_serve_compare.py uses it for Q4_0 files when it is there). `serve_command()` is the `llama-server` command line the load
test runs: one slot per concurrent user, continuous batching, Prometheus metrics on.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # vendors ggml-org/llama.cpp@0c1e57098 (its CHANGELOG says)
SENTENCEPIECE_VERSION = "0.2.3"  # the converter imports it for every Llama checkpoint, used or not
MODEL_NAME = "smollm2-135m-instruct"  # the embedded model's folder name, and the server's --alias
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
               "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF",
               "-DLLAMA_USE_PREBUILT_UI=OFF", "-DGGML_CCACHE=OFF"]  # fmt: skip
# the web UI would be built with npm or fetched from a model hub at build time: neither is reachable,
# and the benchmark does not use it (serve_command also turns it off)
BUILD_FLAVOUR = "isa-flags-no-amx"  # in the stamp: a binary built another way is rebuilt
# ggml's x86 options, each on where this CPU reports the feature (/proc/cpuinfo's flags). GGML_NATIVE
# (-march=native) is not used: it also turns on the AMX kernels, which die with SIGILL on the hosts
# here that report amx flags (a VM whose kernel does not grant the tile state); the AMX options stay
# off, so llama.cpp runs its AVX-512/VNNI (or AVX2) kernels with its Q4_0 repacking, as on a CPU
# without AMX.
ISA_OPTIONS = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C", "bmi2": "GGML_BMI2",
               "avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI", "avx512_vnni": "GGML_AVX512_VNNI",
               "avx512_bf16": "GGML_AVX512_BF16", "avx_vnni": "GGML_AVX_VNNI"}  # fmt: skip

T = TypeVar("T")


def install_dir() -> Path:
    default = Path.home() / ".cache" / "cbserve" / "llama-cpp"
    return Path(os.environ.get("CBSERVE_LLAMA_CPP_DIR") or default)


def source_dir() -> Path:
    """The vendored llama.cpp sources `--setup` extracts (and keeps, for the converter)."""
    return install_dir() / f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}" / "llama.cpp"


def _stamp() -> Path:
    return install_dir() / "bin" / "llama-server.version"


def server_binary() -> Path | None:
    """The installed `llama-server` if `--setup` has built it, else None."""
    binary = install_dir() / "bin" / "llama-server"
    return binary if binary.is_file() and os.access(binary, os.X_OK) else None


def quantize_binary() -> Path | None:
    """The installed `llama-quantize` if `--build-quantize` has built it, else None."""
    binary = install_dir() / "bin" / "llama-quantize"
    return binary if binary.is_file() and os.access(binary, os.X_OK) else None


def gguf_path(model_folder: Path | None = None) -> Path | None:
    """The F32 GGUF `--setup` converted from a checkpoint folder (None: the embedded model's), else None."""
    path = _gguf_target(model_folder)
    return path if path.is_file() else None


def _gguf_target(model_folder: Path | None) -> Path:
    name = Path(model_folder).name if model_folder is not None else MODEL_NAME
    return install_dir() / f"{name}-f32.gguf"


def serve_command(port: int, gguf: Path, parallel: int, ctx_per_slot: int = 2048, host: str = "127.0.0.1") -> list[str]:
    """`llama-server` for the load-test comparison: `parallel` slots (one per concurrent user), each
    with `ctx_per_slot` tokens of context (the KV cache is split evenly among the slots: with an
    explicit --parallel it is not unified), continuous batching (on by default; said anyway), every
    core, the model under its folder's name (`<name>-f32.gguf` -> `<name>`), `/metrics` on (Prometheus,
    `llamacpp:` names), no web UI."""
    if parallel < 1 or ctx_per_slot < 1:
        raise ValueError(f"parallel and ctx_per_slot must be positive, got {parallel} and {ctx_per_slot}")
    binary = server_binary() or install_dir() / "bin" / "llama-server"
    alias = Path(gguf).name.removesuffix(".gguf").removesuffix("-f32")
    return [str(binary), "--model", str(gguf), "--alias", alias, "--host", host, "--port", str(port),
            "--parallel", str(parallel), "--ctx-size", str(parallel * ctx_per_slot), "--cont-batching",
            "--threads", str(os.cpu_count() or 1), "--metrics", "--no-webui"]  # fmt: skip


def _timed(what: str, step: Callable[[], T]) -> T:
    print(f"{what} ...", flush=True)
    start = time.perf_counter()
    result = step()
    print(f"{what}: done in {time.perf_counter() - start:.1f} s", flush=True)
    return result


def _download_sdist(dest: Path) -> Path:
    """`pip download` the pinned sdist (source only, no dependencies) into dest."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:", "--no-deps",
                    "--dest", str(dest), f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"], check=True)  # fmt: skip
    found = sorted(dest.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"))
    if not found:
        raise FileNotFoundError(f"pip download left no llama-cpp-python sdist in {dest}")
    return found[0]


def _extract_vendored(sdist: Path, target: Path) -> str:
    """Extract the sdist's vendor/llama.cpp (less its dangling submodule .git link) into target; return
    the llama.cpp commit its CHANGELOG names for this version ("unknown" if none)."""
    top = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/"
    vendored = top + "vendor/llama.cpp/"
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        members = []
        for member in tar.getmembers():
            if member.name.startswith(vendored) and member.name != vendored + ".git":
                member.name = member.name.removeprefix(vendored)
                members.append(member)
        tar.extractall(partial, members=members, filter="data")
        changelog = tar.extractfile(top + "CHANGELOG.md")
        commit = _changelog_commit(changelog.read().decode()) if changelog else "unknown"
    (partial / "LLAMA_CPP_COMMIT").write_text(commit + "\n")
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return commit


def _changelog_commit(changelog: str) -> str:
    """The llama.cpp commit llama-cpp-python's CHANGELOG gives for the pinned version."""
    heading = f"## [{LLAMA_CPP_PYTHON_VERSION}]"
    section = changelog.split(heading, 1)[1].split("\n## [", 1)[0] if heading in changelog else ""
    found = re.search(r"llama\.cpp@([0-9a-f]{7,40})", section)
    return found.group(1) if found else "unknown"


def isa_flags(cpu_flags: set[str] | None = None) -> list[str]:
    """ggml's ISA options for this CPU (or for `cpu_flags`, /proc/cpuinfo's names): each on where the
    CPU has it, AMX off."""
    if cpu_flags is None:
        cpu_flags = set()
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                cpu_flags = set(line.split(":", 1)[1].split())
                break
    return [f"-D{option}={'ON' if flag in cpu_flags else 'OFF'}" for flag, option in ISA_OPTIONS.items()]


def _build(source: Path, build: Path, targets: tuple[str, ...] = ("llama-server",)) -> None:
    """Configure and build the targets (`llama-server`, `llama-quantize`) in one tree, on 2 jobs."""
    commit = (source / "LLAMA_CPP_COMMIT").read_text().strip()
    flags = isa_flags()
    print("llama.cpp ISA options: " + " ".join(f.removeprefix("-DGGML_") for f in flags), flush=True)
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS, *flags, "-DGGML_AMX_TILE=OFF",
                    "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF", f"-DLLAMA_BUILD_COMMIT={commit}",
                    "-DLLAMA_BUILD_NUMBER=0"], check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    subprocess.run(["cmake", "--build", str(build), "--target", *targets, "-j", "2"], check=True)


def _install(build: Path, target: str = "llama-server") -> Path:
    binary = install_dir() / "bin" / target
    binary.parent.mkdir(parents=True, exist_ok=True)
    partial = binary.with_name(f"{target}.partial")
    shutil.copy2(build / "bin" / target, partial)
    partial.rename(binary)
    if target == "llama-server":
        _stamp().write_text(f"{LLAMA_CPP_PYTHON_VERSION} {BUILD_FLAVOUR}\n")
    return binary


def build_quantize() -> Path:
    """Build and install `llama-quantize` from the sources `--setup` extracted (run that first), unless
    it is there."""
    if quantize_binary() is not None:
        print(f"llama-quantize: already built ({quantize_binary()})", flush=True)
        return install_dir() / "bin" / "llama-quantize"
    if not (source_dir() / "CMakeLists.txt").is_file():
        raise FileNotFoundError(f"no llama.cpp sources in {source_dir()}: run --setup first")
    with tempfile.TemporaryDirectory(dir=install_dir(), prefix="quantize-") as scratch:
        build = Path(scratch) / "build"
        _timed("build llama-quantize (cmake, Release, -j 2)", lambda: _build(source_dir(), build, ("llama-quantize",)))
        binary = _install(build, "llama-quantize")
    print(f"installed {binary}", flush=True)
    return binary


def _converter_packages() -> Path:
    """sentencepiece, which the converter imports before it looks for a tokenizer.model (SmolLM2 has
    none), installed for the converter alone: into a folder of its own, not the project venv."""
    folder = install_dir() / "converter-packages"
    if not (folder / "sentencepiece").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--only-binary", ":all:",
                        "--target", str(folder), f"sentencepiece=={SENTENCEPIECE_VERSION}"], check=True)  # fmt: skip
    return folder


def converter_env() -> dict[str, str]:
    """The environment llama.cpp's Python tools run in: the vendored gguf-py (ahead of the venv's gguf)
    and sentencepiece first on the path."""
    path = (str(source_dir() / "gguf-py"), str(_converter_packages()), os.environ.get("PYTHONPATH"))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in path if x)}


def convert(folder: Path, target: Path, outtype: str = "f32") -> None:
    """The vendored converter, checkpoint folder -> GGUF of `outtype` (f32, f16, bf16, q8_0)."""
    partial = target.with_name(target.name + ".partial")
    subprocess.run([sys.executable, str(source_dir() / "convert_hf_to_gguf.py"), str(folder), "--outtype", outtype,
                    "--outfile", str(partial)], check=True, env=converter_env())  # fmt: skip
    partial.rename(target)


def built() -> bool:
    """A `llama-server` from the pinned version, and the sources the converter needs, are in place."""
    stamp = _stamp()
    return (server_binary() is not None and stamp.is_file() and stamp.read_text().strip() == f"{LLAMA_CPP_PYTHON_VERSION} {BUILD_FLAVOUR}"
            and (source_dir() / "convert_hf_to_gguf.py").is_file())  # fmt: skip


def setup(model_folder: Path | None = None) -> tuple[Path, Path]:
    """Build llama-server and convert the checkpoint folder (None: the embedded model's), each only if
    missing. Returns the binary and the GGUF."""
    start = time.perf_counter()
    install_dir().mkdir(parents=True, exist_ok=True)
    if built():
        print(f"llama-server {LLAMA_CPP_PYTHON_VERSION}: already built ({server_binary()})", flush=True)
    else:
        with tempfile.TemporaryDirectory(dir=install_dir(), prefix="setup-") as scratch:
            if not (source_dir() / "convert_hf_to_gguf.py").is_file():
                sdist = _timed(f"download the llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} sdist",
                               lambda: _download_sdist(Path(scratch)))  # fmt: skip
                commit = _timed(f"extract vendor/llama.cpp to {source_dir()}",
                                lambda: _extract_vendored(sdist, source_dir()))  # fmt: skip
                print(f"llama.cpp commit {commit}", flush=True)
            build = Path(scratch) / "build"
            _timed("build llama-server and llama-quantize (cmake, Release, -j 2)",
                   lambda: _build(source_dir(), build, ("llama-server", "llama-quantize")))  # fmt: skip
            print(f"installed {_install(build, 'llama-quantize')}", flush=True)
            print(f"installed {_install(build)}", flush=True)
    target = _gguf_target(model_folder)
    if target.is_file():
        print(f"{target.name}: already converted ({target})", flush=True)
    else:
        if model_folder is None:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, if cbserve is not installed
            from engine.loader import embedded_folder  # the first call converts cbserve's model (about 30 s)

            model_folder = _timed("find the embedded model's checkpoint folder", embedded_folder)
        folder = Path(model_folder)
        _timed(f"convert {folder} to {target} (F32)", lambda: convert(folder, target))
    print(f"setup took {time.perf_counter() - start:.1f} s", flush=True)
    return install_dir() / "bin" / "llama-server", target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", action="store_true", help="build llama-server and convert the model to GGUF")
    parser.add_argument("--model", type=Path, help="a checkpoint folder to convert (default: the embedded model)")
    parser.add_argument("--build-quantize", action="store_true", help="build llama-quantize too (after --setup)")
    args = parser.parse_args(argv)
    if args.build_quantize and not args.setup:
        build_quantize()
    elif args.setup:
        if args.model is not None and not (args.model / "config.json").is_file():
            parser.error(f"--model {args.model} is not a transformers checkpoint folder (no config.json)")
        binary, gguf = setup(args.model)
        print(f"llama.cpp peer ready: {binary} {gguf}")
        if args.build_quantize:
            build_quantize()
    else:
        parser.print_help()


if __name__ == "__main__":
    main()
