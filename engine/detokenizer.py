"""Token ids to text, incrementally, with stop strings cut exactly.

`IncrementalDetokenizer` decodes only a small window around the newest tokens, so each token costs
the same however long the output is, and it holds text back while the last token ends inside a
multi-byte character. `StopStrings` holds back any tail that could still become a stop string, and
cuts the text right before the first stop string found, even when it spans several tokens.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = []
        self.prefix_offset = 0  # start of the window decoded for context
        self.read_offset = 0  # tokens before this are already turned into text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """The text the new tokens add (possibly empty while a character is incomplete)."""
        self.tokens.extend(token_ids)
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""  # an incomplete UTF-8 sequence, or a token that adds no text
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return full[len(prefix) :]

    def flush(self) -> str:
        """At the end of generation: the text held back while the last token ended inside a character,
        as the tokenizer decodes it (a replacement character included), so that the whole text equals
        a decode of every token."""
        if self.read_offset == len(self.tokens):
            return ""
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return full[len(prefix) :] if len(full) > len(prefix) else ""


class StopStrings:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self.pending = ""  # text received but not yet released
        self.stopped: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> str:
        """Text that is safe to release; after a stop string, nothing more."""
        if self.stopped is not None:
            return ""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out
        first = None
        for stop in self.stops:
            i = self.pending.find(stop)
            if i != -1 and (first is None or i < first[0]):
                first = (i, stop)
        if first is not None:
            self.stopped = first[1]
            out, self.pending = self.pending[: first[0]], ""
            return out
        keep = self._partial_tail()
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def _partial_tail(self) -> int:
        """Length of the longest tail of the pending text that begins some stop string."""
        for n in range(min(self.longest - 1, len(self.pending)), 0, -1):
            tail = self.pending[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def flush(self) -> str:
        """At the end of generation: whatever was held back (it never became a stop string)."""
        out, self.pending = ("" if self.stopped is not None else self.pending), ""
        return out


class TextStream:
    """Detokenizer and stop strings together: feed tokens, get releasable text."""

    def __init__(self, tokenizer, stop: list[str] | None = None, skip_special_tokens: bool = True) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stops = StopStrings(stop or [])
        self.text = ""
        self.num_tokens = 0  # tokens that contributed to the released text (up to the stop)

    @property
    def stopped(self) -> bool:
        return self.stops.stopped is not None

    def fresh(self) -> TextStream:
        """A new stream with the same tokenizer and stop strings."""
        return TextStream(self.detokenizer.tokenizer, self.stops.stops, self.detokenizer.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        out = ""
        for token in token_ids:  # one at a time, so the stop is known to the token
            if self.stopped:
                break
            out += self.stops.feed(self.detokenizer.add([token]))
            self.num_tokens += 1
        self.text += out
        return out

    def finish(self) -> str:
        """The text held back at the end: an incomplete last character, then a tail that never became
        a stop string."""
        out = "" if self.stopped else self.stops.feed(self.detokenizer.flush())
        out += self.stops.flush()
        self.text += out
        return out
