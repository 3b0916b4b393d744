"""Structured-output constraints compiled at admission: in worker threads, a few at a time, each
within a time budget.

llguidance builds a grammar with the GIL released (measured: a 5.6 s compile of a 50,000-alternative
grammar let a 2 ms ticker thread run with gaps of at most 5 ms), and reports its own panics as an
error state, so a thread bounds a compile well enough: the event loop and the engine thread keep
their pace, and a compile past `budget` seconds answers 400 at once. The thread itself cannot be
stopped; it keeps its slot until it ends, so at most `slots` cores ever compile, and a request that
finds no slot free within the budget gets 503 with Retry-After. The caps checked before compiling
(engine/structured.py: `StructuredOutput.check`) keep any one compile far below the budget.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from engine.server.errors import APIError

COMPILE_BUDGET_S = 5.0
COMPILE_SLOTS = 2


class ConstraintCompiler:
    def __init__(self, compile: Callable[[Any], Any], slots: int = COMPILE_SLOTS,
                 budget: float = COMPILE_BUDGET_S) -> None:  # fmt: skip
        self._compile = compile  # the engine's compile_grammar: a spec in, a Grammar out, ValueError if refused
        self.budget = budget
        self._slots = asyncio.Semaphore(slots)

    async def compile(self, spec: Any, param: str | None) -> Any:
        """The compiled constraint (grammar, first mask and first step included); a constraint the
        grammar engine refuses, or one that takes over the budget, is a 400 naming `param`."""
        try:
            await asyncio.wait_for(self._slots.acquire(), self.budget)
        except TimeoutError:
            raise APIError(503, "the server is busy compiling other structured output constraints; retry later",
                           type="server_busy", code="compile_busy", headers={"Retry-After": "1"}) from None  # fmt: skip
        work = asyncio.get_running_loop().run_in_executor(None, self._compile, spec)
        work.add_done_callback(self._release)
        try:
            return await asyncio.wait_for(asyncio.shield(work), self.budget)
        except TimeoutError:
            raise APIError(400, f"'{param}': compiling the constraint took over {self.budget:g} s; make it smaller "
                                "or simpler", param=param, code="constraint_too_complex") from None  # fmt: skip
        except ValueError as exc:
            raise APIError(400, f"'{param}': {exc}", param=param) from None

    def _release(self, work: asyncio.Future) -> None:
        """A compile ended (in time or not): its slot is free; an outcome nobody awaits any more is read."""
        self._slots.release()
        if not work.cancelled():
            work.exception()
