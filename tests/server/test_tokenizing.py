"""The server's tokenizer: large texts through the helper process give the model tokenizer's ids."""

from __future__ import annotations

import logging

import pytest

from engine.server import tokenizing
from engine.server.errors import APIError
from engine.server.tokenizing import ServerTokenizer
from engine.testing import build_test_tokenizer

TEXTS = ["The capital of France is Paris. " * 40, "ünïcödé <|im_end|> def add(a, b):\n\treturn a + b\n" * 30]


@pytest.fixture
def small_large(monkeypatch):
    monkeypatch.setattr(tokenizing, "LARGE_TEXT", 100)  # every text of 100+ characters goes to the helper


@pytest.fixture
def server_tokenizer(small_large):
    tok = ServerTokenizer(build_test_tokenizer())
    tok.start()
    yield tok
    tok.close()


def test_the_helper_gives_the_model_tokenizers_ids(server_tokenizer) -> None:
    reference = build_test_tokenizer()
    assert server_tokenizer._helper is not None and server_tokenizer._usable
    for text in TEXTS:
        for add in (True, False):
            assert server_tokenizer(text, add_special_tokens=add).input_ids == reference(text, add_special_tokens=add).input_ids
    chat = [{"role": "user", "content": TEXTS[1]}]
    got = server_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    want = reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    assert got["input_ids"] == (want["input_ids"] if hasattr(want, "keys") else want)


def test_a_text_that_fills_the_context_is_refused_with_its_count(small_large) -> None:
    tok = ServerTokenizer(build_test_tokenizer(), max_tokens=50)
    count = len(build_test_tokenizer()(TEXTS[0]).input_ids)
    with pytest.raises(APIError, match=f"maximum context length is 50 tokens. However, your request has {count} input"):
        tok(TEXTS[0])
    tok.close()


def test_a_helper_that_dies_is_replaced(server_tokenizer) -> None:
    first = server_tokenizer._helper
    first.proc.kill()
    first.proc.wait()
    reference = build_test_tokenizer()
    assert server_tokenizer(TEXTS[0]).input_ids == reference(TEXTS[0]).input_ids
    assert server_tokenizer._helper is not None and server_tokenizer._helper is not first


def test_a_helper_that_fails_mid_text_hands_the_text_back(server_tokenizer, caplog) -> None:
    def broken(text, add):
        raise RuntimeError("the tokenizer helper exited (-9)")

    server_tokenizer._helper.encode = broken
    with caplog.at_level(logging.WARNING, "cbserve.server"):
        assert server_tokenizer(TEXTS[0]).input_ids == build_test_tokenizer()(TEXTS[0]).input_ids
    assert "helper failed" in caplog.text and server_tokenizer._helper is None


class Different:
    """A tokenizer whose Python side adds a token its Rust side does not know of."""

    def __init__(self) -> None:
        self.inner = build_test_tokenizer()
        self.backend_tokenizer = self.inner.backend_tokenizer

    def __call__(self, text, add_special_tokens=True, **kwargs):
        out = self.inner(text, add_special_tokens=add_special_tokens, **kwargs)
        out["input_ids"] = [1] + out["input_ids"]
        return out


def test_a_helper_that_tokenises_differently_is_not_used(small_large, caplog) -> None:
    tok = ServerTokenizer(Different())
    with caplog.at_level(logging.WARNING, "cbserve.server"):
        tok.start()
    assert "tokenises differently" in caplog.text and tok._helper is None
    assert tok(TEXTS[0]).input_ids[0] == 1  # the model's own tokenizer, in-process


def test_an_answer_cut_off_midway_is_never_used(server_tokenizer, caplog) -> None:
    """A helper that dies while writing its answer: the text is tokenised in-process, not cut short."""
    import io
    import struct

    helper = server_tokenizer._helper
    helper.proc.stdout = io.BufferedReader(io.BytesIO(struct.pack("<Q", 12) + b"\0" * 8))  # 12 bytes promised, 8 sent
    with caplog.at_level(logging.WARNING, "cbserve.server"):
        assert server_tokenizer(TEXTS[0]).input_ids == build_test_tokenizer()(TEXTS[0]).input_ids
    assert "mid-answer" in caplog.text and server_tokenizer._helper is None
