"""The scheduler's prompt-token cap next to running decodes (max_decode_stall) and the step-cost model it
uses, on the real BlockManager and Requests; no model runs (the engine's tokens are stood in by 0s) but in
the last test, the step log through a real LLMEngine."""

from __future__ import annotations

import random

import pytest

from engine.block_manager import BlockManager
from engine.request import Request, SamplingParams
from engine.sampler import SampleResult
from engine.scheduler import Scheduler
from engine.step_cost import MIN_SAMPLES, REFIT_EVERY, StepCostModel

BLOCK = 16
BUDGET = 512


def scheduler(stall: float, budget: int = BUDGET, blocks: int = 256, **kw) -> Scheduler:
    return Scheduler(BlockManager(blocks, BLOCK), budget, max_running=64, max_decode_stall=stall, **kw)


def request(i: int, prompt_len: int, max_new: int = 64) -> Request:
    return Request(f"r{i}", [(i * 7 + j) % 500 + 1 for j in range(prompt_len)], max_new, SamplingParams(), frozenset())


def run_step(s: Scheduler, seconds: float | None = None):
    batch = s.schedule()
    s.update_from_output(batch, SampleResult([0] * len(batch.samples), None, None), None)
    if seconds is not None:
        s.observe_step(batch, seconds)
    return batch


def prompt_tokens(batch) -> int:
    return sum(n for _, n in batch.items if n > 1)


def with_decodes(s: Scheduler, decodes: int = 4, prompt_len: int = 40) -> None:
    """`decodes` requests prefilled and decoding, then a long prompt waiting."""
    for i in range(decodes):
        s.add(request(i, prompt_len))
    run_step(s)  # the budget takes every prompt whole: no decode runs yet, so no cap
    assert all(r.num_tokens - r.num_computed == 1 for r in s.running) and len(s.running) == decodes
    s.add(request(99, 2000))


def test_no_cap_without_running_decodes() -> None:
    s = scheduler(stall=1.0)
    for i in range(3):
        s.add(request(i, 300))
    batch = run_step(s)
    assert prompt_tokens(batch) == BUDGET  # the whole budget, though the factor allows no more than a block


def test_a_factor_of_one_leaves_each_step_one_block_of_prompt_and_every_decode() -> None:
    s = scheduler(stall=1.0)
    with_decodes(s, decodes=4)
    for _ in range(5):
        batch = run_step(s)
        assert sum(1 for _, n in batch.items if n == 1) == 4  # every decode, every step
        assert prompt_tokens(batch) == BLOCK  # the minimum chunk: the waiting prompt still moves
    assert s.prefill_cap == BLOCK
    long = s.requests["r99"]
    assert long.num_computed == 5 * BLOCK


def test_off_is_the_budget_alone() -> None:
    """max_decode_stall=0: the same steps as a scheduler built without it."""
    plain = Scheduler(BlockManager(256, BLOCK), BUDGET, max_running=64)
    off = scheduler(stall=0.0)
    for s in (plain, off):
        with_decodes(s, decodes=4)
    for step in range(6):
        a, b = run_step(plain), run_step(off)
        assert [(r.request_id, n) for r, n in a.items] == [(r.request_id, n) for r, n in b.items]
        if step == 0:
            assert prompt_tokens(a) == BUDGET - 4  # the 4 decodes, then the rest of the budget to the prompt
    assert off.prefill_cap == BUDGET


def test_unfitted_the_cap_is_an_eighth_of_the_budget() -> None:
    s = scheduler(stall=4.0)
    with_decodes(s, decodes=4)
    batch = run_step(s)
    assert prompt_tokens(batch) == BUDGET // 8 == s.prefill_cap


