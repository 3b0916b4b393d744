"""Structured output: every output obeys its grammar, and constrained greedy decoding is
token-identical to transformers' model.generate under the same mask (a logits processor)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from engine import ContinuousBatchingConfig, LLMEngine, generate_batch
from engine.structured import Grammar, StructuredOutput, allocate_bitmask, apply_bitmask
from engine.testing import build_test_tokenizer
from tests.engine.conftest import model_for, prompts_for

TOKENIZER = build_test_tokenizer()
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe not"]


def engine_for(arch: str = "llama", **cfg) -> LLMEngine:
    config = ContinuousBatchingConfig(block_size=16, num_blocks=cfg.pop("num_blocks", 128), **cfg)
    return LLMEngine(model_for(arch), config, tokenizer=TOKENIZER)


def run(engine: LLMEngine, requests: list[dict], everyone: dict | None = None) -> list:
    """The requests, run to the end; `everyone` collects every sequence by id (n > 1 siblings too)."""
    reqs = [engine.make_request(**r) for r in requests]
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished():
        for r in engine.step():
            if everyone is not None:
                everyone[r.request_id] = r
    return reqs


def text(req) -> str:
    return TOKENIZER.decode(req.generated_ids, skip_special_tokens=True)


def mixed_requests(spec: dict, n: int = 8, max_new_tokens: int = 96) -> list[dict]:
    prompts = prompts_for()
    return [
        dict(input_ids=list(prompts[i]), max_new_tokens=max_new_tokens, structured_output=spec,
             **({"temperature": 1.0, "seed": i} if i % 2 else {}))
        for i in range(n)
    ]  # fmt: skip


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_json_output_parses_and_validates(arch: str) -> None:
    reqs = run(engine_for(arch), mixed_requests({"json": SCHEMA}))
    for r in reqs:
        assert r.finish_reason == "stop", (r.finish_reason, r.error, text(r))
        jsonschema.validate(json.loads(text(r)), SCHEMA)


def test_regex_choice_and_json_object() -> None:
    engine = engine_for()
    reqs = run(engine, mixed_requests({"regex": REGEX}, 4) + mixed_requests({"choice": CHOICES}, 4)
               + mixed_requests({"json": {"type": "object", "properties": {"a": {"type": "boolean"}},
                                          "required": ["a"], "additionalProperties": False}}, 2))  # fmt: skip
    for r in reqs[:4]:
        assert re.fullmatch(REGEX, text(r)), text(r)
    for r in reqs[4:8]:
        assert text(r) in CHOICES
    for r in reqs[8:]:
        assert isinstance(json.loads(text(r))["a"], bool)
    assert engine.block_manager.num_free == engine.block_manager.num_blocks


class GrammarProcessor(LogitsProcessor):
    """transformers' side of the comparison: the same grammar, as a logits processor."""

    def __init__(self, grammar: Grammar, prompt_len: int) -> None:
        self.matcher, self.prompt_len = grammar.matcher(), prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[1] > self.prompt_len:
            assert self.matcher.accept(int(input_ids[0, -1]))
        bitmask = allocate_bitmask(1, scores.shape[1])
        self.matcher.fill_bitmask(bitmask, 0)
        scores = scores.clone()
        apply_bitmask(scores, bitmask, [0])
        return scores


def reference(engine: LLMEngine, prompt: list[int], spec: dict, max_new_tokens: int) -> list[int]:
    processor = GrammarProcessor(engine.compile_grammar(spec), len(prompt))
    eos = sorted(engine._eos_ids(None))
    with torch.no_grad():
        out = engine.model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                    logits_processor=LogitsProcessorList([processor]), eos_token_id=eos,
                                    pad_token_id=3)  # fmt: skip
    tokens = out[0, len(prompt) :].tolist()
    return tokens[: tokens.index(eos[0])] if eos[0] in tokens else tokens  # up to the end, EOS aside


@pytest.mark.parametrize("cfg", [{}, {"max_batch_tokens": 32}, {"num_blocks": 14, "max_batch_tokens": 256}],
                         ids=["plain", "chunked-prefill", "preemption"])  # fmt: skip
def test_constrained_greedy_equals_model_generate_with_the_same_mask(cfg: dict) -> None:
    engine = engine_for(**cfg)
    specs = [{"json": SCHEMA}, {"regex": REGEX}, {"choice": CHOICES}]
    prompts = [list(p) for p in prompts_for()[:12]]
    requests = [dict(input_ids=p, max_new_tokens=64, structured_output=specs[i % 3]) for i, p in enumerate(prompts)]
    reqs = run(engine, requests)
    if "num_blocks" in cfg:
        assert engine.scheduler.num_preemptions > 0
    for r, q in zip(reqs, requests):
        # the engine ends a request whose grammar allows nothing more without sampling the EOS
        mine = [t for t in r.generated_ids if t not in r.eos_token_ids]
        assert mine == reference(engine, q["input_ids"], q["structured_output"], 64), r.request_id


