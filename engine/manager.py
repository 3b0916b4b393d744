"""`ContinuousBatchingManager`: the engine on a background thread, with transformers' API.

The loop is event-driven: it sleeps on an Event while there is nothing to do and wakes when a
request or a cancellation arrives. Results go to the request's own queue or to its registered
handler, never through a shared queue that has to be re-queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from engine.config import ContinuousBatchingConfig
from engine.llm_engine import LLMEngine
from engine.openmp import Team, engine_nice, lower_this_thread
from engine.output_processor import family_ids, unforked_outputs
from engine.output_thread import OutputThread
from engine.request import GenerationOutput, QueueFullError, Request
from engine.tp_group import GroupBroken, Launch

logger = logging.getLogger("cbserve.manager")

CACHED = "_cached_continuous_batching_manager"  # transformers' model attribute for a kept manager


class _Route:
    """Where one request's outputs go: a queue, or a callback on an asyncio loop."""

    __slots__ = ("queue", "handler", "finished")

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
        self.handler: tuple[Callable[[GenerationOutput], Any], asyncio.AbstractEventLoop] | None = None
        self.finished = False


class ContinuousBatchingManager:
    def __init__(
        self,
        model: torch.nn.Module,
        generation_config=None,
        continuous_batching_config: ContinuousBatchingConfig | None = None,
        workload_hints: Any = None,
        *,
        tokenizer=None,
        tensor_parallel: Launch | None = None,
    ) -> None:
        """`workload_hints` (transformers' WorkloadHints) is accepted and unused: cbserve sizes the
        cache and the batch from a measured forward, not from hints. `tensor_parallel`: how the other
        ranks start when the config's tensor_parallel_size > 1 (engine/tp_group.py)."""
        self.config = continuous_batching_config or ContinuousBatchingConfig()
        self.engine = LLMEngine(model, self.config, generation_config, tokenizer=tokenizer,
                                tensor_parallel=tensor_parallel)  # fmt: skip
        self._tensor_parallel = tensor_parallel
        self.model = model
        self._engine_args = (generation_config, tokenizer)
        self._released = False  # the engine's KV cache was freed by a stop(): start() builds a new one
        self._destroyed = False
        self._keep = False
        self._inbox: list[Request] = []
        self._cancels: list[str] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._pause = threading.Condition()
        self._pausers = 0  # threads inside pause()
        self._paused = False  # the loop is parked between steps
        self._routes: dict[str, _Route] = {}
        self._any: queue.SimpleQueue[str | None] = queue.SimpleQueue()  # request ids in delivery order
        self._thread: threading.Thread | None = None
        self._outputs: OutputThread | None = None  # with config.output_thread: text and delivery, while the loop runs
        self._loop_ended = True
        self._stopping = False
        self._hard_stop = False
        self._accepting = True
        self._fatal: BaseException | None = None
        # called (on the loop's thread) with the error that ended the engine for good: a broken
        # tensor-parallel group; the server exits on it
        self.on_fatal: list[Callable[[BaseException], Any]] = []
        self._watch_group()
        self.warmed_up = False

    def built_like(self, continuous_batching_config: ContinuousBatchingConfig | None = None) -> bool:
        """Whether this manager's engine was sized as this config asks (None: whatever it was)."""
        return continuous_batching_config is None or continuous_batching_config == self.config

    def use_generation_config(self, generation_config=None, tokenizer=None) -> None:
        """Defaults for the requests added from now on (see LLMEngine.use_generation_config)."""
        if generation_config is None and tokenizer is None:
            return
        old_gen, old_tok = self._engine_args
        self._engine_args = (generation_config or old_gen, tokenizer or old_tok)
        if not self._released:
            with self._lock:
                self.engine.use_generation_config(*self._engine_args)

    def ready_engine(self) -> LLMEngine:
        """The engine, built again if a stop() freed its cache."""
        if self._destroyed:
            raise RuntimeError("the manager was destroyed: build a new one")
        if self._released:
            generation_config, tokenizer = self._engine_args
            self.engine = LLMEngine(self.model, self.config, generation_config, tokenizer=tokenizer,
                                    tensor_parallel=self._tensor_parallel)  # fmt: skip
            self._released = self.warmed_up = False
            self._fatal = None
            self._watch_group()
        return self.engine

    # -- control --------------------------------------------------------------------------------
    def start(self) -> None:
        if self.is_running():
            logger.warning("the manager is already running")
            return
        nice = engine_nice()  # a bad CBSERVE_ENGINE_NICE is refused here, on the caller's thread
        self.ready_engine()  # stopped without keep_for_next_session: a fresh engine (and KV cache)
        self._stopping = self._hard_stop = False
        self._accepting = True
        self._loop_ended = False
        self._outputs = OutputThread(self._deliver, self._end_at) if self.config.output_thread else None
        self._thread = threading.Thread(target=self._loop, args=(nice,), name="cbserve-engine", daemon=True)
        self._thread.start()

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def switch_to_cb_friendly_attn(self, model: torch.nn.Module, auto_switch_to_flash: bool = True) -> None:
        """transformers' step that sets the model's attention implementation to one its continuous
        batching can run ("paged|eager", "sdpa" or flash, switching to flash-attn when
        `auto_switch_to_flash`), restored by stop(). cbserve needs no switch, so the model is left as
        it was loaded: around each engine step cbserve's paged attention stands in for whatever
        implementation the model has and puts it back after (engine/attention.py), and the CUDA
        backend runs flash-attn's kernels by itself when flash-attn is installed."""

    def stop(self, block: bool = True, timeout: float | None = None, keep_for_next_session: bool = False,
             hard_stop: bool = False, **_: Any) -> None:  # fmt: skip
        """Stop accepting requests; finish the in-flight ones (or abort them with hard_stop), then exit.
        The KV cache is freed once the loop has ended, unless `keep_for_next_session`, which also keeps
        the manager on the model for the next `init_continuous_batching` (as transformers does); either
        way a later start() serves again (after a free, on a newly built engine)."""
        if keep_for_next_session:
            setattr(self.model, CACHED, self)
        with self._lock:
            self._accepting = False
            self._stopping = True
            self._hard_stop = self._hard_stop or hard_stop
            self._keep = keep_for_next_session
        self._wake.set()
        if block:
            self.join(timeout=timeout)

    def join(self, stop_trigger_time: float | None = None, timeout: float | None = None) -> None:
        """Wait for the loop to end (at most `timeout` s); `stop_trigger_time` (transformers' first
        argument, a perf_counter() reading taken at stop) only dates the log line."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the engine loop did not end within %s s", timeout)
            elif stop_trigger_time is not None:
                logger.info("the engine loop stopped %.2f s after stop()", time.perf_counter() - stop_trigger_time)
        if not self.is_running() and self._stopping and not self._keep and not self._released:
            self.engine.close()
            self._released = True

    def destroy(self) -> None:
        """Stop (finishing in-flight requests) and free everything; the manager cannot start again."""
        if self.is_running():
            self.stop(block=True)
        if not self._released:
            self.engine.close()
            self._released = True
        self._destroyed = True
        if getattr(self.model, CACHED, None) is self:
            delattr(self.model, CACHED)

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Park the loop between two steps while the caller uses the model (an in-place weight update,
        an evaluation); requests and cache stay, and the loop resumes when the last pauser leaves.
        Weights changed in place are noticed at the next step, which drops the stale prefix cache."""
        if not self.is_running():
            raise RuntimeError("pause() needs a running manager")
        with self._pause:
            self._pausers += 1
            self._wake.set()
            self._pause.wait_for(lambda: self._paused or self._loop_ended)
        try:
            yield
        finally:
            with self._pause:
                self._pausers -= 1
                self._pause.notify_all()

    def reset_prefix_cache(self) -> None:
        """Forget cached prefixes (and pack CPU weights again): call after replacing the model's weight
        tensors. Safe while running: the loop is paused around it."""
        if self.is_running():
            with self.pause():
                self.engine.reset_prefix_cache()
        else:
            self.engine.reset_prefix_cache()

    def warmup(self) -> None:
        """Run one small step so the first real request does not pay for lazy initialisation.

        The steps run on a thread of their own that ends with them: OpenMP keeps a pool of workers
        for every thread that opened a parallel region, for as long as that thread lives, and with
        more pooled workers than cores libgomp's idle workers stop spinning and sleep after each
        kernel (docs/engine.md, One OpenMP team). A caller's long-lived thread (a server's executor)
        would otherwise keep a second team beside the engine thread's."""
        if self.warmed_up:
            return
        if self.is_running():
            raise RuntimeError("warmup() must be called before start()")
        failure: list[BaseException] = []

        def run() -> None:
            try:
                self._warmup_steps()
            except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
                failure.append(exc)

        thread = threading.Thread(target=run, name="cbserve-warmup")
        thread.start()
        thread.join()
        if failure:
            raise failure[0]

    def _warmup_steps(self) -> None:
        self.engine.warmup()
        req = self.engine.make_request([0] * min(8, self.engine.block_size), max_new_tokens=2, ignore_eos=True)
        req.otel_context = None  # not traced nor counted (engine/telemetry.py)
        self.engine.add_request(req)
        while self.engine.has_unfinished():
            self.engine.step()
        self.engine.prompt_tokens_total = self.engine.generation_tokens_total = 0
        self.warmed_up = True

    # -- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        input_ids: list[int],
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        eos_token_id: int | list[int] | None = None,
        **kwargs: Any,
    ) -> str:
        if not self._accepting or self._fatal is not None:
            raise RuntimeError("the manager is stopped: it accepts no new requests")
        with self._lock:
            if request_id is not None and request_id in self._routes:
                raise ValueError(f"request_id {request_id!r} is already in use")
            req = self.engine.make_request(
                input_ids,
                request_id=request_id,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos_token_id,
                streaming=streaming,
                record_timestamps=record_timestamps,
                **kwargs,
            )
            # text off the engine thread (not with a grammar: its matcher and the stop strings end the request
            # in one order, on the engine thread)
            req.text_deferred = self.config.output_thread and req.text_stream is not None and req.matcher is None
            limit = self.config.max_queue_size
            if limit and self._waiting_sequences() + 1 + req.num_children > limit:
                raise QueueFullError(f"the request queue is full ({limit} waiting)")
            for rid in family_ids(req.request_id, 1 + req.num_children):  # n > 1: one route per sequence
                self._routes[rid] = _Route()
            self._inbox.append(req)
        self._wake.set()
        return req.request_id

    def _waiting_sequences(self) -> int:
        """Sequences not started yet: each waiting request with its n - 1 siblings still to fork. The
        engine thread moves the scheduler's waiting deque meanwhile: it is copied in one C call (the GIL
        held throughout), not iterated step by step, which raised "deque mutated during iteration"."""
        waiting = tuple(self.engine.scheduler.waiting)
        return len(self._inbox) + len(waiting) + sum(r.num_children for r in self._inbox) + sum(
            r.num_children for r in waiting)

    def add_requests(self, inputs: list[list[int]], max_new_tokens: int | None = None, streaming: bool = False,
                     record_timestamps: bool = False, **kwargs: Any) -> list[str]:  # fmt: skip
        return [self.add_request(ids, max_new_tokens=max_new_tokens, streaming=streaming,
                                 record_timestamps=record_timestamps, **kwargs) for ids in inputs]  # fmt: skip

    def cancel_request(self, request_id: str) -> None:
        with self._lock:
            self._cancels.append(request_id)
        self._wake.set()

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next output of one request (or of any request); None when none came within `timeout`."""
        if request_id is None:
            return self._get_any(timeout)
        route = self._routes.get(request_id)
        if route is None:
            return None
        try:
            out = route.queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if out.is_finished():
            with self._lock:
                self._routes.pop(request_id, None)
        return out

    def _get_any(self, timeout: float | None) -> GenerationOutput | None:
        while True:
            try:
                rid = self._any.get(timeout=timeout)
            except queue.Empty:
                return None
            if rid is None:  # the loop ended: wakes iterators
                if self._loop_ended and self._any.empty():
                    return None
                continue
            out = self.get_result(rid, timeout=0)
            if out is not None:
                return out  # else: already taken by a get_result(rid) caller; look further

    def request_id_iter(self, request_id: str) -> Iterator[GenerationOutput]:
        """Every output of one request, in order; ends when it finishes."""
        while request_id in self._routes:
            out = self.get_result(request_id, timeout=None)
            if out is None:
                return
            yield out
            if out.is_finished():
                return

    def __iter__(self) -> Iterator[GenerationOutput]:
        """Outputs of every request as they come. Ends once each request added so far has handed out
        its final output, or the manager stopped and every output was taken (transformers' iterator
        runs until the manager stops)."""
        while self._routes or not self._any.empty():
            out = self._get_any(timeout=None)
            if out is not None:
                yield out
            elif self._loop_ended:
                return

    def register_result_handler(self, request_id: str, callback: Callable[[GenerationOutput], Any]) -> None:
        """Deliver this request's outputs to `callback`, run on the calling asyncio loop."""
        loop = asyncio.get_running_loop()
        with self._lock:
            route = self._routes.get(request_id)
            if route is None:
                raise KeyError(f"unknown request_id {request_id!r}")
            route.handler = (callback, loop)
            pending = []
            while not route.queue.empty():
                pending.append(route.queue.get_nowait())
            if route.finished:
                self._routes.pop(request_id, None)
        for out in pending:
            loop.call_soon(callback, out)

    def stats(self) -> dict[str, float]:
        stats = self.engine.stats()
        stats["num_requests_waiting"] += len(self._inbox)
        return stats

    # -- the loop -------------------------------------------------------------------------------
    def _deliver_request(self, req: Request) -> None:
        """The request's output, made by the engine's output processor; a request that ended before it
        forked its n - 1 siblings ends theirs too. With the output thread, the output is made there from
        the request's progress (except for a request whose text is made here: a grammar's), and every
        other output goes there too, to keep each request's outputs in order."""
        outputs = self._outputs
        if outputs is None:
            self._deliver(self.engine.output_processor.make_output(req))
            for out in unforked_outputs(req):
                self._deliver(out)
            return
        if req.text_stream is not None and not req.text_deferred:
            outputs.put_output(self.engine.output_processor.make_output(req))
        else:
            outputs.put(req)
        for out in unforked_outputs(req):
            outputs.put_output(out)

    def _end_at(self, req: Request, num_generated: int, reason: str, error: str | None) -> None:
        """From the output thread: the request ends there (a stop string); the loop applies it."""
        self.engine.end_at(req, num_generated, reason, error)
        self._wake.set()

    def _deliver(self, out: GenerationOutput) -> None:
        with self._lock:
            route = self._routes.get(out.request_id)
            if route is None:
                return
            finished = out.is_finished()
            route.finished = finished
            if route.handler is not None:
                if finished:
                    self._routes.pop(out.request_id, None)
                callback, loop = route.handler
            else:
                route.queue.put(out)
                self._any.put(out.request_id)
                return
        try:
            loop.call_soon_threadsafe(callback, out)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass

    def _drain_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
            hard = self._hard_stop
        for req in inbox:
            self.engine.add_request(req)
        if hard:
            cancels = list(self.engine.requests)
        for rid in cancels:
            req = self.engine.abort_request(rid)
            if req is not None:
                self._deliver_request(req)

    def _watch_group(self) -> None:
        """A tensor-parallel group that breaks wakes the loop (which then ends: engine.tp.check)."""
        if self.engine.tp:
            self.engine.tp.on_failure.append(lambda reason: self._wake.set())

    def _park_if_paused(self) -> None:
        with self._pause:
            if self._pausers:
                self._paused = True
                self._pause.notify_all()
                self._pause.wait_for(lambda: not self._pausers)
                self._paused = False

    def _hand_out(self, updated: list) -> None:
        """The outputs of the requests a step gave a token."""
        for req in updated:
            if req.streaming or req.is_finished:
                self._deliver_request(req)
            elif req.text_deferred:  # its stop strings are looked for on the output thread
                self._outputs.put(req, deliver=False)

    def _loop(self, nice: int = 0) -> None:
        engine = self.engine
        lower_this_thread(nice)  # before its first step: its OpenMP workers inherit it (engine/openmp.py)
        team = Team()  # one core fewer while other work borrows one (engine/openmp.py)
        try:
            while True:
                self._wake.clear()
                if self._pausers:
                    team.idle()  # a core lent meanwhile is not waited for
                    self._hand_out(engine.settle())  # async batching: nothing runs on the device while parked
                self._park_if_paused()
                self._drain_inbox()
                for req in engine.apply_ends():  # stop strings the output thread found (its final outputs went out)
                    self._deliver_request(req)
                if engine.tp:
                    engine.tp.check()  # a rank died while idle: end here, not at the next request
                if not engine.has_unfinished():
                    if self._stopping:
                        return
                    team.idle()
                    self._wake.wait()
                    continue
                team.fit()
                try:
                    updated = engine.step()
                except GroupBroken:
                    raise
                except Exception as exc:  # a failing step fails its requests, not the server
                    logger.exception("engine step failed")
                    for req in engine.fail_all(f"{type(exc).__name__}: {exc}"):
                        self._deliver_request(req)
                    engine.block_manager.reset_prefix_cache()
                    continue
                self._hand_out(updated)
        except GroupBroken as exc:  # the engine cannot step any more: its requests fail, the owner is told
            self._fatal = exc
            for req in engine.fail_all(str(exc)):
                self._deliver_request(req)
            for callback in self.on_fatal:
                callback(exc)
        except BaseException as exc:  # pragma: no cover - a bug in the loop itself
            self._fatal = exc
            logger.exception("the engine loop died")
            for req in engine.fail_all(f"engine loop died: {exc}"):
                self._deliver_request(req)
            raise
        finally:
            team.restore()
            if self._outputs is not None:
                self._outputs.close()  # every output queued so far is delivered before the loop counts as ended
                engine.apply_ends()  # the last ones it found: only the token count changes
            self._loop_ended = True
            self._any.put(None)  # wakes an iterator waiting for outputs that will not come
            with self._pause:
                self._pause.notify_all()
