"""A small OpenAI-compatible server that is not cbserve: no /ready, no /metrics, optional API key.

    python tests/loadtest/openai_standin.py --port 8001 [--api-key KEY] [--no-health] [--token-ms 2]
        [--hold-every K]
    python tests/loadtest/openai_standin.py --fd N ...   # serve on an inherited listening socket

It streams `max_tokens` one-word chunks, `--token-ms` apart, then a usage chunk, as vLLM does with
`stream_options.include_usage`. With --hold-every K every K-th token's text is held back and sent
with the next token's (as a server does for an incomplete UTF-8 character), its own chunk carrying
empty text, as vLLM sends it. The load-test runner's tests drive it through a real uvicorn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

MODEL = "standin-model"


def build_app(api_key: str | None, health: bool, token_ms: float, hold_every: int = 0) -> Starlette:
    def authorised(request: Request) -> bool:
        return api_key is None or request.headers.get("authorization") == f"Bearer {api_key}"

    def refused() -> JSONResponse:
        return JSONResponse({"error": {"message": "bad key", "type": "invalid_request_error"}}, 401)

    async def models(request: Request) -> JSONResponse:
        if not authorised(request):
            return refused()
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def health_route(request: Request) -> JSONResponse:
        return JSONResponse({})

    async def generate(request: Request):
        if not authorised(request):
            return refused()
        body = await request.json()
        chat = request.url.path.endswith("/chat/completions")
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        n = int(body.get("max_tokens", 16))

        def chunk(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        async def events():
            created = int(time.time())
            held = ""
            for i in range(n):
                await asyncio.sleep(token_ms / 1000)  # the stand-in's decode step
                text, held = held + " tok", ""
                if hold_every and (i + 1) % hold_every == 0 and i + 1 < n:
                    text, held = "", text  # this token's text goes out with the next one's
                choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                yield chunk({"id": "x", "created": created, "model": MODEL, "choices": [choice]})
            usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n, "total_tokens": n}
            yield chunk({"id": "x", "created": created, "model": MODEL, "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    routes = [Route("/v1/models", models), Route("/v1/completions", generate, methods=["POST"]),
              Route("/v1/chat/completions", generate, methods=["POST"])]  # fmt: skip
    if health:
        routes.append(Route("/health", health_route))
    return Starlette(routes=routes)


def main() -> None:
    p = argparse.ArgumentParser()
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--port", type=int)
    where.add_argument("--fd", type=int, help="a listening socket the parent bound (no race for the port)")
    p.add_argument("--api-key")
    p.add_argument("--no-health", action="store_true")
    p.add_argument("--token-ms", type=float, default=2.0)
    p.add_argument("--hold-every", type=int, default=0, help="hold every K-th token's text for the next one")
    a = p.parse_args()
    app = build_app(a.api_key, not a.no_health, a.token_ms, a.hold_every)
    if a.fd is not None:
        uvicorn.run(app, fd=a.fd, log_level="warning")
    else:
        uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
