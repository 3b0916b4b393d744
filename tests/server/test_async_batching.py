"""`cbserve serve --use-async-batching`, as a pod runs it with `engine.useAsyncBatching: true`: greedy
answers, streamed and not, concurrent with other requests, are those of a server stepping one step at a
time (the engine's tests hold both to model.generate), and the steps it ran ahead are counted on /metrics.
On the CPU the flag is turned down unless CBSERVE_ASYNC_BATCHING_ON_CPU=1."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.server.conftest import Server

PROMPTS = [[17, 230, 41, 99, 7, 301, 12, 88, 150, 5], [3, 44, 5, 6], [200, 201, 202, 9, 8, 7, 6, 5, 4, 3, 2, 1]]
NEW = 24


def answer(server: Server, prompt: list[int], stream: bool) -> str:
    body = {"prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True, "stream": stream}
    with httpx.Client(timeout=120) as c:
        if not stream:
            r = c.post(server.url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        text = ""
        with c.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += "".join(choice["text"] for choice in json.loads(line[6:])["choices"])
        return text


def answers(server: Server) -> list[str]:
    jobs = [(p, stream) for stream in (False, True) for p in PROMPTS] * 2  # concurrent: decodes run together
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: answer(server, *job), jobs))


def test_greedy_answers_are_those_of_one_step_at_a_time_and_steps_run_ahead(model_dir, tmp_path) -> None:
    """On the CPU the flag alone is turned down (one step at a time, said in /v1/models); the tests' switch
    runs the pipeline through the whole server."""
    from engine.backends.cpu_executor import ASYNC_ON_CPU_ENV

    engine = {"block_size": 16, "num_blocks": 256}
    plain = Server(model_dir, tmp_path, engine, ["--use-async-batching"])
    try:
        want = answers(plain)
        [model] = httpx.get(plain.url + "/v1/models").json()["data"]
        assert model["engine"]["use_async_batching"] is False
        assert plain.metrics()["cbserve:steps_ahead_total"] == 0
    finally:
        assert plain.stop() == 0
    assert "use_async_batching has no effect on the CPU" in plain.log.read_text()
    ahead = Server(model_dir, tmp_path, engine, ["--use-async-batching"], env={ASYNC_ON_CPU_ENV: "1"})
    try:
        assert answers(ahead) == want
        [model] = httpx.get(ahead.url + "/v1/models").json()["data"]
        assert model["engine"]["use_async_batching"] is True
        assert ahead.metrics()["cbserve:steps_ahead_total"] > 0
    finally:
        assert ahead.stop() == 0
    assert want[: len(PROMPTS)] == want[len(PROMPTS) : 2 * len(PROMPTS)]  # streamed text adds up to the whole
