"""One API call in flight: its engine requests (one per prompt, n sequences each), their outputs, their end.

Each prompt is one engine request with `num_return_sequences=n`: it is prefilled once, then the engine
forks n - 1 siblings that share its blocks; each sequence is one choice (choice `p * n + j` is sequence
j of prompt p). The engine's output processor (engine/output_processor.py) makes each output's text:
a stop string ends the sequence in the engine, with "stop", the text cut right before it. Outputs
arrive on the server's event loop through the manager's result handlers.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from engine import ContinuousBatchingManager, GenerationOutput, ParamError, QueueFullError
from engine.output_processor import TokenLogprob, family_ids, new_logprobs
from engine.server.errors import APIError
from engine.server.metrics import ServerMetrics
from engine.server.protocol import HONOURED, GenerationRequest, check_generations, context_exceeded
from engine.server.tools import ToolStream
from engine.structured import client_error

logger = logging.getLogger("cbserve.server")

# the engine's parameter names that the API calls otherwise; "input_ids" is "prompt" or "messages"
API_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "num_return_sequences": "n",
             "stop_strings": "stop"}  # fmt: skip
API_FIELDS = {name for names in HONOURED.values() for name in names}


def api_param(exc: ParamError, req: GenerationRequest) -> str | None:
    """The API field an engine ParamError is about (None for a parameter the client did not give)."""
    if exc.param == "input_ids":
        return "messages" if req.kind == "chat" else "prompt"
    if exc.param == "structured_output":
        return req.structured_param
    name = API_NAMES.get(exc.param, exc.param)
    return name if name in API_FIELDS else None


@dataclass
class Choice:
    index: int
    engine_id: str
    prompt: list[int]
    last: GenerationOutput | None = None
    finish_reason: str | None = None
    tools: ToolStream | None = None  # with tools: holds a tool call's text back and parses it

    @property
    def completion_tokens(self) -> int:
        return 0 if self.last is None else len(self.last.generated_tokens)


@dataclass
class Delta:
    """What one choice adds in one event: text, logprob entries, and its end if it ended."""

    index: int
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class Generation:
    def __init__(self, manager: ContinuousBatchingManager, tokenizer, req: GenerationRequest,
                 metrics: ServerMetrics, max_model_len: int | None, request_id: str = "") -> None:  # fmt: skip
        self.manager, self.tokenizer, self.req, self.metrics = manager, tokenizer, req, metrics
        self.max_model_len = max_model_len
        self.request_id = request_id  # the x-request-id, for the log
        self.cut_error: APIError | None = None  # set by cut(): what events() raises once woken
        self.id = f"{'chatcmpl' if req.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.choices: list[Choice] = []
        self.queue: asyncio.Queue[tuple[int, GenerationOutput] | None] = asyncio.Queue()

    def check_fits(self) -> None:
        """A request that could never be served, refused with 400 before any of it is queued: a
        prompt plus `max_tokens` over the model's context (vLLM's wording), or more engine requests
        (prompts x n) than the admission queue holds at all (the parser checked that already, before
        tokenising; again here for a request built otherwise)."""
        req, limit = self.req, self.max_model_len
        words = "messages" if req.kind == "chat" else "prompt"
        for prompt in req.prompts:
            if limit and len(prompt) >= limit:
                raise context_exceeded(limit, len(prompt), words)
            if limit and req.max_tokens is not None and len(prompt) + req.max_tokens > limit:
                raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                    f"{len(prompt) + req.max_tokens} tokens ({len(prompt)} in the {words}, "
                                    f"{req.max_tokens} in the completion). Please reduce the length of the {words} "
                                    "or completion.", param="max_tokens", code="context_length_exceeded")  # fmt: skip
        check_generations(req, len(req.prompts), self.manager.config.max_queue_size or 0)

    def submit(self) -> None:
        """Add one engine request per prompt, n sequences each; on refusal, withdraw the ones already
        added. May run in a worker thread (a long prompt's validation takes a while); `listen()` then
        follows on the event loop."""
        req = self.req
        self.check_fits()
        try:
            for p, prompt in enumerate(req.prompts):
                max_tokens = req.max_tokens
                if max_tokens is None and self.max_model_len:
                    max_tokens = max(1, self.max_model_len - len(prompt))
                engine_id = self.manager.add_request(
                    prompt, request_id=f"{self.id}-{p}", max_new_tokens=max_tokens, streaming=True,
                    record_timestamps=True, logprobs=req.logprobs, num_return_sequences=req.n, stop_strings=req.stop,
                    detokenize=True, **req.engine_kwargs,
                )  # fmt: skip
                for j, sequence_id in enumerate(family_ids(engine_id, req.n)):
                    self.choices.append(Choice(p * req.n + j, sequence_id, prompt,
                                               tools=ToolStream(req.tools) if req.tools is not None else None))  # fmt: skip
        except QueueFullError as exc:
            self.cancel()
            self.metrics.rejected("queue_full")
            raise APIError(503, f"the server is busy: {exc}; retry later", type="server_busy",
                           code="queue_full", headers={"Retry-After": "1"}) from None  # fmt: skip
        except ParamError as exc:
            self.cancel()
            raise APIError(400, str(exc), param=api_param(exc, req)) from None
        except ValueError as exc:
            self.cancel()
            raise APIError(400, str(exc)) from None
        except RuntimeError as exc:  # the manager stopped
            self.cancel()
            raise APIError(503, str(exc), type="service_unavailable", headers={"Retry-After": "5"}) from None

    def listen(self) -> None:
        """On the event loop: every choice's outputs go to `events()` (any that came already, too)."""
        for choice in self.choices:
            self.manager.register_result_handler(choice.engine_id,
                                                 lambda out, i=choice.index: self.queue.put_nowait((i, out)))  # fmt: skip

    def cancel(self) -> None:
        """Withdraw every choice that has not ended (client gone, or an error): they end as "abort"."""
        for choice in self.choices:
            if choice.finish_reason is None:
                self.manager.cancel_request(choice.engine_id)
                choice.finish_reason = "abort"
                self.metrics.finished(choice.last, self._prompt_share(choice), choice.completion_tokens, "abort")

    def abandon(self) -> None:
        """The client left: cancel what has not ended, and wake `events()` so that it ends too."""
        self.cancel()
        self.queue.put_nowait(None)

    def cut(self, error: APIError) -> None:
        """The server is shutting down: cancel what has not ended, and make `events()` end with `error`
        (the stream writes it as its last event; a non-streaming request answers it)."""
        if self.done:
            return
        self.cut_error = error
        self.abandon()

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    async def events(self) -> AsyncIterator[Delta]:
        while not self.done:
            item = await self.queue.get()
            if item is None:  # abandon(): every choice has ended
                continue
            index, out = item
            choice = self.choices[index]
            if choice.finish_reason is not None:
                continue  # the engine's last word on a choice already withdrawn (cancel())
            delta = self._advance(choice, out)
            if delta.text or delta.logprobs or delta.finish_reason:
                yield delta
        if self.cut_error is not None:
            raise self.cut_error

    def _failure(self, choice: Choice, error: str) -> APIError:
        """The error a failed choice answers with. A structured-output grammar that cannot go on
        (llguidance's parser limits) is the request's: a 400 with the grammar engine's line. Anything
        else is the server's: logged here, and the client learns only that it failed."""
        if error.startswith("structured output:"):
            why = client_error(error.removeprefix("structured output:"))
            return APIError(400, f"the structured output constraint failed after {choice.completion_tokens} tokens: "
                                 f"{why}", param=self.req.structured_param, code="structured_output_failed")  # fmt: skip
        logger.error("generation failed (request %s): %s", self.request_id, error.splitlines()[0][:500] if error else "")
        return APIError(500, f"generation failed (request {self.request_id}); the server log has the cause",
                        type="server_error")  # fmt: skip

    def _advance(self, choice: Choice, out: GenerationOutput) -> Delta:
        choice.last = out
        text = out.new_text or ""
        reason = None
        if out.is_finished():
            if out.error is not None:
                raise self._failure(choice, out.error)
            reason = {"length": "length", "stop": "stop", "abort": "abort"}.get(out.finish_reason, "stop")
        calls = None
        if choice.tools is not None:
            text = choice.tools.feed(text)
            if reason is not None:
                text += choice.tools.finish()
                calls = choice.tools.calls
                if calls and reason == "stop" and choice.tools.tools.choice != "function":
                    reason = "tool_calls"
        logprobs = new_logprobs(out, self.tokenizer) if self.req.logprobs is not None else []
        delta = Delta(choice.index, text, logprobs, reason, calls)
        if reason is not None:
            choice.finish_reason = reason
            self.metrics.finished(out, self._prompt_share(choice), choice.completion_tokens, reason)
        return delta

    def _prompt_share(self, choice: Choice) -> int:
        """A prompt's tokens count once, as in usage, however many samples (n) it has."""
        return len(choice.prompt) if choice.index % self.req.n == 0 else 0

    # -- what goes back ------------------------------------------------------------------------
    def usage(self) -> dict[str, int]:
        prompt = sum(len(p) for p in self.req.prompts)
        completion = sum(c.completion_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def timings(self) -> dict[str, float | None]:
        """The request's breakdown in seconds (cbserve's extension field `timings`)."""
        outs = [c.last for c in self.choices if c.last is not None]
        if not outs:
            return {}
        created = min(o.created_time for o in outs)
        scheduled = min((o.scheduled_time for o in outs if o.scheduled_time), default=None)
        first = min((o.first_token_time for o in outs if o.first_token_time), default=None)
        end = max((o.finished_time or time.perf_counter()) for o in outs)
        tokens = max(c.completion_tokens for c in self.choices)

        def span(a, b):
            return None if a is None or b is None else round(b - a, 6)

        decode = span(first, end)
        return {
            "queue_s": span(created, scheduled),
            "prefill_s": span(scheduled, first),
            "decode_s": decode,
            "time_to_first_token_s": span(created, first),
            "mean_inter_token_latency_s": round(decode / (tokens - 1), 6) if decode and tokens > 1 else None,
            "e2e_s": span(created, end),
        }

    def logprobs_json(self, entries: list[TokenLogprob]) -> Any:
        """Logprob entries in the endpoint's shape (chat's `content` list, or completions' columns)."""
        if self.req.logprobs is None:
            return None
        if self.req.kind == "chat":
            return {"content": [
                {"token": e.token, "logprob": e.logprob, "bytes": list(e.token.encode()),
                 "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in e.top or ()]}
                for e in entries
            ]}  # fmt: skip
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [dict(e.top) if e.top is not None else None for e in entries],
            "text_offset": [],
        }
