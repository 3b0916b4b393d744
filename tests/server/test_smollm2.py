"""`cbserve serve` with no model argument serves the embedded SmolLM2-135M-Instruct (must-show 7)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from pathlib import Path

import httpx
import torch

from tests.server.conftest import free_port


def test_default_model_answers_a_chat_in_english(tmp_path) -> None:
    port = free_port()
    log = tmp_path / "smollm2.log"
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240  # a fresh machine converts the GGUF first (~20 s here)
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        models = httpx.get(url + "/v1/models").json()["data"]
        assert models[0]["id"] == "SmolLM2-135M-Instruct" and models[0]["max_model_len"] == 8192
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 24, "temperature": 0})
        answer = r.json()["choices"][0]["message"]["content"]
        assert "Paris" in answer, answer
        assert r.json()["choices"][0]["finish_reason"] == "stop"
        # structured output and a forced tool call on the real model
        person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
                  "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Give me a person called Ann aged 31 as JSON."}], "max_tokens": 40,
            "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": person}}})
        assert json.loads(r.json()["choices"][0]["message"]["content"]) == {"name": "Ann", "age": 31}
        weather = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                                  "required": ["city"], "additionalProperties": False}}}  # fmt: skip
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "What is the weather like in Paris today?"}], "tools": [weather],
            "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 40, "temperature": 0})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_default_model_through_cbserve_equals_model_generate() -> None:
    from engine import generate_batch
    from engine.loader import load_model

    loaded = load_model(None, dtype="float32")
    tok = loaded.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in ("What is the capital of France?", "Name three colours.", "Write a haiku about the sea.")]
    prompts = [p["input_ids"] if hasattr(p, "keys") else p for p in prompts]
    out = generate_batch(loaded.model, prompts, max_new_tokens=20, ignore_eos=True, progress_bar=False)
    for p, o in zip(prompts, out.values()):
        # the attention mask is given: SmolLM2's pad id is <|im_end|>, which chat prompts contain, and
        # generate would otherwise infer a mask that hides those tokens
        ref = loaded.model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                    max_new_tokens=20, do_sample=False, eos_token_id=None)
        assert o.generated_tokens == ref[0, len(p):].tolist()


def test_default_model_over_three_tensor_parallel_ranks_equals_model_generate() -> None:
    """SmolLM2-135M has 9 heads and 3 KV heads: three ranks of 3 heads and 1 KV head each."""
    from engine import ContinuousBatchingConfig, generate_batch
    from engine.loader import load_model

    loaded = load_model(None, dtype="float32")
    tok = loaded.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in ("What is the capital of France?", "Name three colours.")]
    prompts = [p["input_ids"] if hasattr(p, "keys") else p for p in prompts]
    config = ContinuousBatchingConfig(tensor_parallel_size=3, block_size=16, num_blocks=64)
    out = generate_batch(loaded.model, prompts, max_new_tokens=16, ignore_eos=True, progress_bar=False,
                         continuous_batching_config=config)  # fmt: skip
    for p, o in zip(prompts, out.values()):
        ref = loaded.model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                    max_new_tokens=16, do_sample=False, eos_token_id=None)
        assert o.generated_tokens == ref[0, len(p):].tolist()


def test_the_converted_checkpoint_is_a_plain_transformers_one(tmp_path) -> None:
    """Its weights are float32 safetensors: no GGUF quantization_config, so other servers (vLLM)
    and transformers load the folder as it is; a cache converted before this holds gets repaired."""
    import json
    import shutil

    from transformers import AutoConfig

    from engine.loader import drop_stale_quantization, load_model

    loaded = load_model(None, dtype="float32")
    folder = loaded.model.name_or_path
    config = json.loads((Path(folder) / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert not hasattr(AutoConfig.from_pretrained(folder), "quantization_config")
    old = tmp_path / "old-cache"
    shutil.copytree(folder, old, ignore=shutil.ignore_patterns("*.safetensors"))
    stale = {**config, "quantization_config": {"quant_method": "gguf", "gguf_file": "x.gguf", "dequantize": False}}
    (old / "config.json").write_text(json.dumps(stale))
    assert drop_stale_quantization(old) and not drop_stale_quantization(old)
    assert json.loads((old / "config.json").read_text()) == config
