"""`python -m cbserve_operator [kopf run flags]`: `kopf run` with the cbserve settings.

Defaults (each overridden by passing the flag yourself): `--standalone` (one replica, no peering),
`--all-namespaces` (unless `--namespace`/`-n` is given), `--liveness http://0.0.0.0:8080/healthz`.
With `--peering` and no `--priority`, the priority comes from the pod's name (`POD_NAME`, else the
host name): Kopf pauses every operator but the highest-priority live one, and pauses all of them
when two share a priority, so replicas need distinct ones.
"""

from __future__ import annotations

import os
import socket
import sys
import zlib

HANDLERS_MODULE = "cbserve_operator.handlers"
DEFAULT_LIVENESS = "http://0.0.0.0:8080/healthz"


def _has(args: list[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in args for f in flags)


def peering_priority(name: str) -> int:
    """A stable priority in [1, 1,000,000] for one replica, from its pod name."""
    return 1 + zlib.crc32(name.encode()) % 1_000_000


def kopf_args(argv: list[str]) -> list[str]:
    """The `kopf` command line for our flags `argv`."""
    args = ["run", "-m", HANDLERS_MODULE]
    if not _has(argv, "--standalone", "--peering", "--priority"):
        args.append("--standalone")
    if _has(argv, "--peering") and not _has(argv, "--priority"):
        args.append(f"--priority={peering_priority(os.environ.get('POD_NAME') or socket.gethostname())}")
    if not _has(argv, "--namespace", "-n", "--all-namespaces", "-A"):
        args.append("--all-namespaces")
    if not _has(argv, "--liveness"):
        args += ["--liveness", DEFAULT_LIVENESS]
    return args + argv


def main(argv: list[str] | None = None) -> None:
    from kopf.cli import main as kopf_main

    kopf_main(args=kopf_args(list(sys.argv[1:] if argv is None else argv)), prog_name="cbserve-operator")


if __name__ == "__main__":
    main()
