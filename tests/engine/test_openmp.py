"""GOMP_SPINCOUNT for cbserve's processes (engine/openmp.py): set before torch loads libgomp. And the
engine's OpenMP team, one thread smaller while other work in the process borrows a core."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from engine import ContinuousBatchingConfig, ContinuousBatchingManager
from engine.openmp import (ENGINE_NICE, NICE_ENV, SPIN_COUNT, SPIN_ENV, Team, cores_lent, engine_nice, lend_core,
                           lower_this_thread, set_spin_default)  # fmt: skip
from engine.testing import build_test_model

ROOT = Path(__file__).resolve().parents[2]

# what a `cbserve` process sees: main() runs (here as far as --help), then torch is imported
PROBE = """
import os, sys
from engine.cli import main
try:
    main(["serve", "--help"])
except SystemExit:
    pass
loaded_before = "torch" in sys.modules
import torch  # libgomp reads GOMP_SPINCOUNT now
print(loaded_before, os.environ.get("GOMP_SPINCOUNT"))
"""


def _probe(env: dict[str, str]) -> str:
    clean = {k: v for k, v in os.environ.items() if k != SPIN_ENV}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env={**clean, **env}, capture_output=True,
                         text=True, timeout=120, check=True)  # fmt: skip
    return out.stdout.strip().splitlines()[-1]


def test_the_cbserve_entry_point_sets_the_spin_count_before_torch_loads() -> None:
    assert _probe({}) == f"False {SPIN_COUNT}"


def test_a_spin_count_in_the_environment_is_kept() -> None:
    assert _probe({SPIN_ENV: "50000"}) == "False 50000"


def test_once_torch_is_loaded_nothing_is_changed() -> None:
    environ: dict[str, str] = {}
    assert "torch" in sys.modules  # this test process imported it
    assert set_spin_default(environ) is None and environ == {}


def test_before_torch_the_default_goes_into_the_environment_given() -> None:
    out = subprocess.run([sys.executable, "-c", "import sys; from engine.openmp import set_spin_default; e = {}; "
                          "print(set_spin_default(e), e, 'torch' in sys.modules)"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    assert out.stdout.strip() == f"{SPIN_COUNT} {{'{SPIN_ENV}': '{SPIN_COUNT}'}} False"


def test_the_team_gives_up_one_thread_while_a_core_is_lent() -> None:
    seen: list[tuple[int, ...]] = []

    def on_a_new_thread() -> None:  # torch's thread count is per thread: the test's own stays as it is
        torch.set_num_threads(3)
        team = Team()
        before = team.fit()
        with lend_core(wait=0):  # wait=0: this thread's own team is the one stepping at full size
            with lend_core(wait=0):
                lent = (team.fit(), torch.get_num_threads(), cores_lent())
            still = team.fit()
        seen.append((before, *lent, still, team.fit(), torch.get_num_threads(), cores_lent()))
        team.restore()
        torch.set_num_threads(1)
        one = Team()
        with lend_core():
            seen.append((one.fit(),))  # a team of one keeps its thread
        one.restore()

    worker = threading.Thread(target=on_a_new_thread)
    worker.start()
    worker.join()
    assert seen == [(3, 2, 2, 2, 2, 3, 3, 0), (1,)]


def test_a_lender_waits_for_a_stepping_team_to_shed_its_thread_and_not_for_an_idle_one() -> None:
    events: list[str] = []
    stepping, lent = threading.Event(), threading.Event()

    def engine_thread() -> None:
        torch.set_num_threads(2)
        team = Team()
        team.fit()  # a step at full size is under way
        stepping.set()
        lent.wait()  # the lender below is waiting now (or soon): it must not get through before fit()
        events.append("fit")
        team.fit()
        team.idle()
        team.restore()

    def lender() -> None:
        stepping.wait()
        with lend_core(wait=60):
            events.append("lent")

    threads = [threading.Thread(target=engine_thread), threading.Thread(target=lender)]
    for t in threads:
        t.start()
    while cores_lent() == 0:  # the lender has asked
        threading.Event().wait(0.001)
    lent.set()
    for t in threads:
        t.join()
    assert events == ["fit", "lent"]
    with lend_core(wait=60):  # no team is stepping: nothing to wait for
        assert cores_lent() == 1


def test_a_running_manager_steps_on_one_thread_fewer_while_a_core_is_lent() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the engine thread starts with the process's count
    try:
        mgr = ContinuousBatchingManager(build_test_model("llama"),
                                        continuous_batching_config=ContinuousBatchingConfig(block_size=16, num_blocks=64))  # fmt: skip
        seen: list[int] = []
        step = mgr.engine.step

        def counted_step():
            seen.append(torch.get_num_threads())  # on the engine thread, as the step's kernels see it
            return step()

        mgr.engine.step = counted_step
        mgr.start()
        try:
            phases = []
            for lent in (False, True, False):
                seen.clear()
                with lend_core() if lent else contextlib.nullcontext():
                    rid = mgr.add_request([5, 6, 7, 8], max_new_tokens=6, ignore_eos=True)
                    assert mgr.get_result(rid, timeout=60).error is None
                phases.append(set(seen))
        finally:
            mgr.stop(block=True)
    finally:
        torch.set_num_threads(threads)
    assert phases == [{2}, {1}, {2}]


# -- the engine thread's priority --------------------------------------------------------------------


def _nice_of(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def test_the_engine_nice_is_read_from_the_environment_and_bad_values_are_named() -> None:
    assert engine_nice({}) == ENGINE_NICE == 0
    assert engine_nice({NICE_ENV: "0"}) == 0 and engine_nice({NICE_ENV: " 19 "}) == 19
    for bad in ("-3", "20", "nice", "1.5"):
        with pytest.raises(ValueError, match=f"{NICE_ENV}='{bad.strip()}': an integer from 0"):
            engine_nice({NICE_ENV: bad})


def test_a_lowered_thread_passes_its_priority_to_the_threads_it_starts_and_never_raises_it() -> None:
    seen: dict[str, int] = {}

    def child() -> None:
        seen["child"] = _nice_of(threading.get_native_id())

    def lowered() -> None:
        seen["set"] = lower_this_thread(4)
        seen["again"] = lower_this_thread(2)  # asking for less is not a raise: it stays at 4
        thread = threading.Thread(target=child)
        thread.start()
        thread.join()

    thread = threading.Thread(target=lowered)
    thread.start()
    thread.join()
    assert seen == {"set": 4, "again": 4, "child": 4}
    assert _nice_of(threading.get_native_id()) == 0  # the caller's thread is untouched


def _niced_threads(nice: int) -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task") if _nice_of(int(tid)) == nice}


@pytest.mark.parametrize("setting", [None, "0", "7"])
def test_the_managers_engine_thread_and_its_openmp_workers_run_at_the_engine_nice(monkeypatch, setting) -> None:
    """After a step, the threads at the engine's nice are the engine thread and its OpenMP team's
    other members (inherited at the team's first parallel region); this thread and the output
    thread keep the process's."""
    if setting is None:
        monkeypatch.delenv(NICE_ENV, raising=False)
    else:
        monkeypatch.setenv(NICE_ENV, setting)
    nice = engine_nice()
    before = _niced_threads(nice) if nice else set()
    manager = ContinuousBatchingManager(build_test_model("llama", vocab_size=128),
                                        ContinuousBatchingConfig(block_size=16, num_blocks=32))  # fmt: skip
    manager.start()
    try:
        manager.add_request([5, 6, 7], max_new_tokens=4, request_id="r")
        assert manager.get_result("r", timeout=60).generated_tokens
        engine_tid = manager._thread.native_id
        niced = _niced_threads(nice) - before if nice else set()
        assert _nice_of(threading.get_native_id()) == 0
        if nice:
            assert engine_tid in niced and len(niced) == torch.get_num_threads()  # the engine thread and its workers
        else:
            assert _nice_of(engine_tid) == 0
    finally:
        manager.stop(block=True, timeout=60)
