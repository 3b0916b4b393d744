"""glibc malloc settings that keep a CPU engine's freed activation memory in the process.

Each step allocates and frees activations of a few MB (a [1024, 1376] MLP intermediate, logits).
With glibc's defaults such blocks may be handed back to the kernel when freed (mmap'd chunks,
or a heap top past the trim threshold) and the next step pays a page fault per 4 KB page on first
touch, and element-wise ops of a 1,024-token step run far slower (`python benchmarks/cpu_paths.py`
compares the paths). vLLM's CPU build asks for tcmalloc for the same reason. These settings keep
blocks up to 32 MB on the heap and the heap from shrinking below 1 GB of free space, so memory
freed by one step is reused, already mapped, by the next. The process keeps its peak activation
memory (typically tens to hundreds of MB) instead of returning it.

`tune()` runs once per process, on glibc only; `CBSERVE_CPU_MALLOC_TUNING=0` skips it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading

logger = logging.getLogger("cbserve.engine")

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = {M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 1 << 30, M_TOP_PAD: 64 << 20}

_lock = threading.Lock()
_done: bool | None = None


def tune() -> bool:
    """Apply SETTINGS once; True when they are in effect."""
    global _done
    with _lock:
        if _done is not None:
            return _done
        _done = False
        if os.environ.get("CBSERVE_CPU_MALLOC_TUNING", "1") == "0":
            logger.info("cbserve: malloc settings left alone (CBSERVE_CPU_MALLOC_TUNING=0)")
            return False
        if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
            return False
        try:
            mallopt = ctypes.CDLL("libc.so.6").mallopt
        except (OSError, AttributeError):
            return False
        _done = all(mallopt(param, value) == 1 for param, value in SETTINGS.items())
        return _done
