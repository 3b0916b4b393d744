"""Async batching (`use_async_batching`): each step is launched before the last one's tokens are taken
back, decodes scheduled ahead and fed their tokens on the device. The tokens, their logprobs, finish
reasons and the freed blocks are those of the engine stepping one step at a time, whatever ends the
requests (EOS in flight, max_new_tokens, cancels, stop strings) and whatever the scheduler does
(preemption, prefix hits, new arrivals)."""

from __future__ import annotations

import logging

import pytest

from engine import ContinuousBatchingConfig, ContinuousBatchingManager, LLMEngine, RequestStatus
from tests.engine.conftest import MAX_NEW, model_for, prompts_for, reference

EOS = [7, 11, 13, 17, 19]  # with min_new_tokens


def _run(cfg: dict, async_on: bool, arch: str = "llama", requests=None, arrivals: int = 0):
    """Every prompt with its own max_new_tokens, EOS ids and logprobs; `arrivals` more added mid-run. Returns
    per request (tokens, finish reason, logprobs), and the engine."""
    engine = LLMEngine(model_for(arch), ContinuousBatchingConfig(**cfg, use_async_batching=async_on))
    prompts = [list(p) for p in prompts_for()[:12]]
    reqs = []
    for i, prompt in enumerate(prompts):
        # by default a token of its greedy path is its EOS: it stops on it, with a step ahead in flight
        eos = [reference(arch, tuple(prompt))[3 + i % 6]]
        kw = requests(i) if requests else dict(max_new_tokens=6 + 3 * i, eos_token_id=eos, logprobs=2)
        reqs.append(engine.make_request(prompt, request_id=f"r{i}", **kw))
    for req in reqs[: len(reqs) - arrivals]:
        engine.add_request(req)
    steps = 0
    while engine.has_unfinished() or steps < arrivals:
        engine.step()
        if steps < arrivals:  # one arrival a step, while the others decode
            engine.add_request(reqs[len(reqs) - arrivals + steps])
        steps += 1
    got = [(r.generated_ids, r.finish_reason, [round(x, 4) for x in r.logprobs], r.top_logprobs) for r in reqs]
    return got, engine


def _same_as_one_step_at_a_time(cfg: dict, **kw) -> tuple[list, LLMEngine]:
    want, sync = _run(cfg, False, **kw)
    got, engine = _run(cfg, True, **kw)
    assert got == want
    assert sync.steps_ahead == 0
    assert engine.block_manager.num_free == engine.block_manager.num_blocks  # every block back
    assert not engine.has_unfinished()
    assert engine.generation_tokens_total == sync.generation_tokens_total == sum(len(g[0]) for g in got)
    return got, engine


def test_eos_in_flight_and_lengths_give_the_same_tokens_and_logprobs(arch: str) -> None:
    got, engine = _same_as_one_step_at_a_time(dict(block_size=16, num_blocks=512, max_batch_tokens=256), arch=arch)
    assert engine.steps_ahead > 0
    # some request stopped on EOS before its max_new_tokens: its row of the step ahead was dropped
    assert any(reason == "stop" for _, reason, _, _ in got)
    assert engine.rows_dropped > 0


def test_preemption_and_new_arrivals() -> None:
    # 16 blocks of 16 tokens cannot hold the 12 requests: the scheduler preempts (never while a step is ahead)
    _, engine = _same_as_one_step_at_a_time(dict(block_size=16, num_blocks=16, max_batch_tokens=256), arrivals=4)
    assert engine.scheduler.num_preemptions > 0
    assert engine.steps_ahead > 0


def test_prefix_hits_on_blocks_that_steps_ahead_filled() -> None:
    """A second request whose prompt is the first one's prompt and output finds the blocks the first one's
    decodes filled, steps ahead included (their block hashes are taken once the tokens are known)."""
    prompt = list(prompts_for()[5])
    # the first request's last computed token (its last token is sampled, never computed) ends a block: that
    # block is filled by a step ahead, and no step after it hashes it
    new = 2 * MAX_NEW + (1 - len(prompt) - 2 * MAX_NEW) % 16

    def run(async_on: bool):
        engine = LLMEngine(model_for("llama"), ContinuousBatchingConfig(block_size=16, num_blocks=256,
                                                                         use_async_batching=async_on))  # fmt: skip
        outs = []
        for p in (prompt, None):
            req = engine.make_request(p or prompt + outs[0] + [5, 6], max_new_tokens=new, ignore_eos=True)
            engine.add_request(req)
            while engine.has_unfinished():
                engine.step()
            outs.append(req.generated_ids)
        return outs, engine

    want, sync = run(False)
    got, engine = run(True)
    assert got == want
    assert (len(prompt) + new - 1) % 16 == 0 and got[0] == list(reference("llama", tuple(prompt), new))
    assert engine.block_manager.prefix_hits == sync.block_manager.prefix_hits > 0 and engine.steps_ahead > 0


def test_requests_that_need_their_tokens_on_the_host_are_never_run_ahead() -> None:
    """Penalties, a seed of its own, min_new_tokens: the next step waits for the tokens (and the output is the
    one-step-at-a-time output, seeded sampling included)."""

    def kinds(i: int) -> dict:
        return [dict(max_new_tokens=20, repetition_penalty=1.3, logprobs=1),
                dict(max_new_tokens=20, temperature=0.8, seed=100 + i),
                dict(max_new_tokens=20, min_new_tokens=15, eos_token_id=EOS)][i % 3]  # fmt: skip

    _run_cfg = dict(block_size=16, num_blocks=512, max_batch_tokens=512)
    _, engine = _same_as_one_step_at_a_time(_run_cfg, requests=kinds)
    assert engine.steps_ahead == 0


