"""Edge inputs: text, numpy and 2-D prompts, non-finite sampling numbers, bad EOS ids, a cut output file."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import yaml
from transformers import GenerationConfig

from engine import ContinuousBatchingConfig, ContinuousBatchingManager, SamplingParams, generate_batch
from engine.cli import main
from engine.testing import save_test_model
from tests.engine.conftest import MAX_NEW, VOCAB, model_for, prompts_for, reference

SMALL = ContinuousBatchingConfig(block_size=16, num_blocks=64)


@pytest.fixture(scope="module")
def manager():
    mgr = ContinuousBatchingManager(model_for("llama"), continuous_batching_config=SMALL)
    mgr.start()
    yield mgr
    mgr.stop(timeout=30)


def run(inputs, **kwargs):
    return generate_batch(model_for("llama"), inputs, continuous_batching_config=SMALL, progress_bar=False, **kwargs)


# -- prompts --------------------------------------------------------------------------------------
def test_text_prompt_says_tokenize_first(manager) -> None:
    with pytest.raises(ValueError, match=r"input_ids must be token ids, not text.*tokenizer\.encode\(text\)"):
        manager.add_request("The capital of France is")
    with pytest.raises(ValueError, match="not text"):
        manager.add_requests(["hello"])
    out = run(["hello", [1, 2, 3]], max_new_tokens=2, ignore_eos=True)
    assert "not text" in out["req_0"].error and "empty" not in out["req_0"].error
    assert out["req_1"].error is None and len(out["req_1"].generated_tokens) == 2


def test_numpy_and_tensor_ids_work_like_a_list() -> None:
    prompt = prompts_for()[0]
    inputs = [list(prompt), np.array(prompt, dtype=np.int64), [np.int64(t) for t in prompt],
              np.array(prompt, dtype=np.int32), [np.int32(t) for t in prompt], torch.tensor([prompt]),
              np.array([prompt]), torch.tensor(prompt, dtype=torch.int32)]  # fmt: skip
    out = run(inputs, max_new_tokens=MAX_NEW, ignore_eos=True)
    want = list(reference("llama", prompt))
    for res in out.values():
        assert res.error is None
        assert res.generated_tokens == want
        assert res.prompt_ids == list(prompt) and all(type(t) is int for t in res.prompt_ids)


def test_numpy_ids_outside_the_vocabulary_are_refused(manager) -> None:
    with pytest.raises(ValueError, match=rf"input_ids holds {VOCAB}, which is not a token id"):
        manager.add_request(np.array([1, VOCAB]))
    with pytest.raises(ValueError, match=rf"input_ids holds {VOCAB}, which is not a token id"):
        manager.add_request([np.int64(1), np.int64(VOCAB)])


BAD_PROMPTS = [
    (np.array([1.0, 2.0]), "input_ids must hold integer token ids, got a ndarray of dtype float64"),
    (torch.tensor([1.0, 2.0]), "input_ids must hold integer token ids, got a Tensor of dtype torch.float32"),
    (torch.tensor([True, False]), "input_ids must hold integer token ids, got a Tensor of dtype torch.bool"),
    ([1.0, 2.0], "input_ids holds 1.0, which is not a token id: token ids are integers, not floats"),
    ([1, np.float64(2.0)], "which is not a token id: token ids are integers, not floats"),
    (torch.tensor([[1, 2, 3], [4, 5, 6]]), r"input_ids has shape \[2, 3\], not \[T\] or \[1, T\]: one request takes one prompt"),
    (np.array([[1, 2, 3], [4, 5, 6]]), r"shape \[2, 3\].*use add_requests or generate_batch with a list of prompts"),
    (torch.zeros(1, 2, 3, dtype=torch.long), r"shape \[1, 2, 3\].*one request takes one prompt"),
    ([[1, 2, 3]], "input_ids holds a list: one request takes one prompt"),
    (torch.tensor(5), r"input_ids is a single number \(0-d\)"),
    (np.int64(5), "input_ids must be a list of token ids, got int64"),
    (torch.tensor([], dtype=torch.long), "the prompt is empty"),
    (torch.zeros(1, 0, dtype=torch.long), "the prompt is empty"),
]


@pytest.mark.parametrize("ids,message", BAD_PROMPTS, ids=[str(i) for i in range(len(BAD_PROMPTS))])
def test_bad_prompt_is_refused_with_a_clear_error(manager, ids, message) -> None:
    with pytest.raises(ValueError, match=message):
        manager.add_request(ids, max_new_tokens=2)


def test_generate_batch_fails_only_a_two_d_prompt() -> None:
    out = run([torch.tensor([[1, 2, 3], [4, 5, 6]]), [1, 2, 3]], max_new_tokens=2, ignore_eos=True)
    assert "one request takes one prompt" in out["req_0"].error and out["req_0"].finish_reason == "error"
    assert out["req_1"].error is None


# -- sampling numbers ----------------------------------------------------------------------------
NON_FINITE = [
    ("temperature", math.nan), ("temperature", math.inf), ("top_p", math.nan), ("min_p", math.nan),
    ("repetition_penalty", math.nan), ("repetition_penalty", math.inf), ("presence_penalty", math.nan),
    ("presence_penalty", -math.inf), ("frequency_penalty", math.nan), ("frequency_penalty", math.inf),
]  # fmt: skip


@pytest.mark.parametrize("field,value", NON_FINITE, ids=[f"{f}={v}" for f, v in NON_FINITE])
def test_non_finite_sampling_number_is_refused(manager, field, value) -> None:
    with pytest.raises(ValueError, match=rf"^{field} must be a finite number, got {value}$"):
        manager.add_request([1, 2, 3], **{field: value})
    with pytest.raises(ValueError, match=rf"^{field} must be a finite number"):
        SamplingParams(**{field: value}).validate(VOCAB)


@pytest.mark.parametrize("bias", [math.nan, math.inf, -math.inf])
def test_non_finite_logit_bias_is_refused(manager, bias) -> None:
    with pytest.raises(ValueError, match=rf"^logit_bias value for token 5 must be a finite number, got {bias}$"):
        manager.add_request([1, 2, 3], logit_bias={5: bias})


def test_huge_integer_sampling_number_is_refused() -> None:
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        SamplingParams(temperature=10**400).validate(VOCAB)


# -- EOS ids -------------------------------------------------------------------------------------
@pytest.mark.parametrize("eos", [VOCAB, -1, [3, VOCAB + 5], True, "2"], ids=str)
def test_request_eos_outside_the_vocabulary_is_refused(manager, eos) -> None:
    with pytest.raises(ValueError, match=rf"^eos_token_id .* is not a token id in \[0, {VOCAB}\)$"):
        manager.add_request([1, 2, 3], eos_token_id=eos)


def test_generation_config_eos_outside_the_vocabulary_is_refused() -> None:
    out = run([[1, 2, 3]], max_new_tokens=2, generation_config=GenerationConfig(eos_token_id=[0, VOCAB]))
    assert out["req_0"].error == f"generation_config.eos_token_id {VOCAB} is not a token id in [0, {VOCAB})"


def test_generation_config_negative_eos_is_ignored() -> None:
    prompt = prompts_for()[1]
    first = reference("llama", prompt)[0]
    config = GenerationConfig(eos_token_id=[-1, first])  # transformers' -1: no EOS
    out = run([list(prompt)], max_new_tokens=MAX_NEW, generation_config=config)
    assert out["req_0"].error is None
    assert out["req_0"].generated_tokens == [first] and out["req_0"].finish_reason == "stop"
    out = run([list(prompt)], max_new_tokens=MAX_NEW, generation_config=GenerationConfig(eos_token_id=-1))
    assert out["req_0"].generated_tokens == list(reference("llama", prompt))


def test_numpy_eos_ids_work() -> None:
    prompt = prompts_for()[1]
    first = reference("llama", prompt)[0]
    out = run([list(prompt)], max_new_tokens=MAX_NEW, eos_token_id=[np.int64(first)])
    assert out["req_0"].generated_tokens == [first] and out["req_0"].finish_reason == "stop"


# -- `cbserve generate` resuming a cut output file ------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_test_model(tmp_path_factory.mktemp("models") / "tiny-llama", "llama")


def cli_generate(model_dir, tmp_path, items: list[dict], out_text: str | bytes) -> tuple[int, list[dict]]:
    src, out, config = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "engine.yaml"
    src.write_text("".join(json.dumps(i) + "\n" for i in items))
    out.write_bytes(out_text.encode() if isinstance(out_text, str) else out_text)
    config.write_text(yaml.safe_dump({"block_size": 16, "num_blocks": 64}))
    code = main(["generate", "--model", str(model_dir), "--input", str(src), "--output", str(out),
                 "--config", str(config), "--max-new-tokens", "3"])  # fmt: skip
    return code, [json.loads(line) for line in out.read_text().splitlines()]


ITEMS = [{"id": "a", "prompt": "The capital of"}, {"id": "b", "prompt": "Once upon a time"}]
RECORD_A = json.dumps({"id": "a", "text": "kept", "finish_reason": "length"})


@pytest.mark.parametrize("cut", ['{"id": "b", "te', b'{"id": "b", "text": "\xc3'], ids=["json", "utf8"])
def test_generate_drops_a_cut_last_line_and_redoes_its_prompt(model_dir, tmp_path, capsys, cut) -> None:
    head = (RECORD_A + "\n").encode()
    code, lines = cli_generate(model_dir, tmp_path, ITEMS, head + (cut.encode() if isinstance(cut, str) else cut))
    assert code == 0
    assert [x["id"] for x in lines] == ["a", "b"] and lines[0]["text"] == "kept"
    assert lines[1]["usage"]["completion_tokens"] > 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == [f"cbserve: warning: {tmp_path / 'out.jsonl'}:2: dropped a cut last line (an interrupted run); "
                        "its prompt runs again"]  # fmt: skip


def test_generate_keeps_a_whole_last_line_without_its_newline(model_dir, tmp_path, capsys) -> None:
    code, lines = cli_generate(model_dir, tmp_path, ITEMS, RECORD_A)
    assert code == 0
    assert [x["id"] for x in lines] == ["a", "b"] and lines[0]["text"] == "kept"
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "out_text,message",
    [('{"id": "a", "te\n' + RECORD_A + "\n", "2: not JSON"), (RECORD_A + "\n{oops\n", "3: not JSON"),
     (RECORD_A + '\n["b"]\n', "3: a result line needs an 'id'")],
    ids=["cut-middle", "bad-last-with-newline", "no-id"],
)
def test_generate_bad_output_line_is_one_clear_error(model_dir, tmp_path, capsys, out_text, message) -> None:
    out_text = "\n" + out_text  # a blank first line is skipped, and still counts as line 1
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(i) + "\n" for i in ITEMS))
    out.write_text(out_text)
    code = main(["generate", "--model", str(model_dir), "--input", str(src), "--output", str(out)])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"cbserve: error: {out}:{message}") and "Traceback" not in err
    assert err.count("\n") == 1
    assert out.read_text() == out_text  # nothing was dropped or written
