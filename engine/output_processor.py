"""From engine requests to what callers read: text, stop strings, n fan-out, logprobs.

cbserve's counterpart of vLLM v1's OutputProcessor, and the one output path of every caller
(`generate_batch`, the manager, the HTTP server, `cbserve generate`). The engine holds one
(`engine.output_processor`):

- `watch`, from `make_request`: a request with stop strings, or that asks for text (`detokenize`),
  gets an incremental detokenizer with its stop strings (`engine/detokenizer.py`). Every sampled
  token goes through it (`Request.append_token`); when one completes a stop string the request
  finishes with "stop" in that step, so no token is generated past it and the text is cut right
  before it. Under the manager the request's text is deferred instead: its output thread
  (engine/output_thread.py) feeds the stream beside the steps and ends the request at its stop
  string (`LLMEngine.end_at`), with the same outputs;
- `make_output`, for every output handed out: a `GenerationOutput` with the tokens and the text
  since the previous output, everything so far, and the finish (`snapshot` and `add_text`, its two
  halves, are what the output thread calls).

n > 1 is one engine request forked into siblings after its one prefill (`Scheduler._fork`);
`family_ids` names them in order and `unforked_outputs` ends the siblings of a request that ended
before it forked them. `new_logprobs` turns an output's logprobs into entries with token text.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.detokenizer import TextStream
from engine.request import GenerationOutput, ParamError, Request, RequestStatus, child_id


class OutputProcessor:
    def __init__(self, tokenizer=None) -> None:
        self.tokenizer = tokenizer

    def watch(self, req: Request, stop_strings: list[str] | str | None, detokenize: bool = False) -> None:
        """Give `req` a text stream when it has stop strings or asks for text; a ParamError names a bad
        value, or the missing tokenizer."""
        stops = [stop_strings] if isinstance(stop_strings, str) else stop_strings
        if stops is not None and (not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops)):
            raise ParamError("stop_strings", f"stop_strings must be a string or a list of strings, got {stop_strings!r}")
        stops = [s for s in stops or () if s]
        if not isinstance(detokenize, bool):
            raise ParamError("detokenize", f"detokenize must be a boolean, got {detokenize!r}")
        if not stops and not detokenize:
            return
        if self.tokenizer is None:
            param = "stop_strings" if stops else "detokenize"
            raise ParamError(param, f"{param} need a tokenizer: pass tokenizer= to the engine, manager or generate_batch")
        req.text_stream = TextStream(self.tokenizer, stops)

    @staticmethod
    def make_output(req: Request) -> GenerationOutput:
        """What the request produced so far; `new_tokens` and `new_text` since its previous output."""
        out = snapshot(req, req.num_streamed)
        req.num_streamed = len(out.generated_tokens)
        if req.text_stream is not None:
            add_text(out, req)
        return out


End = tuple[RequestStatus, "str | None", "str | None", "float | None"]  # status, finish reason, error, finished time


def ending(req: Request) -> End:
    """The request's status and end as they are now (taken on the engine thread, for the output thread)."""
    return req.status, req.finish_reason, req.error, req.finished_time


def snapshot(req: Request, since: int, count: int | None = None, end: End | None = None) -> GenerationOutput:
    """The request's output without text, over its first `count` generated tokens (None: all), its new
    tokens those after the first `since`, its status and end `end` (None: the request's now); changes
    nothing. The lists it reads only grow while the engine runs (a stop string's cut comes after the
    last output), so the output thread may read them while the engine thread appends."""
    start = req.num_prompt_tokens
    count = req.num_generated if count is None else count
    status, reason, error, finished = ending(req) if end is None else end
    generated = req.token_ids[start : start + count]
    return GenerationOutput(
        request_id=req.request_id,
        prompt_ids=req.token_ids[:start],
        generated_tokens=generated,
        logprobs=req.logprobs[:count],
        error=error,
        status=status,
        created_time=req.created_time,
        lifespan=(req.scheduled_time or -1, finished or -1),
        timestamps=req.timestamps[:count] if req.timestamps is not None else None,
        new_tokens=generated[since:],
        top_logprobs=req.top_logprobs[:count] if req.top_logprobs is not None else None,
        finish_reason=reason,
        scheduled_time=req.scheduled_time,
        first_token_time=req.first_token_time,
        finished_time=finished,
        num_cached_tokens=req.num_cached_tokens,
        num_preemptions=req.num_preemptions,
    )


def add_text(out: GenerationOutput, req: Request) -> None:
    """The output's `text` and `new_text` from the request's text stream (fed up to the output's tokens)."""
    if out.is_finished():
        req.text_stream.finish()  # what was held back as a possible stop string (once; then a no-op)
    out.text = req.text_stream.text
    out.new_text, req.text_streamed = out.text[req.text_streamed :], len(out.text)


def family_ids(request_id: str, n: int) -> list[str]:
    """The ids of an n-sequence request's outputs, in order: the request, then its forked siblings."""
    return [request_id] + [child_id(request_id, i) for i in range(n - 1)]


def unforked_outputs(req: Request) -> list[GenerationOutput]:
    """For a request that ended (aborted, failed) before its first token, so before it forked its n - 1
    siblings: one final output per sibling, ending as it did."""
    if not req.is_finished or not req.num_children:
        return []
    outs = []
    for rid in family_ids(req.request_id, 1 + req.num_children)[1:]:
        outs.append(GenerationOutput(
            rid, prompt_ids=req.token_ids[: req.num_prompt_tokens], error=req.error, status=req.status,
            created_time=req.created_time, finish_reason=req.finish_reason, finished_time=req.finished_time,
            lifespan=(req.scheduled_time or -1, req.finished_time or -1), text="" if req.text_stream else None,
            new_text="" if req.text_stream else None,
        ))  # fmt: skip
    return outs


@dataclass
class TokenLogprob:
    """One generated token's logprob entry, as APIs show it."""

    token_id: int
    token: str  # the token's own text
    logprob: float
    top: list[tuple[str, float]] | None  # the top alternatives' texts and logprobs, best first; None: none asked


def new_logprobs(out: GenerationOutput, tokenizer) -> list[TokenLogprob]:
    """Entries for the output's new tokens (empty when the request asked for no logprobs)."""
    if not out.logprobs or not out.new_tokens:
        return []
    start = len(out.generated_tokens) - len(out.new_tokens)
    end = min(len(out.generated_tokens), len(out.logprobs))

    def text(token: int) -> str:
        return tokenizer.decode([token])

    entries = []
    for k in range(start, end):
        top = out.top_logprobs[k] if out.top_logprobs is not None and k < len(out.top_logprobs) else None
        token = out.generated_tokens[k]
        entries.append(TokenLogprob(token, text(token), out.logprobs[k],
                                    [(text(a), b) for a, b in top.items()] if top is not None else None))  # fmt: skip
    return entries

