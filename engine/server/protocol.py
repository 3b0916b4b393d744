"""OpenAI request bodies in, validated generation requests out; errors in OpenAI's shape."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import jinja2

from engine.llm_engine import token_ids_ok
from engine.server import tools as toolkit
from engine.server.errors import APIError, bad
from engine.structured import STRUCTURED_KEYS, StructuredOutput

MAX_N = 16
MAX_LOGPROBS = 20
# stop strings: OpenAI takes 4, TGI 4 by default, vLLM any number; how many there are costs nothing per
# token (one automaton, engine/detokenizer.py), but building it costs their characters, on the thread that
# admits the request
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096  # all of a request's stop strings together
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})  # OpenAI's chat roles
INT64 = (-(2**63), 2**63 - 1)  # integers beyond these reach no engine knob: refused, not overflowed

logger = logging.getLogger("cbserve.server")

# Every request field of OpenAI's and vLLM's completions and chat APIs that cbserve knows, and what it
# does with it; docs/server.md's table lists the same (a test holds them together).
HONOURED = {
    "both": ("model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop",
             "seed", "stream", "stream_options", "presence_penalty", "frequency_penalty", "repetition_penalty",
             "logit_bias", "stop_token_ids", "min_tokens", "ignore_eos", "response_format", "guided_json",
             "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"),
    "completion": ("prompt", "logprobs", "echo"),
    "chat": ("messages", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"),
}
# refused with 400 naming the field when set to anything but its no-op value
REFUSED = {
    "functions": "the legacy 'functions' field is not supported; use 'tools'",
    "function_call": "the legacy 'function_call' field is not supported; use 'tool_choice'",
    "guided_whitespace_pattern": "not supported: JSON is generated compact; structured_outputs.whitespace allows any",
    "best_of": "best_of above 1 is not supported (vLLM's V1 engine dropped it too); use n",
    "suffix": "suffix (fill-in-the-middle) is not supported",
    "prompt_logprobs": "prompt logprobs are not supported",
    "logits_processors": "custom logits processors are not supported",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
}
NO_OP = {"best_of": (1,), "suffix": ("",), "modalities": (["text"],), "functions": ([],)}  # fmt: skip
# accepted and not acted on, each for a reason docs/server.md gives
IGNORED = {
    "user": "an end-user id for the caller's own abuse tracking; cbserve keeps no per-user state",
    "metadata": "OpenAI stores it with stored completions; cbserve stores nothing",
    "store": "cbserve stores no completions",
    "service_tier": "one tier: every request is served alike",
    "reasoning_effort": "no reasoning-effort control for transformers models",
    "add_generation_prompt": "always true: the chat template's generation prompt is added",
    "skip_special_tokens": "special tokens are always skipped in the text",
    "spaces_between_special_tokens": "decided by the tokenizer",
    "request_id": "the x-request-id header names a request",
    "priority": "one queue, first come first served",
    "guided_decoding_backend": "one structured-output backend: llguidance",
}
_warned: set[str] = set()


def _check_fields(body: dict, kind: str) -> None:
    for name, reason in REFUSED.items():
        value = body.get(name)
        if value is not None and value not in NO_OP.get(name, ()):
            raise bad(name, f"'{name}': {reason}")
    known = {*HONOURED["both"], *HONOURED[kind], *REFUSED, *IGNORED}
    for name in body:
        if name not in known and name not in _warned and len(_warned) < 1000:
            _warned.add(name)  # once per field name, and a bounded set: a client cannot flood the log
            logger.warning("ignoring the request field %r, which cbserve does not know", name[:100])


@dataclass
class GenerationRequest:
    """One API call: its prompts (as token ids) and what to do with them."""

    kind: str  # "chat" or "completion"
    model: str | None
    prompts: list[list[int]]
    n: int = 1
    max_tokens: int | None = None
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # usage on every chunk (stream_options.continuous_usage_stats)
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # top alternatives per token; None: no logprobs at all
    echo: bool = False
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # sampling, passed to add_request
    structured: StructuredOutput | None = None  # the constraint on every choice's output
    structured_param: str | None = None  # the field it came from, for errors
    tools: Any = None  # engine.server.tools.ToolRequest when tools are in play (chat)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


# -- field readers: each raises a 400 that names the field -----------------------------------------
def _number(body: dict, key: str, lo: float | None = None, hi: float | None = None, lo_open: bool = False):
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(key, f"'{key}' must be a number, got {value!r}")
    if not math.isfinite(value):
        raise bad(key, f"'{key}' must be a finite number, got {value!r}")
    if lo is not None and (value < lo or (lo_open and value == lo)):
        raise bad(key, f"'{key}' must be {'>' if lo_open else '>='} {lo}, got {value}")
    if hi is not None and value > hi:
        raise bad(key, f"'{key}' must be <= {hi}, got {value}")
    return float(value)


def _integer(body: dict, key: str, lo: int | None = None, hi: int | None = None):
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(key, f"'{key}' must be an integer, got {value!r}")
    lo = INT64[0] if lo is None else lo
    hi = INT64[1] if hi is None else hi
    if lo is not None and value < lo:
        raise bad(key, f"'{key}' must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise bad(key, f"'{key}' must be <= {hi}, got {value}")
    return value


def _boolean(body: dict, key: str, default: bool = False) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(key, f"'{key}' must be a boolean, got {value!r}")
    return value


def text(value: str, param: str) -> str:
    """`value`, if it is text a tokenizer can take: JSON's \\ud800 escapes make lone surrogates,
    which no UTF-8 encoder accepts."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(param, f"'{param}' holds a lone UTF-16 surrogate, which is not text") from None
    return value


