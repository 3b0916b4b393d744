"""The `cbserve` command: `serve` (the pod's endpoint), `generate` (a dataset, offline) and `download`
(an hf:// model into a model folder, as the operator's cache Job runs it)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from engine.server.settings import add_setting_flags

logger = logging.getLogger("cbserve")


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("--config", help="YAML file of settings (engine/settings_table.py; docs/engine.md)")
    p.add_argument("--api-key", action="append", dest="api_key",
                   help="require 'Authorization: Bearer KEY' on every route but /health, /ready and /metrics "
                        "(repeatable; or CBSERVE_API_KEY, comma-separated)")  # fmt: skip
    _group_flags(p)
    add_setting_flags(p, "serve")  # every setting engine/settings_table.py gives `cbserve serve` a flag


def _group_flags(p: argparse.ArgumentParser, worker: bool = False) -> None:
    """Where the ranks of a tensor-parallel engine across hosts meet (docs/engine.md)."""
    p.add_argument("--nnodes", type=int, default=1, help="hosts the --tensor-parallel-size ranks span (default 1)")
    p.add_argument("--dist-addr", required=worker, help="the host of rank 0 (the serving pod), where the other "
                                                        "ranks meet" + ("" if worker else " (default 127.0.0.1)"))
    p.add_argument("--dist-port", type=int, default=29500, help="rank 0's torch.distributed store port "
                                                                "(default 29500; one host: any free port)")
    if worker:
        p.add_argument("--node-rank", type=int, required=True, help="this host's index among --nnodes (1..nnodes-1)")


def _worker_parser(sub) -> None:
    p = sub.add_parser("worker", help="run this host's ranks of a tensor-parallel engine served from another host")
    p.add_argument("--config", help="the same YAML settings file the serving host reads")
    _group_flags(p, worker=True)
    add_setting_flags(p, "worker")  # give it the serving host's --model and engine settings


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="run a JSONL dataset of prompts or chats through the engine")
    p.add_argument("--input", required=True, help='JSONL: {"id", "prompt"} or {"id", "messages"} per line')
    p.add_argument("--output", required=True, help="JSONL results, in input order; existing ids are skipped")
    p.add_argument("--config", help="YAML file of settings (engine/settings_table.py; docs/engine.md)")
    add_setting_flags(p, "generate")  # the engine's settings and --model, as `cbserve serve` has them
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int, dest="request_seed", help="each request's sampling seed (reproducible samples)")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--chunk", type=int, default=256, help="prompts per batch written at once (resume granularity)")


def _download_parser(sub) -> None:
    p = sub.add_parser("download", help="download hf://org/name[@revision] once into a model folder")
    p.add_argument("model", help="hf://org/name@revision (a commit id, tag or branch; none: main)")
    p.add_argument("--to", help="the model folders' root: the model goes to <to>/<org>/<name>/<revision> "
                                "(default: $CBSERVE_MODEL_DIR, else ~/.cache/cbserve/models)")  # fmt: skip


def download(args: argparse.Namespace) -> int:
    """Print the model's folder; a complete one is left as it is (HF_TOKEN, HF_ENDPOINT, HF_HUB_OFFLINE apply)."""
    from engine import hub

    model = hub.parse_hub_uri(args.model)
    if model.revision is None:
        print(f"cbserve: warning: {model.uri} names no revision: fetching {hub.DEFAULT_REVISION} as it is now; "
              f"{model.uri}@<commit> pins what every replica serves", file=sys.stderr)  # fmt: skip
    root = Path(args.to) if args.to else None
    folder = hub.locate(model, root)
    print(f"{model.uri} (commit {hub.completed(folder)['commit']}) is in {folder}")  # type: ignore[index]
    return 0


def _placement(settings: Any) -> tuple[str, str, str]:
    """The device, dtype and quantization the settings resolve to on this machine (engine/device.py,
    engine/loader.resolve_quantization); a device that is not there is a ValueError, which `main`
    turns into one line and exit status 2."""
    from engine.device import probe, resolve_device, resolve_dtype
    from engine.loader import resolve_quantization

    acc = probe()
    device = resolve_device(settings.device, acc)
    quantization, dtype = resolve_quantization(settings.quantization, settings.dtype, settings.model, device,
                                               settings.engine.tensor_parallel_size)  # fmt: skip
    return device, dtype or resolve_dtype(settings.dtype, device, acc), quantization


