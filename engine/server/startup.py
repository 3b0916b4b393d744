"""Start-up and shutdown as probes see them: the port answers while the model loads, and stays
open while in-flight requests drain.

`Startup` is the ASGI app uvicorn runs. Its lifespan starts loading the model in a background
thread and returns at once, so uvicorn binds the port first: while loading, `/health` is 200
(the process is alive), `/ready` 503 `{"status": "loading"}`, and every other route 503 with
`Retry-After`. When the real app is built, its own lifespan runs (warm-up, engine loop,
`gc.freeze`) and every request goes to it from then on. A load that fails stops the server,
and `serve` re-raises the error (one line, exit 2).

`DrainingServer` is uvicorn's server with SIGTERM handled in two stages: first the app stops
admitting (new requests 503, `/ready` 503 `{"status": "draining"}`) while the listener stays
open and in-flight requests finish, up to the drain timeout; then uvicorn's own shutdown closes
the listener and stops the engine. A second signal exits at once. Requests still running when the
drain times out are ended by the app itself (`ServerState.cut`: a stream gets an error event and
`[DONE]`, a non-streaming request a 503; one warning line each), and the drain waits up to
`CUT_GRACE` seconds for their last bytes, well within uvicorn's own graceful-shutdown timeout (5 s),
which would otherwise cancel their tasks mid-write.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

import uvicorn

logger = logging.getLogger("cbserve.server")

LOADING_RETRY_AFTER = "10"  # seconds; a model takes that order of time to load and warm
CUT_GRACE = 2.0  # seconds the drain waits, after cutting what is left, for the cut requests' last bytes


class Startup:
    def __init__(self, build: Callable[[], Any]) -> None:
        self.build = build  # loads the model and returns the Starlette app (runs in a thread)
        self.app: Any = None
        self.error: BaseException | None = None
        self.on_failure: Callable[[], None] = lambda: None
        self._lifespan: Any = None

    def engine_died(self, exc: BaseException) -> None:
        """The engine ended for good (a broken tensor-parallel group; any thread): /ready and /health
        are 503 already (the engine loop ended), and the server exits with the error."""
        self.error = exc
        self.on_failure()

    @property
    def state(self):
        """The running app's ServerState, or None while loading."""
        return self.app.state.cbserve if self.app is not None else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._run_lifespan(receive, send)
        elif self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await self._while_loading(scope, send)

    async def _run_lifespan(self, receive, send) -> None:
        loader = None
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                loader = asyncio.ensure_future(self._load())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if loader is not None and not loader.done():
                    loader.cancel()
                if self._lifespan is not None:
                    await self._lifespan.__aexit__(None, None, None)
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _load(self) -> None:
        try:
            app = await _in_daemon_thread(self.build)
            lifespan = app.router.lifespan_context(app)
            await lifespan.__aenter__()  # warm-up, engine loop, ready
            self.app, self._lifespan = app, lifespan
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - any failure to load ends the server
            self.error = exc
            logger.error("start-up failed: %s", exc)
            self.on_failure()

    async def _while_loading(self, scope, send) -> None:
        path = scope.get("path", "")
        if path == "/health":
            status, body, headers = 200, {"status": "loading"}, []
        elif path == "/ready":
            status, body, headers = 503, {"status": "loading"}, []
        else:
            status, headers = 503, [(b"retry-after", LOADING_RETRY_AFTER.encode())]
            body = {"error": {"message": "the model is still loading; retry later", "type": "service_unavailable",
                              "param": None, "code": None}}  # fmt: skip
        raw = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                                *headers]})  # fmt: skip
        await send({"type": "http.response.body", "body": raw})


async def _in_daemon_thread(fn: Callable[[], Any]) -> Any:
    """`fn()` in a daemon thread: a server told to exit while loading does not wait for the load
    to finish (asyncio.to_thread's pool is joined at exit)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting coroutine
            loop.call_soon_threadsafe(lambda exc=exc: future.done() or future.set_exception(exc))
        else:
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(result))

    threading.Thread(target=run, name="cbserve-load", daemon=True).start()
    return await future


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, startup: Startup, drain_timeout: float) -> None:
        super().__init__(config)
        self.boot, self.drain_timeout = startup, drain_timeout  # not `startup`: uvicorn.Server has one
        self._draining: asyncio.Task | None = None
        startup.on_failure = self._fail

    def _fail(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig: int, frame) -> None:
        """uvicorn's signal handler (SIGTERM, SIGINT), called in the main thread, where the loop runs."""
        state = self.boot.state
        if self._draining is not None:
            logger.warning("second signal: exiting without waiting for in-flight requests")
            self.force_exit = True
            super().handle_exit(sig, frame)
            return
        if state is None:  # still loading: nothing to drain
            self._exit(sig, frame)
            return
        state.draining = True  # new requests 503, /ready 503; the listener stays open meanwhile
        logger.info("signal %d: draining %d in-flight request(s), up to %.0f s", sig, state.in_flight,
                    self.drain_timeout)  # fmt: skip
        loop = asyncio.get_running_loop()
        self._draining = loop.create_task(self._drain(sig, frame))
        loop.call_soon_threadsafe(lambda: None)  # wake the selector: the task starts now, not at the next tick

    async def _drain(self, sig: int, frame) -> None:
        state = self.boot.state
        try:
            await asyncio.wait_for(state.idle(), self.drain_timeout)
        except TimeoutError:
            logger.warning("drain timeout: %d request(s) still in flight are cut", state.in_flight)
            state.cut()
            try:
                await asyncio.wait_for(state.idle(), CUT_GRACE)
            except TimeoutError:
                logger.warning("%d request(s) did not end within %g s of being cut", state.in_flight, CUT_GRACE)
        self._exit(sig, frame)

    def _exit(self, sig: int, frame) -> None:
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM and sig in self._captured_signals:  # a drained SIGTERM exits 0, not re-raised
            self._captured_signals.remove(sig)