def test_fitted_the_cap_follows_the_model() -> None:
    """Steps cost 10 ms + 1 ms a decode row + 0.5 ms a prompt token: with 4 decodes (14 ms alone) and a factor of
    3.1, a step may hold (3.1 - 1) * 14 / 0.5 = 58.8 prompt tokens."""
    s = scheduler(stall=3.1)
    for d, p in [(0, 100), (0, 300), (0, 50), (0, 200), (1, 0), (2, 0), (4, 0), (8, 0)]:
        s.step_cost.observe(d, p, 0.010 + 0.001 * d + 0.0005 * p)
    with_decodes(s, decodes=4)
    batch = run_step(s)
    assert prompt_tokens(batch) == 58 == s.prefill_cap


@pytest.mark.parametrize("waves", [False, True], ids=["cap", "waves"])
def test_under_preemption_the_cap_holds_and_everything_finishes(waves: bool) -> None:
    """A cache too small for all: requests are preempted and recomputed (their recompute is prompt work, capped
    like a prompt), and every request still finishes; with prefill waves too (their steps hold the decodes)."""
    s = scheduler(stall=1.0, blocks=12, prefill_waves=waves)
    for i in range(3):
        s.add(request(i, 40, max_new=60))
    run_step(s)
    for i in range(3, 6):
        s.add(request(i, 50, max_new=20))
    for _ in range(2000):
        if not s.has_unfinished():
            break
        decoding = any(r.num_tokens - r.num_computed == 1 for r in s.running)
        batch = run_step(s)
        if decoding and not s.wave:
            assert prompt_tokens(batch) <= BLOCK
    assert not s.has_unfinished() and s.num_preemptions > 0
    assert s.bm.num_free == s.bm.num_blocks


def test_prefill_first_is_capped_too() -> None:
    s = scheduler(stall=1.0, prefill_first=True)
    with_decodes(s, decodes=3)
    batch = run_step(s)
    assert prompt_tokens(batch) == BLOCK and sum(1 for _, n in batch.items if n == 1) == 3


def decode_rows(batch) -> list[str]:
    return [r.request_id for r, n in batch.items if n == 1]


def test_prompts_that_arrive_together_are_prefilled_as_a_wave_and_decode_together() -> None:
    """One request decoding, six prompts arriving at once: they outnumber it, so they are prefilled first,
    shortest first and without the cap, the decode held until the last has its first token; then all seven
    decode in the same steps. With prefill_waves off the decode runs every step beside capped chunks."""
    lengths = [300, 100, 200, 150, 250, 120]  # 1,120 prompt tokens: within WAVE_STEPS steps' budget
    for waves in (True, False):
        s = scheduler(stall=4.0, prefill_waves=waves)
        s.add(request(0, 40))
        run_step(s)  # r0 prefilled, decoding
        for i, n in enumerate(lengths, start=1):
            s.add(request(i, n))
        steps = []
        while any(not s.requests[f"r{i}"].num_generated for i in range(1, 7)):
            steps.append(run_step(s))
        if not waves:
            assert all(decode_rows(b) and decode_rows(b)[0] == "r0" for b in steps)  # r0 never waits
            assert max(prompt_tokens(b) for b in steps) == BUDGET // 8  # the unfitted cap
            continue
        assert all("r0" not in decode_rows(b) for b in steps) and s.wave  # r0 held through the wave
        assert [b.num_tokens for b in steps] == [512, 512, 96]  # the whole budget, uncapped
        first = [r.request_id for r, _ in steps[0].items]
        assert first[:3] == ["r2", "r6", "r4"]  # shortest first: 100, 120, 150 tokens
        assert all(not b.samples for b in steps[:-1]) and len(steps[-1].samples) == 6  # first tokens: the last step
        after = run_step(s)
        assert sorted(decode_rows(after)) == [f"r{i}" for i in range(7)] and not prompt_tokens(after)
        assert not s.wave or all(r.num_generated for r in s.wave)


@pytest.mark.parametrize("kw", [{"prefill_waves": False}, {"prefill_waves": True, "prefill_first": True}],
                         ids=["waves-off", "prefill-first"])
