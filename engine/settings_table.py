"""Every engine and server setting, once: its name, type, bounds, default and one line of doc.

The name is the `ContinuousBatchingConfig` field (or the server's setting) and the key of the
`--config` YAML; the rest follows from it, one rule for all:

- environment variable `CBSERVE_<NAME>` (`CBSERVE_BLOCK_SIZE=16`);
- `cbserve serve` flag `--<name-with-dashes>` where `flag` is set (`--block-size 16`);
- CBDeployment field `spec.engine.<nameInCamelCase>` where `operator` is set (`blockSize`).

`check_value` applies a setting's rule wherever a value arrives (ContinuousBatchingConfig, the
server's loader, the operator). The CRD's engine schema, the operator's field list
(operator/cbserve_operator/engine_fields.py) and the tables of docs/engine.md and
docs/kubernetes.md are generated from here: `python -m engine.settings_render --write`
(engine/settings_render.py; a test fails when a generated file is stale).

Standard library only: the generator and the operator's generated copy must not need torch.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "CBSERVE_"
DEVICE_PATTERN = r"auto|cpu|cuda(:[0-9]+)?"


@dataclass(frozen=True)
class Setting:
    name: str
    # "int", "float", "bool", "str"; "cuda_graph" (a bool or a [varlen, decode] pair) and "compile"
    # (a transformers CompileConfig or a dict of its fields) are checked by ContinuousBatchingConfig
    kind: str
    default: Any
    doc: str
    section: str = "engine"  # "engine": a ContinuousBatchingConfig field; "server": the server's own
    nullable: bool = False  # None accepted: derived at start-up, or off
    minimum: float | None = None
    exclusive_minimum: bool = False
    maximum: float | None = None
    exclusive_maximum: bool = False
    choices: tuple[Any, ...] = ()
    pattern: str | None = None  # str: the whole value matches it
    accepts: str | None = None  # how errors and docs say what is accepted, where the rule says it badly
    max_length: int | None = None
    power_of_two: bool = False
    flag: bool = True  # a `cbserve serve` flag
    operator: bool = False  # a CBDeployment spec.engine field
    crd_choices: tuple[Any, ...] = ()  # where the CRD accepts fewer values than the engine
    crd_deprecated: tuple[str, ...] = ()  # older CRD spellings, still accepted with a warning
    aliases: tuple[str, ...] = ()  # other YAML/keyword names (transformers')
    commands: tuple[str, ...] = ("serve", "generate", "worker")  # the `cbserve` commands that have its flag

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def cli_flag(self) -> str | None:
        return "--" + self.name.replace("_", "-") if self.flag else None

    @property
    def crd(self) -> str | None:
        return camel(self.name) if self.operator else None

    def rule(self, for_crd: bool = False) -> dict[str, Any]:
        """The checkable part, as plain data (the operator gets a copy of it)."""
        rule: dict[str, Any] = {"kind": self.kind}
        for key in ("nullable", "minimum", "exclusive_minimum", "maximum", "exclusive_maximum", "pattern",
                    "accepts", "max_length", "power_of_two"):  # fmt: skip
            value = getattr(self, key)
            if value is not None and value is not False:
                rule[key] = value
        choices = self.crd_choices if for_crd and self.crd_choices else self.choices
        if choices:
            rule["choices"] = list(choices)
        return rule

    def check(self, value: Any, label: str | None = None) -> Any:
        return check_value(self.rule(), label or self.name, value)


def camel(name: str) -> str:
    first, *rest = name.split("_")
    return first + "".join(part.capitalize() for part in rest)


def check_value(rule: dict[str, Any], label: str, value: Any) -> Any:
    """`value` if `rule` (Setting.rule) accepts it, an int given for a float as a float; else a
    ValueError "<label> must be <what is accepted>, got <value>". Copied verbatim into the operator."""
    kind, given = rule["kind"], value
    if value is None:
        if rule.get("nullable"):
            return None
        ok = False
    elif kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        value = float(value) if ok else value
    elif kind == "str":
        ok = isinstance(value, str)
    else:
        return value  # checked where it is used
    if ok and kind in ("int", "float"):
        low, high = rule.get("minimum"), rule.get("maximum")
        if low is not None:
            ok = value > low if rule.get("exclusive_minimum") else value >= low
        if ok and high is not None:
            ok = value < high if rule.get("exclusive_maximum") else value <= high
        if ok and rule.get("power_of_two"):
            ok = value & (value - 1) == 0
    if ok and rule.get("choices"):
        ok = value in rule["choices"]
    if ok and rule.get("pattern"):
        ok = re.fullmatch(rule["pattern"], value) is not None
    if ok and rule.get("max_length") is not None:
        ok = len(value) <= rule["max_length"]
    if not ok:
        raise ValueError(f"{label} must be {describe(rule)}, got {given!r}")
    return value


def describe(rule: dict[str, Any]) -> str:
    """What a rule accepts, in words: "a positive integer", "in (0, 1]", "one of fifo, prefill_first"."""
    if rule.get("accepts"):
        return rule["accepts"]
    kind = rule["kind"]
    if rule.get("choices") and rule.get("power_of_two"):
        return f"a power of two from {min(rule['choices'])} to {max(rule['choices'])}"
    if rule.get("choices"):
        return "one of " + ", ".join(str(c) for c in rule["choices"])
    if kind == "bool":
        return "a bool"
    if kind == "str":
        return f"a string matching {rule['pattern']}" if rule.get("pattern") else "a string"
    low, high = rule.get("minimum"), rule.get("maximum")
    if rule.get("power_of_two"):
        return "a power of two" + (f" up to {high}" if high is not None else "")
    if kind == "int" and high is None and low in (0, 1) and not rule.get("exclusive_minimum"):
        return "a positive integer" if low == 1 else "an integer >= 0"
    noun = "an integer" if kind == "int" else "a number"
    if low is not None and high is not None:
        left = "(" if rule.get("exclusive_minimum") else "["
        right = ")" if rule.get("exclusive_maximum") else "]"
        return f"{'an integer ' if kind == 'int' else ''}in {left}{_num(low)}, {_num(high)}{right}"
    if low is not None:
        return f"{noun} {'>' if rule.get('exclusive_minimum') else '>='} {_num(low)}"
    if high is not None:
        return f"{noun} {'<' if rule.get('exclusive_maximum') else '<='} {_num(high)}"
    return noun


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


GRAPH_PARTS = ("varlen", "decode")  # use_cuda_graph's pair; the CRD has one boolean field per part

SETTINGS: tuple[Setting, ...] = (
    # ---- the process: what to serve and where (cbserve serve; --model and --log-level for every command) ----
    Setting("model", "str", None, "local checkpoint folder or hf://org/name[@revision]; unset: the embedded "
            "SmolLM2-135M-Instruct", section="process", nullable=True),
    Setting("served_model_name", "str", None, "the model's name in the API; unset: the folder's name",
            section="process", nullable=True, commands=("serve",)),
    Setting("host", "str", "0.0.0.0", "the address the server listens on", section="process", commands=("serve",)),
    Setting("port", "int", 8000, "the port the server listens on", section="process", minimum=1, maximum=65535,
            commands=("serve",)),
    Setting("log_level", "str", "info", "the log level", section="process",
            choices=("critical", "error", "warning", "info", "debug")),
    Setting("drain_timeout", "float", 30.0, "seconds SIGTERM waits for in-flight requests before they are cut",
            section="process", minimum=0, commands=("serve",)),
    Setting("body_timeout", "float", 30.0, "seconds a request body may pause before the request gets 408",
            section="process", minimum=0, exclusive_minimum=True, commands=("serve",)),
    # ---- the KV cache and the step ----
    Setting("block_size", "int", None, "tokens per KV block; unset: 64 on the CPU, 256 on CUDA (flash-attn's paged "
            "kernels want multiples of 256)", nullable=True, minimum=1, power_of_two=True, operator=True,
            crd_choices=(16, 32, 64, 128, 256, 512, 1024), aliases=("page_size",)),
    Setting("num_blocks", "int", None, "KV blocks in the cache; unset: sized from max_memory_percent",
            nullable=True, minimum=1, operator=True),
    Setting("max_batch_tokens", "int", None, "token budget of one step (decodes plus prompt chunks); unset: derived "
            "at start-up", nullable=True, minimum=1, operator=True),
    Setting("max_decode_stall", "float", None, "with decodes running, a step's prompt tokens are capped so that it is "
            "predicted to take at most this many times a step of its decodes alone (a cost model fitted to the "
            "measured steps; at least 16 prompt tokens a step, or one smaller block); 0: off, prompt chunks fill "
            "max_batch_tokens; unset: 16 where tokens are streamed (cbserve serve, ContinuousBatchingManager), off "
            "for offline batches (generate_batch, cbserve generate)", nullable=True, minimum=0, operator=True),
    Setting("prefill_waves", "bool", True, "with the max_decode_stall cap on: when at least two requests wait for "
            "their first token and they outnumber the decoding ones, they are prefilled first as a wave (shortest "
            "first, uncapped, at most 4 steps' budget of prompt tokens; first tokens in its last step, or its "
            "majority's in the step that ends their prompts where one pause each stays under 1 in 200 of the "
            "wave's gaps) and the running decodes wait for it, so that requests that arrive together decode "
            "together; off: every prompt goes under the cap", operator=True),
    Setting("max_memory_percent", "float", 0.9, "share of the memory free after the model loads that the KV cache may "
            "take (unset: 0.9)", nullable=True, minimum=0, exclusive_minimum=True, maximum=1, operator=True),
    Setting("max_requests_per_batch", "int", None, "cap on requests running at once; unset: derived at start-up",
            nullable=True, minimum=1),
    Setting("max_blocks_per_request", "int", None, "cap on the KV blocks one request may hold; unset or 0 "
            "(transformers' value that turns its fast decode path off): no cap", nullable=True, minimum=1),
    Setting("allow_block_sharing", "bool", True, "prefix caching: requests sharing a prompt prefix share its full KV "
            "blocks", operator=True, crd_deprecated=("prefixCaching",)),
    Setting("scheduler_type", "str", "fifo", "fifo: running decodes first, then prompt chunks; prefill_first: prompt "
            "chunks first", choices=("fifo", "prefill_first"), operator=True),
    Setting("safety_margin", "float", None, "share of the KV blocks kept free for running requests: while fewer are "
            "free no new request is admitted; unset: 0, cbserve preempts instead", nullable=True, minimum=0,
            maximum=1, exclusive_maximum=True),
    Setting("cpu_offload_space", "float", 0.0, "GiB of host memory for swapping preempted requests' KV blocks; "
            "0 recomputes them", minimum=0, operator=True, crd_deprecated=("cpuOffloadGiB",)),
    Setting("cpu_offload_space_safety_threshold", "float", 0.8, "the swap pool is clamped to this share of the "
            "host's RAM (1: no clamp)", minimum=0, exclusive_minimum=True, maximum=1),
    Setting("cpu_kv_cache_space", "float", 1.0, "CPU: GiB the KV cache takes at most (it also stays within "
            "max_memory_percent of the memory available and half the machine's); more holds more tokens, not more "
            "speed", minimum=0, exclusive_minimum=True, operator=True),
    Setting("max_queue_size", "int", 0, "waiting requests accepted before refusing (QueueFullError; the server's "
            "503); 0: unbounded; cbserve serve: 4096 unless set", minimum=0, operator=True),
    # ---- sampling and outputs ----
    Setting("seed", "int", None, "seed of the sampler for requests without their own; unset: random", nullable=True,
            commands=("serve", "worker")),  # cbserve generate's own --seed seeds each request
    Setting("output_thread", "bool", True, "the manager's text, stop strings and delivery of outputs run on their own "
            "thread, beside the engine's steps (the engine thread never calls the tokenizer); false: on the engine "
            "thread"),
    Setting("return_logprobs", "bool", False, "the sampled token's logprob for every request"),
    Setting("logprobs_mode", "str", "raw_logprobs", "raw_logprobs: the model's own distribution; "
            "processed_logprobs: the one each token was drawn from (after bias, penalties, grammar, temperature, "
            "top-k/p, min-p), as transformers returns", choices=("raw_logprobs", "processed_logprobs")),
    Setting("drop_unsupported_processors", "bool", True, "generation-config fields cbserve does not implement are "
            "dropped with a warning; false: a ValueError", flag=False),
    Setting("per_request_processors", "bool", False, "accepted for transformers: per-request sampling parameters "
            "always work", flag=False),
    # ---- devices and kernels ----
    Setting("attn_backend", "str", None, "cpu (C++ paged attention kernel; torch SDPA as fallback) or cuda "
            "(flash-attn, else FlexAttention, else SDPA: docs/gpu.md); unset: from the device", nullable=True, choices=("cpu", "cuda")),
    Setting("cpu_packed_weights", "bool", None, "CPU: linear layers on packed copies of their weights (more memory); "
            "unset: on when the copies take under a quarter of free memory", nullable=True),
    Setting("use_async_batching", "bool", None, "async batching: each step is launched before the last one's tokens "
            "are back on the host (decodes scheduled ahead, fed their tokens on the device), so that a GPU's forward "
            "overlaps the host's work between steps; not with tensor parallel; turned down on the CPU, where a step runs "
            "inside its launch (one warning); unset: off (not yet measured on a GPU)", nullable=True, operator=True),
    Setting("use_cuda_graph", "cuda_graph", None, "GPU: CUDA graphs, a bool or a [varlen, decode] pair; unset: decode "
            "graphs on CUDA (docs/gpu.md)", nullable=True, flag=False, operator=True, crd_deprecated=("cudaGraphs",)),
    Setting("varlen_compile_config", "compile", None, "GPU: torch.compile of prefill and mixed steps (a transformers "
            "CompileConfig or a dict of its fields); unset: eager", nullable=True, flag=False),
    Setting("decode_compile_config", "compile", None, "GPU: torch.compile of decode steps, as varlen_compile_config",
            nullable=True, flag=False),
    Setting("default_compile_level", "int", 0, "transformers' shorthand: 1-3 fill the compile configs left unset "
            "(1: mode default, dynamic; 2: max-autotune-no-cudagraphs, dynamic; 3: the same, static)", minimum=0,
            maximum=3),
    # ---- transformers' fields with no effect in cbserve (accepted so its configs load) ----
    Setting("q_padding_interval_size", "int", 0, "transformers' CUDA-graph padding; cbserve pads graph steps to its "
            "own buckets (another value is logged once)", minimum=0, flag=False),
    Setting("kv_padding_interval_size", "int", 0, "as q_padding_interval_size", minimum=0, flag=False),
    Setting("use_default_compile_configs", "bool", None, "deprecated in transformers (FutureWarning): true sets "
            "default_compile_level 3", nullable=True, flag=False),
    Setting("max_cached_graphs", "int", None, "deprecated in transformers (FutureWarning); no effect", nullable=True,
            flag=False),
    Setting("auto_switch_to_flash", "bool", True, "no effect: cbserve always runs its own paged attention",
            flag=False),
    Setting("tensor_parallel_size", "int", 1, "ranks one engine runs over (torch.distributed: gloo on the CPU, NCCL on "
            "GPUs); each holds its share of the heads, MLP and KV cache; must divide the KV heads", minimum=1),
    Setting("cpu_group_timeout", "float", 300.0, "tensor parallel: seconds a rank waits in a forward's all-reduce "
            "before the group counts as broken; unset: 1800", nullable=True, exclusive_minimum=True, minimum=0,
            flag=False),
    Setting("disable_nccl_graph_mixing", "bool", True, "no effect: under tensor parallel every rank captures the "
            "same CUDA graphs, all-reduces inside, in lockstep", flag=False),
    # ---- the server's own (cbserve serve, cbserve generate) ----
    Setting("device", "str", "auto", "where the model runs: auto (cuda when torch sees a GPU, else cpu), cpu, cuda or "
            "cuda:N", section="server", pattern=DEVICE_PATTERN, accepts="auto, cpu, cuda or cuda:N"),
    Setting("dtype", "str", "auto", "the weights' dtype; auto: bfloat16 on a GPU that supports it, else float16; "
            "on the CPU bfloat16 where it has bfloat16 dot products (avx512_bf16, amx_bf16), else float32", section="server", choices=("auto", "float32", "bfloat16", "float16"),
            operator=True),
    Setting("quantization", "str", "auto", "the weights' format in memory: gguf keeps a GGUF file's Q8_0, Q4_0, "
            "Q4_1, Q4_K and Q6_K weights in their blocks (CPU, one rank; the rest in the dtype); none "
            "dequantises; int8 makes any checkpoint's linear layers int8 with per-channel scales at load time (CPU, one "
            "rank); auto, for a GGUF file (the embedded model included) on the CPU when dtype is auto: "
            "blocks for the kinds of weights (decoder layers, LM head) where a probe at load times the block "
            "kernel faster, the rest dequantised to the dtype; else none", section="server", choices=("auto", "none", "gguf", "int8"), operator=True),
    Setting("attn_implementation", "str", None, "transformers' attn_implementation the model loads with (the engine "
            "runs its own paged attention)", section="server", nullable=True, pattern=r"[A-Za-z0-9_]+",
            max_length=64, operator=True),
    Setting("quantized_activations", "str", "float", "what the weights kept in blocks (quantization gguf, auto's "
            "blocks, int8) multiply: float keeps each input row in float32 against the dequantised blocks (the "
            "result is the product with the dequantised weight up to float rounding: greedy output as "
            "model.generate gives); int8 quantizes each input row to int8 blocks of 32 and takes integer dot "
            "products (llama.cpp's arithmetic; VNNI where the CPU has it; the blocks are repacked once at load "
            "for its int8 tiles, the same size): faster, and greedy output departs from "
            "model.generate now and then",
            section="server", choices=("float", "int8"), operator=True),
    Setting("compile", "bool", False, "torch.compile both step kinds with default compile configs", section="server",
            operator=True),
    Setting("max_body_bytes", "int", 4 * 1024 * 1024, "larger request bodies get 413 before they are read",
            section="server", minimum=1024, commands=("serve",)),
)

BY_NAME = {s.name: s for s in SETTINGS}
ALIASES = {alias: s.name for s in SETTINGS for alias in s.aliases}


def setting(name: str) -> Setting:
    return BY_NAME[ALIASES.get(name, name)]


def engine_settings() -> list[Setting]:
    return [s for s in SETTINGS if s.section == "engine"]


def server_settings() -> list[Setting]:
    """The server's and the process's settings: fields of `ServeSettings`, not of the engine's config."""
    return [s for s in SETTINGS if s.section in ("server", "process")]


