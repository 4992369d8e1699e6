"""The model pool: one handle per configured model, loading in the background, running in threads.

A model loads, runs one warm-up forward and (``compile: auto`` where a verdict
on disk says so) compiles before it reports ready (``LocalPool.readiness``), so
that its first call is served at the steady rate.

Every forward pass runs in a worker thread under ``torch.inference_mode`` so the
event loop never blocks; the lane's formation decides which rows share a pass
(``policy``), the handle pads them to the batch's longest row, survives
out-of-memory errors (split, retry, CPU fallback, lower budget) and counts
real against padded tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

import anyio
import torch

from multiplexer.core.batching import Formation
from multiplexer.core.errors import RpcError, upstream_unavailable

from .budget import BudgetControl
from .compiling import compiled_forward, compiler_available, timing_rows, warm_batches
from .daemon import run_daemon
from .devices import auto_concurrency, auto_threads, pick_device, pick_dtype, run_resilient
from .formation import PassThrough, TokenBudget, plan_chunks
from .handoff import ForwardThreads
from .loading import Loaded, load
from .memory import keep_freed_memory
from .onednn import faster, onednn_copy, time_ratio, usable, widest
from .sources import resolve_source
from .spec import ModelSpec
from .tasks.classify import classify
from .tasks.embed import EmbedConfig, embed, read_embed_config
from .tasks.generate import GenerateEngine, GenRequest
from .tasks.packed_bert import PackedEncoder, pack, packable
from .tensors import padded_cost
from .verdicts import MARGIN, read_verdict, verdict_file, verdict_key, write_ratio
from .word_ids import WordIds

log = logging.getLogger(__name__)
T = TypeVar("T")
DEFAULT_MAX_PADDING = 0.1  # where padding costs compute: the padded forward, the compiled packed one
DIRECT_TOKENIZE = 8  # calls with at most this many texts skip the batch tokenizer
CompilePlan = Literal["never", "at_load", "background"]
Readiness = tuple[Literal["up", "starting", "failing"], str | None]


@dataclass(slots=True)
class Stats:
    batches: int = 0
    rows: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    busy_s: float = 0.0  # summed forward-pass time (can exceed wall time with concurrency > 1)
    cpu_s: float = 0.0  # CPU time of the threads running the passes (all of it with one torch thread)

    @property
    def padding_waste(self) -> float:
        return 1 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0


class ModelHandle:
    def __init__(self, name: str, spec: ModelSpec, *, cache_dir: str | None,
                 on_event: Callable[[str, str], None], verdicts: Path | None = None) -> None:
        self.name = name
        self.spec = spec
        self.task = spec.task
        self.cache_dir = cache_dir
        self.on_event = on_event
        self.verdicts = verdicts or verdict_file()  # measured compile timings (verdicts.py)
        self.verdict_key: str | None = None  # this model's entry there, once loaded
        self.compiled_faster: bool | None = None  # what the entry said at load (None: never measured)
        # what readiness reports while the model is not ready; the dashboard shows it throughout:
        # loading, warming up, compiling (at load), then ready or failed as ``ready`` is set
        self.stage = "loading"
        self.ready = anyio.Event()
        self.warm = anyio.Event()  # the fastest forward is in place (compiled, or eager for good)
        self.compile_started = False
        self.started = False
        self.loaded: Loaded | None = None
        self.error: str | None = None
        self.limit: int | None = None
        self.embed_cfg = EmbedConfig()
        self.engine: GenerateEngine | None = None
        self.packed: PackedEncoder | None = None
        self.word_ids: WordIds | None = None  # BERT tokenizers: token ids from a table of words
        self.compiled_model: Callable[..., Any] | None = None  # the padded path's compiled model
        self.onnx_model: Callable[..., Any] | None = None  # backend: onnx
        self.onednn_model: torch.nn.Module | None = None  # the padded path's model on oneDNN linears
        self.linear = "torch"  # whose fp32 linear layers the forward runs: torch's BLAS or oneDNN
        self.concurrency = spec.concurrency or auto_concurrency(spec.device)
        self.fallback_device: torch.device | None = None
        self.budget = TokenBudget(
            spec.max_batch_size, spec.max_tokens, spec.max_wait_ms / 1000.0,
            self._padding(padding_free=False), spec.length_grouping, spec.aging_s, spec.padding_slack,
        )
        self.control = BudgetControl(spec.max_tokens, spec.max_tokens)
        self.stats = Stats()
        self._lock = threading.Lock()

    # -- loading (worker thread) ------------------------------------------------
    def load_sync(self) -> None:
        path = resolve_source(self.spec.source, cache_dir=self.cache_dir)
        device = pick_device(self.spec.device)
        dtype = pick_dtype(self.spec.dtype, device)
        limits = [self.spec.max_length]
        if self.task == "embed":
            self.embed_cfg = read_embed_config(path, pooling=self.spec.pooling, normalize=self.spec.normalize)
            limits.append(self.embed_cfg.max_length)
        loaded = load(path, self.task, device, dtype)
        if self.spec.backend == "onnx":
            from .onnx_backend import session_for

            on_cpu = loaded if device.type == "cpu" and dtype == torch.float32 else \
                load(path, self.task, torch.device("cpu"), torch.float32)
            lower = self.task == "embed" and self.embed_cfg.lowercase

            def tokenize(text: str) -> list[int]:  # as calls are, for int8's calibration
                return on_cpu.tokenizer(text.lower() if lower else text, truncation=True,
                                        max_length=on_cpu.max_positions())["input_ids"]

            self.onnx_model = session_for(on_cpu, on_cpu.model, quantize=self.spec.quantize,
                                          threads=torch.get_num_threads(), device=device, tokenize=tokenize)
        elif self.task == "embed" and self.spec.unpadded and packable(loaded.model):
            self.packed = PackedEncoder(loaded.model)
            self._set_padding(padding_free=self.packed.attends_by_row(device))
        if self.spec.backend == "torch" and self.task != "generate":
            self._choose_linear(loaded)
        limits.append(loaded.max_positions())
        if self.task != "generate":
            self.word_ids = WordIds.for_tokenizer(loaded.tokenizer)
        known = [n for n in limits if n]
        self.limit = min(known) if known else None
        self.fallback_device = torch.device("cpu") if device.type != "cpu" else None
        if self.task == "generate":
            self.engine = GenerateEngine(
                loaded.model, loaded.tokenizer, device, max_rows=self.spec.max_batch_size,
                max_tokens=self.spec.max_tokens, max_positions=loaded.max_positions(),
                on_event=lambda name, n: self.on_event(self.name, name),
            )
        if self.spec.compile is not False and self.task != "generate":
            form = "packed" if self.packed is not None else self.task
            self.verdict_key = verdict_key(device, dtype, self.spec.source, self.task, form)
            self.compiled_faster = read_verdict(self.verdicts, self.verdict_key)
        log.info("local model %s (%s) loaded from %s on %s as %s", self.name, self.task, path, device, dtype)
        self._warm_up(loaded)
        self.loaded = loaded

    def _warm_up(self, loaded: Loaded) -> None:
        """One forward on the chosen device and backend before the model reports ready: the first
        call does not pay for the first run's allocations and kernel choices."""
        self.stage = "warming up"
        ids = loaded.tokenizer(["warm up the forward"], verbose=False)["input_ids"]
        with torch.inference_mode():
            if self.task == "generate":
                loaded.model(input_ids=torch.tensor(ids, device=loaded.device))
            else:
                self._task(self._primary(loaded), self.packed, ids, loaded)

    def _choose_linear(self, loaded: Loaded) -> None:
        """oneDNN linear layers where they are faster here (``auto``) or asked for, on CPU fp32 only."""
        setting = self.spec.linear
        if setting == "torch" or self.spec.compile is True:  # inductor packs the weights its own way
            return
        if not usable(loaded.device, loaded.dtype):
            if setting == "onednn":
                log.warning("local model %s: linear: onednn needs fp32 on a CPU with oneDNN; torch's stays",
                            self.name)
            return
        target = self.packed.module if self.packed is not None else loaded.model
        if setting == "auto":
            layer = widest(target)
            if layer is None:
                return
            wins, ratio = faster(layer)
            log.info("local model %s: oneDNN linear takes %.2fx torch's time here: %s", self.name, ratio,
                     "using oneDNN" if wins else "keeping torch's")
            if not wins:
                return
        if self.packed is not None:
            self.packed.module.use_onednn()  # the packed forward's own layer table, not the model's
        else:
            self.onednn_model = onednn_copy(loaded.model)
        self.linear = "onednn"
        self.on_event(self.name, "linear_onednn")

    def _padding(self, *, padding_free: bool) -> float:
        """The padding share batches may carry: the spec's, else none limited where it costs nothing."""
        if self.spec.max_padding is not None:
            return self.spec.max_padding
        return 1.0 if padding_free else DEFAULT_MAX_PADDING

    def _set_padding(self, *, padding_free: bool) -> None:
        share = self._padding(padding_free=padding_free)
        with self._lock:
            self.budget = dataclasses.replace(self.budget, max_padding=share)

    # -- tokens ------------------------------------------------------------------
    def tokenize(self, texts: list[str], truncate: bool) -> tuple[list[list[int]], list[tuple[int, int]]]:
        """Token ids per text, and (index, length) of each text over the limit (kept when truncating)."""
        assert self.loaded is not None
        tok = self.loaded.tokenizer
        if self.embed_cfg.lowercase:
            texts = [t.lower() for t in texts]
        limit = self.limit
        if self.task == "generate":
            ids = tok(texts, verbose=False)["input_ids"]
            cap = None if limit is None else limit - 1  # room for one new token at least
            over = [(i, len(x)) for i, x in enumerate(ids) if cap is not None and len(x) > cap]
            if truncate and over:
                ids = [x[-cap:] if cap is not None else x for x in ids]
            return ids, over
        cut = limit if truncate else None
        # the word table pads nothing and cuts at ``cut``, as the wrapper's call below does,
        # whatever truncation or padding an earlier call left set on the backend
        words = self.word_ids
        found = [words.ids(t, cut) for t in texts] if words is not None else [None] * len(texts)
        rest = [t for t, x in zip(texts, found, strict=True) if x is None]
        if not rest:
            ids = cast(list[list[int]], found)  # every text was in the word table
        else:
            backend = getattr(tok, "backend_tokenizer", None)
            if cut is not None:
                more = tok(rest, truncation=True, max_length=cut, verbose=False)["input_ids"]
            elif (backend is not None and backend.truncation is None and backend.padding is None
                  and len(rest) <= DIRECT_TOKENIZE):
                # What ``tok(texts)`` returns, without its wrapper or a hop to the tokenizer's thread
                # pool. ``encode_batch_fast`` (tokenizers 0.21+) skips the character offsets nobody
                # here reads: about a fifth less CPU per text.
                fast = getattr(backend, "encode_batch_fast", None)
                more = [e.ids for e in fast(rest)] if fast is not None else \
                    [backend.encode(t).ids for t in rest]
            else:
                more = tok(rest, verbose=False)["input_ids"]
            tail = iter(more)
            ids = [x if x is not None else next(tail) for x in found]
        if cut is not None or limit is None:
            return ids, []
        return ids, [(i, len(x)) for i, x in enumerate(ids) if len(x) > limit]

    # -- forward passes (worker thread) -------------------------------------------
    def forward(self, rows: Sequence[Sequence[int]], on: str) -> list[torch.Tensor]:
        """One padded pass on the primary device or the CPU fallback; a vector per row."""
        assert self.loaded is not None
        loaded = self.loaded if on == "primary" else self._cpu()
        start, cpu = time.perf_counter(), time.thread_time()
        primary = on == "primary"
        model = self._primary(loaded) if primary else loaded.model
        out = self._task(model, self.packed if primary else None, rows, loaded)
        cost = padded_cost(rows)
        with self._lock:
            self.stats.batches += 1
            self.stats.rows += len(rows)
            self.stats.real_tokens += sum(len(r) for r in rows)
            self.stats.padded_tokens += cost
            self.stats.busy_s += time.perf_counter() - start
            self.stats.cpu_s += time.thread_time() - cpu
            raised = self.control.passed(cost) if primary else None
            if raised is not None:
                self.budget = dataclasses.replace(self.budget, max_tokens=raised)
        if raised is not None:
            log.info("local model %s: token budget raised to %d", self.name, raised)
            self.on_event(self.name, "budget_raised")
        return list(out)

    def _primary(self, loaded: Loaded) -> Any:
        """The fastest forward in place on the primary device."""
        return next((m for m in (self.onnx_model, self.compiled_model, self.onednn_model) if m is not None),
                    loaded.model)

    def _task(self, model: Any, packed: PackedEncoder | None, rows: Sequence[Sequence[int]],
              loaded: Loaded) -> torch.Tensor:
        tok = loaded.tokenizer
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        side = getattr(tok, "padding_side", "right") or "right"
        if self.task == "embed":
            return embed(model, rows, self.embed_cfg, pad_id=pad_id, side=side, device=loaded.device,
                         packed=packed)
        return classify(model, rows, pad_id=pad_id, side=side, device=loaded.device)

    def compile_sync(self) -> bool:
        """Compile and warm the primary forward, then swap it in (blocking; a worker thread).

        ``compile: auto`` swaps it in only where it beats the eager forward here
        (``verdicts.MARGIN``); False when the eager forward stays."""
        loaded = self.loaded
        assert loaded is not None
        batches = warm_batches(loaded.tokenizer)
        packed = self.packed
        rows = timing_rows(loaded.tokenizer)
        if packed is not None:
            def warm_packed(forward: Callable[..., Any]) -> None:
                for rows in batches:
                    forward(*pack(rows, loaded.device)[0])

            compiled = compiled_forward(loaded, "packed", packed.module, warm_packed)
            device = loaded.device  # each side packs its rows, as a call does
            if not self._compiled_wins(lambda: compiled(*pack(rows, device)[0]),
                                       lambda: packed(rows, device)):
                return False
            packed.forward = compiled
            self._set_padding(padding_free=packed.attends_by_row(device))  # compiled: the padded grid
        else:
            def warm_model(forward: Callable[..., Any]) -> None:
                for rows in batches:
                    self._task(forward, None, rows, loaded)

            compiled = compiled_forward(loaded, self.task, loaded.model, warm_model)
            eager = self.onednn_model or loaded.model
            if not self._compiled_wins(lambda: self._task(compiled, None, rows, loaded),
                                       lambda: self._task(eager, None, rows, loaded)):
                return False
            self.compiled_model = compiled
        log.info("local model %s: compiled forward in place", self.name)
        return True

    def _compiled_wins(self, compiled: Callable[[], Any], eager: Callable[[], Any]) -> bool:
        """Timed in interleaved pairs on a batch of mixed lengths, the verdict recorded on disk for
        ``auto`` to read at later loads; ``compile: true`` keeps the compiled forward either way,
        ``auto`` where it takes at most the margin's share of the eager one's time."""
        assert self.loaded is not None
        sync = torch.cuda.synchronize if self.loaded.device.type == "cuda" else (lambda: None)
        with torch.inference_mode():
            ratio = time_ratio(lambda: (compiled(), sync()), lambda: (eager(), sync()))
        if self.verdict_key is not None:
            write_ratio(self.verdicts, self.verdict_key, ratio)
        wins = self.spec.compile is True or ratio <= MARGIN
        log.info("local model %s: the compiled forward takes %.2fx the eager one's time here: %s",
                 self.name, ratio, "using it" if wins else "keeping the eager one")
        return wins

    def compile_plan(self) -> CompilePlan:
        """When this model compiles, once loaded. ``compile: true``: in the background while the
        eager forward serves (asked for, so its CPU is the config's to spend). ``auto``: at load,
        before the model reports ready, and only where a verdict on disk says the compiled forward
        was timed faster on this processor with this torch (``verdicts.py``), inductor finds a C++
        compiler and the eager forward kept torch's linear layers (where oneDNN's won, a compiled
        model served at 0.64x their speed over HTTP). Never otherwise: finding out means compiling,
        a minute or two of the cores that serve, on hosts where the eager forward then stayed."""
        if self.task == "generate" or self.onnx_model is not None or not self.spec.compile:
            return "never"
        if self.spec.compile is True:
            return "background"
        if self.compiled_faster and self.linear == "torch" and compiler_available():
            return "at_load"
        return "never"

    def _cpu(self) -> Loaded:
        assert self.loaded is not None
        return load(self.loaded.path, self.task, torch.device("cpu"), torch.float32)

    def run_sync(self, rows: Sequence[Sequence[int]], finish: Callable[[torch.Tensor], T]) -> T:
        assert self.loaded is not None
        budget = self.budget
        fallback = (lambda r: self.forward(r, "fallback")) if self.fallback_device is not None else None
        with torch.inference_mode():
            results: list[torch.Tensor | None] = [None] * len(rows)
            for chunk in plan_chunks([len(r) for r in rows], budget.max_rows, budget.max_tokens):
                part = run_resilient(
                    [rows[i] for i in chunk], lambda r: self.forward(r, "primary"), fallback,
                    cost=padded_cost, on_event=self._oom, device=self.loaded.device,
                )
                for i, vector in zip(chunk, part, strict=True):
                    results[i] = vector
            return finish(torch.stack(results))  # type: ignore[arg-type]

    def _oom(self, event: str, failed_cost: int) -> None:
        log.warning("local model %s: %s (a batch of %d padded tokens did not fit)",
                    self.name, event, failed_cost)
        self.on_event(self.name, event)
        with self._lock:
            lowered = self.control.failed(failed_cost)
            if lowered is not None:
                self.budget = dataclasses.replace(self.budget, max_tokens=lowered)
        if lowered is not None:
            log.warning("local model %s: token budget lowered to %d", self.name, lowered)
            self.on_event(self.name, "budget_lowered")


