"""The server's tokenizer: the model's own, with very large texts tokenised in a helper process.

The server tokenises in worker threads, but HF tokenizers hold the GIL at the end of a call while
they hand over (and free) the encoding: with millions of tokens, a stall of every stream and
probe on the event loop, and of the engine thread (tests/server/test_guard.py measures the pace). Texts of `LARGE_TEXT` characters or more
therefore go to a helper process: a small Python program that imports only `tokenizers`, holds
the same Rust tokenizer (serialised from the model's) and answers with packed int32 ids over a
pipe. It starts with the server, a probe checks that it tokenises exactly as the model's
tokenizer does (if not, or if it cannot start, large texts are tokenised in-process, with one
log line), and a helper that dies is replaced on the next large text.

Chat templates are rendered here and the rendered text tokenised like any other, as
`apply_chat_template(tokenize=True)` does (no special tokens added). A text whose tokens fill
the model's context is refused (400, vLLM's words) before its ids become Python objects:
building and checking millions of ints would slow the engine thread, which shares the GIL.
"""

from __future__ import annotations

import array
import logging
import struct
import subprocess
import sys
import threading
from typing import Any

from transformers import BatchEncoding

from engine.server.protocol import context_exceeded

logger = logging.getLogger("cbserve.server")

LARGE_TEXT = 1 << 20  # characters; below this the hand-over stalls the loop for under ~25 ms
CHUNK = 1 << 16  # token ids turned into Python ints per slice (~1 ms)
PROBE = "Hello, world! <|im_end|> ünïcödé — 123\n\tcode(x) {return x;}  end"

# The helper: frames are an 8-byte little-endian length and that many bytes. It reads the
# tokenizer's JSON, then requests (1 byte add_special_tokens, the UTF-8 text) and answers each
# with the packed int32 ids.
_HELPER = r"""
import array, struct, sys
from tokenizers import Tokenizer
src, dst = sys.stdin.buffer, sys.stdout.buffer
def frame():
    head = src.read(8)
    if len(head) < 8:
        sys.exit(0)
    return src.read(struct.unpack("<Q", head)[0])
tokenizer = Tokenizer.from_str(frame().decode())
while True:
    add = frame() == b"\x01"
    ids = tokenizer.encode_batch([frame().decode()], add_special_tokens=add)[0].ids
    out = array.array("i", ids).tobytes()
    dst.write(struct.pack("<Q", len(out)) + out)
    dst.flush()
"""


class Helper:
    """One helper process; `encode` is called by one thread at a time (the caller's lock)."""

    def __init__(self, tokenizer_json: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _HELPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._send(tokenizer_json.encode())

    def _send(self, payload: bytes) -> None:
        self.proc.stdin.write(struct.pack("<Q", len(payload)) + payload)

    def encode(self, text: str, add_special_tokens: bool) -> array.array:
        self._send(b"\x01" if add_special_tokens else b"\x00")
        self._send(text.encode("utf-8"))
        self.proc.stdin.flush()
        head = self.proc.stdout.read(8)  # file reads release the GIL while they wait
        if len(head) < 8:
            raise RuntimeError(f"the tokenizer helper exited ({self.proc.poll()})")
        size = struct.unpack("<Q", head)[0]
        body = self.proc.stdout.read(size)
        if len(body) != size:  # it died while answering: never hand back a cut-off prompt
            raise RuntimeError(f"the tokenizer helper exited mid-answer ({self.proc.poll()})")
        ids = array.array("i")
        ids.frombytes(body)
        return ids

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class ServerTokenizer:
    """Behaves as the wrapped tokenizer; `__call__` and `apply_chat_template` send large texts to
    the helper process."""

    def __init__(self, tokenizer, max_tokens: int | None = None) -> None:
        self._tokenizer = tokenizer
        self.max_tokens = max_tokens  # a text of this many tokens or more is refused unconverted
        self._helper: Helper | None = None
        self._usable = True  # False once the helper could not start or tokenised differently
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __call__(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> BatchEncoding:
        if not isinstance(text, str) or len(text) < LARGE_TEXT or kwargs:
            return self._tokenizer(text, add_special_tokens=add_special_tokens, **kwargs)
        packed = self._encode_large(text, add_special_tokens)
        if packed is None:
            return self._tokenizer(text, add_special_tokens=add_special_tokens)
        if self.max_tokens and len(packed) >= self.max_tokens:
            raise context_exceeded(self.max_tokens, len(packed), "prompt" if add_special_tokens else "messages")
        ids: list[int] = [0] * len(packed)  # one allocation, filled in slices: other threads get the GIL between
        for start in range(0, len(packed), CHUNK):
            ids[start : start + CHUNK] = packed[start : start + CHUNK].tolist()
        return BatchEncoding({"input_ids": ids})

    def apply_chat_template(self, conversation, tokenize: bool = True, **kwargs: Any):
        rendered = self._tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
        if not tokenize:
            return rendered
        if len(rendered) < LARGE_TEXT:
            return self._tokenizer.apply_chat_template(conversation, tokenize=True, **kwargs)
        return self(rendered, add_special_tokens=False)

    def start(self) -> None:
        """Start the helper and check it against the model's tokenizer (at server start-up)."""
        with self._lock:
            self._start()

    def _start(self) -> Helper | None:
        if self._helper is not None and self._helper.proc.poll() is None:
            return self._helper
        if not self._usable:
            return None
        try:
            helper = Helper(self._tokenizer.backend_tokenizer.to_str())
            for add in (True, False):
                mine = self._tokenizer(PROBE, add_special_tokens=add).input_ids
                if helper.encode(PROBE, add).tolist() != list(mine):
                    helper.close()
                    raise ValueError("it tokenises differently from the model's tokenizer")
        except (AttributeError, OSError, RuntimeError, ValueError) as exc:
            logger.warning("large texts are tokenised in the server process (the helper is unavailable: %s)", exc)
            self._usable = False
            return None
        self._helper = helper
        return helper

    def _encode_large(self, text: str, add_special_tokens: bool) -> array.array | None:
        with self._lock:
            helper = self._start()
            if helper is None:
                return None
            try:
                return helper.encode(text, add_special_tokens)
            except (OSError, RuntimeError, ValueError) as exc:  # it died: the next large text starts another
                logger.warning("the tokenizer helper failed (%s); tokenising this text in the server process", exc)
                helper.close()
                self._helper = None
                return None

    def close(self) -> None:
        with self._lock:
            if self._helper is not None:
                self._helper.close()
                self._helper = None
