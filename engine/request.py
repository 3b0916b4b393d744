"""A request's state inside the engine, its sampling parameters, and the output users receive (made by
engine/output_processor.py)."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import torch


class RequestStatus(IntEnum):
    """Lifecycle of a request (transformers' names and order)."""

    PENDING = 0
    PREFILLING = 1
    DECODING = 2
    FINISHED = 3
    FAILED = 4


class QueueFullError(RuntimeError):
    """`add_request` refused: `max_queue_size` requests are already waiting."""


class ParamError(ValueError):
    """A request refused for one of its parameters; `param` names it as `make_request` (and
    `add_request`, `generate_batch`) call it: "input_ids", "max_new_tokens", "temperature", ..."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


MAX_LOGPROBS = 20


def _number(name: str, value: Any, param: str | None = None) -> float:
    """`value` as a float when it is a finite int or float (not a bool); a ParamError for `param` (or `name`) else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ParamError(param or name, f"{name} must be a number, got {value!r}")
    try:
        x = float(value)
    except OverflowError:  # an int beyond any float
        x = math.inf
    if not math.isfinite(x):
        raise ParamError(param or name, f"{name} must be a finite number, got {value!r}")
    return x


# a temperature below this is greedy, as in vLLM (its _SAMPLING_EPS): l / T for a T near float32's
# smallest overflows to infinities and NaNs, whose largest is not the largest logit
GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    """Per-request sampling. temperature 0 (or below GREEDY_BELOW, or None with no sampling asked) is greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    min_new_tokens: int = 0
    logprobs: int | None = None  # None: none; 0: the sampled token's; N: plus the top N

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @functools.cached_property
    def bias(self) -> tuple[torch.Tensor, torch.Tensor]:
        """logit_bias as host tensors of token ids and biases (float64: each step rounds them once, to
        its logits' dtype), made once, not at every step: a request may bias the whole vocabulary."""
        bias = self.logit_bias or {}
        return torch.tensor(list(bias), dtype=torch.long), torch.tensor(list(bias.values()), dtype=torch.float64)

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate_temperature(self) -> None:
        """temperature a finite number >= 0; a ParamError otherwise."""
        if _number("temperature", self.temperature) < 0:
            raise ParamError("temperature", f"temperature must be >= 0, got {self.temperature}")

    def validate(self, vocab_size: int) -> None:
        """Every field in range; a ParamError names the first that is not."""
        self.validate_temperature()
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ParamError("top_k", f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not 0 < _number("top_p", self.top_p) <= 1:
            raise ParamError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= _number("min_p", self.min_p) <= 1:
            raise ParamError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if _number("repetition_penalty", self.repetition_penalty) <= 0:
            raise ParamError("repetition_penalty", f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2 <= _number("presence_penalty", self.presence_penalty) <= 2:
            raise ParamError("presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= _number("frequency_penalty", self.frequency_penalty) <= 2:
            raise ParamError("frequency_penalty", f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ParamError("seed", f"seed must be an integer, got {self.seed!r}")
        if isinstance(self.min_new_tokens, bool) or not isinstance(self.min_new_tokens, int) or self.min_new_tokens < 0:
            raise ParamError("min_new_tokens", f"min_new_tokens must be an integer >= 0, got {self.min_new_tokens!r}")
        if self.logprobs is not None:
            if isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ParamError("logprobs", f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.logit_bias:
            for token, bias in self.logit_bias.items():
                if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
                    raise ParamError("logit_bias", f"logit_bias key {token!r} is not a token id in [0, {vocab_size})")
                _number(f"logit_bias value for token {token}", bias, "logit_bias")


@dataclass
class GenerationOutput:
    """What a request produced so far (streamed) or in the end (finished)."""

    request_id: str
    prompt_ids: list[int] = field(default_factory=list)
    generated_tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    error: str | None = None
    status: RequestStatus = RequestStatus.PENDING
    created_time: float = field(default_factory=time.perf_counter)
    lifespan: tuple[float, float] = (-1, -1)
    timestamps: list[float] | None = None
    # cbserve's additions
    new_tokens: list[int] = field(default_factory=list)  # since the previous streamed output
    top_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    text: str | None = None  # with stop strings or detokenize: the generated text, cut before a stop string
    new_text: str | None = None  # with text: the text since the previous streamed output

    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED


def child_id(request_id: str, index: int) -> str:
    """The id of the index-th extra sequence of an n > 1 request (transformers' naming)."""
    return f"{request_id}__child#{index}"


class Request:
    """One sequence in the engine: its tokens, how many are in the KV cache, its blocks."""

    # slots: each attribute sits in the object itself, not in a dict beside it; the scheduler reads a few
    # of every running request right after a forward has pushed them out of the caches
    __slots__ = (
        "request_id", "token_ids", "num_prompt_tokens", "max_new_tokens", "sampling", "eos_token_ids",
        "stop_token_ids", "streaming", "timestamps", "status", "num_computed", "block_ids", "block_hashes",
        "num_cached_tokens", "num_preemptions", "finish_reason", "error", "logprobs", "top_logprobs", "generator",
        "num_streamed", "text_streamed", "num_children", "text_stream", "text_deferred", "output_done", "matcher",
        "otel_context", "created_time", "scheduled_time", "first_token_time", "finished_time",
    )

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        max_new_tokens: int,
        sampling: SamplingParams,
        eos_token_ids: frozenset[int],
        stop_token_ids: frozenset[int] = frozenset(),
        streaming: bool = False,
        record_timestamps: bool = False,
    ) -> None:
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_ids)  # prompt, then generated tokens
        self.num_prompt_tokens = len(prompt_ids)
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.eos_token_ids = eos_token_ids
        self.stop_token_ids = stop_token_ids
        self.streaming = streaming
        self.timestamps: list[float] | None = [] if record_timestamps else None

        self.status = RequestStatus.PENDING
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the full blocks registered so far
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] | None = [] if sampling.logprobs else None
        # with a seed: the request's own random stream on the logits' device, seeded at its first sample
        # (engine/sampler.py)
        self.generator: torch.Generator | None = None
        self.num_streamed = 0  # generated tokens already handed out
        self.text_streamed = 0  # characters of text already handed out (engine/output_processor.py)
        self.num_children = 0  # n - 1: sequences forked from this one after its prefill
        self.text_stream = None  # engine.detokenizer.TextStream with stop strings or detokenize (output_processor)
        # the text stream is fed off the engine thread (the manager's output thread, engine/output_thread.py),
        # which ends the request at its stop string through LLMEngine.end_at; append_token leaves it alone
        self.text_deferred = False
        self.output_done = False  # the output thread handed out its final output (a stop string found there)
        self.matcher = None  # engine.structured.Matcher when the request has structured output
        self.otel_context = None  # OpenTelemetry context its span records under (engine/telemetry.py); None: none

        self.created_time = time.perf_counter()
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    def fork(self, child_index: int) -> Request:
        """A sibling sequence for n > 1: same prompt and parameters, its own seed stream."""
        sampling = dataclasses.replace(self.sampling)
        if sampling.seed is not None:
            sampling.seed += child_index + 1
        child = Request(
            child_id(self.request_id, child_index),
            self.token_ids[: self.num_prompt_tokens],
            self.max_new_tokens,
            sampling,
            self.eos_token_ids,
            self.stop_token_ids,
            self.streaming,
            self.timestamps is not None,
        )
        child.num_computed = self.num_computed
        child.status = RequestStatus.DECODING
        child.created_time, child.scheduled_time = self.created_time, self.scheduled_time
        child.num_cached_tokens = self.num_cached_tokens
        child.otel_context = self.otel_context
        if self.text_stream is not None:
            child.text_stream = self.text_stream.fresh()
            child.text_deferred = self.text_deferred
        if self.matcher is not None:  # forked before the first token: the parser is at its start
            child.matcher = self.matcher.fork()
        return child

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED

    def append_token(self, token: int, now: float, max_context: int | None = None) -> None:
        """A sampled token; the request finishes on what it stops on: a grammar refusing the token
        (error) or complete, a stop string, an EOS id (after min_new_tokens), a stop id, max_new_tokens,
        or the model's context."""
        self.token_ids.append(token)
        if self.first_token_time is None:
            self.first_token_time = now
        if self.timestamps is not None:
            self.timestamps.append(now)
        if self.matcher is not None and token not in self.eos_token_ids:
            if not self.matcher.accept(token):
                self.finish("error", f"structured output: {self.matcher.error or f'the grammar refused token {token}'}")
                return
        if self.text_stream is not None and not self.text_deferred:  # engine/output_processor.py: the token's text
            self.text_stream.add([token])
            if self.text_stream.stopped:  # it completes a stop string: the text ends right before it
                self.finish("stop")
                return
        if self.matcher is not None and self.matcher.finished:  # the grammar is complete: nothing may follow
            self.finish("stop")
        elif token in self.eos_token_ids and self.num_generated > self.sampling.min_new_tokens - 1:
            self.finish("stop")
        elif token in self.stop_token_ids:
            self.finish("stop")
        elif self.num_generated >= self.max_new_tokens:
            self.finish("length")
        elif max_context is not None and self.num_tokens >= max_context:
            self.finish("length")

    def cut_to(self, num_generated: int) -> int:
        """Drop the generated tokens after the first `num_generated` (with their logprobs and timestamps):
        a stop string found off the engine thread ended the request there. Returns how many were dropped."""
        dropped = max(0, self.num_generated - num_generated)
        if dropped:
            del self.token_ids[self.num_prompt_tokens + num_generated :]
            del self.logprobs[num_generated:]
            if self.top_logprobs is not None:
                del self.top_logprobs[num_generated:]
            if self.timestamps is not None:
                del self.timestamps[num_generated:]
        return dropped

    def finish(self, reason: str, error: str | None = None) -> None:
        self.finish_reason = reason
        self.error = error
        self.status = RequestStatus.FAILED if error is not None else RequestStatus.FINISHED
        self.finished_time = time.perf_counter()
