"""The run's environment: what a person pastes above the results (GPU, driver, CUDA, torch, transformers,
flash-attn, the attention backend an engine gets)."""

from __future__ import annotations

import datetime
import platform
import subprocess

import torch

from scripts.gpu_checks.common import Context


def driver_version() -> str:
    """The NVIDIA driver, as nvidia-smi reports it (empty when it is not on PATH)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""


def environment(ctx: Context) -> list[tuple[str, str]]:
    import transformers

    from engine.backends.cuda import flash_attn_available

    device = ctx.device
    rows = [("date (UTC)", datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")),
            ("python", platform.python_version()), ("torch", torch.__version__),
            ("torch CUDA", str(torch.version.cuda)), ("transformers", transformers.__version__)]  # fmt: skip
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        rows += [("GPU", f"{props.name}, {props.total_memory / (1 << 30):.0f} GiB, sm_{props.major}{props.minor}"),
                 ("GPUs on the machine", str(torch.cuda.device_count())),
                 ("driver", driver_version() or "unknown (nvidia-smi not found)")]  # fmt: skip
    else:
        rows += [("CPU", f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"),
                 ("mode", "CPU smoke run: stand-ins for flash-attn and CUDA graphs, no GPU measured")]  # fmt: skip
    if flash_attn_available():
        import flash_attn

        rows.append(("flash-attn", flash_attn.__version__))
    else:
        rows.append(("flash-attn", "not installed"))
    if ctx.cuda:
        name, graphs = ctx.attention()
        rows.append(("attention backend", f"{name} (CUDA graphs: {'yes' if graphs else 'no'})"))
    else:
        rows.append(("attention backend", "cpu; the checks' GPU stand-ins run flash-attn's reference kernels"))
    return rows
