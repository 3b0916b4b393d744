"""`cbserve serve --tensor-parallel-size 2` as a pod runs it: on one host (rank 1 spawned by the
server), and across two "hosts" (rank 1 from `cbserve worker`, here on the same machine). Greedy
answers equal model.generate's; a rank that dies makes the server exit 1, and the death of the server
makes `cbserve worker` exit 1: nothing waits on a broken group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.server.conftest import Server, free_port

# float32 on every host: --dtype auto may differ between CPUs, and the reference is float32
ENGINE = {"block_size": 16, "num_blocks": 256, "tensor_parallel_size": 2, "dtype": "float32"}
PROMPT = [17, 230, 41, 99, 7, 301, 12, 88, 150, 5]
EXIT_WAIT_S = 60


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> str:
    """The greedy continuation of PROMPT by transformers' own generate, as text."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                             pad_token_id=3)  # fmt: skip
    return AutoTokenizer.from_pretrained(model_dir).decode(out[0, len(PROMPT) :])


def complete(server: Server) -> dict:
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def spawned_ranks(pid: int) -> list[psutil.Process]:
    """The server's rank processes (multiprocessing's spawned children, not its resource tracker)."""
    return [p for p in psutil.Process(pid).children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]


def test_one_host_two_ranks_answer_as_generate_and_a_dead_rank_exits_the_server(model_dir, tmp_path,
                                                                                 expected) -> None:  # fmt: skip
    server = Server(model_dir, tmp_path, ENGINE)
    try:
        assert complete(server)["choices"][0]["text"] == expected
        [model] = httpx.get(server.url + "/v1/models").json()["data"]
        assert model["engine"]["tensor_parallel_size"] == 2
        [rank1] = spawned_ranks(server.proc.pid)
        rank1.kill()
        assert server.proc.wait(EXIT_WAIT_S) == 1
        assert "tensor-parallel group broken: rank 1 exited with code -9" in server.log.read_text()
    finally:
        server.stop()


def test_sigterm_to_the_whole_process_group_drains_and_exits_0(model_dir, tmp_path) -> None:
    """Ctrl-C or a `timeout` signals every process of the group: ranks leave the stop to rank 0."""
    server = Server(model_dir, tmp_path, ENGINE, own_group=True)
    [rank1] = spawned_ranks(server.proc.pid)
    os.killpg(server.proc.pid, signal.SIGTERM)
    assert server.proc.wait(EXIT_WAIT_S) == 0
    rank1.wait(EXIT_WAIT_S)  # stopped by rank 0, not by the signal
    assert "broken" not in server.log.read_text()


def start_worker(model_dir: Path, tmp_path: Path, *args: str) -> tuple[list[str], subprocess.Popen, Path]:
    """`cbserve worker` as the second of two "hosts" on this machine: (the group flags the server needs
    too, the worker's process, its log)."""
    group = ["--nnodes", "2", "--dist-addr", "127.0.0.1", "--dist-port", str(free_port(fixed=True))]
    config = tmp_path / "engine.yaml"
    config.write_text(yaml.safe_dump(ENGINE))
    log = tmp_path / "worker.log"
    worker = subprocess.Popen([sys.executable, "-m", "engine.cli", "worker", "--model", str(model_dir), "--config",
                               str(config), *args, "--node-rank", "1", *group], stdout=log.open("w"),
                              stderr=subprocess.STDOUT)  # fmt: skip
    return group, worker, log


def test_two_hosts_meet_through_cbserve_worker_and_the_worker_exits_when_the_server_dies(model_dir, tmp_path,
                                                                                         expected) -> None:  # fmt: skip
    group, worker, log = start_worker(model_dir, tmp_path)
    server = None
    try:
        server = Server(model_dir, tmp_path, ENGINE, extra_args=group)
        assert complete(server)["choices"][0]["text"] == expected
        assert not spawned_ranks(server.proc.pid)  # rank 1 is the worker's, not the server's
        server.proc.send_signal(signal.SIGKILL)
        assert worker.wait(EXIT_WAIT_S) == 1, log.read_text()
        assert "exited with code 1" in log.read_text()
    finally:
        if server is not None:
            server.stop()
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_a_worker_killed_while_its_rank_waits_for_rank_0_takes_the_rank_with_it(model_dir, tmp_path) -> None:
    """SIGKILL (the OOM killer) leaves a worker no time to stop its ranks: each ends on its own when its
    parent is gone, instead of holding the model until the join times out (30 minutes)."""
    _, worker, log = start_worker(model_dir, tmp_path)  # no server: rank 0 never listens
    try:
        deadline = time.monotonic() + EXIT_WAIT_S
        # the worker starts its rank as its first step; killed before the rank has read its start-up data
        # from the pipe, the rank ends too, but of that pipe's EOF, before it watches its parent
        while not ((ranks := spawned_ranks(worker.pid)) and "rank 1 started" in log.read_text()):
            assert worker.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)  # polling a child's log, with a deadline
        worker.kill()
        worker.wait()
        ranks[0].wait(EXIT_WAIT_S)  # psutil.TimeoutExpired if it outlives its parent; its status is the line
        assert "tensor-parallel rank 1 stops: the process that started it" in log.read_text(), log.read_text()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_a_host_that_loads_another_dtype_stops_the_group_saying_so(model_dir, tmp_path) -> None:
    """--dtype auto can differ between two hosts' CPUs: a worker holding bfloat16 against a float32 server
    stops with a line that names the cause, not only a broken all-reduce."""
    group, worker, log = start_worker(model_dir, tmp_path, "--dtype", "bfloat16")
    try:
        with pytest.raises(RuntimeError, match="server exited with 1"):
            Server(model_dir, tmp_path, ENGINE, extra_args=group)
        assert worker.wait(EXIT_WAIT_S) != 0
        assert "every host must load the same model with the same --dtype" in log.read_text(), log.read_text()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_worker_arguments_that_cannot_work_are_one_line_and_exit_2(model_dir) -> None:
    run = subprocess.run([sys.executable, "-m", "engine.cli", "worker", "--model", str(model_dir), "--nnodes", "2",
                          "--node-rank", "2", "--dist-addr", "127.0.0.1", "--tensor-parallel-size", "2"],
                         capture_output=True, text=True, timeout=120, env={**os.environ})  # fmt: skip
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].startswith("cbserve: error: cbserve worker needs --nnodes >= 2")


@pytest.mark.parametrize(("args", "message"), [
    (["--nnodes", "2"], "--nnodes 2 needs --tensor-parallel-size of at least 2"),
    (["--tensor-parallel-size", "3", "--nnodes", "2"], "--tensor-parallel-size 3 must be a multiple of --nnodes (2)"),
    (["--tensor-parallel-size", "2", "--nnodes", "2"], "--nnodes > 1 needs --dist-addr: the address the other hosts reach this one at"),
])
def test_serve_group_arguments_that_cannot_work_are_one_line_and_exit_2(model_dir, args, message, capsys) -> None:
    from engine.cli import main

    assert main(["serve", "--model", str(model_dir), "--device", "cpu", *args]) == 2  # before the port is bound
    assert capsys.readouterr().err.strip() == f"cbserve: error: {message}"
