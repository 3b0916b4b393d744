"""The manager's output thread: outputs, text, stop strings and delivery, beside the engine's steps.

The engine thread only appends token ids. After each step it hands this thread, in order, a few
numbers per request that got a token (its token count, and its status and end as they are then);
this thread builds the outputs from them (copying the token, logprob and timestamp lists), feeds the
new tokens of a request with text to its incremental detokenizer and stop strings
(engine/detokenizer.py), fills in `text` and `new_text`, and delivers the output to its queue or
handler. So the post-processing of step N runs while the engine thread schedules and runs step N+1
(the forward's kernels release the GIL); the engine thread never calls the tokenizer.

A stop string ends the sequence: when one completes at the N-th generated token, this thread hands
out the final output itself, N tokens with "stop" (what the engine would have produced had it found
the stop string in that step), and tells the engine (`LLMEngine.end_at`), which drops the tokens it
sampled meanwhile and ends the request before its next step. Whatever comes for the request after
that is not delivered. So callers see what they see with text on the engine thread: the same tokens,
text, finish reason and usage; the engine samples a step or two more.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from engine.output_processor import End, add_text, ending, snapshot
from engine.request import GenerationOutput, Request, RequestStatus

logger = logging.getLogger("cbserve.manager")

Deliver = Callable[[GenerationOutput], None]
EndAt = Callable[[Request, int, str, str | None], None]
# (request, its generated tokens then, its status and end then, deliver?, an output made on the engine thread)
Item = tuple[Request | None, int, End | None, bool, GenerationOutput | None]


class OutputThread:
    def __init__(self, deliver: Deliver, end_at: EndAt) -> None:
        """`deliver` hands one output to its caller; `end_at(req, num_generated, reason, error)` tells the
        engine that the request ends there (LLMEngine.end_at, thread-safe)."""
        self._deliver, self._end_at = deliver, end_at
        self._queue: queue.SimpleQueue[Item | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="cbserve-output", daemon=True)
        self._thread.start()

    def put(self, req: Request, deliver: bool = True) -> None:
        """From the engine thread, after a step: the request's progress, its output delivered when
        `deliver` (a request with deferred text that hands nothing out now is still fed its tokens)."""
        self._queue.put((req, req.num_generated, ending(req), deliver, None))

    def put_output(self, out: GenerationOutput) -> None:
        """From the engine thread: an output made there, delivered in order with the others."""
        self._queue.put((None, 0, None, True, out))

    def close(self) -> None:
        """Deliver everything queued so far, then end the thread."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            req, count, end, deliver, out = item
            try:
                if req is not None:
                    out = self._output(req, count, end, deliver)
                if out is not None:
                    self._deliver(out)
            except Exception as exc:  # a tokenizer that fails fails its request, not the thread
                logger.exception("output processing failed")
                if req is not None and req.text_deferred and not req.output_done:
                    self._fail(req, f"{type(exc).__name__}: {exc}")

    def _output(self, req: Request, count: int, end: End, deliver: bool) -> GenerationOutput | None:
        """The request's output over its first `count` tokens, with its text; or its final output cut at
        a stop string its new tokens complete; None when there is nothing to deliver."""
        if req.output_done:
            return None  # its final output went out: what the engine sends after it is dropped
        if req.text_deferred:
            stream, start = req.text_stream, req.num_prompt_tokens
            if stream.num_tokens < count and not stream.stopped:
                stream.add(req.token_ids[start + stream.num_tokens : start + count])
            if stream.stopped:
                n = stream.num_tokens  # the token that completed the stop string is the last
                if not (end[0] >= RequestStatus.FINISHED and end[1] == "stop" and count == n):
                    end = (RequestStatus.FINISHED, "stop", None, time.perf_counter())
                    self._end_at(req, n, "stop", None)
                count, deliver = n, True
                req.output_done = True
        if not deliver:
            return None
        out = snapshot(req, req.num_streamed, count, end)
        req.num_streamed = count
        if req.text_deferred:
            add_text(out, req)
        return out

    def _fail(self, req: Request, error: str) -> None:
        """The request's text could not be made: it fails, with the tokens handed out so far."""
        req.output_done = True
        count = req.num_streamed
        out = snapshot(req, count, count, (RequestStatus.FAILED, "error", error, time.perf_counter()))
        out.text, out.new_text = req.text_stream.text, ""
        self._end_at(req, count, "error", error)
        self._deliver(out)
