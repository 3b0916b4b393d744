"""Open-loop arrivals: a seeded Poisson schedule, and what became of each arrival.

The schedule is a pure function of (rate, seed): the same seed sends every server its requests at
the same offsets. An arrival is sent when its time comes, whether or not earlier requests have been
answered; one that finds `max_in_flight` requests still unanswered is dropped (counted, not sent),
so an overloaded server cannot make the load generator pile up connections without bound.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field


def poisson_arrivals(rate: float, seed: int) -> Iterator[float]:
    """Arrival offsets in seconds from the start, exponential gaps of mean 1 / `rate`, without end."""
    if rate <= 0:
        raise ValueError(f"the arrival rate must be > 0 requests/s, got {rate}")
    rng = random.Random(f"poisson-arrivals:{seed}")  # apart from the prompt sequence's generator
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        yield t


def arrivals_within(rate: float, seed: int, horizon_s: float) -> list[float]:
    """The schedule's offsets before `horizon_s` seconds."""
    out = []
    for t in poisson_arrivals(rate, seed):
        if t >= horizon_s:
            return out
        out.append(t)
    raise AssertionError("the schedule has no end")


@dataclass
class OpenLoopTally:
    """The fate of a run's arrivals; `as_dict()` goes into summary.json as "open_loop"."""

    rate: float
    max_in_flight: int
    offered: int = 0  # arrivals whose time came during the run
    dropped: int = 0  # found max_in_flight requests unanswered: not sent
    lags_ms: list[float] = field(default_factory=list)  # how late each sent request left (a busy load generator)
    schedule_s: float = 0.0  # the time the schedule ran for

    def arrival(self, in_flight: int, lag_s: float) -> bool:
        """Count one arrival; True if it is to be sent."""
        self.offered += 1
        if in_flight >= self.max_in_flight:
            self.dropped += 1
            return False
        self.lags_ms.append(max(lag_s, 0.0) * 1000)
        return True

    def as_dict(self) -> dict:
        sent = self.offered - self.dropped
        lags = sorted(self.lags_ms) or [0.0]
        return {"offered_rate": self.rate, "schedule_s": self.schedule_s, "offered": self.offered,
                "sent": sent, "dropped": self.dropped, "max_in_flight": self.max_in_flight,
                "sent_rate": sent / self.schedule_s if self.schedule_s > 0 else 0.0,
                "median_send_lag_ms": statistics.median(lags), "max_send_lag_ms": lags[-1]}  # fmt: skip


def pool_tallies(tallies: list[dict]) -> dict:
    """Several runs' `as_dict()`s as one: counts and schedule time summed, the worst lag kept."""
    schedule_s = sum(t["schedule_s"] for t in tallies)
    sent = sum(t["sent"] for t in tallies)
    return {"offered_rate": tallies[0]["offered_rate"], "schedule_s": schedule_s,
            "offered": sum(t["offered"] for t in tallies), "sent": sent,
            "dropped": sum(t["dropped"] for t in tallies), "max_in_flight": tallies[0]["max_in_flight"],
            "sent_rate": sent / schedule_s if schedule_s > 0 else 0.0,
            "median_send_lag_ms": statistics.median(t["median_send_lag_ms"] for t in tallies),
            "max_send_lag_ms": max(t["max_send_lag_ms"] for t in tallies)}  # fmt: skip
