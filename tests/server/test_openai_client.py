"""The official openai client, unchanged, drives both endpoints (must-show 1)."""

from __future__ import annotations

import openai
import pytest


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model(client) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-llama"]


def test_completion_with_n_logprobs_and_seed(client) -> None:
    kwargs = dict(model="tiny-llama", prompt="The quick brown fox", max_tokens=12, n=2, logprobs=3, seed=11,
                  temperature=1.0)
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: repeats exactly
    assert len(a.choices) == 2 and a.choices[0].text != a.choices[1].text  # each choice its own stream
    lp = a.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 12
    assert all(len(t) <= 3 for t in lp.top_logprobs)
    assert a.usage.completion_tokens == 24 and a.usage.prompt_tokens > 0


def test_completion_streaming_equals_non_streaming(client) -> None:
    kwargs = dict(model="tiny-llama", prompt="Kubernetes reconciles", max_tokens=16, temperature=0)
    full = client.completions.create(**kwargs).choices[0]
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_continuous_usage_stats_puts_the_tokens_so_far_on_every_chunk(client) -> None:
    """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk carries the usage
    so far, its completion tokens rising to the total; without include_usage, as in vLLM, no chunk does."""
    kwargs = dict(model="tiny-llama", prompt="Kubernetes reconciles", max_tokens=16, temperature=0, stream=True)
    chunks = list(client.completions.create(stream_options={"include_usage": True, "continuous_usage_stats": True},
                                            **kwargs))  # fmt: skip
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and 1 <= counts[0] and counts[-1] == 16
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens > 0 for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    chat = list(client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=5, temperature=0, stream=True,
                                               stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert chat[0].usage.completion_tokens == 0 and chat[0].choices[0].delta.role == "assistant"  # the role chunk
    assert all(c.usage is not None for c in chat) and chat[-1].usage.completion_tokens == 5
    plain = list(client.completions.create(stream_options={"continuous_usage_stats": True}, **kwargs))
    assert all(c.usage is None for c in plain)
    with pytest.raises(openai.BadRequestError, match="continuous_usage_stats"):
        client.completions.create(stream_options={"include_usage": True, "continuous_usage_stats": "yes"}, **kwargs)


def test_chat_streaming_and_not(client) -> None:
    messages = [{"role": "user", "content": "Tell me about continuous batching."}]
    full = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=10, temperature=0)
    assert full.choices[0].message.role == "assistant"
    stream = list(client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=10,
                                                 temperature=0, stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == full.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == "length"


def test_chat_logprobs_n2_seed(client) -> None:
    messages = [{"role": "user", "content": "hello"}]
    kw = dict(model="tiny-llama", messages=messages, max_tokens=6, n=2, seed=5, temperature=0.9, logprobs=True,
              top_logprobs=2)
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    content = a.choices[0].logprobs.content
    assert len(content) == 6 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)


def test_stop_string_cuts_the_text_exactly(client) -> None:
    base = client.completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=24, temperature=0)
    text = base.choices[0].text
    # a stop string from the middle of the greedy text, spanning token boundaries
    stop = text[5:9]
    assert len(stop) == 4 and stop in text
    cut = client.completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=24, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=24,
                                         temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text[: text.index(stop)]


def test_n2_is_one_prefill_and_repeats_with_its_seed(server, client) -> None:
    prompt = "Two samples of one prompt share its prefill: " + "block " * 40  # a prompt no other test sends
    kwargs = dict(model="tiny-llama", prompt=prompt, max_tokens=8, n=2, seed=3, temperature=1.0)
    before = server.metrics()["cbserve:prefix_cache_queries_total"]
    a = client.completions.create(**kwargs)
    looked_up = server.metrics()["cbserve:prefix_cache_queries_total"] - before
    # one engine request: its prompt is looked up (and prefilled) once; the second choice is forked from it
    assert looked_up == a.usage.prompt_tokens > 16
    assert a.usage.completion_tokens == 16
    b = client.completions.create(**kwargs)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # the same seed: the same two choices
    assert a.choices[0].text != a.choices[1].text
    # choice i samples with seed + i: choice 1 of seed 3 is choice 0 of seed 4
    c = client.completions.create(**{**kwargs, "n": 1, "seed": 4})
    assert c.choices[0].text == a.choices[1].text


def test_text_on_the_engine_thread_answers_the_same(server, client, model_dir, tmp_path) -> None:
    """output_thread=false (text and stop strings on the engine thread) against the default (its own thread):
    the same text, finish reasons and usage, streamed and not."""
    from tests.server.conftest import Server

    base = client.completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=24, temperature=0)
    stop = base.choices[0].text[7:11]
    off = Server(model_dir, tmp_path, {"block_size": 16, "num_blocks": 512}, extra_args=["--no-output-thread"])
    try:
        other = openai.OpenAI(base_url=off.url + "/v1", api_key="unused", max_retries=0)
        for kwargs in (dict(stop=[stop]), dict(stop=["never-there"]), dict(n=2, seed=3, temperature=1.0, stop=[stop])):
            request = {**dict(model="tiny-llama", prompt="Once upon a time", max_tokens=24, temperature=0), **kwargs}
            answers = [c.completions.create(**request) for c in (client, other)]
            assert [[(ch.text, ch.finish_reason) for ch in a.choices] for a in answers] == 2 * [
                [(ch.text, ch.finish_reason) for ch in answers[0].choices]]  # fmt: skip
            assert answers[0].usage == answers[1].usage
            streams = [list(c.completions.create(stream=True, stream_options={"include_usage": True}, **request))
                       for c in (client, other)]  # fmt: skip
            texts = ["".join(ch.choices[0].text for ch in s if ch.choices) for s in streams]
            assert texts[0] == texts[1] and streams[0][-1].usage == streams[1][-1].usage
    finally:
        assert off.stop() == 0
