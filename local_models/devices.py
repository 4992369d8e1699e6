"""Device and dtype choice, and surviving out-of-memory errors without failing callers.

On OOM a batch is split in halves and retried; a single row that still does
not fit runs on the CPU fallback. The caller (the pool) lowers its budget so
the next batches are formed smaller; every step is reported through ``on_event``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import torch

log = logging.getLogger(__name__)

R = TypeVar("R")
T = TypeVar("T")

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float64": torch.float64,
}


def pick_device(spec: str = "auto") -> torch.device:
    """``auto`` prefers CUDA, then Apple MPS, then the CPU; an explicit device must exist."""
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {spec!r} requested but CUDA is not available")
    mps = getattr(torch.backends, "mps", None)
    if device.type == "mps" and not (mps is not None and mps.is_available()):
        raise ValueError(f"device {spec!r} requested but MPS is not available")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {spec!r} does not exist ({torch.cuda.device_count()} CUDA devices)")
    return device


def pick_dtype(spec: str, device: torch.device) -> torch.dtype:
    """``auto``: fp16 on CUDA and MPS, fp32 on CPU; half precision asked for on CPU stays fp32."""
    if spec == "auto":
        return torch.float16 if device.type in ("cuda", "mps") else torch.float32
    dtype = _DTYPES[spec]
    if device.type == "cpu" and dtype == torch.float16:
        log.warning("float16 is slow and lossy on CPU; using float32")
        return torch.float32
    if device.type == "mps" and dtype in (torch.bfloat16, torch.float64):
        raise ValueError(f"dtype {spec} is not supported on MPS")
    if device.type == "cpu" and dtype == torch.bfloat16 and not native_bf16():
        log.warning("bfloat16 on this CPU runs without bf16 instructions (AVX-512 BF16 or AMX): in "
                    "bench_local it served at a fifth of float32's speed on such a host")
    return dtype


def native_bf16() -> bool:
    """Whether the CPU multiplies bf16 in hardware (AVX-512 BF16 or AMX); True when torch cannot tell."""
    cpu = getattr(torch, "cpu", None)
    checks = [getattr(cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if any(check is None for check in checks):
        return True
    return any(check() for check in checks)  # type: ignore[misc]


MAX_AUTO_CONCURRENCY = 4


def cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def auto_concurrency(device: str) -> int:
    """Batches at once on a model: one per core on CPU (each on its own thread; a small batch
    does not keep two threads busy), up to 4; 1 on a GPU, whose kernels queue anyway."""
    try:
        on_cpu = pick_device(device).type == "cpu"
    except ValueError:
        on_cpu = True  # the load reports the bad device
    return max(1, min(cores(), MAX_AUTO_CONCURRENCY)) if on_cpu else 1


def auto_threads(concurrencies: Iterable[int]) -> int:
    """torch intra-op threads so that the concurrent batches together fill the cores."""
    return max(1, cores() // max(concurrencies, default=1))


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def free_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "mps":
        torch.mps.empty_cache()


def run_resilient(
    rows: Sequence[R],
    primary: Callable[[Sequence[R]], list[T]],
    fallback: Callable[[Sequence[R]], list[T]] | None,
    *,
    cost: Callable[[Sequence[R]], int],
    on_event: Callable[[str, int], None],
    device: torch.device | None = None,
) -> list[T]:
    """``primary(rows)``; on OOM split and retry each half, then ``fallback`` for a row that still fails.

    ``on_event(name, padded_cost)`` hears ``oom_split`` and ``oom_cpu_fallback``
    with the padded cost of the batch that did not fit.
    """
    try:
        return primary(rows)
    except Exception as e:
        if not is_oom(e):
            raise
        if device is not None:
            free_memory(device)
        failed = cost(rows)
        if len(rows) > 1:
            on_event("oom_split", failed)
            mid = len(rows) // 2
            return (
                run_resilient(rows[:mid], primary, fallback, cost=cost, on_event=on_event, device=device)
                + run_resilient(rows[mid:], primary, fallback, cost=cost, on_event=on_event, device=device)
            )
        if fallback is None:
            raise
        on_event("oom_cpu_fallback", failed)
        return fallback(rows)
