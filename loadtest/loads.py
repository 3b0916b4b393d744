"""The loads a comparison can run one after another on the same started servers.

A closed loop keeps `--users` requests in flight; with every request asking for the same number of
tokens the users fall into step (they are admitted together and finish together), so a comparison
also runs one whose output lengths are drawn from a range, and an open loop whose Poisson arrivals
come at a rate set from the closed-loop results: a fraction of the slowest server's request throughput.

Each load draws prompts of its own: load i's round r is seeded --seed + i x rounds + r, so no load finds
an earlier load's prompts in a server's prefix cache (a server with a larger KV cache would keep more
of them, and its time to first token would show its cache, not its prefill).
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass


@dataclass(frozen=True)
class Load:
    name: str  # the report's section and the load's output folder
    title: str
    output_len: str | None = None  # None: the run's --output-len
    open_loop: bool = False
    rate: float | None = None  # open loop: requests/s; None: `rate_fraction` of the slowest in `rate_from`
    rate_from: str | None = None  # the closed-loop load whose request throughputs set the rate
    rate_fraction: float = 0.8


def open_loop_rate(request_throughputs: dict[str, float], fraction: float = 0.8) -> float:
    """`fraction` of the slowest server's requests/s: a load every server should keep up with."""
    measured = [v for v in request_throughputs.values() if v and v > 0]
    if not measured:
        raise ValueError("no server completed a request in the closed loop: no open-loop rate to derive")
    return fraction * min(measured)


def first_seed(args: argparse.Namespace, index: int) -> int:
    """The first prompt seed of the load at `index` in the run order (its rounds take the next ones);
    with `index` the number of loads, the first seed no load uses."""
    return args.seed + index * args.rounds


def load_args(args: argparse.Namespace, load: Load, rate: float | None, index: int = 0) -> argparse.Namespace:
    """The run's flags with the load's output lengths and arrival rate, and for the load at `index` in the
    run order the first of its own --rounds prompt seeds."""
    out = copy.copy(args)
    out.seed = first_seed(args, index)
    if load.output_len is not None:
        out.output_len = load.output_len
    out.rate = rate if load.open_loop else None
    return out


def describe(load: Load, args: argparse.Namespace, rate: float | None) -> str:
    lengths = f"{args.output_len} tokens out"
    if load.open_loop:
        return f"{load.title}: Poisson arrivals at {rate:.2f} requests/s, {lengths}"
    return f"{load.title}: {args.users} users, {lengths}"
