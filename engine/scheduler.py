"""One token-budget scheduler; "fifo" and "prefill_first" are two orderings of it. It owns the
requests and their blocks: `schedule()` picks the step's tokens, `update_from_output()` takes the
step's sampled tokens back, ends what is done and frees its blocks.

There is no prefill phase and decode phase: each step, every scheduled request's computed tokens
catch up with its known tokens as far as the budget allows. A running request that is decoding
needs one token; a waiting or partly prefilled prompt takes a chunk of what is left. When a
request needs a block and none is free, the newest running request is preempted: its blocks are
freed and it goes back to the front of the queue, to be recomputed (its generated tokens are kept).

With decodes running, the prompt tokens of a step are capped (`max_decode_stall`, a factor): the step
may be predicted to take at most that many times a step of its decodes alone, by a cost model fitted
to the measured steps (engine/step_cost.py; until it is fitted, an eighth of the budget). The cap is
never below one block, so the oldest prompt in the queue always moves; with no decode running, the
whole budget goes to prompts.

Prompts that arrive together are prefilled as a wave (`prefill_waves`, on by default): when at least
two requests wait for their first token and they outnumber the decoding ones, and their prompts fit in
WAVE_STEPS steps' budget, those requests (the wave) are prefilled first, shortest first, without the cap
and with the running decodes held; every member's last prompt token waits for the wave's last step, so
that its first tokens come together and no member waits out the rest of the wave between its first token
and its second, with one exception: when that one pause each is at most EARLY_PAUSE_SHARE of the wave's
inter-token gaps (its members ask for enough tokens), the wave's majority, the first in its order, samples
in the step that ends their prompts (a step cut there) and then waits once, so that the wave's median first
token comes when most of it is prefilled. Prompts that arrive while it is prefilled join it within the
same bound. The wave then decodes together, and finishes together when its requests ask for the same length: a closed
loop of users stays in step instead of spreading every prompt over steps beside everyone else's decodes.
A held decode waits at most the wave's prefill; a step in which the wave cannot move (no block, no slot)
runs the decodes instead. Prompts that arrive when every running request is a decode within JOIN_STEPS
tokens of its `max_new_tokens` wait for those to finish (the arrivals join the next wave instead of going
in capped chunks beside them): a closed loop's users that finished a few steps before the others rejoin
them, rather than staying a second group whose prompts are chunked beside the first group's decodes
every round.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TextIO

from engine.block_manager import BlockManager
from engine.request import ParamError, Request, RequestStatus
from engine.sampler import SampleResult
from engine.step_cost import StepCostModel
from engine.swap import HostSwapPool

WAVE_STEPS = 4  # a wave's prompt tokens fit this many steps' budget: the longest the running decodes are held
# a wave's majority gets its first tokens early (then waits out the rest of the wave once) when those pauses are
# at most this share of the wave's inter-token gaps: one pause in 200 gaps stays out of the streams' p99
EARLY_PAUSE_SHARE = 1 / 200
# with waves on, new prompts wait for running decodes that all end within this many tokens (their max_new_tokens)
JOIN_STEPS = 8
# with decodes running, the fewest prompt tokens a step takes (one block where blocks are smaller), so
# that the oldest waiting prompt always moves
MIN_PREFILL_CHUNK = 16


@dataclass
class ScheduledBatch:
    """What one step computes: (request, number of new tokens), single-token ones first; and the
    requests that sample a token after it, each with the row of `items` whose logits it samples
    from (siblings forked for n > 1 sample from their parent's row)."""

    items: list[tuple[Request, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write, before the forward
    samples: list[Request] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    # scheduled ahead (`Scheduler.lookahead`): one decode a row whose input is the token its request samples in
    # the step before, not yet taken back: row i's is that step's sample `feed_rows[i]`, at position `ahead_starts[i]`
    ahead: bool = False
    feed_rows: list[int] = field(default_factory=list)
    ahead_starts: list[int] = field(default_factory=list)
    taken: list[Request] = field(default_factory=list)  # after update_from_output: the requests that got a token

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_batch_tokens: int,
        max_running: int,
        prefill_first: bool = False,
        swap: HostSwapPool | None = None,
        reserve_blocks: int = 0,
        max_decode_stall: float = 0.0,
        prefill_waves: bool = False,
    ) -> None:
        self.bm = block_manager
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.prefill_first = prefill_first
        self.swap = swap
        self.reserve_blocks = reserve_blocks  # safety_margin: fewer free blocks admit no one while others run
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the newest
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.num_preemptions = 0
        # 0: off; else a step with decodes is predicted to take at most this many times their step alone
        self.max_decode_stall = max_decode_stall
        self.step_cost = StepCostModel()
        self.step_log: TextIO | None = None  # one JSON line a step (LLMEngine opens it: CBSERVE_STEP_LOG)
        self.min_prefill_chunk = min(block_manager.block_size, MIN_PREFILL_CHUNK)
        self.unfitted_prefill_cap = max(self.min_prefill_chunk, max_batch_tokens // 8)
        self.prefill_cap = max_batch_tokens  # the prompt tokens the last step with decodes could take
        self.prefill_waves = prefill_waves  # with the cap on: prompts that arrive together go first, as a wave
        self.wave: set[Request] = set()  # the wave being prefilled: requests still waiting for their first token
        self.wave_tokens = 0  # the prompt tokens the wave under way took on (at most WAVE_STEPS steps' budget)
        self.wave_size = 0  # the requests the wave under way took on, its early group's first tokens included
        self.joining = False  # this step admits no new prompt: they wait for the decodes about to end (JOIN_STEPS)
        self.wave_holds_last = False  # this wave step is not its last: its members' last prompt tokens wait for that

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ParamError("request_id", f"request_id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        """Take a finished or cancelled request out, releasing its blocks."""
        self.requests.pop(req.request_id, None)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.bm.release(req)
        if self.swap is not None:
            self.swap.drop(req)

    def prefill_budget(self) -> int:
        """The prompt tokens this step may take (tokens of rows that need more than one): the whole
        budget when max_decode_stall is off or no request is decoding, else the cap it sets."""
        if not self.max_decode_stall:
            return self.max_batch_tokens
        decodes = sum(1 for req in self.running if not _prompt_row(req))
        if not decodes:
            return self.max_batch_tokens
        cap = 0  # a factor of 1 or less leaves room for no prompt token beyond the minimum chunk
        if self.max_decode_stall > 1:
            within = self.step_cost.prefill_tokens_within(decodes, self.max_decode_stall)
            cap = self.unfitted_prefill_cap if within is None else within
        self.prefill_cap = min(self.max_batch_tokens, max(self.min_prefill_chunk, cap))
        return self.prefill_cap

    def observe_step(self, batch: ScheduledBatch, seconds: float, threads: int | None = None) -> None:
        """The step `batch` took `seconds` (wall time, schedule to outputs) on `threads` OpenMP threads: one
        sample of the cost model, and one line of `step_log` when it is open."""
        decode_rows = sum(1 for _, n in batch.items if n == 1)
        prefill = batch.num_tokens - decode_rows
        if self.step_log is not None:
            predicted = self.step_cost.predict(decode_rows, prefill)
            self.step_log.write(json.dumps({
                "t": round(time.time(), 4), "decode_rows": decode_rows, "prefill_tokens": prefill,
                "seconds": round(seconds, 5), "predicted": None if predicted is None else round(predicted, 5),
                "prefill_cap": self.prefill_cap, "waiting": len(self.waiting), "threads": threads,
                "wave": bool(self.wave), "joining": self.joining}) + "\n")  # fmt: skip
        self.step_cost.observe(decode_rows, prefill, seconds)

    def _wave_step(self) -> bool:
        """Whether this step prefills a wave with the decodes held: one is under way, or one starts now
        (its waiting members are put in the queue shortest first, behind preempted requests). With no
        wave, sets `joining` when the new prompts should wait for the decodes about to end."""
        self.joining = False
        if not (self.prefill_waves and self.max_decode_stall) or self.prefill_first:
            self.wave.clear()  # (a cap turned off for an offline batch ends a wave under way)
            return False
        self.wave = {req for req in self.wave if req.request_id in self.requests and not req.num_generated}
        if self.wave:
            self._take_late_arrivals()
            return True
        first = [req for req in (*self.running, *self.waiting) if not req.num_generated]
        decodes = sum(1 for req in self.running if req.num_generated and not _prompt_row(req))
        if len(first) < 2 or len(first) <= decodes:
            self.joining = bool(first) and self._decodes_end_soon()  # (all running decoding: `first` is waiting)
            return False
        left = sum(req.num_prompt_tokens - req.num_computed for req in first)  # a waiting request's is 0
        if left > WAVE_STEPS * self.max_batch_tokens:
            return False
        self.wave = set(first)
        self.wave_tokens = left
        self.wave_size = len(first)
        self._sort_waiting()
        return True

    def _take_late_arrivals(self) -> None:
        """New prompts that arrived while the wave is prefilled join it, shortest first, while the prompt tokens it
        took on stay within WAVE_STEPS steps' budget: a closed loop's next prompts come over a few
        milliseconds, and the wave starts with the first two."""
        late = sorted((req for req in self.waiting if not req.num_generated and req not in self.wave),
                      key=lambda req: req.num_prompt_tokens)  # fmt: skip
        for req in late:
            if self.wave_tokens + req.num_prompt_tokens > WAVE_STEPS * self.max_batch_tokens:
                break
            self.wave.add(req)
            self.wave_tokens += req.num_prompt_tokens
            self.wave_size += 1
        if late and late[0] in self.wave:
            self._sort_waiting()

    def _sort_waiting(self) -> None:
        """The wave's waiting members behind the other waiting requests (preempted ones), shortest first."""
        # a new deque, not the old one sorted in place: another thread may copy the old one meanwhile
        self.waiting = deque(sorted(self.waiting, key=lambda req: (req in self.wave, req.num_prompt_tokens)))

    def _decodes_end_soon(self) -> bool:
        """Whether new prompts should wait this step: every running request is a decode that ends within
        JOIN_STEPS tokens, so they can go in as one wave with those decodes' successors."""
        return bool(self.running) and all(
            req.num_generated and not _prompt_row(req) and req.max_new_tokens - req.num_generated <= JOIN_STEPS
            for req in self.running
        )

    def schedule(self) -> ScheduledBatch:
        wave = self._wave_step()
        batch = self._schedule(hold_decodes=wave, hold_arrivals=self.joining)
        if (wave or self.joining) and not batch:  # nothing can move this way (no block or slot): as without waves
            self.joining = False
            batch = self._schedule(hold_decodes=False)
        return batch

    def _schedule(self, hold_decodes: bool, hold_arrivals: bool = False) -> ScheduledBatch:
        if hold_decodes:
            budget = [self.max_batch_tokens, self.max_batch_tokens]  # all tokens; prompt tokens
            left = sum(req.num_tokens - req.num_computed for req in self.wave)  # (a waiting request's num_computed is 0)
            self.wave_holds_last = left > self.max_batch_tokens and left > len(self.wave)  # not the wave's last step
            early = self._early_group_tokens() if self.wave_holds_last else None
            if early is not None:  # this step ends the prompts of the wave's majority, and they sample
                budget = [early, early]
                self.wave_holds_last = False
        else:
            budget = [self.max_batch_tokens, self.prefill_budget()]
            self.wave_holds_last = False
        chosen: dict[Request, int] = {}
        self._copies: list[tuple[int, int]] = []
        if self.prefill_first:
            self._admit_waiting(chosen, budget)
            self._schedule_running(chosen, budget)
        else:
            if not self._schedule_running(chosen, budget, hold_decodes):
                self._admit_waiting(chosen, budget, hold_arrivals)
        items = sorted(chosen.items(), key=lambda item: item[1] != 1)  # stable: decodes first
        batch = ScheduledBatch(items, self._copies)
        for row, (req, n) in enumerate(items):
            if req.num_computed + n == req.num_tokens:  # its known tokens are all computed after this step
                batch.samples.append(req)
                batch.sample_rows.append(row)
                if req.num_children and not req.num_generated:
                    self._fork(req, n, row, batch)
        return batch

    def _fork(self, parent: Request, n: int, row: int, batch: ScheduledBatch) -> None:
        """n > 1: a request about to sample its first token forks its siblings, which share its blocks
        (copy-on-write) and sample from the same logits with their own seeds."""
        for i in range(parent.num_children):
            child = parent.fork(i)
            child.num_computed = parent.num_computed + n  # as the parent's after this step
            self.bm.share(parent, child)
            self.requests[child.request_id] = child
            self.running.append(child)
            batch.samples.append(child)
            batch.sample_rows.append(row)
        parent.num_children = 0

    def update_from_output(self, batch: ScheduledBatch, out: SampleResult, max_context: int | None) -> list[Request]:
        """The step ran: its tokens are computed, and `out.tokens[i]` (with its logprobs when asked)
        is appended to `batch.samples[i]`. Returns the requests that ended, taken out with their
        blocks released."""
        # with async batching a request may end between the step's launch and now (by the step before's token,
        # a cancel, a stop string found off the engine thread): it takes nothing
        keep = [i for i, req in enumerate(batch.samples) if not req.is_finished]
        batch.taken = [batch.samples[i] for i in keep]
        for req, n in batch.items:
            req.num_computed += n
        now = time.perf_counter()
        for i in keep:
            req = batch.samples[i]
            req.append_token(out.tokens[i], now, max_context)
            if out.logprobs is not None and req.sampling.logprobs is not None:
                req.logprobs.append(out.logprobs[i])
                if req.top_logprobs is not None:
                    req.top_logprobs.append(out.top_logprobs[i])
        for req, _ in batch.items:
            if req.status == RequestStatus.PREFILLING and req.num_computed >= req.num_prompt_tokens:
                req.status = RequestStatus.DECODING
        if batch.ahead:  # its blocks filled with tokens the host now knows: hashed as its scheduling would have
            for req in batch.taken:
                self.bm.register_full_blocks(req, req.num_computed)
        ended = [req for req in batch.taken if req.is_finished]
        for req in ended:
            self.remove(req)
        return ended

    def lookahead(self, last: ScheduledBatch, max_context: int | None) -> ScheduledBatch | None:
        """The step after `last`, scheduled before `last`'s tokens are taken back (async batching): each of
        its decodes once more, fed its token on the device. Only where nothing else would be scheduled and
        nothing depends on that token on the host: every running request decodes in `last` (no prompt
        chunk, no fork, nobody waiting), and none has a grammar, penalties, a logit bias, a min_new_tokens
        still to reach or a seed of its own (its draws count its tokens). A request that `last` ends for
        certain (max_new_tokens, the context) is left out; one that `last`'s token ends (EOS, a stop) gets a
        row whose token is dropped. None when that does not hold or the blocks are short (then the step is
        scheduled as usual, after `last`'s tokens, and may preempt)."""
        if self.waiting or not last.items or len(last.samples) != len(last.items):
            return None
        rows = {}
        for row, (req, n) in enumerate(last.items):
            if n != 1 or last.sample_rows[row] != row or req.num_children:
                return None
            rows[req] = row
        if any(req not in rows for req in self.running):
            return None
        reqs, need = [], 0
        for req, row in rows.items():
            if req.is_finished or req not in self.running:
                continue
            sp = req.sampling
            if req.matcher is not None or sp.seed is not None or sp.needs_penalties or sp.logit_bias:
                return None
            if sp.min_new_tokens > req.num_generated:
                return None
            num_tokens = req.num_tokens + 1  # with `last`'s token
            if req.num_generated + 1 >= req.max_new_tokens or (max_context is not None and num_tokens >= max_context):
                continue  # `last` ends it
            need += self.bm.blocks_to_grow(req, num_tokens)
            reqs.append(req)
        if not reqs or need > self.bm.num_free:
            return None
        batch = ScheduledBatch(ahead=True)
        for i, req in enumerate(reqs):
            num_tokens = req.num_tokens + 1
            batch.copies += self.bm.grow(req, num_tokens)
            self.bm.register_full_blocks(req, req.num_tokens)  # the tokens known on the host
            batch.items.append((req, 1))
            batch.samples.append(req)
            batch.sample_rows.append(i)
            batch.feed_rows.append(rows[req])
            batch.ahead_starts.append(req.num_tokens)
        return batch

    def _schedule_running(self, chosen: dict[Request, int], budget: list[int], hold_decodes: bool = False) -> bool:
        """Give running requests their tokens (with `hold_decodes`, only prompt rows); returns True if
        anything was preempted."""
        preempted = False
        for req in list(self.running):
            if budget[0] == 0:
                break
            if req in chosen or req not in self.running:  # admitted this step, or preempted just now
                continue
            if hold_decodes and req.num_generated and not _prompt_row(req):  # (a prompt's last token is no decode)
                continue
            n = min(req.num_tokens - req.num_computed, budget[0])
            if _prompt_row(req):
                n = min(n, budget[1])
            n = self._wave_chunk(req, req.num_computed, n)
            if n == 0:  # a prompt chunk, and the step's prompt tokens are spent (or a wave's last token held): decodes
                continue  # behind it still run
            while not self.bm.can_grow(req, req.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim, chosen, budget)
                preempted = True
                if victim is req:
                    break
            else:
                self._take(req, n, chosen, budget)
        return preempted

    def _admit_waiting(self, chosen: dict[Request, int], budget: list[int], hold_arrivals: bool = False) -> None:
        while self.waiting and budget[0] > 0 and len(self.running) < self.max_running:
            if self.running and self.bm.num_free < self.reserve_blocks:
                break
            req = self.waiting[0]
            if hold_arrivals and not req.num_generated:  # (preempted requests, at the front, still go in)
                break
            # n > 1: siblings join the running sequences at their parent's first token; count them now
            sequences = len(self.running) + sum(r.num_children for r in self.running)
            if self.running and sequences + 1 + req.num_children > self.max_running:
                break
            swapped = self.swap is not None and self.swap.holds(req)
            if swapped:
                start = self.swap.saved_tokens(req)
            else:
                start = req.num_computed = self.bm.match_prefix(req)
            n = min(req.num_tokens - start, budget[0])
            if req.num_tokens - start > 1:  # a prompt row (req.num_computed is `start` from here on)
                n = min(n, budget[1])  # 0: the step's prompt tokens are spent
                n = self._wave_chunk(req, start, n)  # (one the cache holds but for its last token samples at once)
            if n == 0 or not self.bm.can_grow(req, start + n):
                self.bm.release(req)  # give the cached blocks back; try again next step
                req.num_computed = 0
                break
            if swapped:
                self._copies += self.bm.grow(req, start + n)
                req.num_computed = self.swap.swap_in(req)
            else:
                self.bm.count_lookup(req.num_prompt_tokens, start)
                req.num_cached_tokens = max(req.num_cached_tokens, min(start, req.num_prompt_tokens))
            self._take(req, n, chosen, budget)
            self.waiting.popleft()
            self.running.append(req)
            req.status = RequestStatus.PREFILLING
            if req.scheduled_time is None:
                req.scheduled_time = time.perf_counter()

    def _early_group_tokens(self) -> int | None:
        """The tokens that finish the prompts of the wave's majority (its members in the order this step takes
        them), when they fit this step's budget and no member has its first token yet, and one pause for each of
        them is at most EARLY_PAUSE_SHARE of the wave's inter-token gaps; else None. Those members sample at the
        end of this step and wait out the rest of the wave once: the wave's median first token comes when its
        majority is prefilled, not when all of it is (as vLLM's chunked prefill gives a wave's first chunk)."""
        if len(self.wave) < self.wave_size:  # the early group had its first tokens (or a member left)
            return None
        need = self.wave_size // 2 + 1
        gaps = sum(max(req.max_new_tokens - 1, 0) for req in self.wave)
        if need > EARLY_PAUSE_SHARE * gaps:
            return None
        tokens = 0
        for req in (*(req for req in self.running if req in self.wave), *self.waiting):  # (preempted ones first)
            if need == 0:
                break
            tokens += req.num_tokens - req.num_computed
            need -= req in self.wave
        return tokens if tokens <= self.max_batch_tokens else None

    def _wave_chunk(self, req: Request, start: int, n: int) -> int:
        """`n` tokens of `req` from `start`, less its last prompt token when it is a member of a wave whose last
        step this is not: the wave's first tokens all come in its last step, so that none of its requests waits
        for the rest of the wave between its first token and its second."""
        if self.wave_holds_last and start + n == req.num_tokens and req in self.wave:
            return n - 1
        return n

    def _take(self, req: Request, n: int, chosen: dict[Request, int], budget: list[int]) -> None:
        self._copies += self.bm.grow(req, req.num_computed + n)
        self.bm.register_full_blocks(req, req.num_computed + n)
        chosen[req] = n
        budget[0] -= n
        if _prompt_row(req):
            budget[1] -= n

    def _preempt(self, req: Request, chosen: dict[Request, int], budget: list[int]) -> None:
        self.running.remove(req)
        if req in chosen:
            n = chosen.pop(req)
            budget[0] += n
            if _prompt_row(req):  # its num_computed is still where this step starts
                budget[1] += n
            self.bm.forget_uncomputed(req)
            mine = set(req.block_ids)
            self._copies = [(src, dst) for src, dst in self._copies if dst not in mine]
        if self.swap is not None:
            self.swap.swap_out(req)  # when the pool is full, the request is recomputed instead
        self.bm.release(req)
        req.num_computed = 0
        req.status = RequestStatus.PENDING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)


def _prompt_row(req: Request) -> bool:
    """More than one token to compute this step: a prompt (or a preempted request's recompute), not a decode."""
    return req.num_tokens - req.num_computed > 1