def serve(args: argparse.Namespace) -> int:
    """Bind the port first, then load the model behind it (engine/server/startup.py): probes get
    answers from the start, `/ready` turns 200 once the engine is warm."""
    import uvicorn

    from engine.server.settings import DEFAULT_SERVER_QUEUE, load_settings
    from engine.server.startup import DrainingServer, Startup

    settings = load_settings(vars(args), queue_default=DEFAULT_SERVER_QUEUE)
    device, dtype, quantization = _placement(settings)  # a device that is not there stops here, before the port is bound
    launch, load_device = _tensor_parallel(args, settings, device, dtype, settings.model)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not settings.api_keys and settings.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s without an API key: anyone who reaches the port can use it "
                       "(--api-key or CBSERVE_API_KEY)", settings.host)  # fmt: skip

    def build():
        from engine import ContinuousBatchingManager
        from engine.loader import load_model
        from engine.server.app import build_state, create_app

        loaded = load_model(settings.model, dtype, settings.attn_implementation, load_device, quantization,
                    settings.quantized_activations)
        manager = ContinuousBatchingManager(loaded.model, continuous_batching_config=settings.engine,
                                            tokenizer=loaded.tokenizer, tensor_parallel=launch)  # fmt: skip
        manager.on_fatal.append(startup.engine_died)  # a broken tensor-parallel group: the server exits 1
        name = settings.served_model_name or loaded.name
        state = build_state(manager, loaded.tokenizer, name, loaded.max_model_len or manager.engine.block_size)
        return create_app(state, api_keys=settings.api_keys, max_body_bytes=settings.max_body_bytes,
                          body_timeout=settings.body_timeout)  # fmt: skip

    startup = Startup(build)
    config = uvicorn.Config(
        startup, host=settings.host, port=settings.port, workers=1, log_level=settings.log_level,
        timeout_keep_alive=75,  # above the usual 60 s idle timeout of load balancers
        timeout_graceful_shutdown=5,  # after the drain (DrainingServer): what is left is cut
    )  # fmt: skip
    DrainingServer(config, startup, settings.drain_timeout).run()
    if startup.error is not None:
        raise startup.error
    return 0


def _tensor_parallel(args: argparse.Namespace, settings: Any, device: str, dtype: str,
                     model: str | None) -> tuple[Any, str]:  # fmt: skip
    """The Launch of the other ranks (None for one rank) and where this process loads the model: with
    several ranks, "meta" (engine/loader.load_model: no weights read; rank 0 reads its shard as each
    rank does, or the whole model into host memory when the checkpoint has no safetensors)."""
    from engine.loader import ModelSource
    from engine.tp_group import Launch

    world = settings.engine.tensor_parallel_size
    nnodes, dist_addr, dist_port = getattr(args, "nnodes", 1), getattr(args, "dist_addr", None), getattr(args, "dist_port", 0)
    if world == 1:
        if nnodes != 1:
            raise ValueError(f"--nnodes {nnodes} needs --tensor-parallel-size of at least {nnodes}")
        return None, device
    if ":" in device:
        raise ValueError(f"--device {device} names one GPU; {world} tensor-parallel ranks take cuda:0.."
                         f"{world // max(nnodes, 1) - 1} of each host (use --device cuda)")
    if nnodes < 1 or world % nnodes:
        raise ValueError(f"--tensor-parallel-size {world} must be a multiple of --nnodes ({nnodes})")
    if nnodes > 1 and not dist_addr:
        raise ValueError("--nnodes > 1 needs --dist-addr: the address the other hosts reach this one at")
    source = ModelSource(model, dtype, settings.attn_implementation)
    port = dist_port if nnodes > 1 else 0
    return Launch(load=source, nnodes=nnodes, addr=dist_addr or "127.0.0.1", port=port, device=device), "meta"