def test_no_wave_when_off_nor_under_prefill_first(kw) -> None:
    """Six prompts arriving together beside one decode: with waves off and under prefill_first (prompts go
    first anyway, capped beside the decodes) every prompt goes under the cap and the decode runs. Waves are
    on by default."""
    from engine import ContinuousBatchingConfig

    s = Scheduler(BlockManager(256, BLOCK), BUDGET, max_running=64, max_decode_stall=4.0, **kw)
    assert ContinuousBatchingConfig().prefill_waves is True
    s.add(request(0, 40))
    run_step(s)
    for i in range(1, 7):
        s.add(request(i, 200))
    batch = run_step(s)
    assert decode_rows(batch) == ["r0"] and prompt_tokens(batch) == BUDGET // 8 and not s.wave


def test_a_waves_first_tokens_all_come_in_its_last_step() -> None:
    """Four prompts of 300 tokens beside one decode: the wave's steps carry the whole budget (512, 512, then the
    176 left), every member's last prompt token waits for the last of them, and all four sample their first
    token there; the next step decodes all five. Without that the members prefilled first would wait out the
    rest of the wave between their first token and their second."""
    s = scheduler(stall=4.0, prefill_waves=True)
    s.add(request(0, 40))
    run_step(s)
    for i in range(1, 5):
        s.add(request(i, 300))
    steps = [run_step(s) for _ in range(3)]
    assert [b.num_tokens for b in steps] == [512, 512, 176] and s.wave_tokens == 1200
    assert [len(b.samples) for b in steps] == [0, 0, 4]
    assert sorted(r.request_id for r, n in steps[-1].items if n == 1) == ["r1", "r2", "r3"]  # held at their last token
    assert all(s.requests[f"r{i}"].num_generated == 1 for i in range(1, 5))
    assert sorted(decode_rows(run_step(s))) == [f"r{i}" for i in range(5)]


def test_a_waves_majority_gets_its_first_tokens_when_it_is_prefilled() -> None:
    """Sixteen prompts at once that ask for 128 tokens each: the nine shortest (a majority) sample at the end of
    the step that finishes their prompts, a step cut to just those tokens, and then wait, held like decodes,
    while the other seven are prefilled; those sample in the wave's last step and all sixteen decode together.
    The median first token comes when the majority is prefilled (1,376 of 3,258 prompt tokens here). Asking for
    64 tokens each, the nine pauses would be over EARLY_PAUSE_SHARE of the wave's gaps: all sixteen first
    tokens come in the last step."""
    rng = random.Random(1)
    lengths = [rng.randrange(80, 330) for _ in range(16)]
    majority = sum(sorted(lengths)[:9])
    for max_new, samples in ((128, [0, 9, 0, 7]), (64, [0, 0, 0, 16])):
        s = scheduler(stall=4.0, prefill_waves=True, blocks=1024, budget=1024)
        for i, n in enumerate(lengths):
            s.add(request(i, n, max_new=max_new))
        steps = [run_step(s) for _ in range(4)]
        assert [len(b.samples) for b in steps] == samples and all(r.num_generated for r in s.wave)
        if max_new == 128:
            assert sum(b.num_tokens for b in steps[:2]) == majority == 1376  # the early group's step ends there
            early = {r.request_id for r in steps[1].samples}
            assert early == {f"r{i}" for i in sorted(range(16), key=lambda i: lengths[i])[:9]}
            assert not early & {r.request_id for b in steps[2:] for r, _ in b.items}  # held through the rest
        assert sorted(decode_rows(run_step(s))) == sorted(f"r{i}" for i in range(16))


def test_no_wave_when_the_decodes_outnumber_the_prompts_or_the_prompts_are_too_long() -> None:
    """Two prompts beside two decodes, or two prompts longer than WAVE_STEPS steps' budget beside one: the
    decodes run every step and the prompts go in capped chunks."""
    from engine.scheduler import WAVE_STEPS

    for decodes, prompt_len in ((2, 200), (1, WAVE_STEPS * BUDGET)):  # (the bound holds what is left to prefill)
        s = scheduler(stall=4.0, prefill_waves=True)
        for i in range(decodes):
            s.add(request(i, 40))
        run_step(s)
        s.add(request(10, prompt_len))
        s.add(request(11, prompt_len))
        for _ in range(4):
            batch = run_step(s)
            assert len(decode_rows(batch)) == decodes and 0 < prompt_tokens(batch) <= BUDGET // 8
        assert not s.wave


