"""cbserve's C++ CPU kernels (engine/csrc/), compiled for this machine on first use.

The build (one to two minutes on two cores) is for the ISA that engine/backends/cpu_isa.py chooses:
AVX-512 (16 float lanes a register) or AVX2 (8 lanes), `-march=native` when that is the CPU's best
and an x86-64 level (v3 for AVX2) when `CBSERVE_CPU_ISA` asks for less. `make kernels` (which
`make test`, `make demo` and `make bench` run first) builds it: `python -m engine.backends.cpu_kernels`.

The cache is safe to share. A build lives in the cbserve cache folder under a tag made of the
sources, the flags, the CPU's flags, the Python version and torch's version and install folder: two
virtualenvs (two torch installs) get two builds and never rebuild each other's. One process builds a
tag at a time (a file lock), into a private folder that is renamed into place when done, so nobody
loads a half-written build; later loads import the finished library directly, without asking the
compiler whether anything changed.

When the kernels cannot be had (no C++ compiler, no kernel ISA on this CPU, `CBSERVE_CPU_KERNELS=0`
or `CBSERVE_CPU_ISA=none`), `cpu_ops()` returns None, one log line says why, and the CPU backend keeps
its torch-only paths.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from collections.abc import Callable
from types import ModuleType

import torch

from engine.backends.cpu_isa import ISAS, kernel_isa, read_cpu
from engine.cache import cache_dir

logger = logging.getLogger("cbserve.engine")

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = [CSRC / name for name in ("paged_attention_cpu.cpp", "greedy_cpu.cpp", "elementwise_cpu.cpp", "linear_cpu.cpp",
                                     "decoder_cpu.cpp", "quant_cpu.cpp", "kquant_cpu.cpp", "sample_cpu.cpp", "bindings.cpp")]  # fmt: skip
HEADERS = [CSRC / "vec.h", CSRC / "decoder_cpu.h", CSRC / "int8_lanes.h", CSRC / "version_watch.h"]
NAME = "cbserve_cpu_ops"
BASE_CFLAGS = ["-O3", "-fopenmp"]  # OpenMP: at::parallel_for runs on torch's own thread pool
LEVELS = {"avx512": "x86-64-v4", "avx2": "x86-64-v3"}

_lock = threading.Lock()
_ops: ModuleType | None = None
_tried = False


def cflags(isa: str, best: str | None) -> list[str]:
    """Compiler flags for kernels of `isa` on a CPU whose best ISA is `best`."""
    if isa == best:
        return [*BASE_CFLAGS, "-march=native"]
    return [*BASE_CFLAGS, f"-march={LEVELS[isa]}", "-mtune=native"]


def build_tag(isa: str) -> str:
    h = hashlib.sha256()
    for src in SOURCES + HEADERS:
        h.update(src.read_bytes())
    cpu = read_cpu()
    for part in (
        " ".join(cflags(isa, cpu.best_isa())),
        " ".join(sorted(cpu.flags)),
        platform.python_version(),
        torch.__version__,
        str(Path(torch.__file__).resolve().parent),
    ):
        h.update(part.encode() + b"\0")
    return f"{isa}-{h.hexdigest()[:12]}"


def build_directory(isa: str | None = None) -> Path:
    return cache_dir() / "kernels" / build_tag(isa or kernel_isa() or "avx2")


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ops_of_build(tag: str) -> ModuleType:
    """The kernels of an earlier build in the cache, by its folder's name (`avx512-5e344599a33f`), for
    benchmarks that time two builds; one build per process, since their symbols clash."""
    path = cache_dir() / "kernels" / tag / f"{NAME}.so"
    if not path.is_file():
        raise FileNotFoundError(f"no kernel build {tag!r} in {path.parent.parent} (`python -m engine.backends.cpu_kernels` "
                                "builds this tree's and prints its name)")  # fmt: skip
    return _import(path)


def publish_once(final: Path, build: Callable[[Path], object], marker: str) -> object | None:
    """Make `final` by `build(folder)` unless a finished one (holding `marker`) exists: one process
    at a time (a lock file beside it), into a private folder renamed into place when whole. Returns
    what `build` returned, or None when a finished `final` was already there (built earlier or by a
    process we waited for). A `final` without the marker (an interrupted build of an older version)
    is removed and built again."""
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f"{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building this very tag: wait for it
        if (final / marker).exists():
            return None
        shutil.rmtree(final, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=f"{final.name}.build-", dir=final.parent))
        try:
            result = build(work)
            os.replace(work, final)  # readers see no build or a whole one
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return result


def load_kernels(isa: str) -> ModuleType:
    """The kernels for `isa`: imported from a finished build in the cache, else built there first."""
    final = build_directory(isa)
    library = final / f"{NAME}.so"
    if library.exists():
        return _import(library)

    def build(folder: Path) -> ModuleType:
        from torch.utils.cpp_extension import load

        if shutil.which("ninja") is None:  # pip's ninja sits next to this interpreter, maybe not on PATH
            os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        logger.info("cbserve: building the %s CPU kernels (one to two minutes, once)", isa)
        return load(name=NAME, sources=[str(s) for s in SOURCES], extra_cflags=cflags(isa, read_cpu().best_isa()),
                    extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)  # fmt: skip

    module = publish_once(final, build, library.name)  # None: another process finished it while we waited
    return module if module is not None else _import(library)


def cpu_ops() -> ModuleType | None:
    """The compiled module (attention, greedy argmax, element-wise passes), or None when it cannot be had."""
    global _ops, _tried
    with _lock:
        if _tried:
            return _ops
        _tried = True
        if os.environ.get("CBSERVE_CPU_KERNELS", "1") == "0":
            logger.info("cbserve CPU kernels off (CBSERVE_CPU_KERNELS=0): torch-only paths")
            return None
        isa = kernel_isa()
        if isa is None:
            logger.info("cbserve CPU kernels off (no AVX2 or AVX-512 here, or CBSERVE_CPU_ISA=none): torch-only paths")
            return None
        try:
            _ops = load_kernels(isa)
        except Exception as exc:  # no compiler, no ninja, a read-only home: all mean the torch path
            logger.warning("cbserve CPU kernels unavailable, using torch-only paths: %s", exc)
            _ops = None
        return _ops


def runnable_isas() -> list[str]:
    """Every kernel ISA this CPU can run, its best first (an AVX-512 CPU runs the AVX2 build too)."""
    best = read_cpu().best_isa()
    return list(ISAS[ISAS.index(best):]) if best else []


if __name__ == "__main__":
    # `make kernels`: this CPU's build, and on an AVX-512 CPU the AVX2 one as well, which the tests
    # run there (CBSERVE_CPU_ISA=avx2) so that both sides of the probe are tested on such a host. The
    # other builds run at the same time, each in its own process (symbols clash in one): a build's
    # compile steps leave a core idle while its largest source compiles, and two builds fill it.
    import subprocess

    logging.basicConfig(level=logging.INFO)
    others = [(other, subprocess.Popen([sys.executable, "-c", "from engine.backends.cpu_kernels import load_kernels; "
                                        f"load_kernels({other!r})"]))  # fmt: skip
              for other in runnable_isas()[1:] if other != kernel_isa()]
    ops = cpu_ops()
    print(f"cbserve CPU kernels: {'built in ' + str(build_directory()) if ops else 'unavailable (torch path)'}")
    for other, process in others:
        if process.wait() != 0:
            raise SystemExit(f"cbserve CPU kernels ({other}): the build failed (exit {process.returncode})")
        print(f"cbserve CPU kernels ({other}, for tests): built in {build_directory(other)}")
