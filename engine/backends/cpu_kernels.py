"""cbserve's C++ CPU kernels (engine/csrc/), compiled for this machine on first use.

The build (about a minute on two cores, with `-O3 -march=native`) lands in the cbserve cache folder
under a tag made of the source, torch's version and the CPU's flags, so a later start loads it in
well under a second and a copied cache never runs code built for another CPU. `make kernels` (which
`make test`, `make demo` and `make bench` run first) builds it: `python -m engine.backends.cpu_kernels`.

When the build cannot happen (no C++ compiler, `CBSERVE_CPU_KERNELS=0`), `cpu_ops()` returns None
once with a warning and the CPU backend keeps its torch-only path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger("cbserve.engine")

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = [CSRC / name for name in ("paged_attention_cpu.cpp", "greedy_cpu.cpp", "elementwise_cpu.cpp", "bindings.cpp")]
HEADERS = [CSRC / "vec16.h"]
CFLAGS = ["-O3", "-march=native", "-fopenmp"]  # OpenMP: at::parallel_for runs on torch's own thread pool

_lock = threading.Lock()
_ops: ModuleType | None = None
_tried = False


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def build_tag() -> str:
    h = hashlib.sha256()
    for src in SOURCES + HEADERS:
        h.update(src.read_bytes())
    h.update(" ".join(CFLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(_cpu_flags().encode())
    return h.hexdigest()[:12]


def build_directory() -> Path:
    from engine.loader import cache_dir

    return cache_dir() / "kernels" / build_tag()


def cpu_ops() -> ModuleType | None:
    """The compiled module (attention, greedy argmax, element-wise passes), or None when it cannot be had."""
    global _ops, _tried
    with _lock:
        if _tried:
            return _ops
        _tried = True
        if os.environ.get("CBSERVE_CPU_KERNELS", "1") == "0":
            logger.info("cbserve CPU kernels off (CBSERVE_CPU_KERNELS=0): torch-only attention")
            return None
        try:
            from torch.utils.cpp_extension import load

            if shutil.which("ninja") is None:  # pip's ninja sits next to this interpreter, maybe not on PATH
                os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
            directory = build_directory()
            directory.mkdir(parents=True, exist_ok=True)
            _ops = load(
                name="cbserve_cpu_ops",
                sources=[str(s) for s in SOURCES],
                extra_cflags=CFLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                verbose=False,
            )
        except Exception as exc:  # no compiler, no ninja, a read-only home: all mean the torch path
            logger.warning("cbserve CPU kernels unavailable, using torch-only attention: %s", exc)
            _ops = None
        return _ops


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    ops = cpu_ops()
    print(f"cbserve CPU kernels: {'built in ' + str(build_directory()) if ops else 'unavailable (torch path)'}")
