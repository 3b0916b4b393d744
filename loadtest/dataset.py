"""Prompts with controlled lengths, cut from a text corpus shipped in the repo (or random words).

Lengths are in words of the corpus, which a tokenizer turns into roughly as many tokens; output
lengths are held by `max_tokens` with `ignore_eos`, so they are exact.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

CORPUS = Path(__file__).with_name("data") / "corpus.txt"


@dataclass(frozen=True)
class LengthSpec:
    """"128" (fixed) or "64:256" (uniform in the range)."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str, name: str) -> LengthSpec:
        try:
            parts = [int(p) for p in str(text).split(":")]
        except ValueError:
            raise ValueError(f"{name} must be N or LOW:HIGH (whole numbers), got {text!r}") from None
        if len(parts) == 1:
            parts *= 2
        if len(parts) != 2 or not 0 < parts[0] <= parts[1]:
            raise ValueError(f"{name} must be N or LOW:HIGH with 0 < LOW <= HIGH, got {text!r}")
        return cls(parts[0], parts[1])

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


class PromptSource:
    def __init__(self, input_len: LengthSpec, output_len: LengthSpec, shared_prefix: int = 0, seed: int = 0) -> None:
        self.words = CORPUS.read_text().split()
        self.input_len, self.output_len = input_len, output_len
        self.rng = random.Random(seed)
        self.prefix = self._words(shared_prefix) if shared_prefix else ""

    def _words(self, n: int) -> str:
        start = self.rng.randrange(len(self.words))
        picked = [self.words[(start + i) % len(self.words)] for i in range(n)]
        return " ".join(picked)

    def next(self) -> tuple[str, int]:
        """(prompt text, output tokens to ask for)."""
        body = self._words(self.input_len.draw(self.rng))
        prompt = f"{self.prefix}\n{body}" if self.prefix else body
        return prompt, self.output_len.draw(self.rng)