def test_prompts_arriving_while_a_wave_is_prefilled_join_it() -> None:
    """A closed loop's next prompts come over a few milliseconds and the wave starts with the first two: the
    ones that arrive during its steps join it (within WAVE_STEPS steps' budget), so all sixteen users decode in
    the same steps, round after round; without that the late arrivals would be fewer than the wave and go
    in capped chunks beside its decodes."""
    from engine.scheduler import WAVE_STEPS

    rng = random.Random(0)
    s = scheduler(stall=4.0, prefill_waves=True, blocks=1024, budget=1024)
    users, pending, rows = iter(range(10_000)), 16, []
    for _ in range(10 * 132):
        for _ in range(min(8, pending)):  # eight arrive per step
            s.add(request(next(users), rng.randrange(64, 256), max_new=128))
            pending -= 1
        batch = s.schedule()
        rows.append(sum(1 for r, n in batch.items if n == 1 and r.num_generated))
        pending += len(s.update_from_output(batch, SampleResult([0] * len(batch.samples), None, None), None))
        assert s.wave_tokens <= WAVE_STEPS * 1024
    assert set(rows) == {0, 16} and rows.count(16) > 9 * 127


def test_a_wave_prompts_last_token_goes_in_the_wave_not_with_the_held_decodes() -> None:
    """A wave step that leaves each member one token short (their last tokens wait for the wave's last step):
    the next step computes those tokens alone (one new token each, but the requests have none yet: not
    decodes), the running decode still held; then all three decode."""
    s = scheduler(stall=4.0, prefill_waves=True)
    s.add(request(0, 40))
    run_step(s)
    s.add(request(1, 100))
    s.add(request(2, BUDGET - 100 + 1))
    assert prompt_tokens(run_step(s)) == BUDGET - 1 and s.wave
    assert sorted((r.request_id, n) for r, n in run_step(s).items) == [("r1", 1), ("r2", 1)]
    assert sorted(decode_rows(run_step(s))) == ["r0", "r1", "r2"]


def test_prompts_arriving_as_the_decodes_end_wait_to_join_the_next_wave() -> None:
    """Three requests decoding, JOIN_STEPS - 1 tokens from their max_new_tokens, when two prompts arrive (fewer
    than the decodes: no wave): with waves on, the prompts wait while the decodes finish, then go in as one wave
    with the three prompts that replace them; with waves off they go in at once beside the decodes."""
    from engine.scheduler import JOIN_STEPS

    for waves in (True, False):
        s = scheduler(stall=4.0, prefill_waves=waves)
        for i in range(3):
            s.add(request(i, 40, max_new=JOIN_STEPS))
        run_step(s)  # prefilled whole (no decode ran yet): each has its first token
        s.add(request(10, 200))
        s.add(request(11, 200))
        batch = run_step(s)
        if not waves:
            assert len(decode_rows(batch)) == 3 and prompt_tokens(batch) == BUDGET // 8
            continue
        steps = [batch]
        while s.running:
            steps.append(run_step(s))
        assert len(steps) == JOIN_STEPS - 1  # the decodes ran to their end, alone
        assert all(len(decode_rows(b)) == 3 and not prompt_tokens(b) for b in steps[:-1]) and s.joining
        for i in range(3):  # a closed loop: each finished user sends its next prompt
            s.add(request(20 + i, 150))
        wave = run_step(s)
        assert prompt_tokens(wave) == BUDGET and s.wave and not s.joining
        assert {r.request_id for r in s.wave} == {"r10", "r11", "r20", "r21", "r22"}