class LocalPool:
    """Owns the handles and a task group for background loads and generation loops."""

    def __init__(
        self, specs: dict[str, ModelSpec], *, on_event: Callable[[str, str], None] = lambda m, e: None,
        threads: int | None = None, preload: bool = True, cache_dir: str | Path | None = None,
        keep_freed_memory: bool = True, verdicts: Path | None = None,
    ) -> None:
        verdicts = verdicts or verdict_file()
        self.handles = {
            name: ModelHandle(name, spec, cache_dir=str(cache_dir) if cache_dir else None, on_event=on_event,
                              verdicts=verdicts)
            for name, spec in specs.items()
        }
        self.on_event = on_event
        self.threads = threads
        self.preload = preload
        self.keep_freed_memory = keep_freed_memory
        self._stack: AsyncExitStack | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._threads: ForwardThreads | None = None

    async def __aenter__(self) -> LocalPool:
        torch.set_num_threads(self.threads or auto_threads(h.concurrency for h in self.handles.values()))
        if self.keep_freed_memory:
            keep_freed_memory()
        stack = AsyncExitStack()
        self._threads = ForwardThreads(sum(h.concurrency for h in self.handles.values()))
        stack.callback(self._threads.close)
        self._tg = await stack.enter_async_context(anyio.create_task_group())
        self._stack = stack
        if self.preload:
            for handle in self.handles.values():
                self._start_load(handle)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._stack is None:
            return
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        stack, self._stack = self._stack, None
        await stack.aclose()

    def _start_load(self, handle: ModelHandle) -> None:
        if handle.started:
            return
        handle.started = True
        assert self._tg is not None
        self._tg.start_soon(self._load, handle)

    async def _load(self, handle: ModelHandle) -> None:
        plan: CompilePlan = "never"
        try:
            await run_daemon(handle.load_sync, f"load {handle.name}")
        except Exception as e:
            handle.error = f"{type(e).__name__}: {e}"
            handle.stage = "failed"
            log.error("local model %s failed to load: %s", handle.name, handle.error)
            self.on_event(handle.name, "load_failed")
        else:
            self.on_event(handle.name, "model_loaded")
            assert self._tg is not None and self._threads is not None
            if handle.engine is not None:
                self._tg.start_soon(handle.engine.run, self._threads)
            plan = handle.compile_plan()
            if plan == "at_load":  # before ready: no call is served while it compiles
                await self._compile(handle)
            elif plan == "background":
                self._tg.start_soon(self._compile, handle)
        finally:
            if handle.error is None:  # with ``ready`` and no await between: readiness says up
                handle.stage = "ready"
            handle.ready.set()
            if plan == "never":  # otherwise the compile sets it, however it ends
                handle.warm.set()

    async def _compile(self, handle: ModelHandle) -> None:
        handle.compile_started = True
        if not handle.ready.is_set():  # at load; a background compile serves meanwhile: ready
            handle.stage = "compiling"
        try:
            kept = await run_daemon(handle.compile_sync, f"compile {handle.name}")
        except Exception as e:
            level = logging.WARNING if handle.spec.compile is True else logging.INFO  # auto: quietly
            log.log(level, "local model %s: compile failed, the eager forward stays: %s: %s",
                    handle.name, type(e).__name__, e)
            self.on_event(handle.name, "compile_failed")
        else:
            self.on_event(handle.name, "compiled" if kept else "compile_slower")
        finally:
            handle.warm.set()

    async def ready(self, name: str) -> ModelHandle:
        handle = self.handles[name]
        self._start_load(handle)
        if not handle.ready.is_set():  # a set event's wait still yields: a batch would queue behind
            await handle.ready.wait()  # the replies its predecessor just released (handoff.py)
        if handle.error is not None:
            raise upstream_unavailable(f"local:{name}", handle.error)
        return handle

    async def warm(self, name: str) -> ModelHandle:
        """Ready, with its fastest forward in place: for ``compile: true``, once its background
        compile has ended (``auto`` compiles, if at all, before the model is ready)."""
        handle = await self.ready(name)
        await handle.warm.wait()
        return handle

    def readiness(self) -> Readiness:
        """``failing`` with each failed model's error; else ``starting`` while a model loads, warms
        up or compiles at load (``loading minilm``); else ``up``. A model not yet asked to load
        (``preload: false``) loads at its first call and does not hold readiness back."""
        failed = [f"{h.name}: {h.error}" for h in self.handles.values() if h.error is not None]
        if failed:
            return "failing", "; ".join(failed)
        busy = [f"{h.stage} {h.name}" for h in self.handles.values() if h.started and not h.ready.is_set()]
        return ("starting", ", ".join(busy)) if busy else ("up", None)

    def policy(self, group: Hashable) -> tuple[Formation, int | None]:
        """The formation and capacity for a lane group ``(model,)``; used by ``GatedFormation``."""
        name = group[0] if isinstance(group, tuple) and group else group
        handle = self.handles.get(name)  # type: ignore[arg-type]
        if handle is None or handle.task == "generate":
            return PassThrough(), None
        return handle.budget, handle.concurrency

    async def run_rows(
        self, name: str, rows: Sequence[Sequence[int]], finish: Callable[[torch.Tensor], T]
    ) -> T:
        handle = await self.ready(name)
        if handle.task == "generate":
            raise RpcError(-32603, "Internal error", {"detail": f"{name} is a generation model"})
        assert self._threads is not None, "the pool is not running"
        return await self._threads.run(handle.run_sync, rows, finish)

    async def generate(self, name: str, requests: list[GenRequest]) -> list[GenRequest]:
        handle = await self.ready(name)
        assert handle.engine is not None
        return await handle.engine.generate(requests)

    def stats(self, name: str) -> Stats:
        return self.handles[name].stats