def worker(args: argparse.Namespace) -> int:
    """This host's ranks of an engine served from another host (--node-rank of --nnodes), one process
    each; all stop when one does, and the command exits non-zero unless every rank was told to stop."""
    import multiprocessing.connection

    import torch

    from engine.loader import ModelSource
    from engine.server.settings import load_settings
    from engine.tp_worker import spawned

    settings = load_settings(vars(args))
    device, dtype, _ = _placement(settings)  # several ranks: dequantised (resolve_quantization)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    world, nnodes = settings.engine.tensor_parallel_size, args.nnodes
    if nnodes < 2 or world % nnodes or not 1 <= args.node_rank < nnodes:
        raise ValueError(f"cbserve worker needs --nnodes >= 2 dividing --tensor-parallel-size ({world}) and "
                         f"--node-rank in 1..nnodes-1, got --nnodes {nnodes} --node-rank {args.node_rank}")
    if ":" in device:
        raise ValueError(f"--device {device} names one GPU; a worker host's ranks take cuda:0..N-1 (use --device cuda)")
    per_node = world // nnodes
    source = ModelSource(settings.model, dtype, settings.attn_implementation)
    ctx = torch.multiprocessing.get_context("spawn")
    level = logging.getLogger().getEffectiveLevel()
    ranks = range(args.node_rank * per_node, (args.node_rank + 1) * per_node)
    procs = [ctx.Process(target=spawned, name=f"cbserve-tp-rank-{r}", args=(source, settings.engine, r, world,
             args.dist_addr, args.dist_port, device, per_node, level)) for r in ranks]  # fmt: skip
    for p in procs:
        p.start()
    logger.info("ranks %d-%d of %d started; rank 0 at %s:%d", ranks[0], ranks[-1], world, args.dist_addr,
                args.dist_port)  # fmt: skip
    pending = list(procs)
    while pending:
        multiprocessing.connection.wait([p.sentinel for p in pending])
        for p in [p for p in pending if p.exitcode is not None]:
            pending.remove(p)
            if p.exitcode != 0:  # a broken group: the host's other ranks go too
                for q in pending:
                    q.kill()
                logger.error("%s exited with code %s", p.name, p.exitcode)
                return 1
    return 0


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    items = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not JSON ({exc})") from None
        if not isinstance(item, dict) or ("prompt" not in item and "messages" not in item):
            raise ValueError(f"{path}:{n}: each line needs 'prompt' or 'messages'")
        item.setdefault("id", str(n))
        items.append(item)
    return items