def test_prefix_hits_and_n_siblings_each_keep_their_own_parser() -> None:
    engine = engine_for()
    prompt = list(prompts_for()[1]) * 2
    run(engine, [dict(input_ids=prompt, max_new_tokens=96, structured_output={"json": SCHEMA})])
    everyone: dict = {}
    (again,) = run(engine, [dict(input_ids=prompt, max_new_tokens=96, structured_output={"json": SCHEMA},
                                 num_return_sequences=4, temperature=1.0, seed=5)], everyone)  # fmt: skip
    assert again.num_cached_tokens > 0 and len(everyone) == 4
    assert len({tuple(r.generated_ids) for r in everyone.values()}) > 1
    for r in everyone.values():
        assert r.finish_reason == "stop"
        jsonschema.validate(json.loads(text(r)), SCHEMA)
    outs = generate_batch(engine.model, [prompt], num_return_sequences=4, temperature=1.0, seed=5, max_new_tokens=96,
                          structured_output={"json": SCHEMA}, tokenizer=TOKENIZER, progress_bar=False,
                          continuous_batching_config=ContinuousBatchingConfig(block_size=16, num_blocks=128))  # fmt: skip
    assert sorted(o.generated_tokens for o in outs.values()) == sorted(r.generated_ids for r in everyone.values())


def test_same_seed_same_constrained_sample() -> None:
    a = run(engine_for(), mixed_requests({"json": SCHEMA}, 4))
    b = run(engine_for(), mixed_requests({"json": SCHEMA}, 4))
    assert [r.generated_ids for r in a] == [r.generated_ids for r in b]


def test_a_grammar_that_must_end_wins_over_min_tokens() -> None:
    (r,) = run(engine_for(), [dict(input_ids=list(prompts_for()[2]), max_new_tokens=20, min_new_tokens=10,
                                   structured_output={"choice": ["ok"]})])  # fmt: skip
    assert text(r) == "ok" and r.finish_reason == "stop"


def test_ignore_eos_still_ends_where_the_grammar_ends() -> None:
    (r,) = run(engine_for(), [dict(input_ids=list(prompts_for()[2]), max_new_tokens=30, ignore_eos=True,
                                   structured_output={"choice": CHOICES})])  # fmt: skip
    assert text(r) in CHOICES and r.finish_reason == "stop"


def test_a_grammar_completed_by_the_last_allowed_token_ends_with_stop() -> None:
    """The token that completes the grammar is also the max_new_tokens-th: the request ends because
    its grammar did ("stop"), not because of the budget ("length")."""
    request = dict(input_ids=list(prompts_for()[2]), ignore_eos=True, structured_output={"regex": REGEX})
    (free,) = run(engine_for(), [dict(request, max_new_tokens=64)])
    (exact,) = run(engine_for(), [dict(request, max_new_tokens=free.num_generated)])
    assert exact.generated_ids == free.generated_ids and exact.finish_reason == "stop"


def test_compiled_grammars_are_cached_by_their_text() -> None:
    engine = engine_for()
    assert engine.compile_grammar({"json": SCHEMA}) is engine.compile_grammar(StructuredOutput(json=SCHEMA))
    assert engine.compile_grammar({"json": SCHEMA}) is not engine.compile_grammar({"json": SCHEMA, "whitespace": True})


@pytest.mark.parametrize(
    "spec, words",
    [
        ({"regex": "a("}, "unclosed group"),
        ({"json": {"type": "wat"}}, "wat"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"regex": "a", "choice": ["b"]}, "exactly one"),
        ({}, "exactly one"),
        ({"choice": []}, "non-empty list"),
        ({"grammar": "start: ("}, "Expected token ')'"),
        ({"colour": "red"}, "unknown key"),
        ("json", "a StructuredOutput or a dict"),
    ],
)
def test_bad_constraints_are_refused_with_the_reason(spec, words: str) -> None:
    engine = engine_for()
    with pytest.raises(ValueError, match=re.escape(words)):
        engine.make_request([5, 6, 7], max_new_tokens=4, structured_output=spec)


def test_structured_output_without_a_tokenizer_says_so() -> None:
    engine = LLMEngine(model_for("llama"), ContinuousBatchingConfig(block_size=16, num_blocks=32))
    with pytest.raises(ValueError, match="needs a tokenizer"):
        engine.make_request([5, 6, 7], max_new_tokens=4, structured_output={"regex": "a+"})


def test_bitmask_masks_exactly_the_forbidden_tokens() -> None:
    logits = torch.zeros(3, 70)
    bitmask = allocate_bitmask(2, 70)
    bitmask[0] = 0
    bitmask[0, 1] = 1 << 3  # token 35 only
    bitmask[1, 2] = 0  # tokens 64-69 forbidden
    apply_bitmask(logits, bitmask, [2, 0])
    assert torch.isfinite(logits[1]).all()
    assert torch.isfinite(logits[2]).tolist() == [False] * 35 + [True] + [False] * 34
    assert torch.isfinite(logits[0]).tolist() == [True] * 64 + [False] * 6
