"""Shared test setup: torch threads to match the cores a test process has, deterministic models.

`make test` runs two pytest-xdist workers: each gets its share of the cores (one torch thread each on
two cores), also passed on, as OMP_NUM_THREADS, to the servers and ranks the tests start, so the two
workers never oversubscribe the machine. One process alone (plain `pytest`) keeps two threads.

With `--dist loadfile` a file runs whole on one worker, so the files that take longest start first
(`make test` passes `--no-loadscope-reorder`, which keeps this order): one started last would keep a
worker busy long after the other has run out of files."""

import os

import pytest
import torch

_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    _threads = max(1, (os.cpu_count() or 2) // _workers)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))
else:
    _threads = 2
torch.set_num_threads(_threads)

# the files with the longest totals in make test's --durations, longest first
LONGEST_FIRST = (
    "tests/gpu/test_gpu_image.py",
    "tests/loadtest/test_loadtest.py",
    "tests/server/test_tensor_parallel.py",
    "tests/engine/test_tensor_parallel.py",
    "tests/server/test_generate_cli.py",
    "tests/server/test_lifecycle.py",
    "tests/server/test_guard.py",
    "tests/hub/test_download.py",
    "tests/engine/test_cpu_isa.py",
    "tests/server/test_smollm2.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    """On a pytest-xdist worker: LONGEST_FIRST's files first, the rest after in their own order."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    missing = [path for path in LONGEST_FIRST if not (config.rootpath / path).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py LONGEST_FIRST names files that are not there: {missing}")
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: a file's own order kept
