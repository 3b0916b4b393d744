"""How long torch's idle OpenMP workers spin before they sleep, for `cbserve` processes.

Every CPU kernel splits its work over torch's OpenMP threads; a decode step opens several hundred
parallel regions, a few microseconds apart. Between two regions libgomp's idle workers spin for
GOMP_SPINCOUNT iterations, then sleep and must be woken for the next region. Its default (300,000
iterations, milliseconds) keeps them spinning through a whole step, which is fastest while nothing
else wants the cores; but when another process does (cbserve's own tokenizer helper on a 4 MB
prompt, a sidecar), a spinning worker holds a core while the thread it waits for is preempted, and
a step stretches from milliseconds to hundreds of them. 1,000 iterations (tens of microseconds)
still spans the gaps between a step's kernels and gives the cores back soon after a step ends
(docs/engine.md, On the CPU; the figures are in docs/benchmarks.md, "One OpenMP team").

libgomp reads the variable once, when torch loads it: `cbserve`'s entry point sets the default before
anything imports torch. A value in the environment is kept.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

SPIN_ENV = "GOMP_SPINCOUNT"
SPIN_COUNT = 1_000


def set_spin_default(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """GOMP_SPINCOUNT defaults to SPIN_COUNT; returns the value in effect, or None when torch is loaded
    already (libgomp has read its environment, so nothing is changed)."""
    if "torch" in sys.modules:
        return None
    return environ.setdefault(SPIN_ENV, str(SPIN_COUNT))
