"""The manager's output thread: text, stop strings and delivery, beside the engine's steps.

The engine thread only appends token ids. After each step it hands this thread, in order, each
output to deliver (made without text) and, for a request with text that streams nothing, just its
token count. This thread feeds the new tokens to the request's incremental detokenizer and stop
strings (engine/detokenizer.py), fills in the output's `text` and `new_text`, and delivers it; its
tokenizer calls and the delivery run while the engine thread runs the next step's forward.

A stop string ends the sequence: when one completes at the N-th generated token, this thread hands
out the final output itself, cut to N tokens with "stop" (what the engine would have produced had it
found the stop string in that step), and tells the engine (`LLMEngine.end_at`), which drops the
tokens it sampled meanwhile and ends the request at its next step. Whatever the engine sends for the
request after that is not delivered. So callers see what they see with text on the engine thread:
the same tokens, text, finish reason and usage; the engine samples at most a step or two more.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from engine.output_processor import add_text, cut_output, snapshot
from engine.request import GenerationOutput, Request, RequestStatus

logger = logging.getLogger("cbserve.manager")

Deliver = Callable[[GenerationOutput], None]
EndAt = Callable[[Request, int, str, str | None], None]


class OutputThread:
    def __init__(self, deliver: Deliver, end_at: EndAt) -> None:
        """`deliver` hands one output to its caller; `end_at(req, num_generated, reason, error)` tells the
        engine that the request ends there (LLMEngine.end_at, thread-safe)."""
        self._deliver, self._end_at = deliver, end_at
        self._queue: queue.SimpleQueue[tuple[Request | None, int, GenerationOutput | None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="cbserve-output", daemon=True)
        self._thread.start()

    def put(self, req: Request | None, out: GenerationOutput | None) -> None:
        """From the engine thread: `out` to deliver (None: `req` has text but hands nothing out now); `req`
        (None for an output of no engine request) is fed its new tokens first when its text is deferred."""
        count = len(out.generated_tokens) if out is not None else req.num_generated
        self._queue.put((req, count, out))

    def close(self) -> None:
        """Deliver everything queued so far, then end the thread."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            req, count, out = item
            try:
                if req is not None and req.text_deferred:
                    out = self._text(req, count, out)
                if out is not None:
                    self._deliver(out)
            except Exception as exc:  # a tokenizer that fails fails its request, not the thread
                logger.exception("output processing failed")
                if req is not None and req.text_deferred and not req.output_done:
                    self._fail(req, f"{type(exc).__name__}: {exc}")

    def _text(self, req: Request, count: int, out: GenerationOutput | None) -> GenerationOutput | None:
        """Feed the request's tokens up to `count` to its text stream; the output with its text, or the
        final output cut at a stop string; None when there is nothing to deliver."""
        if req.output_done:
            return None  # its final output went out: the engine's later ones are dropped
        stream, start = req.text_stream, req.num_prompt_tokens
        if stream.num_tokens < count and not stream.stopped:
            stream.add(req.token_ids[start + stream.num_tokens : start + count])
        if stream.stopped:
            n = stream.num_tokens  # the token that completed the stop string is the last
            if out is None:
                out = snapshot(req, 0)  # a request that streams nothing: its first output is its last
            if not (out.is_finished() and out.finish_reason == "stop" and len(out.generated_tokens) == n):
                cut_output(out, n, time.perf_counter())
                self._end_at(req, n, "stop", None)
            req.output_done = True
        if out is not None:
            add_text(out, req)
        return out

    def _fail(self, req: Request, error: str) -> None:
        """The request's text could not be made: it fails, with the tokens handed out so far."""
        out = snapshot(req, req.num_streamed)
        out.new_tokens = []
        cut_output(out, req.num_streamed, time.perf_counter())
        out.finish_reason, out.error, out.status = "error", error, RequestStatus.FAILED
        out.text, out.new_text = req.text_stream.text, ""
        req.output_done = True
        self._end_at(req, req.num_streamed, "error", error)
        self._deliver(out)
