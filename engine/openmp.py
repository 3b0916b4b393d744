"""How long torch's idle OpenMP workers spin, and the engine's team one thread smaller while other
work in the process needs a core.

Every CPU kernel splits its work over torch's OpenMP threads; a decode step opens several hundred
parallel regions, a few microseconds apart. Between two regions libgomp's idle workers spin for
GOMP_SPINCOUNT iterations, then sleep and must be woken for the next region. An iteration is a
`pause` instruction and a load, about 26 ns on an AMD Zen 3. cbserve's default is libgomp's own,
300,000 (about 8 ms), which keeps them spinning through a whole step: under load on a Zen 3 it
served 1.14x the output tokens of 10,000 (about 0.26 ms) and 1.20x those of 1,000, whose workers
sleep inside most steps (docs/benchmarks.md, "How long the OpenMP workers spin"). libgomp reads
the variable once, when torch loads it: `cbserve`'s entry point sets it before anything imports
torch, so that the value in force is known. A value in the environment is kept.

The price of spinning is paid when something else wants a core in the middle of a step: the
thread a worker waits for is preempted, the worker spins on, and a step stretches from
milliseconds to a hundred or more (cbserve's own tokenizer helper on a 4 MB prompt:
tests/server/test_guard.py). So work in the process that needs a core for a while holds a lend
(`lend_core()`, or a `Lend`; the server does while a request body of a megabyte or more arrives,
is parsed and is tokenised), and the engine thread runs its steps on one OpenMP thread fewer
meanwhile (`Team.fit`, called between steps): the lent core is that work's alone, and no worker
waits at a barrier for a preempted thread.

Short work that wakes while a step runs (the event loop sending a token, the output thread
detokenising it) is not worth a lend, but under the scheduler's fair share it may wait for a
spinning team member's time slice before it runs, and the token reaches its client late. With
CBSERVE_ENGINE_NICE=N the engine thread runs at nice N, below the rest of the process, and with it
its OpenMP workers, which it starts and which inherit it: such work then preempts the team at once.
Off by default (ENGINE_NICE, 0): on a 2-core Zen 5 it shortened a one-user stream's inter-token
p90 in a fine alternation, but in end-to-end runs its effect on the p99, and on the 16-user
throughput, stayed within the host's noise (docs/benchmarks.md, "The engine's priority").
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator, MutableMapping

SPIN_ENV = "GOMP_SPINCOUNT"
SPIN_COUNT = 300_000
NICE_ENV = "CBSERVE_ENGINE_NICE"
ENGINE_NICE = 0  # the engine thread's nice (0-19; 0: the process's); the event loop and output thread keep it


def set_spin_default(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """GOMP_SPINCOUNT defaults to SPIN_COUNT; returns the value in effect, or None when torch is loaded
    already (libgomp has read its environment, so nothing is changed)."""
    if "torch" in sys.modules:
        return None
    return environ.setdefault(SPIN_ENV, str(SPIN_COUNT))


def engine_nice(environ: MutableMapping[str, str] = os.environ) -> int:
    """The engine thread's nice: CBSERVE_ENGINE_NICE, else ENGINE_NICE; a ValueError names a bad value."""
    raw = environ.get(NICE_ENV, "").strip()
    if not raw:
        return ENGINE_NICE
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= 19:
        raise ValueError(f"{NICE_ENV}={raw!r}: an integer from 0 (the process's own priority) to 19")
    return value


def lower_this_thread(nice: int) -> int | None:
    """This thread's nice raised to `nice` (never lowered: that takes a privilege), for it and the
    threads it starts from now on (they inherit it: its OpenMP workers, made at its first parallel
    region, among them). Returns the nice in force, None where the OS has no per-thread nice."""
    if not hasattr(os, "setpriority") or sys.platform != "linux":
        return None
    tid = threading.get_native_id()
    current = os.getpriority(os.PRIO_PROCESS, tid)
    if nice > current:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
        return nice
    return current


LEND_WAIT = 2.0  # seconds lend_core() waits for the engine to reach a step boundary (a long prefill step)


class _Lending:
    """How many lends are held, and how many engine teams are stepping at a size that does not leave
    them a core (each sheds a thread at its next step boundary, or goes idle); `on_shed` callbacks
    run (on the engine thread) once none is."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.lent = 0
        self.crowding = 0
        self.on_shed: list[Callable[[], None]] = []


_lending = _Lending()


class Lend:
    """One lent core, held from its making until `end()` (from any thread; a second call does nothing).
    It does not wait: `lend_core()` and `when_shed()` are the ways to wait for the engine to shed."""

    def __init__(self) -> None:
        with _lending.changed:
            _lending.lent += 1
        self.held = True

    def end(self) -> None:
        with _lending.changed:
            if self.held:
                self.held = False
                _lending.lent -= 1


@contextlib.contextmanager
def lend_core(wait: float = LEND_WAIT) -> Iterator[None]:
    """While held, the engine's steps leave one core free (a team of one thread keeps it). It first
    waits, up to `wait` seconds, for every stepping engine to have shed its thread: a step already
    running at full size would otherwise share its cores with the work about to start."""
    lend = Lend()
    try:
        with _lending.changed:
            _lending.changed.wait_for(lambda: not _lending.crowding, timeout=wait)
        yield
    finally:
        lend.end()


def when_shed(callback: Callable[[], None]) -> bool:
    """Without waiting: False when no engine is stepping at full size now, else True and `callback`
    is called (once, on the engine thread that sheds last) when none is. For an event loop, which
    must not block on `lend_core()`'s wait: hold a `Lend`, then wait for the callback."""
    with _lending.changed:
        if not _lending.crowding:
            return False
        _lending.on_shed.append(callback)
        return True


def forget_shed(callback: Callable[[], None]) -> None:
    """Drop a `when_shed` callback that is no longer wanted (its waiter gave up)."""
    with _lending.changed:
        if callback in _lending.on_shed:
            _lending.on_shed.remove(callback)


def cores_lent() -> int:
    return _lending.lent


class Team:
    """The engine thread's OpenMP team size: its full size, or one fewer while a core is lent.
    Made and used on the engine thread (torch's thread count is that thread's own setting):
    `fit()` before each step, `idle()` when the thread has no step to run, `restore()` at its end."""

    def __init__(self) -> None:
        import torch  # not at the top: set_spin_default runs before anything loads torch

        self._torch = torch
        self.full = torch.get_num_threads()
        self.size = self.full
        self.crowding = False  # stepping at a size that leaves no core to a lend_core() holder

    def fit(self) -> int:
        if self.full < 2:
            return self.size
        with _lending.changed:
            want = self.full - 1 if _lending.lent else self.full
            if want != self.size:
                self._torch.set_num_threads(want)
                self.size = want
            self._crowd(want == self.full)
        return want

    def idle(self) -> None:
        if self.crowding:
            with _lending.changed:
                self._crowd(False)

    def restore(self) -> None:
        self.idle()
        if self.size != self.full:
            self._torch.set_num_threads(self.full)
            self.size = self.full

    def _crowd(self, crowding: bool) -> None:  # with _lending.changed held
        if crowding != self.crowding:
            self.crowding = crowding
            _lending.crowding += 1 if crowding else -1
            if not _lending.crowding:
                _lending.changed.notify_all()
                callbacks, _lending.on_shed[:] = list(_lending.on_shed), []
                for callback in callbacks:
                    callback()
