"""What a transformers `GenerationConfig` means for each request, read the way `model.generate` reads it.

A field comes from the config passed to the engine, else from `model.generation_config`, else from
transformers' global defaults (`GenerationConfig._get_default_generation_params`: temperature 1.0,
top_k 50, top_p 1.0 when sampling). A request's own keywords override field by field. Fields that
steer decoding in ways cbserve does not implement (beam search, n-gram bans, ...) are named once in
a warning and dropped, or refused when `drop_unsupported_processors` is False.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("cbserve.engine")

# transformers' global defaults for the sampling fields cbserve reads (the rest are neutral there too)
GLOBAL_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": 0.0,
                   "repetition_penalty": 1.0, "num_return_sequences": 1}  # fmt: skip
# the fields honoured, and how (docs/engine.md has the same table)
HONOURED = (
    "do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_new_tokens", "max_length",
    "min_new_tokens", "min_length", "num_return_sequences", "eos_token_id", "stop_strings",
)  # fmt: skip
# fields whose non-neutral value changes decoding in a way cbserve does not implement: field -> neutral value
UNSUPPORTED = {
    "num_beams": 1, "num_beam_groups": 1, "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "sequence_bias": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
    "encoder_repetition_penalty": 1.0, "exponential_decay_length_penalty": None, "diversity_penalty": 0.0,
    "guidance_scale": None, "watermarking_config": None, "penalty_alpha": None, "top_h": None,
    "renormalize_logits": False, "remove_invalid_values": False,
}  # fmt: skip


@dataclass(frozen=True)
class GenerationDefaults:
    """Per-request defaults resolved from the generation configs; None: not set anywhere."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_new_tokens: int | None = None
    max_length: int | None = None  # prompt + generated, when max_new_tokens is not set
    min_new_tokens: int = 0
    min_length: int = 0  # prompt + generated before EOS may end it
    num_return_sequences: int = 1
    eos_token_id: int | list[int] | None = None
    stop_strings: list[str] | None = None

    def max_new_for(self, prompt_len: int) -> int | None:
        """max_new_tokens for a prompt of this length: max_new_tokens, else what max_length leaves."""
        if self.max_new_tokens is not None or self.max_length is None:
            return self.max_new_tokens
        left = self.max_length - prompt_len
        if left <= 0:
            raise ValueError(f"the prompt has {prompt_len} tokens, generation_config.max_length is {self.max_length}: "
                             "nothing is left to generate; set max_new_tokens")  # fmt: skip
        return left

    def min_new_for(self, prompt_len: int) -> int:
        return max(self.min_new_tokens, self.min_length - prompt_len, 0)


def resolve(passed: Any, model_config: Any, drop_unsupported: bool = True) -> GenerationDefaults:
    """The defaults `passed` (a GenerationConfig or None) and the model's own config give, as generate does."""

    def field(name: str) -> Any:
        for config in (passed, model_config):
            value = getattr(config, name, None) if config is not None else None
            if value is not None:
                return value
        return GLOBAL_DEFAULTS.get(name)

    unsupported = sorted(name for name, neutral in UNSUPPORTED.items() if field(name) not in (None, neutral))
    if unsupported:
        what = ", ".join(f"{name}={field(name)!r}" for name in unsupported)
        if not drop_unsupported:
            raise ValueError(f"generation_config sets {what}, which cbserve does not implement "
                             "(drop_unsupported_processors=False)")  # fmt: skip
        logger.warning("generation_config: %s ignored: cbserve does not implement them", what)
    stops = field("stop_strings")
    return GenerationDefaults(
        do_sample=bool(field("do_sample")),
        temperature=float(field("temperature")),
        top_k=int(field("top_k")),
        top_p=float(field("top_p")),
        min_p=float(field("min_p") or 0.0),
        repetition_penalty=float(field("repetition_penalty")),
        max_new_tokens=field("max_new_tokens"),
        max_length=field("max_length"),
        min_new_tokens=int(field("min_new_tokens") or 0),
        min_length=int(field("min_length") or 0),
        num_return_sequences=int(field("num_return_sequences")),
        eos_token_id=field("eos_token_id"),
        stop_strings=[stops] if isinstance(stops, str) else list(stops) if stops else None,
    )
