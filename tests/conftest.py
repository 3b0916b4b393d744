"""Shared test setup: torch threads to match the cores a test process has, deterministic models.

`make test` runs two pytest-xdist workers: each gets its share of the cores (one torch thread each on
two cores), also passed on, as OMP_NUM_THREADS, to the servers and ranks the tests start, so the two
workers never oversubscribe the machine. One process alone (plain `pytest`) keeps two threads."""

import os

import torch

_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    _threads = max(1, (os.cpu_count() or 2) // _workers)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))
else:
    _threads = 2
torch.set_num_threads(_threads)
