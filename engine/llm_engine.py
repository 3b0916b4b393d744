"""The engine core: requests, the scheduler (which owns them and their blocks) and a device executor.

`step()` is the whole loop body: `scheduler.schedule()`, `executor.launch()` (one forward and the
sampled tokens), `scheduler.update_from_output()` (append them, end what is done). It is
synchronous and single-threaded; `ContinuousBatchingManager` runs it on a thread. The executor
(engine/backends/) holds everything about the device; the core never asks which device it is on.
With async batching (`use_async_batching`) a step is launched before the last one's tokens are taken
back, so that a device's forward overlaps the host's work between steps (`_step_async`).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import psutil
import torch

from engine import telemetry
from engine.backends.executors import make_executor
from engine.block_manager import BlockManager
from engine.config import STREAMING_DECODE_STALL, ContinuousBatchingConfig
from engine.generation_defaults import resolve as resolve_generation_defaults
from engine.model_runner import restore_modes
from engine.output_processor import OutputProcessor
from engine.request import ParamError, Request, SamplingParams
from engine.sampler import PendingSample
from engine.scheduler import ScheduledBatch, Scheduler
from engine.structured import Grammar, GrammarCompiler, StructuredOutput
from engine.swap import HostSwapPool
from engine.tp_group import Launch, TPGroup
from engine.tp_worker import start_tensor_parallel
from engine.weights_watch import WeightsWatch

logger = logging.getLogger("cbserve.engine")

DEFAULT_MAX_NEW_TOKENS = 256
STEP_LOG_ENV = "CBSERVE_STEP_LOG"  # a file: one JSON line a step appended (engine/scheduler.py observe_step)
SAMPLING_KEYS = {
    "temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "logit_bias", "min_new_tokens", "logprobs", "do_sample",
}  # fmt: skip


CHECK_SLICE = 1 << 16


def token_ids_ok(ids: list | tuple, vocab_size: int) -> bool:
    """Every id an int (not a bool) in [0, vocab_size). C loops (map, min, max) over slices of 65,536
    ids: a Python loop over a million ids would slow every other thread of a server for its whole
    length, one C loop over all of them would stop them for tens of milliseconds."""
    for start in range(0, len(ids), CHECK_SLICE):
        part = ids[start : start + CHECK_SLICE]
        if set(map(type, part)) != {int} or min(part) < 0 or max(part) >= vocab_size:
            return False
    return True


ONE_PROMPT = "one request takes one prompt; for several, use add_requests or generate_batch with a list of prompts"


def as_token_ids(input_ids: Any, vocab_size: int) -> list[int] | tuple[int, ...]:
    """One prompt's ids as Python ints in [0, vocab_size), from a list or tuple of ints (or of numpy integers), or
    a 1-D or [1, T] integer tensor or numpy array; anything else is a ParamError ("input_ids") that says what is
    wrong."""
    if isinstance(input_ids, (str, bytes)):
        raise ParamError("input_ids", "input_ids must be token ids, not text: tokenize the prompt first "
                                      "(e.g. tokenizer.encode(text))")
    if isinstance(input_ids, (torch.Tensor, np.ndarray)):
        input_ids = _array_ids(input_ids)
    if not isinstance(input_ids, (list, tuple)):
        raise ParamError("input_ids", f"input_ids must be a list of token ids, got {type(input_ids).__name__}")
    if len(input_ids) == 0:
        raise ParamError("input_ids", "input_ids must be a non-empty list of token ids (the prompt is empty)")
    if token_ids_ok(input_ids, vocab_size):  # the fast path: plain ints
        return input_ids
    if any(isinstance(t, np.integer) for t in input_ids):
        input_ids = [int(t) if isinstance(t, np.integer) else t for t in input_ids]
        if token_ids_ok(input_ids, vocab_size):
            return input_ids
    t = next(t for t in input_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size)
    if isinstance(t, (float, np.floating)):
        raise ParamError("input_ids", f"input_ids holds {t!r}, which is not a token id: token ids are integers, "
                                      "not floats")
    if isinstance(t, (list, tuple, torch.Tensor, np.ndarray)):
        raise ParamError("input_ids", f"input_ids holds a {type(t).__name__}: {ONE_PROMPT}")
    raise ParamError("input_ids", f"input_ids holds {t!r}, which is not a token id in [0, {vocab_size})")


def _array_ids(ids: torch.Tensor | np.ndarray) -> list:
    """A tensor's or numpy array's ids as a list of Python ints: integer dtype, shape [T] or [1, T]."""
    if isinstance(ids, torch.Tensor):
        integer = not (ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool)
    else:
        integer = ids.dtype.kind in "iu"
    if not integer:
        raise ParamError("input_ids", f"input_ids must hold integer token ids, got a {type(ids).__name__} of "
                                      f"dtype {ids.dtype}")
    if ids.ndim == 0:
        raise ParamError("input_ids", "input_ids is a single number (0-d): pass a list of token ids, e.g. [id]")
    if ids.ndim == 2 and ids.shape[0] == 1:  # a batch of one, as transformers' input_ids
        ids = ids[0]
    if ids.ndim != 1:
        raise ParamError("input_ids", f"input_ids has shape {list(ids.shape)}, not [T] or [1, T]: {ONE_PROMPT}")
    return ids.tolist()


def _open_step_log():
    """The file CBSERVE_STEP_LOG names, open for appending a line a step, or None when it is unset."""
    path = os.environ.get(STEP_LOG_ENV)
    if not path:
        return None
    try:
        return open(path, "a", buffering=1, encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{STEP_LOG_ENV}={path}: cannot append to it ({exc.strerror})") from None


@dataclass
class _InFlight:
    """A launched step whose tokens are not taken back yet (async batching)."""

    batch: ScheduledBatch
    sample: PendingSample
    started: float  # perf_counter when it was scheduled
    launch_seconds: float  # scheduling and launching it (where the executor runs a step inside its launch: the step)


class LLMEngine:
    def __init__(
        self, model: torch.nn.Module, config: ContinuousBatchingConfig | None = None, generation_config=None,
        tokenizer=None, tensor_parallel: Launch | None = None,
    ):  # fmt: skip
        """`tensor_parallel`: how the other ranks start when config.tensor_parallel_size > 1 (default:
        spawned on this host, each sent the model; engine/tp_worker.py)."""
        self.config = config = config or ContinuousBatchingConfig()
        step_log = _open_step_log()  # before any rank or cache exists: a bad path stops nothing half-built
        self.tokenizer = tokenizer  # needed only for text (stop strings, detokenize) and structured output
        self.output_processor = OutputProcessor(tokenizer)  # text, stop strings and outputs of requests
        self._grammars: GrammarCompiler | None = None
        self.model = model
        modes = [m.training for m in model.modules()]
        model.eval()  # the engine's forwards run in eval mode; the caller's modes come back below and after each step
        self.use_generation_config(generation_config)
        text_config = model.config.get_text_config()
        self.vocab_size = text_config.vocab_size
        # tensor parallel: this process is rank 0 and runs its shard; the other ranks run theirs
        self.tp: TPGroup | None = None
        run_model = model
        if config.tensor_parallel_size > 1:
            self.tp, run_model = start_tensor_parallel(model, config, tensor_parallel or Launch())
        # the device side: placement, sizing, KV cache, kernels, graphs, forward and sampling
        try:
            self.executor = ex = make_executor(run_model, config, self.tp)
        except BaseException:
            if self.tp:
                self.tp.close()
            raise
        self.max_context, self.block_size, self.sizes = ex.max_context, ex.block_size, ex.sizes
        self.block_manager = BlockManager(self.sizes.num_blocks, self.block_size, config.allow_block_sharing)
        self.swap = None
        if config.cpu_offload_space > 0:
            space = int(config.cpu_offload_space * (1 << 30))
            cap = int(psutil.virtual_memory().total * config.cpu_offload_space_safety_threshold)
            if space > cap:
                logger.warning("cpu_offload_space %.1f GiB is clamped to %.1f GiB (%.0f%% of the host's RAM, "
                               "cpu_offload_space_safety_threshold)", space / (1 << 30), cap / (1 << 30),
                               100 * config.cpu_offload_space_safety_threshold)  # fmt: skip
                space = cap
            self.swap = HostSwapPool(ex.cache, space, self.sizes.bytes_per_block)
        self.scheduler = Scheduler(
            self.block_manager,
            self.sizes.max_batch_tokens,
            self.sizes.max_requests,
            prefill_first=config.scheduler_type == "prefill_first",
            swap=self.swap,
            reserve_blocks=int((config.safety_margin or 0.0) * self.sizes.num_blocks),
            max_decode_stall=STREAMING_DECODE_STALL if config.max_decode_stall is None else config.max_decode_stall,
            prefill_waves=config.prefill_waves,
        )
        self.requests = self.scheduler.requests  # every unfinished request, by id
        self.scheduler.step_log = step_log
        # in-place weight updates (an RL trainer's step) make cached prefixes stale: watched per step
        self._watch = WeightsWatch(model.parameters(), getattr(ex.backend, "ops", None))
        self._weights_seen = self._watch.version()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # wall time per phase of step(); "prepare" is the step's metadata (slots, block tables, ids)
        self.step_times = {"schedule": 0.0, "prepare": 0.0, "forward": 0.0, "sample": 0.0, "output": 0.0}
        # ends found off the engine thread (a stop string in the output thread's text): applied at the next step
        self._ends: deque[tuple[Request, int, str, str | None]] = deque()
        # async batching: the step in flight, whose tokens the next call takes back after launching the one after it
        self._in_flight: _InFlight | None = None
        self._done = 0.0  # when the last step's tokens were taken back
        self.steps_ahead = 0  # steps scheduled ahead of the last one's tokens (async batching)
        self.rows_dropped = 0  # their rows whose request the step before ended (its token dropped)
        restore_modes(model, modes)

    # the executor's parts, as attributes of the engine (benchmarks and tests read them)
    cache = property(lambda self: self.executor.cache)
    backend = property(lambda self: self.executor.backend)
    runner = property(lambda self: self.executor.runner)
    sampler = property(lambda self: self.executor.sampler)
    packed_linears = property(lambda self: getattr(self.executor, "packed_linears", None))
    fused_modules = property(lambda self: getattr(self.executor, "fused_modules", None))
    async_batching = property(lambda self: self.executor.async_batching)  # asked for, where the device takes it

    def placement(self) -> dict[str, Any]:
        """Where the engine runs and how big its KV cache is (the server's /v1/models shows it)."""
        return self.executor.placement()

    def warmup(self) -> None:
        """Capture what the device captures ahead of time (decode graphs); nothing on the CPU."""
        self.executor.warmup()

    # -- requests -------------------------------------------------------------------------------
    def make_request(
        self,
        input_ids: list[int],
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        eos_token_id: int | list[int] | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        stop_token_ids: list[int] | None = None,
        ignore_eos: bool = False,
        num_return_sequences: int | None = None,
        stop_strings: list[str] | str | None = None,
        detokenize: bool = False,
        structured_output: StructuredOutput | dict | Grammar | None = None,
        **sampling: Any,
    ) -> Request:
        """Validate one request; every problem is a ParamError (a ValueError) that names the parameter and says
        what is wrong."""
        if request_id is None:
            request_id = f"req_{uuid.uuid4().hex[:16]}"
        elif not isinstance(request_id, str) or not request_id:
            raise ParamError("request_id", f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.requests:
            raise ParamError("request_id", f"request_id {request_id!r} is already in use")
        input_ids = as_token_ids(input_ids, self.vocab_size)
        if max_new_tokens is None:
            max_new_tokens = self.defaults.max_new_for(len(input_ids)) or DEFAULT_MAX_NEW_TOKENS
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise ParamError("max_new_tokens", f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        total = len(input_ids) + max_new_tokens
        if self.max_context is not None and len(input_ids) >= self.max_context:
            raise ParamError(
                "input_ids", f"the prompt has {len(input_ids)} tokens; the model's context is {self.max_context} tokens"
            )
        capacity = self.block_size * min(self.sizes.num_blocks, self.config.max_blocks_per_request or 1 << 62)
        if total > capacity:
            raise ParamError(
                "max_new_tokens",
                f"prompt ({len(input_ids)} tokens) + max_new_tokens ({max_new_tokens}) = {total} tokens exceeds "
                f"the KV cache capacity for one request ({capacity} tokens)"
            )
        unknown = set(sampling) - SAMPLING_KEYS
        if unknown:
            raise ParamError(min(unknown), f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
        params = self._sampling_params(sampling, len(input_ids))
        params.validate(self.vocab_size)
        if params.logprobs is None and self.config.return_logprobs:
            params.logprobs = 0
        eos = self._eos_ids(eos_token_id) if not ignore_eos else frozenset()
        stops = frozenset(stop_token_ids or ())
        for t in stops:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ParamError("stop_token_ids", f"stop_token_ids holds {t!r}, which is not a token id")
        n = self.defaults.num_return_sequences if num_return_sequences is None else num_return_sequences
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ParamError("num_return_sequences", f"num_return_sequences (n) must be an integer >= 1, got {n!r}")
        if n > self.sizes.max_requests:
            raise ParamError("num_return_sequences", f"num_return_sequences (n) is {n}, more sequences than run at "
                                                     f"once (max_requests_per_batch {self.sizes.max_requests})")
        req = Request(request_id, list(input_ids), max_new_tokens, params, eos, stops, streaming, record_timestamps)
        req.num_children = n - 1
        req.otel_context = telemetry.current_context()
        if stop_strings is None:
            stop_strings = self.defaults.stop_strings
        self.output_processor.watch(req, stop_strings, detokenize)  # text, when stop strings or detokenize ask
        if structured_output is not None:
            grammar = structured_output
            if not isinstance(grammar, Grammar):
                try:
                    grammar = self.compile_grammar(structured_output)
                except ValueError as exc:  # llguidance's message, or no tokenizer
                    raise ParamError("structured_output", str(exc)) from None
            req.matcher = grammar.matcher()
        return req

    def use_generation_config(self, generation_config=None, tokenizer=None) -> None:
        """The generation config new requests take their defaults from (None: the model's), read as
        model.generate reads it; and the tokenizer, when one is given. A kept engine takes a new one
        per generate_batch call without being built again."""
        model_config = getattr(self.model, "generation_config", None)
        self.generation_config = generation_config or model_config
        self.defaults = resolve_generation_defaults(generation_config, model_config, self.config.drop_unsupported_processors)
        if tokenizer is not None and tokenizer is not self.tokenizer:
            self.tokenizer, self._grammars = tokenizer, None
            self.output_processor.tokenizer = tokenizer

    def compile_grammar(self, spec: StructuredOutput | dict) -> Grammar:
        """A structured-output constraint compiled for this model's tokenizer (cached by its text);
        a ValueError names what is wrong. Thread-safe: servers compile off their event loop."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, sorted(self._eos_ids(None)))
        return self._grammars.compile(spec)

    def _sampling_params(self, given: dict[str, Any], prompt_len: int) -> SamplingParams:
        """The request's keywords over the generation config's fields, field by field. Sampling is on
        when the request says do_sample=True, or gives a temperature > 0 without do_sample, or the
        config says do_sample; do_sample=False is greedy whatever the temperature (as generate)."""
        d = self.defaults
        do_sample = given.pop("do_sample", None)
        if do_sample is None:
            temperature = given.get("temperature")
            do_sample = d.do_sample if temperature is None else temperature != 0
        params = SamplingParams(repetition_penalty=d.repetition_penalty, min_new_tokens=d.min_new_for(prompt_len))
        if do_sample:
            params.temperature, params.top_k, params.top_p, params.min_p = d.temperature, d.top_k, d.top_p, d.min_p
        for key, value in given.items():
            if value is not None:
                setattr(params, key, value)
        if not do_sample:  # greedy ignores the temperature, but a given one must still be a valid one
            params.validate_temperature()
            params.temperature = 0.0
        return params

    def _eos_ids(self, eos_token_id) -> frozenset[int]:
        """The request's EOS ids, else the generation config's, else the model config's, each a token id
        in [0, vocab); the configs' negative ids (transformers' -1: none) and None are left out."""
        name = "eos_token_id"
        if eos_token_id is None:
            name, eos_token_id = "generation_config.eos_token_id", getattr(self.generation_config, "eos_token_id", None)
        if eos_token_id is None:
            name, eos_token_id = "model.config.eos_token_id", getattr(self.model.config, "eos_token_id", None)
        if eos_token_id is None:
            return frozenset()
        if isinstance(eos_token_id, (torch.Tensor, np.ndarray)):
            eos_token_id = eos_token_id.tolist()
        ids = list(eos_token_id) if isinstance(eos_token_id, (list, tuple, set, frozenset)) else [eos_token_id]
        ids = [int(t) if isinstance(t, np.integer) else t for t in ids]
        if name != "eos_token_id":
            ids = [t for t in ids if t is not None and not (isinstance(t, (int, float)) and t < 0)]
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ParamError("eos_token_id", f"{name} {t!r} is not a token id in [0, {self.vocab_size})")
        return frozenset(ids)

    def add_request(self, req: Request) -> None:
        self.scheduler.add(req)  # a ValueError when its id is in use
        self.prompt_tokens_total += req.num_prompt_tokens

    def abort_request(self, request_id: str, reason: str = "abort", error: str | None = None) -> Request | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.scheduler.remove(req)
        req.finish(reason, error)
        telemetry.request_finished(req)
        return req

    def end_at(self, req: Request, num_generated: int, reason: str = "stop", error: str | None = None) -> None:
        """Thread-safe: end `req` at its first `num_generated` generated tokens (tokens sampled after them
        are dropped), at the start of the next step. The output thread calls it when a stop string
        completes at that token (engine/output_thread.py). A request that ended by itself meanwhile is only
        cut (its outputs after that token were not handed out)."""
        self._ends.append((req, num_generated, reason, error))

    def apply_ends(self) -> list[Request]:
        """The ends that end_at queued: each request cut to its count, finished and taken out; returns them.
        Tokens sampled past such an end are not counted in generation_tokens_total, also when the request
        ended by itself meanwhile."""
        ended = []
        while self._ends:
            req, num_generated, reason, error = self._ends.popleft()
            self.generation_tokens_total -= req.cut_to(num_generated)
            if self.requests.get(req.request_id) is not req or req.is_finished:
                continue  # it ended by itself meanwhile (or was cancelled)
            self.scheduler.remove(req)
            req.finish(reason, error)
            telemetry.request_finished(req)
            ended.append(req)
        return ended

    def fail_all(self, error: str) -> list[Request]:
        self._in_flight = None  # its tokens are not taken back
        return [self.abort_request(rid, "error", error) for rid in list(self.requests)]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # -- the step -------------------------------------------------------------------------------
    def reset_prefix_cache(self) -> None:
        """Call after replacing the model's weights by new tensors (changes made in place are noticed
        by the engine itself): forgets every cached prefix block, packs the CPU's linear weights
        again, and watches the new parameters from then on."""
        self._watch = WeightsWatch(self.model.parameters(), getattr(self.executor.backend, "ops", None))
        self._weights_seen = self._watch.version()
        self.block_manager.reset_prefix_cache()
        self.executor.weights_replaced()

    def _weights_changed(self) -> bool:
        return self._watch.version() != self._weights_seen or self.executor.weights_moved()

    def _check_weights(self) -> None:
        if self._weights_changed():
            if self.tp:
                raise RuntimeError("the model's weights changed, but tensor-parallel ranks hold their own copies: "
                                   "build a new engine for new weights (tensor_parallel_size > 1)")
            self.reset_prefix_cache()
            logger.info("cbserve: model weights changed; prefix cache cleared, packed weights and graphs refreshed")

    def step(self) -> list[Request]:
        """One iteration: schedule, run the model once and sample, take the tokens back. Returns the
        requests that got a token (some of them finished by it), after those that end_at ended. With
        async batching a call takes back the tokens of the step the call before launched (`_step_async`)."""
        if self.async_batching:
            return self._step_async()
        ended, flight = self._schedule_and_launch()
        if flight is None:
            return ended
        taken = self._take_back(flight)
        return ended + taken if ended else taken

    def _schedule_and_launch(self) -> tuple[list[Request], _InFlight | None]:
        """The ends end_at queued, then the next step scheduled from the tokens known and launched (None:
        nothing to run)."""
        t0 = time.perf_counter()
        ended = self.apply_ends() if self._ends else []
        self._check_weights()
        batch = self.scheduler.schedule()
        return ended, self._launch(batch, t0) if batch else None

    def _step_async(self) -> list[Request]:
        """Async batching: launch the next step, then take back the tokens of the one in flight, so that on
        an accelerator the device runs the next forward while the host waits for those tokens, appends them and ends
        requests. Where every running request decodes, the next step is scheduled ahead of those tokens
        (`Scheduler.lookahead`: the device feeds each row its token); otherwise it is scheduled after them,
        as without async batching, and launched before this call returns. Tokens and their order are those
        of the steps one at a time; a request ended by a token of the step in flight has a row of the next
        step computed and its token dropped."""
        t0 = time.perf_counter()
        last, self._in_flight = self._in_flight, None
        launched = None
        if last is not None and not self._ends and not self._weights_changed():
            batch = self.scheduler.lookahead(last.batch, self.max_context)
            if batch:
                launched = self._launch(batch, t0, last.sample)
                self.steps_ahead += 1
        got = self._take_back(last) if last is not None else []
        ended = []
        if launched is None:
            ended, launched = self._schedule_and_launch()
        self._in_flight = launched
        return ended + got if ended else got

    def settle(self) -> list[Request]:
        """Async batching: take back the tokens of the step in flight and launch none, so that nothing runs
        on the device (before the caller uses the model: `ContinuousBatchingManager.pause`). Returns the
        requests that got a token; none without a step in flight."""
        last, self._in_flight = self._in_flight, None
        return self._take_back(last) if last is not None else []

    def _launch(self, batch: ScheduledBatch, t0: float, feed: PendingSample | None = None) -> _InFlight:
        t1 = time.perf_counter()
        sample = self.executor.launch(batch, self.config.return_logprobs, feed)
        t2 = time.perf_counter()
        step = self.executor.last_times
        times = self.step_times
        times["schedule"] += t1 - t0
        times["prepare"] += step["prepare"]
        times["forward"] += t2 - t1 - step["prepare"] - step["sample"]
        times["sample"] += step["sample"]
        return _InFlight(batch, sample, t0, t2 - t0)

    def _take_back(self, flight: _InFlight) -> list[Request]:
        """The tokens of a launched step (waiting for them where the device runs it), appended; returns the
        requests that got one."""
        t0 = time.perf_counter()
        out = flight.sample.result()
        t1 = time.perf_counter()
        batch = flight.batch
        for req in self.scheduler.update_from_output(batch, out, self.max_context):
            telemetry.request_finished(req)
        self.generation_tokens_total += len(batch.taken)
        self.rows_dropped += len(batch.samples) - len(batch.taken)
        done = time.perf_counter()
        threads = torch.get_num_threads() if self.scheduler.step_log is not None else None
        # what its decodes waited (the cost model's sample): where the device runs steps behind the host, from its
        # scheduling or from the end of the step it was queued behind (async batching); where the step ran inside
        # its launch, that and this take-back (not the next step's launch, which async batching ran in between)
        if self.executor.launches_ahead:
            seconds = done - max(flight.started, self._done)
        else:
            seconds = flight.launch_seconds + done - t0
        self.scheduler.observe_step(batch, seconds, threads)
        self._done = done
        self.step_times["forward"] += t1 - t0  # the device's forward, where the host waits for it
        self.step_times["output"] += done - t1
        return batch.taken

    # -- introspection --------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        bm = self.block_manager
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "kv_cache_usage_perc": bm.usage,
            "num_preemptions_total": self.scheduler.num_preemptions,
            "swap_out_blocks_total": self.swap.swap_out_total if self.swap else 0,
            "swap_in_blocks_total": self.swap.swap_in_total if self.swap else 0,
            "prefix_cache_queries_total": bm.prefix_queries,
            "prefix_cache_hits_total": bm.prefix_hits,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "num_free_blocks": bm.num_free,
            "num_blocks": bm.num_blocks,
            "prefill_token_cap": self.scheduler.prefill_cap,
            "steps_ahead_total": self.steps_ahead,
        }

    def close(self) -> None:
        """Abort what is left and free the cache's memory."""
        self.fail_all("the engine was closed")
        self.executor.cache.k.clear()
        self.executor.cache.v.clear()
        if self.scheduler.step_log is not None:
            self.scheduler.step_log.close()
            self.scheduler.step_log = None
        if self.tp:
            self.tp.close()
