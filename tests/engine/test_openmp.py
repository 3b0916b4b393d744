"""GOMP_SPINCOUNT for cbserve's processes (engine/openmp.py): set before torch loads libgomp. And the
engine's OpenMP team, one thread smaller while other work in the process borrows a core."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import torch

from engine import ContinuousBatchingConfig, ContinuousBatchingManager
from engine.openmp import SPIN_COUNT, SPIN_ENV, Team, cores_lent, lend_core, set_spin_default
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