def command_settings(command: str) -> list[Setting]:
    """The settings that `cbserve <command>` has a flag for."""
    return [s for s in SETTINGS if s.flag and command in s.commands]


def known_names() -> set[str]:
    """Every key the `--config` YAML and CBSERVE_* variables may give."""
    return set(BY_NAME) | set(ALIASES)


def crd_fields() -> list[dict[str, Any]]:
    """spec.engine's setting fields: one per operator setting, use_cuda_graph's parts one each too.
    `key` is the engine YAML key; `part` (use_cuda_graph's) the index in its pair."""
    out: list[dict[str, Any]] = []
    for s in SETTINGS:
        if not s.operator:
            continue
        if s.kind == "cuda_graph":
            base = {"kind": "bool", "nullable": True}
            out.append({"crd": s.crd, "key": s.name, "rule": base, "deprecated": list(s.crd_deprecated),
                        "doc": "CUDA graphs for both step kinds (GPU only; docs/gpu.md)"})
            for i, part in enumerate(GRAPH_PARTS):
                out.append({"crd": f"{s.crd}{part.capitalize()}", "key": s.name, "part": i, "rule": base,
                            "deprecated": [f"{old}{part.capitalize()}" for old in s.crd_deprecated],
                            "doc": f"overrides {s.crd} for {part} steps"})
            continue
        out.append({"crd": s.crd, "key": s.name, "rule": {**s.rule(for_crd=True), "nullable": True},
                    "deprecated": list(s.crd_deprecated), "doc": s.doc})
    return out

