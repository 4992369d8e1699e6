"""Loading a tokenizer and model from a resolved directory, once per process.

Loaded weights are shared by every pool in the process (keyed by directory,
task, device and dtype), so tests and gateway restarts pay for a load once.
Loading always passes ``local_files_only=True``: nothing is ever fetched.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_MODEL_CLASSES = {
    "embed": "AutoModel",
    "classify": "AutoModelForSequenceClassification",
    "generate": "AutoModelForCausalLM",
}
_loaded: dict[tuple[str, str, str, str], Loaded] = {}
_locks: dict[tuple[str, str, str, str], threading.Lock] = {}
_guard = threading.Lock()


@dataclass(eq=False, slots=True)
class Loaded:
    path: Path
    task: str
    tokenizer: Any
    model: torch.nn.Module
    device: torch.device
    dtype: torch.dtype

    def max_positions(self) -> int | None:
        """The longest input the model itself takes (tokenizer limit, position table)."""
        limits = []
        tok_max = getattr(self.tokenizer, "model_max_length", None)
        if isinstance(tok_max, int) and 0 < tok_max < 1_000_000:
            limits.append(tok_max)
        cfg = self.model.config
        for key in ("max_position_embeddings", "n_positions"):
            value = getattr(cfg, key, None)
            if isinstance(value, int) and value > 0:
                limits.append(value)
                break
        return min(limits) if limits else None


def load(path: Path, task: str, device: torch.device, dtype: torch.dtype) -> Loaded:
    """Blocking; call from a worker thread."""
    key = (str(path), task, str(device), str(dtype))
    with _guard:
        lock = _locks.setdefault(key, threading.Lock())
    with lock:
        hit = _loaded.get(key)
        if hit is not None:
            return hit
        import transformers

        transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bars in server logs
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        cls = getattr(transformers, _MODEL_CLASSES[task])
        model = cls.from_pretrained(str(path), dtype=dtype, local_files_only=True)
        model = model.to(device).eval()
        loaded = Loaded(path, task, tokenizer, model, device, dtype)
        _loaded[key] = loaded
        return loaded