def max_token_chars(tokenizer) -> int:
    """The most characters one token of this tokenizer stands for (its longest vocabulary entry:
    byte-level BPE and SentencePiece entries are at least as long as the text they decode to)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1)


def _prompt_chars(body: Any) -> int:
    """The characters of the longest prompt's text (a completion's prompts are one prompt each, a
    chat's messages together one)."""
    if not isinstance(body, dict):
        return 0
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) else []
    total = max((len(p) for p in prompts if isinstance(p, str)), default=0)
    for m in body.get("messages") if isinstance(body.get("messages"), list) else []:
        content = m.get("content") if isinstance(m, dict) else None
        parts = content if isinstance(content, list) else [content]
        total += sum(len(c) if isinstance(c, str) else len(c.get("text") or "") if isinstance(c, dict)
                     and isinstance(c.get("text"), str) else 0 for c in parts)  # fmt: skip
    return total


def context_exceeded(limit: int, tokens: int, words: str) -> APIError:
    """vLLM's 400 for a prompt that alone fills the model's context."""
    return APIError(400, f"This model's maximum context length is {limit} tokens. However, your request has "
                         f"{tokens} input tokens. Please reduce the length of the input {words}.",
                     param=words, code="context_length_exceeded")  # fmt: skip


def check_prompt_size(body: Any, max_model_len: int, token_chars: int) -> None:
    """Refuse, before tokenising it, text that cannot fit the model's context whatever its tokens:
    more characters than `max_model_len` tokens of the tokenizer's longest entry cover. Tokenising
    megabytes takes seconds, and parts of it hold the GIL."""
    chars = _prompt_chars(body)
    if chars > max_model_len * token_chars:
        words = "messages" if isinstance(body, dict) and "messages" in body else "prompt"
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, your request "
                            f"has {chars} characters of text, more than {max_model_len} tokens can hold (at most "
                            f"{token_chars} characters each). Please reduce the length of the input {words}.",
                       param=words, code="context_length_exceeded")  # fmt: skip


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad("stop", "'stop' must be a string or a list of strings")
    if len(value) > MAX_STOP_STRINGS:
        raise bad("stop", f"'stop' holds {len(value)} strings; at most {MAX_STOP_STRINGS}")
    if (chars := sum(map(len, value))) > MAX_STOP_CHARS:
        raise bad("stop", f"'stop' holds {chars} characters; at most {MAX_STOP_CHARS} in all")
    return [text(s, "stop") for s in value if s]


