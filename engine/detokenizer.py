"""Token ids to text, incrementally, with stop strings cut exactly.

`IncrementalDetokenizer` decodes only a small window around the newest tokens, so each token costs
the same however long the output is, and it holds text back while the last token ends inside a
multi-byte character (for `MAX_HELD` tokens at most). `StopStrings` holds back any tail that could
still become a stop string, and cuts the text right before the first stop string found, even when it
spans several tokens; a request's stop strings are one automaton (`StopMatcher`), so each character
costs the same however many there are.
"""

from __future__ import annotations

from collections import deque


# Tokens held back at most while the text ends inside a character (or they add no text): a character is
# at most 4 bytes, a token at least one, so past this the text is no character's start (a model made to
# repeat a lone byte's token) and goes out as decoded, replacement characters and all, instead of each
# token decoding every one held before it on the thread that detokenizes every stream.
MAX_HELD = 16


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
        if (full.endswith("\ufffd") or len(full) <= len(prefix)) and len(self.tokens) - self.read_offset <= MAX_HELD:
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


class StopMatcher:
    """Stop strings as one Aho-Corasick automaton, built once for a request and shared by its
    samples. Fed text one character at a time, its state is the longest tail of the text that begins
    some stop string, and each state names the stop strings that end there: a character costs the
    same however many stop strings there are, where scanning each of them at each token costs their
    number times their length (the server caps them too: engine/server/protocol.py)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.goto: list[dict[str, int]] = [{}]  # node (a prefix of some stop string) -> its one-character extensions
        self.depth = [0]  # the node's prefix length
        self.ends = [-1]  # the first stop string that is the node's prefix, -1: none
        for index, stop in enumerate(self.stops):
            node = 0
            for ch in stop:
                child = self.goto[node].get(ch)
                if child is None:
                    child = len(self.goto)
                    self.goto[node][ch] = child
                    self.goto.append({})
                    self.depth.append(self.depth[node] + 1)
                    self.ends.append(-1)
                node = child
            if self.ends[node] < 0:
                self.ends[node] = index
        self.fail = [0] * len(self.goto)  # the node of the longest proper suffix that is a prefix too
        self.more = [0] * len(self.goto)  # the longest proper suffix that is a whole stop string: 0 none
        queue = deque(self.goto[0].values())
        while queue:
            node = queue.popleft()
            for ch, child in self.goto[node].items():
                f = self.fail[node]
                while f and ch not in self.goto[f]:
                    f = self.fail[f]
                f = self.goto[f].get(ch, 0) if node else 0
                self.fail[child] = f
                self.more[child] = f if self.ends[f] >= 0 else self.more[f]
                queue.append(child)

    def step(self, node: int, ch: str) -> int:
        while True:
            child = self.goto[node].get(ch)
            if child is not None:
                return child
            if not node:
                return 0
            node = self.fail[node]


class StopStrings:
    def __init__(self, stops: list[str] | StopMatcher) -> None:
        self.matcher = stops if isinstance(stops, StopMatcher) else StopMatcher(stops)
        self.node = 0  # the matcher's state after the text so far; `pending` holds its prefix's characters
        self.pending = ""  # text received but not yet released
        self.stopped: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> str:
        """Text that is safe to release; after a stop string, nothing more. The text is cut right before
        the stop string that starts first among those found (the first listed of those starting there)."""
        if self.stopped is not None:
            return ""
        m = self.matcher
        if not m.stops:
            return text
        at = len(self.pending)
        self.pending += text
        node, found = self.node, None  # found: (start, stop string's index)
        for end in range(at, len(self.pending)):
            node = m.step(node, self.pending[end])
            whole = node if m.ends[node] >= 0 else m.more[node]
            while whole:  # every stop string that ends here
                hit = (end + 1 - m.depth[whole], m.ends[whole])
                found = hit if found is None or hit < found else found
                whole = m.more[whole]
        if found is not None:
            self.stopped = m.stops[found[1]]
            out, self.pending = self.pending[: found[0]], ""
            return out
        self.node = node
        cut = len(self.pending) - m.depth[node]  # hold the tail that begins some stop string
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        """At the end of generation: whatever was held back (it never became a stop string)."""
        out, self.pending = ("" if self.stopped is not None else self.pending), ""
        return out


class TextStream:
    """Detokenizer and stop strings together: feed tokens, get releasable text."""

    def __init__(self, tokenizer, stop: list[str] | StopMatcher | None = None, skip_special_tokens: bool = True
                 ) -> None:  # fmt: skip
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stops = StopStrings(stop or [])
        self.text = ""
        self.num_tokens = 0  # tokens that contributed to the released text (up to the stop)

    @property
    def stopped(self) -> bool:
        return self.stops.stopped is not None

    def fresh(self) -> TextStream:
        """A new stream with the same tokenizer and stop strings."""
        return TextStream(self.detokenizer.tokenizer, self.stops.matcher, self.detokenizer.skip_special_tokens)

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
