"""What every HTTP request passes before a handler: the API key, the body's size and its pace.

A pure ASGI middleware around the Starlette app, so responses (SSE streams too) pass through it
untouched. For each request:
- **API key.** With keys configured (`--api-key`, repeatable, or `CBSERVE_API_KEY`, comma-separated),
  every path but the probes' and the scraper's (`/health`, `/ready`, `/metrics`) needs
  `Authorization: Bearer <key>`. The offered key is compared with every configured key in constant
  time (`hmac.compare_digest`); a missing or wrong key gets 401.
- **Body size.** A `Content-Length` over `max_body_bytes` gets 413 before any of the body is read;
  a chunked body gets 413 as soon as what arrived passes the limit.
- **Body pace.** A body whose next part does not arrive within `body_timeout` seconds gets 408, so a
  client that sends half a body cannot hold a connection and its buffer forever.
- **Request id.** Every request gets one: the client's `x-request-id` when it is a plain token (up to
  128 letters, digits and `-_.:/+=@`), else a new one. The handlers find it in
  `scope["state"]["request_id"]`, every response carries it back, and every refusal (here and in the
  handlers, `log_refusal`) is one warning line that names it.
- **A core for a large body.** While a body of `LARGE_BODY` bytes or more arrives, the engine steps
  on one OpenMP thread fewer (`engine.openmp.Lend`): before reading it the guard waits (without
  blocking the event loop, at most `BODY_LEND_MAX` seconds) for the engine's next step boundary,
  so that no step runs at full size while the event loop takes a core to receive megabytes. The
  lend ends `BODY_LEND_HOLD` after the body is whole (the handler's parse takes its own by then),
  and after `BODY_LEND_MAX` seconds whatever the body's pace: a slow sender does not keep the
  engine at half its cores.
The body is read here, whole, and handed to the app as one message (every route reads it whole
anyway); later `receive()` calls, which the handlers use to notice a client leaving, pass through.
Errors are OpenAI error JSON, as the handlers' are.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import uuid
from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.openmp import Lend, forget_shed, when_shed
from engine.server.errors import APIError

logger = logging.getLogger("cbserve.server")

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
DEFAULT_MAX_BODY_BYTES = 4 * 2**20  # about a million tokens as a JSON list of ids
DEFAULT_BODY_TIMEOUT = 30.0
LARGE_BODY = 1 << 20  # bytes: receiving, parsing and tokenising a body this large takes a core for a while
BODY_LEND_MAX = 2.0  # seconds a lent core covers one body's arrival, at most (a step boundary is waited for within it)
BODY_LEND_HOLD = 0.25  # seconds the lend outlasts the whole body, so the handler's own lend takes over
_REQUEST_ID = re.compile(r"[A-Za-z0-9_.:/+=@-]{1,128}")


def request_id(given: str | None) -> str:
    """The client's id when it is a plain token, else a new one: a header echoed into responses and
    log lines carries no markup, control characters or kilobytes."""
    return given if given is not None and _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex


def log_refusal(method: str, path: str, error: APIError, rid: str) -> None:
    """One warning line per refused request: its id, route, status and message (one line, bounded)."""
    message = " ".join(error.message.split())[:300]
    logger.warning("request %s: %s %s refused with %d: %s", rid, method, path[:100], error.status, message)


def split_keys(value: str | None) -> tuple[str, ...]:
    """API keys from a comma-separated string (CBSERVE_API_KEY), blanks dropped."""
    return tuple(k.strip() for k in (value or "").split(",") if k.strip())


class Guard:
    def __init__(
        self, app: ASGIApp, api_keys: Sequence[str] = (), max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        body_timeout: float = DEFAULT_BODY_TIMEOUT,
    ) -> None:  # fmt: skip
        self.app = app
        self.keys = [k.encode() for k in api_keys]
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        rid = request_id(headers.get("x-request-id"))
        scope.setdefault("state", {})["request_id"] = rid
        send = _with_request_id(send, rid)
        if self.keys and scope["path"] not in OPEN_PATHS and not self._authorized(headers):
            error = APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                             type="authentication_error", code="invalid_api_key",
                             headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
            return await self._reject(error, scope, receive, send)
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return await self._reject(self._too_large(), scope, receive, send)
        if scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        lend = timer = None
        if length is not None and int(length) >= LARGE_BODY:
            lend = Lend()
            timer = loop.call_later(BODY_LEND_MAX, lend.end)
        try:
            if lend is not None:
                await _engine_shed(loop, BODY_LEND_MAX)
            body = await self._body(scope, receive, send)
            if body is None:
                return
            if lend is not None:
                timer.cancel()
                timer = loop.call_later(BODY_LEND_HOLD, lend.end)
            await self.app(scope, _replay(body, receive), send)
        finally:
            if lend is not None:
                timer.cancel()
                lend.end()

    async def _body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None when the request was answered here (408, 413) or its client left."""
        body = bytearray()
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout)
            except TimeoutError:
                error = APIError(408, f"the request body did not arrive within {self.body_timeout:g} s",
                                 code="request_timeout", headers={"Connection": "close"})  # fmt: skip
                await self._reject(error, scope, receive, send)
                return None
            if message["type"] == "http.disconnect":
                return None  # the client left before its request was whole: nothing to answer
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await self._reject(self._too_large(), scope, receive, send)
                return None
            if not message.get("more_body", False):
                return bytes(body)

    def _authorized(self, headers: Headers) -> bool:
        scheme, _, offered = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        offered_bytes = offered.strip().encode()
        matches = [hmac.compare_digest(offered_bytes, key) for key in self.keys]  # every key: no early exit
        return any(matches)

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is over the server's limit of {self.max_body_bytes} bytes "
                             "(--max-body-bytes)", code="request_too_large", headers={"Connection": "close"})  # fmt: skip

    @staticmethod
    async def _reject(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
        log_refusal(scope["method"], scope["path"], error, scope["state"]["request_id"])
        await JSONResponse(error.body(), status_code=error.status, headers=error.headers)(scope, receive, send)


async def _engine_shed(loop: asyncio.AbstractEventLoop, timeout: float) -> None:
    """Until no engine steps at full size (it sheds a thread at its next step boundary), at most
    `timeout` seconds; the event loop runs on meanwhile."""
    shed = asyncio.Event()

    def wake() -> None:  # on the engine thread
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
            loop.call_soon_threadsafe(shed.set)

    if not when_shed(wake):
        return
    try:
        await asyncio.wait_for(shed.wait(), timeout)
    except TimeoutError:
        pass
    finally:
        forget_shed(wake)


def _with_request_id(send: Send, rid: str) -> Send:
    """A send that puts `x-request-id` on the response's headers (in place of any the app set)."""
    header = (b"x-request-id", rid.encode())

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            kept = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
            message = {**message, "headers": [*kept, header]}
        await send(message)

    return sending


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the whole body once, then whatever the connection says next."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
