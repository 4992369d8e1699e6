"""What a local-model bench ran on: CPU model, the instruction sets that decide which kernels
run, and how fast one core multiplies fp32 matrices. Hosts with the same name and flags can
differ by 2.5x on the last, so a table's figures are read against it."""

from __future__ import annotations

import platform
import time
from typing import Any

FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")


def cpu_info() -> dict[str, Any]:
    """The CPU's model name and which of ``FLAGS`` it has (Linux: /proc/cpuinfo)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return {"cpu": name, "flags": [f for f in FLAGS if f in flags]}


def fp32_gflops(rows: int = 2048, bursts: int = 8, seconds: float = 0.1) -> dict[str, float]:
    """One thread: GFLOPS of a MiniLM-sized fp32 product (``rows`` x 384 by 384 x 1536) through
    torch's ``Linear`` and, where this torch has it, oneDNN with the weight packed once.

    Each kind's best of ``bursts`` short bursts, the kinds taking turns: one 0.5 s run per
    kind read torch's BLAS at 48 GFLOPS on a host where it runs at 79-85, a first use or a
    passing load landing on one side only."""
    import torch

    from local_models.onednn import OneDnnLinear, usable

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        layer = torch.nn.Linear(384, 1536)
        x = torch.randn(rows, 384)
        kinds: dict[str, Any] = {"torch": layer}
        if usable(torch.device("cpu"), torch.float32):
            kinds["onednn"] = OneDnnLinear(layer)
        best = dict.fromkeys(kinds, 0.0)
        with torch.inference_mode():
            for turn in range(bursts + 1):  # turn 0 warms up (caches, clocks) and is not counted
                for name, f in kinds.items():
                    n, start = 0, time.perf_counter()
                    while (elapsed := time.perf_counter() - start) < seconds:
                        f(x)
                        n += 1
                    if turn:
                        best[name] = max(best[name], 2 * rows * 384 * 1536 * n / elapsed / 1e9)
        return {name: round(rate, 1) for name, rate in best.items()}
    finally:
        torch.set_num_threads(threads)


def describe(host: dict[str, Any]) -> str:
    """One line for ``cpu_info()`` with ``fp32_gflops()`` under ``"gflops"``."""
    rates = ", ".join(f"{k} {v:.0f}" for k, v in host["gflops"].items())
    return f"host: {host['cpu']} [{' '.join(host['flags']) or 'no AVX2'}]; one core, fp32 GFLOPS: {rates}"