def test_prompts_wait_only_for_decodes_that_all_end_soon() -> None:
    """One of the running decodes has more than JOIN_STEPS tokens to go, or a prompt is being prefilled: the
    arrivals go in at once (capped), as without the rule."""
    from engine.scheduler import JOIN_STEPS

    for long_one in (JOIN_STEPS + 2, None):
        s = scheduler(stall=4.0, prefill_waves=True)
        for i in range(3):
            s.add(request(i, 40, max_new=JOIN_STEPS + 3 if long_one is None else JOIN_STEPS if i else long_one))
        run_step(s)
        if long_one is None:
            s.add(request(9, 600))  # admitted while the decodes have JOIN_STEPS + 2 tokens to go
            run_step(s)
            run_step(s)  # now every decode ends within JOIN_STEPS, but r9 is still being prefilled
            assert s.requests["r9"].num_computed == 2 * (BUDGET // 8)
        s.add(request(10, 200))
        batch = run_step(s)
        assert len(decode_rows(batch)) == 3 and prompt_tokens(batch) > 0 and not s.joining


def test_a_closed_loop_split_in_two_groups_becomes_one(monkeypatch) -> None:
    """Sixteen closed-loop users asking 128 tokens each, nine of them starting a few steps after the other
    seven: with waves on, the seven's next prompts wait for the nine to finish, and from then on every step
    decodes all sixteen or none (one group). Without the join the seven go in beside the nine's decodes."""
    from engine import scheduler as sched

    def decoding_per_step(rounds: int) -> list[int]:
        rng = random.Random(0)
        s = scheduler(stall=4.0, prefill_waves=True, blocks=1024, budget=1024)
        users = iter(range(10_000))
        rows = []
        for step in range(rounds * 132):
            for _ in range(7 if step == 0 else 9 if step == 6 else 0):
                s.add(request(next(users), rng.randrange(64, 256), max_new=128))
            batch = s.schedule()
            rows.append(sum(1 for r, n in batch.items if n == 1 and r.num_generated))  # (not a prompt's last token)
            for _ in s.update_from_output(batch, SampleResult([0] * len(batch.samples), None, None), None):
                s.add(request(next(users), rng.randrange(64, 256), max_new=128))  # the user's next prompt, at once
        return rows

    assert sched.JOIN_STEPS == 8
    rows = decoding_per_step(10)
    assert {7, 9} <= set(rows[:140]) and set(rows[140:]) == {0, 16}  # (the nine decode alone while the seven wait)
    monkeypatch.setattr(sched, "JOIN_STEPS", 0)
    assert set(decoding_per_step(2)[135:]) - {0, 16}


def test_turning_the_cap_off_ends_a_wave() -> None:
    """generate_batch turns a kept engine's cap off for its batch: a wave under way ends there (its step log
    says no wave), and the held decode runs again beside uncapped prompt chunks."""
    s = scheduler(stall=4.0, prefill_waves=True)
    s.add(request(0, 40))
    run_step(s)
    for i in range(1, 5):
        s.add(request(i, 300))
    assert not decode_rows(run_step(s)) and s.wave
    s.max_decode_stall = 0.0
    batch = run_step(s)
    rows = decode_rows(batch)  # r0 and the wave's first member, prefilled whole in the wave's step
    assert rows == ["r0", "r1"] and prompt_tokens(batch) == BUDGET - len(rows) and not s.wave


def test_a_wave_that_cannot_move_lets_the_decodes_run() -> None:
    """No block free for the wave's prompts: the step runs the decodes instead of nothing, and the wave goes
    in once they finish and give their blocks back."""
    s = scheduler(stall=4.0, blocks=6, prefill_waves=True)
    s.add(request(0, 60, max_new=10))  # 4 blocks, then a 5th while decoding
    run_step(s)
    s.add(request(1, 80, max_new=4))  # 5 blocks each: neither fits beside r0, nor does a capped chunk of 64
    s.add(request(2, 80, max_new=4))
    batch = run_step(s)
    assert decode_rows(batch) == ["r0"] and not prompt_tokens(batch) and s.wave
    for _ in range(100):
        if not s.has_unfinished():
            break
        run_step(s)
    assert not s.has_unfinished() and s.bm.num_free == s.bm.num_blocks


def test_the_cost_model_fits_a_line() -> None:
    rng = random.Random(0)
    model = StepCostModel()
    a, b, c, e = 0.020, 0.0015, 0.0004, 0.003
    assert model.coefficients() is None
    for _ in range(40):
        d, p = rng.randrange(0, 32), rng.choice([0, 0, rng.randrange(1, 2048)])
        if d + p:
            model.observe(d, p, a + b * d + c * p + (e if p else 0.0))
    fitted = model.coefficients()
    assert fitted == pytest.approx((a, b, c, e), rel=1e-6, abs=1e-9)
    assert model.predict(10, 0) == pytest.approx(a + 10 * b)
    # 10 decodes alone: 35 ms; a factor of 2.05 leaves 36.75 ms, of which e takes 3: 33.75 / 0.4 = 84.4 tokens
    assert model.prefill_tokens_within(10, 2.05) == 84


def test_the_cost_model_waits_for_both_kinds_of_step() -> None:
    model = StepCostModel()
    for i in range(10):
        model.observe(i + 1, 0, 0.01 + 0.001 * i)
    for i in range(MIN_SAMPLES - 1):
        model.observe(0, 100 * (i + 1), 0.05 * (i + 1))
    assert model.prefill_tokens_within(4, 4.0) is None
    model.observe(0, 1000, 0.5)
    assert model.prefill_tokens_within(4, 4.0) is not None


def test_the_cost_model_keeps_prompt_steps_through_a_long_run_of_decodes() -> None:
    model = StepCostModel(window=8)
    for p in (100, 200, 400, 800):
        model.observe(0, p, 0.01 + 0.001 * p)
    for i in range(1000):
        model.observe(1 + i % 16, 0, 0.01 + 0.002 * (1 + i % 16))
    a, b, c, _ = model.coefficients()
    assert c == pytest.approx(0.001, rel=1e-6) and b == pytest.approx(0.002, rel=1e-6)


def test_the_cost_model_fits_again_every_few_steps() -> None:
    """Fitted once both kinds of step are seen, then again after every REFIT_EVERY steps observed: a
    line that changed shows after REFIT_EVERY steps of it, not before."""
    model = StepCostModel(window=REFIT_EVERY)
    for p in (100, 200, 400, 800):
        model.observe(0, p, 0.01 + 0.001 * p)
    for i in range(MIN_SAMPLES):
        model.observe(1 + i, 0, 0.01 + 0.002 * (1 + i))
    assert model.coefficients()[1] == pytest.approx(0.002, rel=1e-6)  # fitted at once
    for i in range(REFIT_EVERY - 1):  # decode rows now cost 0.004
        model.observe(1 + i % 4, 0, 0.01 + 0.004 * (1 + i % 4))
        assert model.coefficients()[1] == pytest.approx(0.002, rel=1e-6)
    model.observe(2, 0, 0.01 + 0.004 * 2)  # the window's decode steps are all the new line's now
    assert model.coefficients()[1] == pytest.approx(0.004, rel=1e-6)


def test_the_step_log_has_a_line_a_step_with_what_it_carried(tmp_path) -> None:
    """observe_step writes one JSON line a step to an open step_log (CBSERVE_STEP_LOG in LLMEngine):
    its decode rows, prompt tokens and seconds, the cost model's prediction once it is fitted."""
    import json

    s = scheduler(stall=1.5)
    path = tmp_path / "steps.jsonl"
    with open(path, "w", encoding="utf-8") as s.step_log:
        with_decodes(s, decodes=4)  # one step, not observed: no line
        carried = [(sum(1 for _, n in b.items if n == 1), prompt_tokens(b))
                   for b in (run_step(s, 0.1 + 0.01 * i) for i in range(3 * MIN_SAMPLES))]  # fmt: skip
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(x["decode_rows"], x["prefill_tokens"]) for x in lines] == carried
    assert [x["seconds"] for x in lines] == [round(0.1 + 0.01 * i, 5) for i in range(3 * MIN_SAMPLES)]
    assert lines[0]["predicted"] is None and all(x["waiting"] == 0 and x["prefill_cap"] > 0 for x in lines)
    assert not any(x["wave"] for x in lines)  # one prompt beside four decodes: capped chunks, no wave


