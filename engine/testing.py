"""Small causal LMs and an offline tokenizer, for tests, benchmarks and examples.

Nothing here downloads. Each model is built from a config with a fixed seed, in float32, with its
weights scaled up from transformers' default init so that greedy decoding wanders across the
vocabulary instead of repeating one token (a model that repeats one token proves nothing).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")

# A few sentences to train the byte-level BPE on; any fixed text works, it only has to be fixed.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Continuous batching keeps the accelerator busy by adding requests as others finish.",
    "A paged key-value cache stores attention keys and values in fixed-size blocks.",
    "Kubernetes reconciles the desired state of a resource with what runs in the cluster.",
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "Prefix caching lets requests that share a system prompt reuse its blocks.",
    "Time to first token and inter-token latency are what a chat user feels.",
    "Once upon a time there was a small model that answered every question with a story.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000; punctuation: , . ; : ! ? ( ) [ ] { }",
    "def add(a, b):\n    return a + b\n",
]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@functools.lru_cache(maxsize=None)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok.to_str()


def build_test_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained offline on a fixed corpus, with a chat template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        pad_token="<pad>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _config(arch: str, vocab_size: int, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=3,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        cfg = LlamaConfig(**{**common, **overrides})
    elif arch == "qwen2":  # attention biases
        cfg = Qwen2Config(**{**common, **overrides})
    elif arch == "qwen3":  # q/k norms, explicit head_dim
        cfg = Qwen3Config(**{**common, "head_dim": 32, **overrides})
    elif arch == "mistral":  # a sliding window smaller than the test prompts
        cfg = MistralConfig(**{**common, "sliding_window": 24, **overrides})
    else:
        raise ValueError(f"arch must be one of {ARCHITECTURES}, got {arch!r}")
    return cfg


def build_test_model(arch: str = "llama", seed: int = 0, vocab_size: int = 512, scale: float = 4.0, **overrides):
    """A small randomly initialised causal LM in float32, deterministic for a given seed.

    `scale` multiplies every weight matrix (not the norms): at transformers' default init the
    logits are nearly flat and greedy decoding repeats itself; scaled, the paths vary.
    """
    from transformers import AutoModelForCausalLM

    cfg = _config(arch, vocab_size, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(scale)
    return model.eval()


def save_test_model(path: str | Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Write a test model and its tokenizer to a folder that `from_pretrained` (and `cbserve serve`) loads."""
    path = Path(path)
    model = build_test_model(arch, seed=seed, **overrides)
    model.generation_config.eos_token_id = 0
    model.save_pretrained(path)
    build_test_tokenizer(model.config.vocab_size).save_pretrained(path)
    return path


def random_prompts(n: int, min_len: int, max_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of random token ids with lengths uniform in [min_len, max_len]."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    # ids from 4 up: 0..3 are the tokenizer's special tokens
    return [torch.randint(4, vocab_size, (length,), generator=g).tolist() for length in lengths]
