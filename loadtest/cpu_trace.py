"""A started server's CPU time, sampled in the background, so the CPU-seconds of any window can be read
afterwards: busy cores = CPU-seconds (user + system, the process and its children) / the window's wall time."""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable


class CpuTrace:
    """Samples `read()` (CPU-seconds so far, None when unknown) with the wall time every `period_s`."""

    def __init__(self, read: Callable[[], float | None], period_s: float = 0.25) -> None:
        self.read, self.period_s = read, period_s
        self.samples: list[tuple[float, float]] = []  # (time.time(), CPU-seconds), in time order
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        """One sample now (also taken every `period_s` in the background)."""
        with self._lock:
            cpu = self.read()
            if cpu is not None:
                self.samples.append((time.time(), cpu))

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    def start(self) -> CpuTrace:
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.sample()

    def at(self, t: float) -> float | None:
        """CPU-seconds at wall time `t`, linear between the samples around it (the nearest outside them)."""
        with self._lock:
            samples = list(self.samples)
        if not samples:
            return None
        times = [s[0] for s in samples]
        i = bisect.bisect_left(times, t)
        if i == 0:
            return samples[0][1]
        if i == len(times):
            return samples[-1][1]
        (t0, c0), (t1, c1) = samples[i - 1], samples[i]
        return c0 + (c1 - c0) * (t - t0) / (t1 - t0) if t1 > t0 else c1

    def between(self, t0: float, t1: float) -> float | None:
        """CPU-seconds used between wall times t0 and t1."""
        a, b = self.at(t0), self.at(t1)
        return None if a is None or b is None else max(b - a, 0.0)