def test_sampling_with_the_engine_seed_repeats() -> None:
    cfg = dict(block_size=16, num_blocks=512, max_batch_tokens=256, seed=1234)

    def sampled(i: int) -> dict:
        return dict(max_new_tokens=12 + i, temperature=0.9, top_p=0.95, eos_token_id=EOS)

    first, engine = _run(cfg, True, requests=sampled)
    second, _ = _run(cfg, True, requests=sampled)
    assert first == second and engine.steps_ahead > 0
    assert len({tuple(g[0]) for g in first}) > 1


def test_greedy_matches_model_generate_with_async_batching(arch: str) -> None:
    from engine import generate_batch

    prompts = [list(p) for p in prompts_for()]
    cfg = ContinuousBatchingConfig(block_size=16, num_blocks=64, max_batch_tokens=128, use_async_batching=True)
    out = generate_batch(model_for(arch), prompts, continuous_batching_config=cfg, max_new_tokens=MAX_NEW,
                         ignore_eos=True, progress_bar=False)  # fmt: skip
    for i, prompt in enumerate(prompts):
        assert tuple(out[f"req_{i}"].generated_tokens) == reference(arch, tuple(prompt)), f"prompt {i}"


def test_manager_streams_and_cancels() -> None:
    """(Stop strings: tests/engine/test_output_thread.py.)"""
    mgr = ContinuousBatchingManager(model_for("llama"), continuous_batching_config=
                                    ContinuousBatchingConfig(block_size=16, num_blocks=128, use_async_batching=True))  # fmt: skip
    mgr.warmup()
    mgr.start()
    try:
        prompts = [list(p) for p in prompts_for()[:6]]
        ids = [mgr.add_request(p, max_new_tokens=1500 if i == 2 else 24, streaming=True, ignore_eos=True)
               for i, p in enumerate(prompts)]  # fmt: skip
        first = mgr.get_result(ids[2], timeout=60)
        assert first is not None and first.status == RequestStatus.DECODING
        mgr.cancel_request(ids[2])
        rest = list(mgr.request_id_iter(ids[2]))
        assert rest[-1].finish_reason == "abort" and len(rest[-1].generated_tokens) < 1500
        for i, (rid, prompt) in enumerate(zip(ids, prompts)):
            if i != 2:
                outs = list(mgr.request_id_iter(rid))
                assert [t for o in outs for t in o.new_tokens] == list(reference("llama", tuple(prompt)))
        stats = mgr.stats()
        assert stats["num_requests_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
        assert mgr.engine.steps_ahead > 0
    finally:
        mgr.stop(block=True, timeout=30)


def test_on_the_cpu_it_is_turned_down_with_one_warning(monkeypatch, caplog) -> None:
    """Without the tests' switch an engine on the CPU runs one step at a time when asked for async batching,
    and says why once."""
    from engine.backends.cpu_executor import ASYNC_ON_CPU_ENV

    monkeypatch.delenv(ASYNC_ON_CPU_ENV)
    with caplog.at_level(logging.WARNING, logger="cbserve.engine"):
        engine = LLMEngine(model_for("llama"), ContinuousBatchingConfig(block_size=16, num_blocks=32,
                                                                         use_async_batching=True))  # fmt: skip
    [said] = [r.getMessage() for r in caplog.records if "use_async_batching" in r.getMessage()]
    assert "no effect on the CPU" in said and "a step late" in said and ASYNC_ON_CPU_ENV in said
    assert not engine.async_batching and engine.placement()["use_async_batching"] is False
    req = engine.make_request(list(prompts_for()[0]), max_new_tokens=8, ignore_eos=True)
    engine.add_request(req)
    assert len(engine.step()) == 1  # its first token at once, as one step at a time gives it
    while engine.has_unfinished():
        engine.step()
    assert engine.steps_ahead == 0 and req.generated_ids == list(reference("llama", prompts_for()[0], 8))


def test_not_with_tensor_parallel() -> None:
    with pytest.raises(ValueError, match="use_async_batching needs tensor_parallel_size 1"):
        ContinuousBatchingConfig(use_async_batching=True, tensor_parallel_size=2)


def test_the_cost_model_sees_each_step_alone_where_steps_run_inside_their_launch() -> None:
    """On the CPU a step runs inside its launch, and async batching launches the next step before taking
    this one's tokens back: the step's time (the `max_decode_stall` cost model's sample) is its own launch
    and take-back, not the next step's forward too. Each launch here takes 30 ms more than it would."""
    import time

    engine = LLMEngine(model_for("llama"), ContinuousBatchingConfig(block_size=16, num_blocks=128, use_async_batching=True))
    assert not engine.executor.launches_ahead
    launch = engine.executor.launch

    def slow_launch(*args, **kwargs):
        time.sleep(0.03)  # a step of known length, not a wait for anything
        return launch(*args, **kwargs)

    seen: list[float] = []
    observe = engine.scheduler.observe_step
    engine.executor.launch = slow_launch
    engine.scheduler.observe_step = lambda batch, seconds, threads=None: (seen.append(seconds),
                                                                           observe(batch, seconds, threads))
    for p in prompts_for()[:4]:
        engine.add_request(engine.make_request(list(p), max_new_tokens=12, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert engine.steps_ahead > 5 and len(seen) > 10
    assert all(0.03 <= s < 0.055 for s in seen), seen  # one launch each, never two
