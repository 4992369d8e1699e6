"""``torch.compile`` of a model's forward, built and warmed off the serving path.

Inductor fuses the work between matrix products (bias with GELU, residual with
layer norm, the packing gathers). Whether that pays depends on the CPU: MiniLM's
packed forward took 0.88x the eager one's time compiled on an AVX2 EPYC, while
on an AVX-512 EPYC, where oneDNN's packed linear layers win, a compiled model
served at 0.64x their speed over HTTP. So ``compile: auto`` compiles only where
the eager forward kept torch's layers, then times the compiled forward against
the eager one on a batch of mixed lengths and keeps it only where it is
clearly faster (``time_ratio``). Compiling takes tens of seconds, so the pool
keeps serving the eager forward while a worker thread compiles and warms this
one with a few batch shapes (one row is its own specialisation), then swaps it
in. Compiled forwards are kept per
loaded model for the process, like the weights, so a restart of the gateway in
the same process does not compile again.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

_compiled: dict[tuple[int, str], tuple[object, Callable[..., Any]]] = {}  # the owner pins its id
_lock = threading.Lock()


@functools.cache
def compiler_available() -> bool:
    """Whether inductor finds a C++ compiler (``compile: auto`` compiles only then)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return bool(get_cpp_compiler())
    except Exception:
        return False


def warm_batches(tokenizer: Any) -> list[list[list[int]]]:
    """Batches of real token ids covering one row, several rows and mixed lengths."""
    texts = ["warm", "compile the forward once", "a longer sentence, so that the rows differ in length."]
    ids = tokenizer(texts, verbose=False)["input_ids"]
    return [[ids[0]], [ids[1], ids[2]], [ids[2], ids[0], ids[1]], [ids[1], ids[1]]]


def timing_rows(tokenizer: Any) -> list[list[int]]:
    """A batch as calls form it: eight rows of 4 to 90 words (the bench's texts run 3 to 120)."""
    sentence = "the gateway groups many small calls into a few batches under each provider's limits"
    words = sentence.split(" ")
    texts = [" ".join(words[i % len(words)] for i in range(n)) for n in (4, 8, 12, 20, 30, 45, 60, 90)]
    return tokenizer(texts, truncation=True, max_length=256, verbose=False)["input_ids"]


def compiled_forward(
    owner: object, kind: str, module: torch.nn.Module, warm: Callable[[Callable[..., Any]], None]
) -> Callable[..., Any]:
    """``module`` compiled with dynamic shapes and warmed by ``warm(forward)``; blocking, once per owner.

    Raises what the compiler raises (no C++ compiler, an unsupported op); the
    caller keeps the eager forward then.
    """
    key = (id(owner), kind)
    with _lock:
        hit = _compiled.get(key)
        if hit is not None:
            return hit[1]
        forward = torch.compile(module, dynamic=True, options={"freezing": True})
        with torch.inference_mode():
            warm(forward)
        _compiled[key] = (owner, forward)
        return forward

