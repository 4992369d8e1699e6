"""Whether a compiled forward was measured faster, kept on disk per device, torch version and model.

Compiling MiniLM takes one to two minutes of CPU on two cores. A gateway that
compiled after its first call (``compile: auto`` before this file) served at
0.19-0.28x offline ``encode`` until the compile ended, against 1.2-2.7x after,
and on that host then kept the eager forward anyway (the compiled one took
1.10x and 1.27x its time). So the pool never spends serving cores to find out:
``compile: auto`` compiles only where a verdict here says the compiled forward
was timed faster on the same device, with the same torch, for the same model,
and then at load, before the model reports ready. Verdicts are written by every
timed compile (``compile: true`` times it too, and keeps it either way).

The file is JSON, one entry per key, in ``$MULTIPLEXER_CACHE_DIR`` (else
``$XDG_CACHE_HOME/multiplexer``, else ``~/.cache/multiplexer``); deleting it
forgets every verdict; an entry's ``faster`` decides (its ``ratio`` says why), so a user
may set it by hand.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from multiplexer.core.paths import verdict_file as verdict_file  # where the file lives

log = logging.getLogger(__name__)
# A compiled forward counts as faster where it takes at most this share of the eager one's time,
# a clear edge for the compile's cost (an AVX2 EPYC: 0.85-0.94, median 0.88, ten timings).
MARGIN = 0.95


def device_name(device: torch.device) -> str:
    """The processor a forward runs on: the CPU's model name, or the GPU's."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or device.type


def verdict_key(device: torch.device, dtype: torch.dtype, source: str, task: str, form: str) -> str:
    """One entry per processor, torch version and model: ``form`` is the forward compiled
    (``packed`` for unpadded BERT, else the task's padded one)."""
    return " | ".join((device_name(device), f"torch {torch.__version__}", source, task, str(dtype), form))


def read_verdict(path: Path, key: str) -> bool | None:
    """Whether the compiled forward was measured faster; None where never measured (or the
    file is unreadable: then nothing compiles, as with no file)."""
    entry = _read(path).get(key)
    faster = entry.get("faster") if isinstance(entry, dict) else None
    return faster if isinstance(faster, bool) else None


def write_ratio(path: Path, key: str, ratio: float) -> None:
    """Record a timing (replacing the file whole, so a reader never sees half of it); a failure
    to write is logged, never raised: the verdict is an optimisation."""
    entries = _read(path)
    entries[key] = {"ratio": round(ratio, 4), "faster": ratio <= MARGIN,
                    "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
        os.replace(partial, path)
    except OSError as e:
        log.warning("could not record the compile timing in %s: %s", path, e)


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("ignoring the compile verdicts in %s: %s", path, e)
        return {}
    return data if isinstance(data, dict) else {}