def test_cbserve_step_log_traces_an_engines_steps(tmp_path, monkeypatch) -> None:
    """With CBSERVE_STEP_LOG set, an LLMEngine appends a line a step: the prompt tokens and decode rows
    add up to what the requests took; close() closes the file."""
    import json

    import torch

    from engine import ContinuousBatchingConfig, LLMEngine
    from tests.engine.conftest import model_for

    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv("CBSERVE_STEP_LOG", str(path))
    engine = LLMEngine(model_for("llama"), ContinuousBatchingConfig(block_size=16, num_blocks=64, max_batch_tokens=64))
    prompts = [[5 + i + j for j in range(40)] for i in range(3)]
    for p in prompts:
        engine.add_request(engine.make_request(p, max_new_tokens=6, ignore_eos=True))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    engine.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == steps and engine.scheduler.step_log is None
    assert {x["threads"] for x in lines} == {torch.get_num_threads()}  # the OpenMP team each step ran on
    assert sum(x["prefill_tokens"] for x in lines) + sum(x["decode_rows"] for x in lines) == 3 * (40 + 5)


def test_a_step_log_that_cannot_be_opened_names_the_variable(tmp_path, monkeypatch) -> None:
    from engine import ContinuousBatchingConfig, LLMEngine
    from tests.engine.conftest import model_for

    monkeypatch.setenv("CBSERVE_STEP_LOG", str(tmp_path / "no-such-folder" / "steps.jsonl"))
    with pytest.raises(ValueError, match=r"CBSERVE_STEP_LOG=.*no-such-folder.*cannot append to it \(No such file"):
        LLMEngine(model_for("llama"), ContinuousBatchingConfig(block_size=16, num_blocks=16))


