"""Causal generation with continuous batching: requests join and leave between decoding steps.

One loop per model runs step after step in a worker thread. Before each step,
waiting requests are admitted under the row cap and a token budget; a step
decodes one token for every running row (one forward with the KV cache) and
prefills the newcomers (left padded, positions from the attention mask), then
drops the rows that finished. A short request therefore leaves as soon as it
is done, whatever else is running.
"""

from __future__ import annotations

import inspect
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from ..devices import free_memory, is_oom
from ..handoff import ForwardThreads
from ..kv import Batch, cache_kwarg, from_output, merge, select, to_cache
from ..tensors import pad
from .sampling import next_tokens

log = logging.getLogger(__name__)
_seq = itertools.count()


@dataclass(eq=False)
class GenRequest:
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    priority: int = 0
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # stop | length | error | cancelled
    error: str | None = None
    cancelled: bool = False
    generator: torch.Generator | None = None
    done: anyio.Event | None = None
    on_step: Callable[[GenRequest], None] | None = None  # called on the loop after each step it ran
    seq: int = field(default_factory=lambda: next(_seq))


class GenerateEngine:
    def __init__(
        self, model: torch.nn.Module, tokenizer: Any, device: torch.device, *,
        max_rows: int, max_tokens: int, max_positions: int | None,
        on_event: Callable[[str, int], None] = lambda name, n: None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.max_rows = max_rows
        self.max_tokens = max_tokens
        self.max_positions = max_positions
        self.on_event = on_event
        self._cache_kw = cache_kwarg(model)
        self._keep_kw = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.pad_id = _pad_id(tokenizer, model)
        self.eos = _eos_ids(tokenizer, model)
        self.waiting: list[GenRequest] = []
        self.running: list[GenRequest] = []
        self.batch: Batch | None = None
        self._rejected: list[GenRequest] = []
        self.steps = 0
        self.listeners: list[Callable[[GenerateEngine], None]] = []
        self._wake = anyio.Event()

    # -- the async side ------------------------------------------------------
    async def generate(self, requests: list[GenRequest]) -> list[GenRequest]:
        for r in requests:
            r.done = anyio.Event()
            if r.temperature > 0:
                r.generator = torch.Generator(device=self.device)
                if r.seed is None:
                    r.generator.seed()
                else:
                    r.generator.manual_seed(r.seed)
            self.waiting.append(r)
        self._wake.set()
        try:
            for r in requests:
                assert r.done is not None
                await r.done.wait()
        except BaseException:
            for r in requests:
                r.cancelled = True
            raise
        return requests

    async def run(self, threads: ForwardThreads) -> None:
        """The step loop; owned by the pool's task group, it ends when that group is cancelled.

        Each step goes to its thread before the loop yields, so the chunks the step before
        sent to streams are written while the next step runs, not before it starts.
        """
        while True:
            if not self.running and not self.waiting:
                self._wake = anyio.Event()
                await self._wake.wait()
                continue
            joiners, dropped = self._admit()
            try:
                finished = await threads.run(self._step, joiners)
            except Exception as e:
                log.exception("generation step failed")
                finished = self._fail_all(joiners, f"{type(e).__name__}: {e}")
            for r in dropped + finished:
                assert r.done is not None
                r.done.set()
            for r in self.running:
                if r.on_step is not None:
                    try:
                        r.on_step(r)
                    except Exception:
                        log.exception("a generation's step listener failed")
                        r.cancelled = True
            self.steps += 1
            for listener in list(self.listeners):
                listener(self)

    def _admit(self) -> tuple[list[GenRequest], list[GenRequest]]:
        dropped = [r for r in self.waiting if r.cancelled]
        for r in dropped:
            r.finish_reason = "cancelled"
        waiting = sorted((r for r in self.waiting if not r.cancelled), key=lambda r: (-r.priority, r.seq))
        rows = len(self.running)
        longest = max((_need(r) for r in self.running), default=0)
        joiners: list[GenRequest] = []
        for r in waiting:
            n_rows, n_long = rows + len(joiners) + 1, max(longest, _need(r))
            if rows + len(joiners) and (n_rows > self.max_rows or n_rows * n_long > self.max_tokens):
                break
            joiners.append(r)
            longest = n_long
        taken = {id(r) for r in joiners}
        self.waiting = [r for r in waiting if id(r) not in taken]
        return joiners, dropped

    def _fail_all(self, joiners: list[GenRequest], detail: str) -> list[GenRequest]:
        failed = self.running + joiners
        for r in failed:
            r.finish_reason, r.error = "error", detail
        self.running, self.batch = [], None
        return failed

    # -- the worker-thread side ------------------------------------------------
    def _step(self, joiners: list[GenRequest]) -> list[GenRequest]:
        with torch.inference_mode():
            if self.batch is not None:
                self._decode_running()
            if joiners:
                self._prefill_join(joiners)
            keep = [i for i, r in enumerate(self.running) if r.finish_reason is None and not r.cancelled]
            finished = [r for r in self.running if r.finish_reason is not None or r.cancelled]
            finished += self._rejected
            self._rejected = []
            for r in finished:
                r.finish_reason = r.finish_reason or "cancelled"
            if self.batch is not None:
                self.batch = select(self.batch, keep)
            self.running = [self.running[i] for i in keep]
        return finished

    def _decode_running(self) -> None:
        b = self.batch
        assert b is not None
        mask = torch.cat([b.mask, b.mask.new_ones((b.rows, 1))], dim=1)
        try:
            out = self.model(
                input_ids=b.next_ids[:, None], attention_mask=mask,
                position_ids=b.mask.sum(dim=1, keepdim=True), use_cache=True,
                **{self._cache_kw: to_cache(b.pairs)},
            )
        except Exception as e:
            if not is_oom(e):
                raise
            self._preempt()
            return
        b.pairs, b.mask = from_output(out), mask
        tokens = next_tokens(out.logits[:, -1, :], self.running)
        b.next_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        for r, t in zip(self.running, tokens, strict=True):
            self._accept(r, t)

    def _preempt(self) -> None:
        """Out of memory while decoding: the newest half goes back to waiting, to be recomputed."""
        free_memory(self.device)
        assert self.batch is not None
        n = len(self.running)
        self.on_event("oom_preempt", n)
        if n == 1:
            self.running[0].finish_reason, self.running[0].error = "error", "out of memory"
            return
        keep = n - n // 2
        self.max_rows = max(1, min(self.max_rows, keep))
        self.on_event("budget_lowered", self.max_rows)
        moved = self.running[keep:]
        self.batch = select(self.batch, list(range(keep)))
        self.running = self.running[:keep]
        self.waiting[:0] = moved

    def _prefill_join(self, joiners: list[GenRequest]) -> None:
        try:
            part, logits = self._prefill(joiners)
        except Exception as e:
            if not is_oom(e):
                raise
            free_memory(self.device)
            self.on_event("oom_split", len(joiners))
            if len(joiners) == 1:
                joiners[0].finish_reason, joiners[0].error = "error", "out of memory"
                self._rejected.append(joiners[0])
                return
            mid = len(joiners) // 2
            self.max_rows = max(1, min(self.max_rows, len(self.running) + mid))
            self._prefill_join(joiners[:mid])
            self._prefill_join(joiners[mid:])
            return
        tokens = next_tokens(logits, joiners)
        part.next_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        self.batch = merge(self.batch, part)
        self.running.extend(joiners)
        for r, t in zip(joiners, tokens, strict=True):
            self._accept(r, t)

    def _prefill(self, joiners: list[GenRequest]) -> tuple[Batch, torch.Tensor]:
        ids, mask = pad([r.prompt + r.tokens for r in joiners], self.pad_id, side="left", device=self.device)
        extra = {"logits_to_keep": 1} if self._keep_kw else {}
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(dim=1) - 1).clamp(min=0),
            use_cache=True, **extra,
        )
        placeholder = torch.zeros(len(joiners), dtype=torch.long, device=self.device)
        return Batch(from_output(out), mask, placeholder), out.logits[:, -1, :]

    def _accept(self, r: GenRequest, token: int) -> None:
        if r.cancelled:
            return
        if token in self.eos:
            self._finish(r, "stop")
            return
        r.tokens.append(token)
        if r.stop:
            tail = self.tokenizer.decode(r.tokens[-(max(map(len, r.stop)) + 16):], skip_special_tokens=True)
            if any(s in tail for s in r.stop):
                text = self.tokenizer.decode(r.tokens, skip_special_tokens=True)
                cut = min(i for i in (text.find(s) for s in r.stop) if i >= 0)
                r.text, r.finish_reason = text[:cut], "stop"
                return
        if len(r.tokens) >= r.max_new_tokens or (
            self.max_positions is not None and len(r.prompt) + len(r.tokens) >= self.max_positions
        ):
            self._finish(r, "length")

    def _finish(self, r: GenRequest, reason: str) -> None:
        r.text = self.tokenizer.decode(r.tokens, skip_special_tokens=True)
        r.finish_reason = reason


def _need(r: GenRequest) -> int:
    return len(r.prompt) + r.max_new_tokens


def _pad_id(tokenizer: Any, model: torch.nn.Module) -> int:
    for value in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None),
                  getattr(model.config, "pad_token_id", None)):
        if isinstance(value, int) and value >= 0:
            return value
    return 0


def _eos_ids(tokenizer: Any, model: torch.nn.Module) -> set[int]:
    ids: set[int] = set()
    sources = [getattr(getattr(model, "generation_config", None), "eos_token_id", None),
               getattr(model.config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)]
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))
    vocab = getattr(model.config, "vocab_size", None)
    return {i for i in ids if vocab is None or 0 <= i < vocab}
