"""Structured output: a grammar per request, applied as a mask on the logits before sampling.

The grammar engine is llguidance (guidance-ai; also a backend of vLLM, SGLang and llama.cpp): a
Rust parser that computes the allowed next tokens of a JSON schema, regular expression, choice
list or Lark grammar in tens of microseconds per token, with no dependency of its own.

A `StructuredOutput` says what to constrain to. `GrammarCompiler.compile` turns it into a
`Grammar` (checked, and cached by its text: an evaluation or RL loop sends one schema thousands
of times); every request then takes its own `Matcher` from it, a cheap copy of the parser state.
The sampler asks each constrained row's matcher for its bitmask (`fill_bitmask`) and masks the
logits with `apply_bitmask`; the engine hands the sampled token back (`Matcher.accept`), and a
matcher that reaches the end of its grammar finishes the request with "stop".

JSON is generated compact by default (no whitespace between tokens): with flexible whitespace a
small model can emit blank lines until `max_tokens`. `StructuredOutput.whitespace` turns it on.

Limits, checked before anything is compiled (`StructuredOutput.check`, pure Python, linear in the
text): a constraint's text (schema, regex, grammar, or all choices together) is at most
`MAX_CONSTRAINT_CHARS` characters, a choice list at most `MAX_CHOICES` strings, and a Lark or GBNF
grammar at most `MAX_ALTERNATIVES` `|` between alternatives (outside its literals). llguidance's Earley
parser refuses a row of more than 2,000 items, and every alternative that can start at one point
of the output is an item of that row: a larger choice list compiles, then fails at its first token.
Compiling also computes the grammar's first mask and takes one step, so a constraint that cannot
run is refused when it is compiled, not in the middle of a generation. Error messages are
llguidance's, without parser state (`client_error`; a panic, which llguidance reports as text with a
backtrace, becomes a sentence of ours).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

CACHE_SIZE = 64  # compiled grammars kept per engine
MAX_CONSTRAINT_CHARS = 64 * 1024  # a schema's JSON, a regex, a grammar, or a choice list's strings together
MAX_CHOICES = 1000
MAX_ALTERNATIVES = 1000  # `|` in a Lark or GBNF grammar, outside its strings, regexes and comments

logger = logging.getLogger("cbserve.structured")


def count_alternatives(grammar: str) -> int:
    """The `|` of a Lark or GBNF grammar outside its string literals, regular expressions (Lark's
    /.../) and comments (# and //): the alternatives the parser predicts, over-counted by those in
    GBNF's character classes ([^|]). One pass over the text."""
    count, i, n = 0, 0, len(grammar)
    while i < n:
        c = grammar[i]
        if c == "|":
            count += 1
        elif c == '"' or (c == "/" and grammar[i + 1 : i + 2] != "/"):
            i += 1
            while i < n and grammar[i] != c:
                i += 2 if grammar[i] == "\\" else 1
        elif c == "#" or grammar.startswith("//", i):
            end = grammar.find("\n", i)
            i = n if end < 0 else end
        i += 1
    return count


def client_error(error: str) -> str:
    """llguidance's error text as a client may see it: a panic (its text carries a backtrace) becomes
    a sentence of ours, anything else loses any parser-state section and is cut to 1,000 characters."""
    error = error.strip()
    if error.startswith("panic") or "<backtrace>" in error:
        logger.debug("llguidance panicked on a constraint: %s", error.splitlines()[0][:300])  # the refusal is logged
        return "the grammar engine cannot build this constraint (too large or too complex)"
    return error.split("<state>")[0].strip()[:1000] or "the grammar engine refused it"


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint: exactly one of `json` (a JSON schema, as a dict or its text), `json_object`
    (any JSON object), `regex`, `choice` (one of these strings) or `grammar` (Lark, or llama.cpp's
    GBNF). These are vLLM's names (`StructuredOutputsParams`)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    whitespace: bool = False  # JSON: allow any whitespace between tokens

    @classmethod
    def of(cls, value: StructuredOutput | dict[str, Any]) -> StructuredOutput:
        if isinstance(value, StructuredOutput):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_output must be a StructuredOutput or a dict, got {type(value).__name__}")
        unknown = set(value) - STRUCTURED_KEYS
        if unknown:
            raise ValueError(f"structured_output has unknown key(s): {', '.join(sorted(map(str, unknown)))}")
        return cls(**value)

    def check(self) -> None:
        """The limits (MAX_CONSTRAINT_CHARS, MAX_CHOICES, MAX_ALTERNATIVES), checked before any
        compiling; a ValueError says which is passed."""
        if self.choice is not None:
            choices = list(self.choice) if isinstance(self.choice, (list, tuple)) else []
            if len(choices) > MAX_CHOICES:
                raise ValueError(f"choice has {len(choices)} strings; at most {MAX_CHOICES} are allowed")
            chars = sum(len(c) for c in choices if isinstance(c, str))
        elif self.json is not None:
            chars = len(self.json) if isinstance(self.json, str) else len(json.dumps(self.json, default=str))
        else:
            chars = len(self.regex) if isinstance(self.regex, str) else len(self.grammar or "")
        if chars > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"the constraint has {chars} characters; at most {MAX_CONSTRAINT_CHARS} are allowed")
        if isinstance(self.grammar, str):
            alternatives = count_alternatives(self.grammar)
            if alternatives > MAX_ALTERNATIVES:
                raise ValueError(f"the grammar has {alternatives} '|' between alternatives; at most "
                                 f"{MAX_ALTERNATIVES} are allowed")  # fmt: skip

    def grammar_text(self) -> str:
        """The llguidance grammar; a ValueError says what is wrong with the constraint itself."""
        from llguidance import LLMatcher, grammar_from

        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                "structured output takes exactly one of json, json_object, regex, choice, grammar; "
                f"got {', '.join(given) if given else 'none'}"
            )
        if self.json is not None or self.json_object:
            schema = {"type": "object"} if self.json_object else self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
            options = {"whitespace_flexible": bool(self.whitespace)}
            return LLMatcher.grammar_from_json_schema(schema, defaults=options)
        if self.regex is not None:
            if not isinstance(self.regex, str):
                raise ValueError("regex must be a string")
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            choices = list(self.choice)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            return grammar_from("choice", json.dumps(choices))
        if not isinstance(self.grammar, str) or not self.grammar.strip():
            raise ValueError("grammar must be a non-empty string (Lark or GBNF)")
        return grammar_from("grammar", self.grammar)

    def key(self) -> str:
        return json.dumps(
            [self.json, self.json_object, self.regex, list(self.choice or ()), self.grammar, self.whitespace],
            sort_keys=True,
            default=str,
        )