@pytest.mark.parametrize("stall,capped", [(None, False), (4.0, True)], ids=["unset-offline", "set"])
def test_an_offline_batch_leaves_the_cap_off_unless_it_is_set(tmp_path, monkeypatch, stall, capped) -> None:
    """generate_batch: max_decode_stall unset means no prompt cap beside the decodes (nobody reads the tokens
    before the batch ends); a value set holds. A kept manager's engine gets its streaming cap back after."""
    import json

    from engine import ContinuousBatchingConfig, generate_batch
    from engine.config import STREAMING_DECODE_STALL
    from engine.generate import destroy_cached_engine
    from engine.manager import CACHED
    from tests.engine.conftest import model_for

    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv("CBSERVE_STEP_LOG", str(path))
    model = model_for("llama")
    config = ContinuousBatchingConfig(block_size=16, num_blocks=64, max_batch_tokens=64, max_decode_stall=stall,
                                      prefill_waves=False)  # (a wave would take these prompts uncapped)
    prompts = [[5 + i + j for j in range(60)] for i in range(3)]  # more than a step's budget: chunked
    try:
        generate_batch(model, prompts, continuous_batching_config=config, max_new_tokens=6, do_sample=False,
                       eos_token_id=None, progress_bar=False, persistent_manager=True)  # fmt: skip
        engine = getattr(model, CACHED).engine
        assert engine.scheduler.max_decode_stall == (STREAMING_DECODE_STALL if stall is None else stall)
    finally:
        destroy_cached_engine(model)
    beside = [x["prefill_tokens"] for x in map(json.loads, path.read_text().splitlines()) if x["decode_rows"]]
    assert beside  # some prompt chunks rode with running decodes
    # unfitted, the cap is an eighth of the budget, at least one block: 16 tokens
    assert (max(beside) <= 16) is capped, beside
