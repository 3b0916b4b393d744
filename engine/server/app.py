"""The OpenAI-compatible HTTP endpoint, as a Starlette app over one ContinuousBatchingManager."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.exposition import choose_encoder
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine import ContinuousBatchingManager
from engine.llm_engine import token_ids_ok
from engine.openmp import lend_core
from engine.server import otel
from engine.server.constraints import ConstraintCompiler
from engine.server.errors import APIError
from engine.server.generation import Delta, Generation
from engine.server.guard import DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_BODY_BYTES, LARGE_BODY, Guard, log_refusal
from engine.server.metrics import ServerMetrics
from engine.server.protocol import check_prompt_size, max_token_chars, parse_chat, parse_completion, text
from engine.server.tokenizing import ServerTokenizer

logger = logging.getLogger("cbserve.server")


@dataclass
class ServerState:
    manager: ContinuousBatchingManager
    tokenizer: Any
    model_name: str
    max_model_len: int
    metrics: ServerMetrics
    token_chars: int = 1  # the tokenizer's longest entry, in characters (protocol.max_token_chars)
    ready: bool = False
    draining: bool = False
    in_flight: int = 0  # generation requests between their arrival and their last byte
    constraints: ConstraintCompiler | None = None  # structured output compiles (build_state makes it)
    live: set[Generation] = field(default_factory=set)  # admitted generations not yet over
    cut_error: APIError | None = None  # set when the drain ran out: every live generation ends with it
    _idle: asyncio.Event | None = None

    @property
    def vocab_size(self) -> int:
        return self.manager.engine.vocab_size

    @property
    def max_generations(self) -> int:
        """The most engine requests one API call may make: the admission queue's size (0: no limit)."""
        return self.manager.config.max_queue_size or 0

    def track(self, gen: Generation) -> None:
        self.live.add(gen)
        if self.cut_error is not None:  # admitted while the drain was cutting
            self._cut(gen)

    def untrack(self, gen: Generation) -> None:
        self.live.discard(gen)

    def cut(self) -> None:
        """The drain ran out: every live generation ends now with a 503 "shutting down" (a stream
        writes it as an error event, then [DONE]); one warning line per generation."""
        self.cut_error = APIError(503, "the server is shutting down: this request was cut before it finished",
                                  type="service_unavailable", code="shutting_down", headers={"Retry-After": "5"})  # fmt: skip
        for gen in [gen for gen in self.live if not gen.done]:
            self._cut(gen)

    def _cut(self, gen: Generation) -> None:
        tokens = sum(c.completion_tokens for c in gen.choices)
        logger.warning("request %s: cut at shutdown after %d generated tokens", gen.request_id, tokens)
        gen.cut(self.cut_error)

    def enter(self) -> None:
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    async def idle(self) -> None:
        """Returns once no generation request is in flight (the drain waits on it)."""
        while self.in_flight:
            self._idle = asyncio.Event()
            await self._idle.wait()