STRUCTURED_KEYS = frozenset(f.name for f in dataclasses.fields(StructuredOutput))


class Matcher:
    """One request's parser state over its generated tokens."""

    def __init__(self, matcher) -> None:
        self._m = matcher

    def fork(self) -> Matcher:
        return Matcher(self._m.deep_copy())

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 [rows, ceil(vocab / 32)] bitmask."""
        v = bitmask[row]
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def accept(self, token: int) -> bool:
        """Advance over a sampled token; False if the grammar refused it (the matcher is then in error)."""
        return self._m.consume_token(token)

    @property
    def finished(self) -> bool:
        """The grammar is complete and nothing may follow: the request ends here."""
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


class Grammar:
    """A compiled constraint; `matcher()` gives each request its own state."""

    def __init__(self, matcher) -> None:
        self._template = matcher

    def matcher(self) -> Matcher:
        return Matcher(self._template.deep_copy())


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary; thread-safe (the server compiles in
    worker threads while the engine loop runs)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        if tokenizer is None:
            raise ValueError("structured output needs a tokenizer: pass tokenizer= to the engine or manager")
        import llguidance.hf

        try:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids or None)
        except ValueError as exc:  # a slow (Python) tokenizer
            raise ValueError(f"structured output needs a fast tokenizer: {exc}") from None
        self.vocab_size = vocab_size
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutput | dict[str, Any]) -> Grammar:
        from llguidance import LLMatcher, LLParserLimits

        spec = StructuredOutput.of(spec)
        key = spec.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        spec.check()
        text = spec.grammar_text()
        limits = LLParserLimits(verbose_errors=False)  # no parser state or grammar in error messages
        matcher = LLMatcher(self.tokenizer, text, log_level=0, limits=limits)  # builds the parser (drops the GIL)
        _first_step(matcher)
        grammar = Grammar(matcher)
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar


def _first_step(matcher) -> None:
    """The grammar's first mask, and one step on a copy over the first token it allows: a grammar that
    fails there (a parser row past llguidance's limit) is refused now, as a ValueError, instead of
    failing a request at its first token."""
    if not matcher.is_error():
        mask = matcher.compute_bitmask()
        probe = matcher.deep_copy()
        first = next((k for k, byte in enumerate(mask) if byte), None)
        if first is not None:
            token = 8 * first + (mask[first] & -mask[first]).bit_length() - 1
            probe.consume_token(token)
            if not probe.is_error():
                probe.compute_bitmask()
        if probe.is_error():
            raise ValueError(f"invalid structured output constraint: {client_error(probe.get_error())}")
    if matcher.is_error():
        raise ValueError(f"invalid structured output constraint: {client_error(matcher.get_error())}")


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


# the additive mask of each byte value: row b holds 0 where bit j of b is set, -inf where it is not
_BYTE_BIAS = torch.where(((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool(), 0.0, float("-inf"))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, the logits of `rows` whose bit is 0 in the matching bitmask row.

    The bitmask's bytes (little-endian: token 8k + j is bit j of byte k) look up an additive
    0 / -inf row of eight in a 256-entry table: one gather and one add, several times faster on the
    CPU than unpacking the bits and a masked_fill (`python benchmarks/structured.py`)."""
    vocab, device = logits.shape[1], logits.device
    table = _byte_bias(device, logits.dtype)
    codes = _to(bitmask.view(torch.uint8), device).long()
    bias = torch.nn.functional.embedding(codes, table).reshape(bitmask.shape[0], -1)[:, :vocab]
    if rows == list(range(rows[0], rows[0] + len(rows))):
        logits[rows[0] : rows[0] + len(rows)].add_(bias)
    else:
        logits.index_add_(0, _to(torch.tensor(rows, dtype=torch.long), device), bias)


@functools.lru_cache(maxsize=None)
def _byte_bias(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return _BYTE_BIAS.to(device=device, dtype=dtype)


def _to(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; on a GPU through pinned memory, without blocking."""
    return (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)