def _done_ids(path: Path) -> set[str]:
    """The ids already in the output file. A cut last line (not JSON, no newline after it: a run stopped
    mid-write) is dropped from the file with a warning, so its prompt runs again; any other bad line is an error."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    lines = data.split(b"\n")  # the last one: what follows the last newline (b"" when the file ends with one)
    done, start = set(), 0
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                record = json.loads(line)
            except ValueError as exc:  # JSONDecodeError, or UnicodeDecodeError for a cut character
                if n < len(lines):
                    raise ValueError(f"{path}:{n}: not JSON ({exc})") from None
                print(f"cbserve: warning: {path}:{n}: dropped a cut last line (an interrupted run); its prompt "
                      "runs again", file=sys.stderr)  # fmt: skip
                with path.open("r+b") as f:
                    f.truncate(start)
                return done
            if not isinstance(record, dict) or "id" not in record:
                raise ValueError(f"{path}:{n}: a result line needs an 'id'")
            done.add(str(record["id"]))
        start += len(line) + 1
    if data and not data.endswith(b"\n"):  # a whole last record, stopped before its newline
        with path.open("ab") as f:
            f.write(b"\n")
    return done


def generate(args: argparse.Namespace) -> int:
    from engine.generate import destroy_cached_engine
    from engine.loader import load_model
    from engine.manager import CACHED
    from engine.server.settings import load_settings

    settings = load_settings(vars(args))
    device, dtype, quantization = _placement(settings)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    items = _read_jsonl(Path(args.input))
    out_path = Path(args.output)
    done = _done_ids(out_path)
    todo = [it for it in items if str(it["id"]) not in done]
    if not todo:
        print(f"nothing to do: all {len(items)} ids are in {out_path}")
        return 0
    launch, load_device = _tensor_parallel(args, settings, device, dtype, settings.model)
    loaded = load_model(settings.model, dtype, settings.attn_implementation, load_device, quantization,
                    settings.quantized_activations)
    if launch is not None:  # the engine kept across chunks, its ranks started once
        from engine import ContinuousBatchingManager

        setattr(loaded.model, CACHED, ContinuousBatchingManager(loaded.model, None, settings.engine,
                                                                tokenizer=loaded.tokenizer, tensor_parallel=launch))
    try:
        _generate_chunks(args, loaded, settings, todo, out_path)
        engine = getattr(loaded.model, CACHED).engine  # the one engine of every chunk: its own counters
        print(f"cbserve generate: {len(todo)} results written to {out_path}; the engine prefilled "
              f"{engine.prompt_tokens_total} prompt tokens and generated {engine.generation_tokens_total} tokens",
              file=sys.stderr)  # fmt: skip
    finally:
        destroy_cached_engine(loaded.model)
    return 0


def _generate_chunks(args: argparse.Namespace, loaded: Any, settings: Any, todo: list[dict], out_path: Path) -> None:
    """Each chunk through one engine kept across chunks (its KV cache, packed weights and prefix cache stay),
    its results appended and flushed before the next chunk starts."""
    from tqdm.auto import tqdm

    from engine import generate_batch
    from engine.server.protocol import parse_chat

    tok = loaded.tokenizer
    vocab = loaded.model.config.get_text_config().vocab_size
    sampling = {k: v for k, v in {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                                  "seed": args.request_seed}.items() if v is not None}  # fmt: skip
    with out_path.open("a") as out, tqdm(total=len(todo), desc="generate", unit="prompt") as bar:
        for start in range(0, len(todo), args.chunk):
            chunk = todo[start : start + args.chunk]
            prompts = [parse_chat({"messages": it["messages"]}, tok, vocab).prompts[0] if "messages" in it
                       else tok(it["prompt"]).input_ids for it in chunk]  # fmt: skip
            # the engine detokenizes and ends a sequence at its stop string (engine/output_processor.py)
            results = generate_batch(loaded.model, prompts, continuous_batching_config=settings.engine,
                                     max_new_tokens=args.max_new_tokens, progress_bar=False, persistent_manager=True,
                                     tokenizer=tok, detokenize=True, stop_strings=args.stop or None, **sampling)  # fmt: skip
            for item, prompt, res in zip(chunk, prompts, results.values()):
                record = {
                    "id": str(item["id"]), "text": res.text or "", "finish_reason": res.finish_reason,
                    "error": res.error,
                    "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(res.generated_tokens)},
                    "timings": {"ttft_s": (res.first_token_time or 0) - res.created_time if res.first_token_time else None,
                                "e2e_s": (res.finished_time or 0) - res.created_time if res.finished_time else None},
                }  # fmt: skip
                out.write(json.dumps(record) + "\n")
            out.flush()
            bar.update(len(chunk))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cbserve", description="continuous-batching serving of HF causal LMs")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _generate_parser(sub)
    _download_parser(sub)
    _worker_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from engine.openmp import set_spin_default

    set_spin_default()  # before torch loads libgomp (engine/openmp.py)
    args = build_parser().parse_args(argv)
    from engine.hub import DownloadError
    from engine.server.settings import SettingsError

    commands = {"serve": serve, "generate": generate, "download": download, "worker": worker}
    try:
        return commands[args.command](args)
    except (SettingsError, ValueError, FileNotFoundError) as exc:
        print(f"cbserve: error: {exc}", file=sys.stderr)
        return 2
    except DownloadError as exc:
        print(f"cbserve: error: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:
        # a tensor-parallel group only breaks where one was started: `download` does not load torch for this
        tp_group = sys.modules.get("engine.tp_group")
        if tp_group is None or not isinstance(exc, tp_group.GroupBroken):
            raise
        print(f"cbserve: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