def _sampling(body: dict, vocab_size: int) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "temperature": _number(body, "temperature", 0, None),
        "top_p": _number(body, "top_p", 0, 1, lo_open=True),
        "min_p": _number(body, "min_p", 0, 1),
        "seed": _integer(body, "seed", INT64[0], INT64[1] - MAX_N),  # seed + i per sample stays in range
        "presence_penalty": _number(body, "presence_penalty", -2, 2),
        "frequency_penalty": _number(body, "frequency_penalty", -2, 2),
        "repetition_penalty": _number(body, "repetition_penalty", 0, None, lo_open=True),
        "min_new_tokens": _integer(body, "min_tokens", 0),
    }
    top_k = _integer(body, "top_k", -1)
    # vLLM's -1 and OpenAI's absence both mean off (not transformers' default of 50)
    kwargs["top_k"] = 0 if top_k in (None, -1) else top_k
    if kwargs["temperature"] is None:
        kwargs["temperature"] = 1.0  # OpenAI's default: sampling
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise bad("logit_bias", "'logit_bias' must map token ids to numbers")
        parsed = {}
        for token, value in bias.items():
            try:
                tid = int(token)
            except (TypeError, ValueError):
                raise bad("logit_bias", f"'logit_bias' key {token!r} is not a token id") from None
            if not 0 <= tid < vocab_size:
                raise bad("logit_bias", f"'logit_bias' key {tid} is outside the vocabulary [0, {vocab_size})")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise bad("logit_bias", f"'logit_bias' value for {tid} must be a number in [-100, 100]")
            parsed[tid] = float(value)
        kwargs["logit_bias"] = parsed
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                     and 0 <= t < vocab_size for t in stop_ids):  # fmt: skip
            raise bad("stop_token_ids", f"'stop_token_ids' must be a list of token ids in [0, {vocab_size})")
        kwargs["stop_token_ids"] = stop_ids
    kwargs["ignore_eos"] = _boolean(body, "ignore_eos")
    return {k: v for k, v in kwargs.items() if v is not None}


def _structured(body: dict) -> tuple[StructuredOutput | None, str | None]:
    """The output constraint, from OpenAI's `response_format` or vLLM's `guided_*` and
    `structured_outputs`; at most one of them. Its contents are checked when it is compiled."""
    found: list[tuple[str, dict[str, Any]]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise bad("response_format", "'response_format' json_schema needs {'json_schema': {'name': ..., "
                                             "'schema': {...}}}")  # fmt: skip
            found.append(("response_format", {"json": schema}))
        elif kind != "text":
            raise bad("response_format", "'response_format' type must be 'text', 'json_object' or 'json_schema'")
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):  # fmt: skip
        if body.get(name) is not None:
            found.append((name, {key: body[name]}))
    given = body.get("structured_outputs")
    if given is not None:
        if not isinstance(given, dict) or set(given) - STRUCTURED_KEYS:
            raise bad("structured_outputs", f"'structured_outputs' takes the keys {', '.join(sorted(STRUCTURED_KEYS))}")
        found.append(("structured_outputs", {k: v for k, v in given.items() if v is not None and v is not False}))
    if not found:
        return None, None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad(found[1][0], f"give one structured output constraint, not several ({names})")
    name, spec = found[0]
    if spec.get("choice") is not None and not isinstance(spec["choice"], list):
        raise bad(name, f"'{name}' choice must be a list of strings")
    whitespace = spec.get("whitespace", False)
    if not isinstance(whitespace, bool):
        raise bad(name, f"'{name}' whitespace must be a boolean")
    try:
        structured = StructuredOutput.of({**spec, "choice": tuple(spec["choice"])} if "choice" in spec else spec)
        structured.check()  # the caps, before anything is compiled
    except (TypeError, ValueError) as exc:
        raise bad(name, f"'{name}': {exc}") from None
    return structured, name


def _common(body: Any, kind: str, vocab_size: int) -> GenerationRequest:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    _check_fields(body, kind)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "'model' must be a string")
    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("stream_options", "'stream_options' must be an object")
    stream = _boolean(body, "stream")
    include_usage = bool(options and _boolean(options, "include_usage"))
    # vLLM's: the usage so far on every chunk, as it gives it only with include_usage
    continuous_usage = bool(options and _boolean(options, "continuous_usage_stats"))
    structured, structured_param = _structured(body)
    return GenerationRequest(
        kind=kind,
        model=model,
        prompts=[],
        n=_integer(body, "n", 1, MAX_N) or 1,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=include_usage and continuous_usage,
        stop=_stop(body),
        engine_kwargs=_sampling(body, vocab_size),
        structured=structured,
        structured_param=structured_param,
    )


def check_generations(req: GenerationRequest, prompts: int, max_generations: int) -> None:
    """More engine requests (prompts x n) than the admission queue holds at all (`max_generations`,
    0: unbounded): a 400 naming the field, before any prompt is tokenised or checked."""
    if max_generations and prompts * req.n > max_generations:
        words = "messages" if req.kind == "chat" else "prompt"
        raise APIError(400, f"this request makes {prompts * req.n} generations ({prompts} prompts x n={req.n}); the "
                            f"server queues at most {max_generations} (max_queue_size): send fewer at a time",
                       param="n" if req.n > 1 else words)  # fmt: skip


