"""KV cache sizing, shared by the CPU and CUDA paths.

The arithmetic is pure and takes the device's figures as arguments, so it is tested with injected
numbers; only `read_device_memory` and `profile_activation_peak` touch a device.

How a CUDA pod sizes its cache at start-up:

1. load the model, then `profile_activation_peak(device, profile_forward(...))` runs one forward
   shaped as a full step (every token of the budget, every sampled row) and returns the extra memory
   it peaked at (activations, workspace, logits); `step_reserve_bytes` adds the sampler's working
   set and, with CUDA graphs, their private pool;
2. `read_device_memory(device)` reads the memory free after that (torch.cuda.mem_get_info);
3. `plan_kv_cache(...)` gives the cache `max_memory_percent` of the free memory, less the activation
   peak that every later step needs again, and turns the rest into whole blocks.

On CPU the free memory is psutil's available memory, or less where the process's cgroup limits it (a
pod's memory limit: `host_available_bytes`), never more than `CPU_FRACTION_OF_TOTAL` of the
machine, and the cache is capped at the `cpu_kv_cache_space` setting (1 GiB unless set): a CPU pod shares
its node, and a 1 GiB cache already holds far more tokens than a CPU can serve at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

GiB = 1 << 30
MiB = 1 << 20
CPU_CACHE_CAP_BYTES = 1 * GiB  # the cpu_kv_cache_space setting's default
CPU_FRACTION_OF_TOTAL = 0.5
DEFAULT_MAX_BATCH_TOKENS = {"cpu": 1024, "cuda": 8192}
DEFAULT_MAX_REQUESTS = 256


def dtype_size(dtype: torch.dtype) -> int:
    """Bytes per element of a torch dtype."""
    return torch.empty((), dtype=dtype).element_size()


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes across all layers: keys and values, `block_size` tokens each."""
    for name, value in (
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("block_size", block_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_size(dtype)


@dataclass(frozen=True)
class DeviceMemory:
    """A device's memory figures at sizing time, in bytes."""

    device_type: str  # "cuda" or "cpu"
    free_bytes: int  # free now (after the model and the profiling forward)
    total_bytes: int
    cap_bytes: int | None = None  # the most the cache may take whatever is free (CPU only)


@dataclass(frozen=True)
class CachePlan:
    num_blocks: int
    block_size: int
    max_batch_tokens: int
    max_requests: int
    bytes_per_block: int
    budget_bytes: int  # what the cache was allowed to take
    free_bytes: int  # what was free when it was sized
    activation_peak_bytes: int

    @property
    def cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def summary(self) -> str:
        """One line for the start-up log."""
        return (
            f"KV cache {self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} tokens "
            f"({self.cache_bytes / GiB:.2f} GiB of {self.free_bytes / GiB:.2f} GiB free, "
            f"activation peak {self.activation_peak_bytes / MiB:.0f} MiB); "
            f"max_batch_tokens {self.max_batch_tokens}; max_requests {self.max_requests}"
        )


def _positive_or_none(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def plan_kv_cache(
    free_bytes: int,
    max_memory_percent: float,
    bytes_per_block: int,
    block_size: int,
    activation_peak_bytes: int = 0,
    max_batch_tokens: int | None = None,
    max_requests: int | None = None,
    num_blocks: int | None = None,
    device_type: str = "cuda",
    cap_bytes: int | None = None,
    reserved_blocks: int = 0,
) -> CachePlan:
    """Blocks, token budget and request cap for a cache of `bytes_per_block` blocks.

    budget = min(free_bytes * max_memory_percent - activation_peak_bytes, cap_bytes)
    num_blocks = budget // bytes_per_block - reserved_blocks (unless `num_blocks` is given)

    `reserved_blocks` are blocks the engine allocates but never hands to a request (the padding
    block of CUDA graphs). A default request cap never exceeds the number of blocks (every running
    request holds at least one). Raises ValueError, with the figures, when not one block fits.
    """
    for name, value in (("free_bytes", free_bytes), ("activation_peak_bytes", activation_peak_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    if isinstance(max_memory_percent, bool) or not isinstance(max_memory_percent, (int, float)):
        raise ValueError(f"max_memory_percent must be a number in (0, 1], got {max_memory_percent!r}")
    if not 0 < max_memory_percent <= 1:
        raise ValueError(f"max_memory_percent must be in (0, 1], got {max_memory_percent!r}")
    _positive_or_none("bytes_per_block", bytes_per_block)
    _positive_or_none("block_size", block_size)
    _positive_or_none("max_batch_tokens", max_batch_tokens)
    _positive_or_none("max_requests", max_requests)
    _positive_or_none("num_blocks", num_blocks)
    _positive_or_none("cap_bytes", cap_bytes)
    if isinstance(reserved_blocks, bool) or not isinstance(reserved_blocks, int) or reserved_blocks < 0:
        raise ValueError(f"reserved_blocks must be an integer >= 0, got {reserved_blocks!r}")

    budget = int(free_bytes * max_memory_percent) - activation_peak_bytes
    if cap_bytes is not None:
        budget = min(budget, cap_bytes)
    if num_blocks is None:
        num_blocks = budget // bytes_per_block - reserved_blocks if budget > 0 else 0
        if num_blocks < 1:
            raise ValueError(
                f"not enough memory for one KV block: {free_bytes / MiB:.0f} MiB free x max_memory_percent "
                f"{max_memory_percent} - activation peak {activation_peak_bytes / MiB:.0f} MiB leaves "
                f"{max(budget, 0) / MiB:.1f} MiB, a block takes {bytes_per_block / MiB:.2f} MiB "
                f"(+{reserved_blocks} reserved); lower block_size or max_batch_tokens, raise "
                "max_memory_percent, or set num_blocks"
            )
    if max_batch_tokens is None:
        max_batch_tokens = DEFAULT_MAX_BATCH_TOKENS.get(device_type, 2048)
    if max_requests is None:
        max_requests = min(DEFAULT_MAX_REQUESTS, num_blocks)
    return CachePlan(
        num_blocks=num_blocks,
        block_size=block_size,
        max_batch_tokens=max_batch_tokens,
        max_requests=max_requests,
        bytes_per_block=bytes_per_block,
        budget_bytes=max(budget, 0),
        free_bytes=free_bytes,
        activation_peak_bytes=activation_peak_bytes,
    )


def cap_layer_elements(plan: CachePlan, max_elements: int | None, num_kv_heads: int, head_dim: int,
                       reserved_blocks: int = 0, explicit: bool = False) -> tuple[CachePlan, str | None]:
    """`plan` with at most as many blocks as keep one layer's K (or V) cache, the reserved blocks
    included, within `max_elements` (a kernel's 32-bit offsets; None: no limit), and the line to log
    when that cut it. A cache sized from the memory is cut; `explicit` (num_blocks set by the user) past
    the limit is a ValueError that names it."""
    if max_elements is None:
        return plan, None
    per_block = plan.block_size * num_kv_heads * head_dim
    most = max_elements // per_block - reserved_blocks
    if plan.num_blocks <= most:
        return plan, None
    if explicit or most < 1:
        raise ValueError(
            f"num_blocks={plan.num_blocks} is more than this attention backend can address: one layer's K "
            f"cache of {plan.num_blocks + reserved_blocks} blocks x {plan.block_size} slots x {num_kv_heads} KV "
            f"heads x {head_dim} would be over {max_elements:,} elements; set num_blocks to at most {most}"
        )
    cut = replace(plan, num_blocks=most, max_requests=min(plan.max_requests, most))
    return cut, (
        f"KV cache cut from {plan.num_blocks} to {most} blocks: the attention kernels address one layer's "
        f"cache with 32-bit offsets (at most {max_elements:,} elements)"
    )


def cpu_memory(
    available_bytes: int,
    total_bytes: int,
    cap_bytes: int = CPU_CACHE_CAP_BYTES,
    fraction_of_total: float = CPU_FRACTION_OF_TOTAL,
) -> DeviceMemory:
    """CPU figures: what is available, never more than a fraction of the machine, cache capped."""
    free = min(available_bytes, int(total_bytes * fraction_of_total))
    return DeviceMemory("cpu", free_bytes=free, total_bytes=total_bytes, cap_bytes=cap_bytes)


CGROUP_ROOT = Path("/sys/fs/cgroup")
NO_LIMIT = 1 << 60  # cgroup v1 writes a number near 2^63 where there is no limit


def cgroup_available_bytes(root: Path = CGROUP_ROOT) -> int | None:
    """What the process's cgroup still allows (its memory limit less its usage, page cache included,
    so on the safe side), or None without a limit: cgroup v2's memory.max, else v1's
    memory.limit_in_bytes. A container's own cgroup is mounted at the root."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):  # fmt: skip
        try:
            limit = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= NO_LIMIT:
            return None
        return max(0, int(limit) - usage)
    return None


def host_available_bytes(root: Path = CGROUP_ROOT) -> int:
    """Host memory this process can still take: psutil's available memory, or the cgroup's room where
    that is less (a Kubernetes pod sees its node's memory in psutil, and is killed at its limit)."""
    import psutil

    available = psutil.virtual_memory().available
    room = cgroup_available_bytes(root)
    return available if room is None else min(available, room)


def read_device_memory(device: torch.device | str, cpu_cap_bytes: int = CPU_CACHE_CAP_BYTES) -> DeviceMemory:
    """The device's memory now: torch.cuda.mem_get_info on CUDA, psutil on CPU (the cache capped at
    `cpu_cap_bytes`)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return DeviceMemory("cuda", free_bytes=free, total_bytes=total)
    if device.type == "cpu":
        import psutil

        return cpu_memory(host_available_bytes(), psutil.virtual_memory().total, cap_bytes=cpu_cap_bytes)
    raise ValueError(f"cannot size a KV cache on device type {device.type!r} (expected 'cuda' or 'cpu')")


SAMPLER_FLOAT_COPIES = 6  # float32 [rows, vocab] copies a sampling step holds at once (logits, softmax,
# noise, masks, a sort's values and its int64 indices); the profile does not run the sampler


def profile_forward(model: torch.nn.Module, tokens: int, rows: int, max_context: int | None,
                    device: torch.device) -> Callable[[], None]:  # fmt: skip
    """The profiling forward: a step of `tokens` tokens, as the engine packs it, with `rows` rows of
    logits. Its positions restart at the model's position limit, as separate sequences' do: a model
    with learned positions (GPT-2's 1,024) never indexes past them."""
    limit = min(max_context or tokens, tokens)
    positions = (torch.arange(tokens, device=device) % limit)[None]
    keep = torch.arange(min(rows, tokens), device=device)

    def forward() -> None:
        with torch.inference_mode():
            model(input_ids=torch.zeros(1, tokens, dtype=torch.long, device=device), position_ids=positions,
                  use_cache=False, logits_to_keep=keep)  # fmt: skip

    return forward


def step_reserve_bytes(forward_peak: int, rows: int, vocab_size: int, graphs: bool) -> int:
    """What every later step needs beside the KV cache: the profiled forward's peak, the sampler's
    float32 working set over `rows` rows, and with CUDA graphs their private memory pool once more (a
    captured step keeps its own activations, at most a full step's)."""
    sampler = SAMPLER_FLOAT_COPIES * rows * vocab_size * 4
    return forward_peak * (2 if graphs else 1) + sampler


def profile_activation_peak(device: torch.device | str, run_forward: Callable[[], object]) -> int:
    """Bytes a forward at full step size needs above what is allocated before it (CUDA only).

    `run_forward` runs one forward at the step's token budget (no KV cache yet). On CPU this
    returns 0: the CPU cache is capped far below the machine's memory instead.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run_forward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return max(0, int(peak))


def plan_for_device(
    memory: DeviceMemory,
    max_memory_percent: float,
    bytes_per_block: int,
    block_size: int,
    activation_peak_bytes: int = 0,
    max_batch_tokens: int | None = None,
    max_requests: int | None = None,
    num_blocks: int | None = None,
    reserved_blocks: int = 0,
) -> CachePlan:
    """`plan_kv_cache` with a device's figures (the CPU cap applied)."""
    return plan_kv_cache(
        memory.free_bytes,
        max_memory_percent,
        bytes_per_block,
        block_size,
        activation_peak_bytes=activation_peak_bytes,
        max_batch_tokens=max_batch_tokens,
        max_requests=max_requests,
        num_blocks=num_blocks,
        device_type=memory.device_type,
        cap_bytes=memory.cap_bytes,
        reserved_blocks=reserved_blocks,
    )
