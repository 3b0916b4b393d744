"""`make compare`: cbserve serve, vllm serve and llama.cpp's llama-server on the embedded model, under
the same Locust load, one report.

    python benchmarks/serve_compare.py [--systems cbserve,vllm,llama.cpp] [python -m loadtest compare flags]

Defaults: 16 users, completions, 64-256 words in, 128 tokens out, 60 s per run, 2 rounds (the order
rotating), into reports/compare/. Every server gets the same model at the same precision: cbserve
and vLLM the converted float32 checkpoint folder, llama.cpp its F32 GGUF conversion, with one slot
per user. A peer that is not set up is skipped with the command that sets it up:
`python benchmarks/vllm_peer.py --setup` and `python benchmarks/llama_cpp_peer.py --setup`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_cpp_peer  # noqa: E402
import vllm_peer  # noqa: E402

from engine.backends.cpu_isa import capabilities  # noqa: E402
from engine.loader import embedded_folder  # noqa: E402
from loadtest.cli import parse_compare_args  # noqa: E402
from loadtest.compare import compare  # noqa: E402
from loadtest.target import Target, UsageError, cbserve_command, free_port  # noqa: E402

DEFAULTS = ["--users", "16", "--duration", "60s", "--endpoint", "completions", "--input-len", "64:256",
            "--output-len", "128", "--rounds", "2", "--out", "reports/compare"]  # fmt: skip
SYSTEMS = ("cbserve", "vllm", "llama.cpp")


def targets(systems: list[str], users: int) -> list[Target]:
    folder = embedded_folder()
    chosen = []
    for name in systems:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        if name == "cbserve":
            # the peers' precision, whatever --dtype auto picks on this CPU
            chosen.append(Target(name, url, command=cbserve_command(port) + ["--dtype", "float32"]))
        elif name == "vllm":
            if vllm_peer.venv_python() is None:
                print("vllm skipped: no venv (python benchmarks/vllm_peer.py --setup)", flush=True)
                continue
            env = {k: v for k, v in vllm_peer.peer_env().items() if k in (*vllm_peer.VLLM_ENV, "LD_PRELOAD")}
            chosen.append(Target(name, url, command=vllm_peer.serve_command(port, folder), env=env))
        elif name == "llama.cpp":
            binary, gguf = llama_cpp_peer.server_binary(), llama_cpp_peer.gguf_path(folder)
            if binary is None or gguf is None:
                print("llama.cpp skipped: not built (python benchmarks/llama_cpp_peer.py --setup)", flush=True)
                continue
            chosen.append(Target(name, url, command=llama_cpp_peer.serve_command(port, gguf, parallel=users)))
    return chosen


def main(argv: list[str]) -> int:
    systems = list(SYSTEMS)
    if "--systems" in argv:
        i = argv.index("--systems")
        systems = argv[i + 1].split(",") if i + 1 < len(argv) else []
        argv = argv[:i] + argv[i + 2 :]
    unknown = [s for s in systems if s not in SYSTEMS]
    try:
        if unknown or not systems:
            raise UsageError(f"--systems takes a comma-separated subset of {','.join(SYSTEMS)}, got {unknown}")
        print(f"host: {capabilities().describe()}", flush=True)
        args = parse_compare_args(DEFAULTS + argv, targets=[])
        args.targets = targets(systems, args.users) + args.targets
        return compare(args.targets, args)
    except UsageError as exc:
        print(f"serve_compare: error: {exc}", file=sys.stderr)
        return exc.status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