def parse_completion(body: Any, tokenizer, vocab_size: int, max_generations: int = 0) -> GenerationRequest:
    req = _common(body, "completion", vocab_size)
    for name in ("tools", "tool_choice", "parallel_tool_calls"):
        if body.get(name) is not None:
            raise bad(name, f"'{name}' is a chat field: use /v1/chat/completions")
    prompt = body.get("prompt")
    many = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
    check_generations(req, len(prompt) if many else 1, max_generations)
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompts = [prompt]
    elif (isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt)
          and all(isinstance(t, int) and not isinstance(t, bool) for p in prompt for t in p)):  # fmt: skip
        prompts = prompt
    else:
        raise bad("prompt", "'prompt' must be a string, a list of strings, a list of token ids or a list of those")
    req.prompts = [tokenizer(text(p, "prompt"), add_special_tokens=True).input_ids if isinstance(p, str) else list(p)
                   for p in prompts]  # fmt: skip
    for ids in req.prompts:
        if not ids:
            raise bad("prompt", "'prompt' is empty")
        if not token_ids_ok(ids, vocab_size):
            t = next(t for t in ids if not 0 <= t < vocab_size)
            raise bad("prompt", f"'prompt' holds token id {t}, outside the vocabulary [0, {vocab_size})")
    logprobs = _integer(body, "logprobs", 0, MAX_LOGPROBS)
    req.logprobs = logprobs
    req.echo = _boolean(body, "echo")
    if req.max_tokens is None:
        req.max_tokens = 16  # OpenAI's default for completions
    return req


def parse_chat(body: Any, tokenizer, vocab_size: int, max_generations: int = 0) -> GenerationRequest:
    req = _common(body, "chat", vocab_size)
    check_generations(req, 1, max_generations)
    req.tools = toolkit.parse_tools(body)
    if req.tools is not None and req.tools.forced:
        if req.structured is not None:
            raise bad(req.structured_param, f"'{req.structured_param}' cannot be combined with a forced 'tool_choice'")
        req.structured, req.structured_param = req.tools.structured_output(), "tool_choice"
        try:
            req.structured.check()
        except ValueError as exc:
            raise bad("tools", f"'tools': {exc}") from None
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "'messages' must be a non-empty list")
    conversation = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad("messages", f"messages[{i}] must be an object with a string 'role'")
        role = message["role"]
        if role not in ROLES:
            raise bad("messages", f"messages[{i}].role must be one of {', '.join(sorted(ROLES))}, got {role[:40]!r}")
        content = message.get("content")
        if content is None and not (role == "assistant" and message.get("tool_calls")):
            raise bad("messages", f"messages[{i}] has no 'content' (only an assistant message with "
                                  "'tool_calls' may leave it out)")  # fmt: skip
        if isinstance(content, list):  # content parts: keep the text ones
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad("messages", f"messages[{i}].content parts must be {{'type': 'text', 'text': ...}}")
                texts.append(part["text"])
            content = "".join(texts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad("messages", f"messages[{i}].content must be a string or a list of text parts")
        turn = {"role": role, "content": text(content, "messages")}
        if message.get("tool_calls") is not None:
            turn["tool_calls"] = toolkit.message_tool_calls(message["tool_calls"], i)
        for key in ("tool_call_id", "name"):
            if isinstance(message.get(key), str):
                turn[key] = text(message[key], "messages")
        conversation.append(turn)
    if getattr(tokenizer, "chat_template", None) is None:
        raise bad("messages", "this model has no chat template: use /v1/completions")
    extra: dict[str, Any] = {}
    if req.tools is not None and toolkit.template_takes_tools(tokenizer):
        extra["tools"] = req.tools.template_tools()
    elif req.tools is not None or any("tool_calls" in m for m in conversation):
        conversation = toolkit.without_template_tools(conversation, req.tools)
    try:
        encoded = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, **extra)
    except jinja2.TemplateError as exc:  # the template's own checks (roles must alternate, ...)
        raise bad("messages", f"the model's chat template refused these messages: {exc}") from None
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    req.prompts = [list(ids)]
    want = _boolean(body, "logprobs")
    top = _integer(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not want:
        raise bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    req.logprobs = (top or 0) if want else None
    return req
