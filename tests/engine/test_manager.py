"""The background manager: streaming, cancellation, result routing, handlers, stop."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine import ContinuousBatchingConfig, ContinuousBatchingManager, RequestStatus
from tests.engine.conftest import model_for, prompts_for, reference


@pytest.fixture
def manager():
    mgr = ContinuousBatchingManager(
        model_for("llama"), continuous_batching_config=ContinuousBatchingConfig(block_size=16, num_blocks=128)
    )
    mgr.warmup()
    mgr.start()
    yield mgr
    mgr.stop(block=True, timeout=30)
    assert not mgr.is_running()


def test_streaming_yields_tokens_in_order_and_ends_like_non_streamed(manager) -> None:
    prompt = list(prompts_for()[0])
    rid = manager.add_request(prompt, max_new_tokens=24, streaming=True, ignore_eos=True)
    outs = list(manager.request_id_iter(rid))
    assert len(outs) == 24
    streamed = [t for o in outs for t in o.new_tokens]
    assert all(len(o.new_tokens) == 1 for o in outs)
    assert [o.generated_tokens for o in outs] == [streamed[: i + 1] for i in range(24)]
    assert outs[-1].is_finished() and outs[-1].finish_reason == "length"
    assert not any(o.is_finished() for o in outs[:-1])
    rid2 = manager.add_request(prompt, max_new_tokens=24, ignore_eos=True)
    final = manager.get_result(rid2, timeout=60)
    assert final.generated_tokens == streamed == list(reference("llama", tuple(prompt)))


def test_cancel_frees_blocks_and_others_finish(manager) -> None:
    prompts = [list(p) for p in prompts_for()[:6]]
    # the victim asks for far more tokens than the others, so the cancel reaches it while it runs however
    # long this thread waits for a core after its first token (24 took the tiny model a few milliseconds)
    ids = [manager.add_request(p, max_new_tokens=1500 if i == 2 else 24, streaming=True, ignore_eos=True)
           for i, p in enumerate(prompts)]  # fmt: skip
    victim = ids[2]
    first = manager.get_result(victim, timeout=60)  # it is running: it produced a token
    assert first is not None and first.status == RequestStatus.DECODING
    manager.cancel_request(victim)
    rest = list(manager.request_id_iter(victim))
    assert rest[-1].finish_reason == "abort" and rest[-1].is_finished()
    assert len(rest[-1].generated_tokens) < 1500
    for rid, prompt in zip(ids, prompts):
        if rid == victim:
            continue
        final = list(manager.request_id_iter(rid))[-1]
        assert tuple(final.generated_tokens) == reference("llama", tuple(prompt))
    stats = manager.stats()
    assert stats["num_requests_running"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"]  # the whole pool is free again


def test_cancel_unknown_or_finished_request_is_harmless(manager) -> None:
    manager.cancel_request("does-not-exist")
    rid = manager.add_request([5, 6, 7], max_new_tokens=3, ignore_eos=True)
    assert manager.get_result(rid, timeout=60).finish_reason == "length"
    manager.cancel_request(rid)
    rid2 = manager.add_request([5, 6, 7], max_new_tokens=3, ignore_eos=True)
    assert manager.get_result(rid2, timeout=60).is_finished()


def test_get_result_never_hands_out_another_requests_output(manager) -> None:
    a = manager.add_request([10, 11, 12], max_new_tokens=5, ignore_eos=True)
    b = manager.add_request([13, 14, 15], max_new_tokens=5, ignore_eos=True)
    out_b = manager.get_result(b, timeout=60)
    out_a = manager.get_result(a, timeout=60)
    assert (out_a.request_id, out_b.request_id) == (a, b)
    assert manager.get_result(a, timeout=0.05) is None  # consumed, nothing re-queued


def test_get_result_any_returns_each_finished_request_once(manager) -> None:
    ids = {manager.add_request([20 + i, 30, 40], max_new_tokens=4, ignore_eos=True) for i in range(5)}
    seen = [manager.get_result(timeout=60).request_id for _ in ids]
    assert sorted(seen) == sorted(ids)


def test_result_handler_runs_on_the_callers_loop(manager) -> None:
    async def run() -> list:
        loop_thread = threading.get_ident()
        done = asyncio.Event()
        got = []

        def on_output(out) -> None:
            got.append((threading.get_ident(), out))
            if out.is_finished():
                done.set()

        rid = manager.add_request([1, 2, 3, 4], max_new_tokens=6, streaming=True, ignore_eos=True)
        manager.register_result_handler(rid, on_output)
        await asyncio.wait_for(done.wait(), 60)
        assert all(tid == loop_thread for tid, _ in got)
        return [o for _, o in got]

    outs = asyncio.run(run())
    assert [t for o in outs for t in o.new_tokens] == outs[-1].generated_tokens
    assert len(outs[-1].generated_tokens) == 6


def test_stop_drains_in_flight_requests_then_refuses() -> None:
    mgr = ContinuousBatchingManager(model_for("llama"), continuous_batching_config=ContinuousBatchingConfig(block_size=16, num_blocks=64))
    mgr.start()
    ids = [mgr.add_request(list(p), max_new_tokens=8, ignore_eos=True) for p in prompts_for()[:3]]
    mgr.stop(block=True, timeout=60)
    assert not mgr.is_running()
    for rid in ids:
        assert mgr.get_result(rid, timeout=0).finish_reason == "length"
    with pytest.raises(RuntimeError, match="stopped"):
        mgr.add_request([1, 2, 3])


def test_hard_stop_aborts_in_flight_requests() -> None:
    mgr = ContinuousBatchingManager(model_for("llama"), continuous_batching_config=ContinuousBatchingConfig(block_size=16, num_blocks=64))
    mgr.start()
    rid = mgr.add_request([1, 2, 3], max_new_tokens=200, streaming=True, ignore_eos=True)
    assert mgr.get_result(rid, timeout=60) is not None
    mgr.stop(block=True, timeout=60, hard_stop=True)
    final = list(mgr.request_id_iter(rid))[-1]
    assert final.finish_reason == "abort"


def test_a_stopped_manager_starts_again_with_or_without_its_cache() -> None:
    """stop() then start() serves again: on a new engine after the cache was freed, on the same one
    with keep_for_next_session (transformers' names); outputs equal model.generate both times."""
    from engine import ContinuousBatchingConfig, ContinuousBatchingManager
    from tests.engine.conftest import model_for, prompts_for, reference

    prompt = list(prompts_for()[0])
    m = ContinuousBatchingManager(model_for("llama"), continuous_batching_config=ContinuousBatchingConfig(
        block_size=16, num_blocks=64))  # fmt: skip
    engines = []
    for keep in (False, True, False):
        m.start()
        rid = m.add_request(prompt, max_new_tokens=8, ignore_eos=True)
        out = m.get_result(rid, timeout=60)
        assert out is not None and tuple(out.generated_tokens) == reference("llama", tuple(prompt))[:8]
        engines.append(m.engine)
        m.stop(keep_for_next_session=keep)
    assert engines[0] is not engines[1]  # the first stop freed the cache: a new engine
    assert engines[1] is engines[2]  # kept for the next session


def test_generate_batch_keeps_a_persistent_engine_and_takes_transformers_keywords() -> None:
    import warnings

    import pytest

    from engine import ContinuousBatchingConfig, generate_batch
    from engine.generate import CACHED, destroy_cached_engine
    from tests.engine.conftest import model_for, prompts_for, reference

    model = model_for("llama")
    prompts = [list(p) for p in prompts_for()[:3]]
    cfg = ContinuousBatchingConfig(block_size=16, num_blocks=128)
    first = generate_batch(model, prompts, continuous_batching_config=cfg, max_new_tokens=6, ignore_eos=True,
                           progress_bar=False, persistent_manager=True, warmup=False)  # fmt: skip
    engine = getattr(model, CACHED).engine
    second = generate_batch(model, prompts, continuous_batching_config=cfg, max_new_tokens=6, ignore_eos=True,
                            progress_bar=False, persistent_manager=True)  # fmt: skip
    assert getattr(model, CACHED).engine is engine  # the same engine: no second profiling, prefix cache kept
    assert engine.block_manager.prefix_hits > 0
    for p, a, b in zip(prompts, first.values(), second.values()):
        assert tuple(a.generated_tokens) == tuple(b.generated_tokens) == reference("llama", tuple(p))[:6]
    destroy_cached_engine(model)
    assert not hasattr(model, CACHED)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = generate_batch(model, prompts[:1], num_blocks=48, max_batch_tokens=64, use_cuda_graph=False,
                             max_new_tokens=4, ignore_eos=True, progress_bar=False)  # fmt: skip
    assert [w.category for w in caught if "continuous_batching_config" in str(w.message)] == [FutureWarning]
    assert tuple(out["req_0"].generated_tokens) == reference("llama", tuple(prompts[0]))[:4]
    with pytest.raises(TypeError, match="unexpected keyword argument.*temprature"):
        generate_batch(model, prompts, temprature=0.7, progress_bar=False)


def test_the_queue_bound_counts_waiting_requests_while_the_engine_thread_moves_them() -> None:
    """add_request's max_queue_size check reads the scheduler's waiting deque from the caller's thread
    while the engine thread pops and pushes it: counting it never fails ("deque mutated during
    iteration" was a 503 under load). The race, forced: a thread mutating the deque, thread switches
    every microsecond."""
    import sys

    from engine.request import Request, SamplingParams

    manager = ContinuousBatchingManager(model_for("llama"), ContinuousBatchingConfig(block_size=16, num_blocks=64,
                                                                                       max_queue_size=10_000))  # fmt: skip
    waiting = manager.engine.scheduler.waiting
    waiting.extend(Request(f"w{i}", [1, 2, 3], 4, SamplingParams(), frozenset()) for i in range(50))
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            waiting.appendleft(waiting.pop())

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    try:
        assert all(49 <= manager._waiting_sequences() <= 50 for _ in range(20_000))  # 49: between pop and push
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(old)


def _fresh_manager() -> ContinuousBatchingManager:
    return ContinuousBatchingManager(
        model_for("llama"), continuous_batching_config=ContinuousBatchingConfig(block_size=16, num_blocks=128)
    )


def test_warmup_steps_on_a_thread_that_ends_with_it(monkeypatch) -> None:
    """A caller's long-lived thread (a server's executor) must not open OpenMP regions of its own: they
    would keep a second worker team beside the engine thread's for the life of the process."""
    mgr = _fresh_manager()
    ran_on: set[int] = set()
    step = mgr.engine.step

    def recording_step():
        ran_on.add(threading.get_ident())
        return step()

    monkeypatch.setattr(mgr.engine, "step", recording_step)
    before = set(threading.enumerate())
    mgr.warmup()
    assert ran_on and threading.get_ident() not in ran_on
    assert set(threading.enumerate()) == before  # the warm-up thread is gone
    assert mgr.warmed_up and mgr.engine.generation_tokens_total == 0
    mgr.start()
    try:
        rid = mgr.add_request(list(prompts_for()[0]), max_new_tokens=4, ignore_eos=True)
        assert mgr.get_result(rid, timeout=60).generated_tokens == list(reference("llama", tuple(prompts_for()[0])))[:4]
    finally:
        mgr.stop(block=True, timeout=30)


def test_a_failing_warmup_raises_on_the_callers_thread(monkeypatch) -> None:
    mgr = _fresh_manager()

    def broken_step():
        raise ValueError("no step today")

    monkeypatch.setattr(mgr.engine, "step", broken_step)
    with pytest.raises(ValueError, match="no step today"):
        mgr.warmup()
    assert not mgr.warmed_up