def _json(data: Any, status: int = 200, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(data, status_code=status, headers=headers)


def _request_id(request: Request) -> str:
    """The id the Guard gave the request (engine/server/guard.py); it puts it on every response."""
    return request.scope.get("state", {}).get("request_id") or "-"


def _error(exc: APIError, request: Request, log: bool = True) -> JSONResponse:
    """A refusal: OpenAI's error JSON, and one warning line in the log (unless it was logged already)."""
    if log:
        log_refusal(request.method, request.url.path, exc, _request_id(request))
    return _json(exc.body(), exc.status, dict(exc.headers))


def _handled(handler):
    """A route handler whose unexpected exceptions are one JSON 500 that says nothing of them (the
    log has the traceback and the request id), not Starlette's plain-text one."""

    async def handle(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception:
            rid = _request_id(request)
            logger.exception("request %s: %s %s failed", rid, request.method, request.url.path)
            error = APIError(500, f"internal error (request {rid}); the server log has the cause", type="server_error")
            return _json(error.body(), 500)

    return handle


MAX_CONTAINERS = 65536  # JSON arrays and objects in one body (json.loads builds them all in one call, holding the GIL)
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
LOOP_TOKENS = 16384  # requests of up to this many prompt tokens (all prompts) are queued from the event loop


def _lending(raw: bytes) -> contextlib.AbstractContextManager:
    """For a body of LARGE_BODY bytes or more, the engine steps on one thread fewer while it is parsed
    and tokenised (engine/openmp.py): with its OpenMP workers spinning between kernels, a step that
    shares its cores with a second of parsing stretches from milliseconds to hundreds of them."""
    return lend_core() if len(raw) >= LARGE_BODY else contextlib.nullcontext()


def _loads(raw: bytes) -> Any:
    """The body's JSON; in a worker thread (a request's body is read, checked and dropped there: making
    and freeing a large one's objects holds the GIL). A body of more than MAX_CONTAINERS arrays and
    objects is refused before it is parsed: a million one-element lists take json.loads, which holds
    the GIL throughout, a large part of a second (more with the collector tracking every one)."""
    if raw.count(b"[") + raw.count(b"{") > MAX_CONTAINERS:  # brackets in strings too: count again without them
        bare = _STRING.sub(b"", raw)
        containers = bare.count(b"[") + bare.count(b"{")
        if containers > MAX_CONTAINERS:
            raise APIError(400, f"the request body holds {containers} JSON arrays and objects; at most "
                                f"{MAX_CONTAINERS} are allowed", code="request_too_complex")  # fmt: skip
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None


async def _json_off_loop(data: Any) -> Response:
    """A JSON response rendered in a worker thread: a long token list or text (tokenize, echo)
    takes a large part of a second to serialise."""
    body = await asyncio.to_thread(json.dumps, data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return Response(body.encode(), media_type="application/json")


async def _off_loop(fn, *args):
    """Tokenisation, chat templates and long decodes run in a worker thread: a large input then
    holds the GIL in slices, and the event loop keeps every other stream and probe moving."""
    return await asyncio.to_thread(fn, *args)


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _CountedStream(StreamingResponse):
    """A stream that calls `on_end` once it is over, however it ends (sent, client gone, error)."""

    def __init__(self, content, on_end, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._on_end = on_end

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_end()


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


class Handlers:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    # -- generation ----------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, parse_completion)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, parse_chat)

    async def _generate(self, request: Request, parse) -> Response:
        state = self.state
        state.enter()
        try:
            response = await self._admit(request, parse)
        except BaseException:
            state.leave()
            raise
        if not isinstance(response, _CountedStream):
            state.leave()  # a stream leaves when it has been sent, or its client has gone
        return response

    def _parse(self, raw: bytes, parse) -> Any:
        """Every check, cheapest first, then the parse (tokenising last); in a worker thread."""
        state = self.state
        with _lending(raw):
            body = _loads(raw)
            check_prompt_size(body, state.max_model_len, state.token_chars)
            return parse(body, state.tokenizer, state.vocab_size, state.max_generations)

    async def _admit(self, request: Request, parse) -> Response:
        state = self.state
        try:
            if state.draining or not state.ready:
                raise APIError(503, "the server is not accepting requests (starting or shutting down)",
                               type="service_unavailable", headers={"Retry-After": "5"})  # fmt: skip
            req = await _off_loop(self._parse, await request.body(), parse)
            if req.model is not None and req.model != state.model_name:
                raise APIError(404, f"the model {req.model[:100]!r} does not exist; this server serves "
                                    f"{state.model_name!r}", param="model", code="model_not_found")  # fmt: skip
            gen = Generation(state.manager, state.tokenizer, req, state.metrics, state.max_model_len,
                             _request_id(request))  # fmt: skip
        except APIError as exc:
            return _error(exc, request)
        span = otel.request_span(gen)
        try:
            with otel.current(span):  # the engine's request spans become this span's children
                if req.structured is not None:  # off the engine thread, within a time budget
                    req.engine_kwargs["structured_output"] = await state.constraints.compile(req.structured,
                                                                                             req.structured_param)
                if sum(map(len, req.prompts)) > LOOP_TOKENS:
                    await _off_loop(gen.submit)  # the engine checks every token id of a long prompt
                else:
                    gen.submit()
            gen.listen()
        except APIError as exc:
            otel.end_span(span, gen, exc.message)
            return _error(exc, request)
        state.track(gen)
        if req.stream:
            def ended() -> None:  # however the stream ended, even if its generator never started
                state.untrack(gen)
                state.leave()

            return _CountedStream(self._stream(gen, request, span), on_end=ended, media_type="text/event-stream")
        try:
            return await self._complete(request, gen, span)
        finally:
            state.untrack(gen)

    async def _complete(self, request: Request, gen: Generation, span: Any) -> Response:
        """Non-streaming: gather everything, unless the client leaves first (then cancel)."""
        state = self.state
        pieces: dict[int, list[str]] = {c.index: [] for c in gen.choices}
        logprobs: dict[int, list] = {c.index: [] for c in gen.choices}
        calls: dict[int, list] = {}

        async def collect() -> None:
            async for delta in gen.events():
                pieces[delta.index].append(delta.text)
                logprobs[delta.index] += delta.logprobs
                if delta.tool_calls:
                    calls[delta.index] = delta.tool_calls

        collector = asyncio.ensure_future(collect())
        watcher = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not collector.done():  # the client is gone
                collector.cancel()
                gen.cancel()
                return Response(status_code=499)
            collector.result()
        except APIError as exc:
            gen.cancel()
            return _error(exc, request, log=exc is not gen.cut_error)  # a cut was logged when it was made
        finally:
            watcher.cancel()
            otel.end_span(span, gen)
        choices = []
        for c in gen.choices:
            text = "".join(pieces[c.index])
            if gen.req.echo and gen.req.kind == "completion":
                text = await _off_loop(lambda p: state.tokenizer.decode(p, skip_special_tokens=True), c.prompt) + text
            lp = gen.logprobs_json(logprobs[c.index])
            if gen.req.kind == "chat":
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if c.index in calls:
                    message = {"role": "assistant", "content": text.strip() or None, "tool_calls": calls[c.index]}
                choices.append({"index": c.index, "message": message, "logprobs": lp, "finish_reason": c.finish_reason})
            else:
                choices.append({"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
        body = {
            "id": gen.id,
            "object": "chat.completion" if gen.req.kind == "chat" else "text_completion",
            "created": gen.created,
            "model": state.model_name,
            "choices": choices,
            "usage": gen.usage(),
            "timings": gen.timings(),
        }
        return await _json_off_loop(body)

    async def _stream(self, gen: Generation, request: Request, span: Any) -> AsyncIterator[str]:
        state = self.state
        # a client that leaves is noticed at once, not at the next write. Starlette watches for it
        # itself only under ASGI < 2.4 (uvicorn 0.54 speaks 2.3); under 2.4 it relies on the next
        # send failing, which during a long prefill comes seconds of wasted steps later
        watcher = asyncio.ensure_future(_wait_for_disconnect(request))
        watcher.add_done_callback(lambda w: None if w.cancelled() or w.exception() else gen.abandon())
        chat = gen.req.kind == "chat"
        base = {"id": gen.id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": gen.created, "model": state.model_name}  # fmt: skip

        def chunk(delta: Delta) -> dict:
            lp = gen.logprobs_json(delta.logprobs) if delta.logprobs else None
            if chat:
                body: dict[str, Any] = {"content": delta.text} if delta.text else {}
                if delta.tool_calls:
                    body["tool_calls"] = [{"index": k, **call} for k, call in enumerate(delta.tool_calls)]
                choice = {"index": delta.index, "delta": body, "logprobs": lp, "finish_reason": delta.finish_reason}
            else:
                choice = {"index": delta.index, "text": delta.text, "logprobs": lp,
                          "finish_reason": delta.finish_reason}  # fmt: skip
            return event(choice)

        def event(choice: dict) -> dict:
            if gen.req.continuous_usage:  # the tokens so far, held text included
                return {**base, "choices": [choice], "usage": gen.usage()}
            return {**base, "choices": [choice]}

        try:
            if chat:
                for c in gen.choices:
                    yield _sse(event({"index": c.index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}))  # fmt: skip
            async for delta in gen.events():
                yield _sse(chunk(delta))
            if gen.req.include_usage:
                yield _sse({**base, "choices": [], "usage": gen.usage(), "timings": gen.timings()})
        except APIError as exc:  # after the headers went out, an error can only travel in the stream
            if exc is not gen.cut_error:  # a cut was logged when it was made
                log_refusal(request.method, request.url.path, exc, gen.request_id)
            yield _sse(exc.body())
        except Exception:
            logger.exception("request %s: stream failed", gen.request_id)
            error = APIError(500, f"internal error (request {gen.request_id}); the server log has the cause",
                             type="server_error")  # fmt: skip
            yield _sse(error.body())
        finally:
            watcher.cancel()
            gen.cancel()  # no-op for finished choices; frees the rest when the client went away
            otel.end_span(span, gen)
        yield "data: [DONE]\n\n"

    # -- the rest ------------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        model = {"id": self.state.model_name, "object": "model", "created": int(time.time()),
                 "owned_by": "cbserve", "max_model_len": self.state.max_model_len,
                 "engine": self.state.manager.engine.placement()}  # fmt: skip
        return _json({"object": "list", "data": [model]})

    async def tokenize(self, request: Request) -> Response:
        try:
            ids = await _off_loop(self._tokenize, await request.body())
        except APIError as exc:
            return _error(exc, request)
        return await _json_off_loop({"tokens": ids, "count": len(ids), "max_model_len": self.state.max_model_len})

    def _tokenize(self, raw: bytes) -> list[int]:
        with _lending(raw):
            return self._tokens(raw)

    def _tokens(self, raw: bytes) -> list[int]:
        """/tokenize's checks and tokens, in a worker thread."""
        state = self.state
        body = _loads(raw)
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        check_prompt_size(body, state.max_model_len, state.token_chars)
        if "messages" in body:
            return parse_chat({"messages": body["messages"]}, state.tokenizer, state.vocab_size).prompts[0]
        prompt, add = body.get("prompt"), body.get("add_special_tokens", True)
        if not isinstance(prompt, str):
            raise APIError(400, "give 'prompt' (a string) or 'messages'", param="prompt")
        if not isinstance(add, bool):
            raise APIError(400, "'add_special_tokens' must be a boolean", param="add_special_tokens")
        return state.tokenizer(text(prompt, "prompt"), add_special_tokens=add).input_ids

    async def detokenize(self, request: Request) -> Response:
        try:
            prompt = await _off_loop(self._detokenize, await request.body())
        except APIError as exc:
            return _error(exc, request)
        return await _json_off_loop({"prompt": prompt})

    def _detokenize(self, raw: bytes) -> str:
        """/detokenize's checks (the count first, from the body's commas before it is parsed; then C
        loops over slices, engine/llm_engine.py's token_ids_ok) and text, in a worker thread. At most
        max_model_len ids, as many as any prompt or output has: parsing a million ids and decoding
        them each hold the GIL throughout, for a large part of a second."""
        vocab, limit = self.state.vocab_size, self.state.max_model_len
        if raw.count(b",") > limit and _STRING.sub(b"", raw).count(b",") > limit:  # refused before it is parsed
            raise APIError(400, f"'tokens' has more than {limit} ids; at most {limit} (the model's context) are "
                                "allowed", param="tokens")  # fmt: skip
        with _lending(raw):
            return self._text(raw, vocab, limit)

    def _text(self, raw: bytes, vocab: int, limit: int) -> str:
        body = _loads(raw)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list):
            raise APIError(400, "'tokens' must be a list of token ids", param="tokens")
        if len(tokens) > limit:
            raise APIError(400, f"'tokens' has {len(tokens)} ids; at most {limit} (the model's context) are allowed",
                           param="tokens")  # fmt: skip
        if not token_ids_ok(tokens, vocab):
            if set(map(type, tokens)) != {int}:
                raise APIError(400, "'tokens' must be a list of token ids", param="tokens")
            t = next(t for t in tokens if not 0 <= t < vocab)
            raise APIError(400, f"token id {t} is outside the vocabulary [0, {vocab})", param="tokens")
        return self.state.tokenizer.decode(tokens)

    async def health(self, request: Request) -> Response:
        alive = self.state.manager.is_running()
        return _json({"status": "ok" if alive else "engine loop is not running"}, 200 if alive else 503)

    async def ready(self, request: Request) -> Response:
        state = self.state
        if state.draining:
            return _json({"status": "draining"}, 503)
        if not state.ready or not state.manager.is_running():
            return _json({"status": "loading"}, 503)
        return _json({"status": "ready"})

    async def metrics(self, request: Request) -> Response:
        """The Prometheus exposition, as prometheus_client's own app serves it: OpenMetrics when the
        scraper's Accept asks for it, and only the samples named by `name[]` query parameters when there
        are any (a sampler that reads three gauges once a second does not have every histogram made,
        sent and parsed each time)."""
        registry = self.state.metrics.registry
        names = request.query_params.getlist("name[]")
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(registry.restricted_registry(names) if names else registry), media_type=content_type)


def freeze_startup_objects() -> None:
    """Moves every object alive after start-up (the model, torch, transformers) out of the garbage
    collector's reach (`gc.freeze`), as vLLM does: a full collection then scans only what requests
    create. Over the start-up objects (hundreds of thousands) one takes a noticeable fraction of a
    second, a stall of every stream."""
    gc.collect()
    gc.freeze()


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own 404 and 405 (no such route, wrong method) as OpenAI error JSON."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    message = f"{request.method} {request.url.path[:100]}: {exc.detail}"
    return _error(APIError(exc.status_code, message, code=code, headers=dict(exc.headers or {})), request)


def create_app(
    state: ServerState, api_keys: tuple[str, ...] = (), max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout: float = DEFAULT_BODY_TIMEOUT,
) -> Starlette:  # fmt: skip
    """The app; its lifespan starts the engine loop (after warm-up) and stops it last. Every
    request passes the Guard first (engine/server/guard.py: API keys, body size and pace)."""
    h = Handlers(state)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        if not state.manager.is_running():
            await asyncio.to_thread(state.manager.warmup)
            state.manager.start()
        if isinstance(state.tokenizer, ServerTokenizer):
            await asyncio.to_thread(state.tokenizer.start)
        try:  # the grammar engine's view of the tokenizer (~0.4 s for a 49k vocabulary), before the first request
            await asyncio.to_thread(state.manager.engine.compile_grammar, {"json_object": True})
        except (ValueError, ImportError) as exc:
            logger.warning("structured output and forced tool calls are unavailable: %s", exc)
        freeze_startup_objects()
        state.ready = True
        logger.info("ready: serving %s", state.model_name)
        try:
            yield
        finally:
            state.draining = True
            await asyncio.to_thread(state.manager.stop, True, 60.0)
            if isinstance(state.tokenizer, ServerTokenizer):
                state.tokenizer.close()

    routes = [
        Route("/v1/completions", _handled(h.completions), methods=["POST"]),
        Route("/v1/chat/completions", _handled(h.chat), methods=["POST"]),
        Route("/v1/models", _handled(h.models), methods=["GET"]),
        Route("/tokenize", _handled(h.tokenize), methods=["POST"]),
        Route("/detokenize", _handled(h.detokenize), methods=["POST"]),
        Route("/health", h.health, methods=["GET"]),
        Route("/ready", h.ready, methods=["GET"]),
        Route("/metrics", h.metrics, methods=["GET"]),
    ]
    guard = Middleware(Guard, api_keys=api_keys, max_body_bytes=max_body_bytes, body_timeout=body_timeout)
    app = Starlette(routes=routes, lifespan=lifespan, middleware=[guard], exception_handlers={HTTPException: _http_error})
    app.state.cbserve = state
    return app


def build_state(manager: ContinuousBatchingManager, tokenizer, model_name: str, max_model_len: int) -> ServerState:
    """The server's state; the manager's engine takes the server's tokenizer (its output processor makes every
    choice's text, engine/output_processor.py)."""
    manager.use_generation_config(tokenizer=tokenizer)
    metrics = ServerMetrics(model_name, max_model_len, manager.stats)
    return ServerState(manager, ServerTokenizer(tokenizer, max_model_len), model_name, max_model_len, metrics,
                       token_chars=max_token_chars(tokenizer),
                       constraints=ConstraintCompiler(manager.engine.compile_grammar))  # fmt: skip
