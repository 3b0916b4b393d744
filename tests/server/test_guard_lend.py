"""The guard's lent core for a large body (engine/server/guard.py): it reads the body only once a
stepping engine has shed its OpenMP thread, and gives the core back on time, however slow the sender.
The guard is called as ASGI here: what is tested is the order of the lend, the step boundary and the
body's reads, which a real socket would only blur."""

from __future__ import annotations

import asyncio
import threading

import torch

from engine.openmp import Lend, Team, cores_lent, when_shed
from engine.server import guard
from engine.server.guard import LARGE_BODY, Guard


def _scope(length: int) -> dict:
    return {"type": "http", "method": "POST", "path": "/v1/completions",
            "headers": [(b"content-length", str(length).encode())]}  # fmt: skip


class _App:
    """Reads the body, noting how many cores are lent when it starts and after `then` seconds."""

    def __init__(self, then: float = 0.0) -> None:
        self.then = then
        self.lent: list[int] = []
        self.body = b""

    async def __call__(self, scope, receive, send) -> None:
        self.lent.append(cores_lent())
        self.body = (await receive())["body"]
        await asyncio.sleep(self.then)  # a stream that goes on after its body was parsed
        self.lent.append(cores_lent())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


async def _call(app, scope, receive) -> list[dict]:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    await Guard(app)(scope, receive, send)
    return sent


def test_a_shed_callback_runs_when_the_last_stepping_team_sheds_and_a_lend_ends_once() -> None:
    assert not when_shed(lambda: None)  # no team is stepping: nothing to wait for
    calls: list[int] = []
    stepping, asked = threading.Event(), threading.Event()

    def engine_thread() -> None:
        torch.set_num_threads(2)
        team = Team()
        team.fit()
        stepping.set()
        asked.wait()
        team.fit()  # a lend is held: the team sheds, and the callback runs here
        calls.append(len(calls))
        team.restore()

    t = threading.Thread(target=engine_thread)
    t.start()
    stepping.wait()
    lend = Lend()
    assert when_shed(lambda: calls.append(-1))
    asked.set()
    t.join()
    assert calls == [-1, 1] and cores_lent() == 1
    lend.end()
    lend.end()
    assert cores_lent() == 0


def test_a_large_body_is_read_after_the_engine_sheds_and_its_lend_ends_after_the_handover(monkeypatch) -> None:
    monkeypatch.setattr(guard, "BODY_LEND_HOLD", 0.01)
    events: list[str] = []
    stepping = threading.Event()

    def engine_thread() -> None:
        torch.set_num_threads(2)
        team = Team()
        team.fit()  # a step at full size is under way
        stepping.set()
        while cores_lent() == 0:  # the guard has lent, and now waits for the step boundary
            threading.Event().wait(0.001)
        events.append("step boundary")
        team.fit()
        team.idle()
        team.restore()

    async def receive() -> dict:
        events.append("read")
        return {"type": "http.request", "body": b"x" * LARGE_BODY, "more_body": False}

    app = _App(then=0.2)
    t = threading.Thread(target=engine_thread)
    t.start()
    stepping.wait()
    sent = asyncio.run(_call(app, _scope(LARGE_BODY), receive))
    t.join()
    assert events == ["step boundary", "read"]
    assert app.lent == [1, 0]  # lent while the handler parses; given back while its stream goes on
    assert sent[0]["status"] == 200 and len(app.body) == LARGE_BODY and cores_lent() == 0


def test_a_slow_sender_holds_the_lent_core_no_longer_than_the_bound(monkeypatch) -> None:
    monkeypatch.setattr(guard, "BODY_LEND_MAX", 0.05)
    seen: list[int] = []
    parts = [b"x" * (LARGE_BODY // 2)] * 2

    async def receive() -> dict:
        seen.append(cores_lent())
        if len(seen) == 2:
            await asyncio.sleep(0.3)  # the second half comes late (within the body timeout)
            seen.append(cores_lent())
        return {"type": "http.request", "body": parts[len(seen) // 2], "more_body": len(seen) == 1}

    app = _App()
    sent = asyncio.run(_call(app, _scope(LARGE_BODY), receive))
    assert seen == [1, 1, 0] and app.lent == [0, 0]
    assert sent[0]["status"] == 200 and len(app.body) == LARGE_BODY


def test_a_small_body_lends_nothing() -> None:
    seen: list[int] = []

    async def receive() -> dict:
        seen.append(cores_lent())
        return {"type": "http.request", "body": b"{}", "more_body": False}

    app = _App()
    asyncio.run(_call(app, _scope(2), receive))
    assert seen == [0] and app.lent == [0, 0]
