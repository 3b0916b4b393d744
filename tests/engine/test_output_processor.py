"""The output processor: streamed text, stop strings ended in the engine, n fan-out, logprob entries,
and validation errors that name their parameter."""

from __future__ import annotations

import pytest

from engine import ContinuousBatchingConfig, ContinuousBatchingManager, LLMEngine, ParamError, QueueFullError, generate_batch
from engine.output_processor import family_ids, new_logprobs
from engine.testing import build_test_tokenizer
from tests.engine.conftest import VOCAB, model_for, prompts_for

CFG = ContinuousBatchingConfig(block_size=16, num_blocks=64)
PROMPT = list(prompts_for()[9])


@pytest.fixture(scope="module")
def tok():
    return build_test_tokenizer()


def stream(manager: ContinuousBatchingManager, rid: str) -> list:
    return list(manager.request_id_iter(rid))


def test_streamed_text_adds_up_to_the_full_decode_and_a_stop_string_ends_the_sequence(tok) -> None:
    manager = ContinuousBatchingManager(model_for("llama"), continuous_batching_config=CFG, tokenizer=tok)
    manager.start()
    try:
        free = stream(manager, manager.add_request(PROMPT, max_new_tokens=30, ignore_eos=True, streaming=True,
                                                   detokenize=True))  # fmt: skip
        assert len(free) > 1 and free[-1].finish_reason == "length"
        text = tok.decode(free[-1].generated_tokens, skip_special_tokens=True)
        assert "".join(o.new_text for o in free) == free[-1].text == text
        stop = text[6:10]
        cut = stream(manager, manager.add_request(PROMPT, max_new_tokens=30, ignore_eos=True, streaming=True,
                                                  stop_strings=[stop]))  # fmt: skip
    finally:
        manager.stop(timeout=30)
    last = cut[-1]
    assert last.finish_reason == "stop" and "".join(o.new_text for o in cut) == last.text == text[: text.index(stop)]
    # the engine ended the sequence on the token that completed the stop string: no token after it
    tokens = last.generated_tokens
    assert tokens == free[-1].generated_tokens[: len(tokens)]
    assert stop in tok.decode(tokens) and stop not in tok.decode(tokens[:-1])


def test_n3_outputs_come_in_family_order_with_text(tok) -> None:
    out = generate_batch(model_for("llama"), [PROMPT], max_new_tokens=8, num_return_sequences=3, temperature=1.0,
                         seed=1, ignore_eos=True, tokenizer=tok, detokenize=True, continuous_batching_config=CFG)  # fmt: skip
    assert list(out) == family_ids("req_0", 3) == ["req_0", "req_0__child#0", "req_0__child#1"]
    assert all(o.text == tok.decode(o.generated_tokens, skip_special_tokens=True) for o in out.values())


def test_a_request_cancelled_before_it_forks_ends_its_siblings_too() -> None:
    manager = ContinuousBatchingManager(model_for("llama"), continuous_batching_config=CFG)
    rid = manager.add_request(PROMPT, max_new_tokens=8, num_return_sequences=3)
    manager.cancel_request(rid)  # before the loop runs: the request never reaches its first token
    manager.start()
    try:
        ends = [stream(manager, member)[-1] for member in family_ids(rid, 3)]
    finally:
        manager.stop(timeout=30)
    assert [o.request_id for o in ends] == family_ids(rid, 3)
    assert all(o.finish_reason == "abort" and o.generated_tokens == [] for o in ends)


def test_the_queue_counts_each_sequence_of_n() -> None:
    manager = ContinuousBatchingManager(model_for("llama"), continuous_batching_config=ContinuousBatchingConfig(
        block_size=16, num_blocks=64, max_queue_size=4))  # fmt: skip  # not started: nothing leaves the queue
    manager.add_request([1, 2, 3], num_return_sequences=3)
    with pytest.raises(QueueFullError):
        manager.add_request([1, 2, 3], num_return_sequences=2)  # 3 + 2 sequences > 4
    manager.add_request([1, 2, 3])
    manager.stop(hard_stop=True)


def test_logprob_entries_cover_the_new_tokens_with_their_text(tok) -> None:
    out = generate_batch(model_for("llama"), [PROMPT], max_new_tokens=5, logprobs=2, ignore_eos=True,
                         continuous_batching_config=CFG)["req_0"]  # fmt: skip
    entries = new_logprobs(out, tok)
    assert [e.token_id for e in entries] == out.generated_tokens
    assert [e.token for e in entries] == [tok.decode([t]) for t in out.generated_tokens]
    assert [e.logprob for e in entries] == out.logprobs
    assert all(len(e.top) == 2 and e.top[0][1] >= e.top[1][1] for e in entries)


BAD = [
    (dict(input_ids="text"), "input_ids"),
    (dict(input_ids=[1, VOCAB]), "input_ids"),
    (dict(input_ids=[1] * 5000), "input_ids"),
    (dict(input_ids=[1, 2], max_new_tokens=0), "max_new_tokens"),
    (dict(input_ids=[1, 2], max_new_tokens=100_000), "max_new_tokens"),
    (dict(input_ids=[1, 2], temperature=-1.0), "temperature"),
    (dict(input_ids=[1, 2], top_p=float("nan")), "top_p"),
    (dict(input_ids=[1, 2], top_k=-1), "top_k"),
    (dict(input_ids=[1, 2], seed=1.5), "seed"),
    (dict(input_ids=[1, 2], logprobs=99), "logprobs"),
    (dict(input_ids=[1, 2], logit_bias={5: float("inf")}), "logit_bias"),
    (dict(input_ids=[1, 2], min_new_tokens=-1), "min_new_tokens"),
    (dict(input_ids=[1, 2], stop_token_ids=[VOCAB]), "stop_token_ids"),
    (dict(input_ids=[1, 2], eos_token_id=VOCAB), "eos_token_id"),
    (dict(input_ids=[1, 2], num_return_sequences=0), "num_return_sequences"),
    (dict(input_ids=[1, 2], stop_strings=[1]), "stop_strings"),
    (dict(input_ids=[1, 2], detokenize="yes"), "detokenize"),
    (dict(input_ids=[1, 2], no_such_knob=1), "no_such_knob"),
    (dict(input_ids=[1, 2], structured_output={"regex": "("}), "structured_output"),
]


@pytest.mark.parametrize("kwargs,param", BAD, ids=[p for _, p in BAD])
def test_validation_errors_name_their_parameter(tok, kwargs, param) -> None:
    engine = LLMEngine(model_for("llama"), CFG, tokenizer=tok)
    with pytest.raises(ParamError) as caught:
        engine.make_request(**kwargs)
    assert caught.value.param == param and isinstance(caught.value, ValueError)


def test_text_without_a_tokenizer_is_refused_naming_what_asked_for_it() -> None:
    engine = LLMEngine(model_for("llama"), CFG)
    for kwargs, param in [(dict(detokenize=True), "detokenize"), (dict(stop_strings="x"), "stop_strings")]:
        with pytest.raises(ParamError, match="need a tokenizer") as caught:
            engine.make_request([1, 2], **kwargs)
        assert caught.value.param == param
