"""``kind: local``: models served in-process by ``local_models``, batched by the gateway's lane.

The lane forms batches with the pool's token-budget formation (similar lengths
together, padded tokens under a budget, priorities with aging, one batch per
model running at a time); generation items pass straight through to the
model's continuous-batching engine. torch and transformers are imported only
when the provider starts, so config parsing never needs them. Models load in the
background from then on; ``readiness`` says when every one is loaded and warm.

Each call may carry one input or a list; a list stays one item whose cost is
its padded size (rows x longest), and the pool splits it into several passes
when it alone exceeds the model's budget.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.from_thread
import anyio.lowlevel
from pydantic import BaseModel, ConfigDict, Field

from local_models.formation import GatedFormation
from local_models.prepared import KEY, Prepared, prepared_of
from local_models.spec import ModelSpec
from local_models.wire import chat_prompt, options_of, texts_of, too_long
from multiplexer.core.batching import Formation
from multiplexer.core.call import Item, Outcome
from multiplexer.core.errors import (
    RpcError,
    cancelled,
    internal_error,
    invalid_params,
    upstream_error,
    upstream_unavailable,
)
from multiplexer.core.paths import ConfigPath
from multiplexer.core.policy import RouteConfig
from multiplexer.core.provider import Provider, ProviderContext, ToolSpec
from multiplexer.core.sink import ChunkSink

if TYPE_CHECKING:
    from local_models.pool import LocalPool, Stats

log = logging.getLogger(__name__)
PREPARE_TOKENIZE_CHARS = 16_384  # bigger calls are tokenised in a worker thread


def _cpu_seconds(stats: Stats) -> Callable[[], float]:
    """A gauge's reading of one model's CPU seconds, taken at each scrape."""
    return lambda: stats.cpu_s


class LocalSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    models: dict[str, ModelSpec] = Field(min_length=1)
    threads: int | None = Field(
        default=None, ge=1,
        description="torch intra-op threads (process-wide); unset: the cores over the models' concurrency",
    )
    preload: bool = True
    keep_freed_memory: bool = Field(
        default=True,
        description="glibc: keep memory the forward passes free for the next batch instead of returning it"
                    " to the kernel (process-wide; the process holds its peak working set)",
    )
    cache_dir: ConfigPath | None = Field(
        default=None, description="Hugging Face cache to resolve ids from (relative: to the config's folder)")


class LocalRouteSettings(BaseModel):
    """A route's own keys for a ``local`` provider."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(
        default=None, description="which of the provider's models answers; unset: the call's `model`,"
                                  " or the provider's only model")


class LocalProvider(Provider):
    Settings = LocalSettings
    RouteSettings = LocalRouteSettings
    default_concurrency = 4096  # each generation holds a lane slot until it ends; the pool gates batches

    def __init__(self, ctx: ProviderContext) -> None:
        super().__init__(ctx)
        self.settings: LocalSettings = ctx.settings
        self.pool: LocalPool | None = None
        self._missing = "not started"
        self._loop_thread: int | None = None
        self._token: Any = None
        self._formation = GatedFormation(self._policy)

    async def start(self) -> None:
        self._loop_thread = threading.get_ident()
        self._token = anyio.lowlevel.current_token()
        try:
            from local_models.pool import LocalPool
        except ImportError as e:  # the gateway still serves everything else
            self._missing = f"the local extra is not installed ({e})"
            log.error("provider %s: %s", self.name, self._missing)
            return
        self.pool = LocalPool(
            self.settings.models, on_event=self._event, threads=self.settings.threads,
            preload=self.settings.preload, cache_dir=self.settings.cache_dir,
            keep_freed_memory=self.settings.keep_freed_memory,
        )
        await self.pool.__aenter__()
        for name, handle in self.pool.handles.items():
            self.ctx.metrics.compute_cpu.labels(self.name, name).set_function(_cpu_seconds(handle.stats))

    def readiness(self) -> tuple[Literal["up", "starting", "failing"], str | None]:
        """For ``/readyz``: ``starting`` until every model has loaded and run its warm-up forward
        (the detail says which: ``loading minilm``), ``failing`` with the error where a load failed
        or the local extra is missing, ``up`` after. The gateway serves ``/healthz`` meanwhile:
        loads run on their own threads."""
        if self.pool is None:
            return ("starting" if self._missing == "not started" else "failing"), self._missing
        return self.pool.readiness()

    async def aclose(self) -> None:
        pool, self.pool = self.pool, None
        if pool is not None:
            await pool.__aexit__(None, None, None)

    def describe(self) -> dict[str, Any]:
        """The ``Describes`` capability (the dashboard): each model's device, budget and counts
        (cumulative: a reader takes rates from two readings)."""
        if self.pool is None:
            return {"models": {}, "detail": self._missing}
        models: dict[str, Any] = {}
        for name, h in self.pool.handles.items():
            st, budget, loaded = h.stats, h.budget, h.loaded
            models[name] = {
                "task": h.task, "stage": h.stage, "error": h.error,
                "device": str(loaded.device) if loaded is not None else None,
                "dtype": str(loaded.dtype).removeprefix("torch.") if loaded is not None else None,
                "max_rows": budget.max_rows, "max_tokens": budget.max_tokens,
                "max_padding": budget.max_padding, "batches": st.batches, "rows": st.rows,
                "real_tokens": st.real_tokens, "padded_tokens": st.padded_tokens,
                "busy_s": round(st.busy_s, 6), "padding_share": round(st.padding_waste, 6),
            }
        return {"models": models}

    def _event(self, model: str, event: str) -> None:
        """Counted at once; listeners hear it on the event loop (OOM and budget events come from
        the forward pass's worker thread, and listeners set anyio events)."""
        self.ctx.metrics.events.labels("local", event).inc()
        data = {"provider": self.name, "model": model}
        if threading.get_ident() == self._loop_thread or self._token is None:
            self.ctx.notify(f"local.{event}", data)
            return
        with contextlib.suppress(RuntimeError):  # the loop is closing: nobody listens any more
            anyio.from_thread.run_sync(self.ctx.notify, f"local.{event}", data, token=self._token)

    def _policy(self, group: Any) -> tuple[Formation, int | None]:
        from local_models.formation import PassThrough

        if self.pool is None:
            return PassThrough(), 1
        return self.pool.policy(group)

    def formation(self, policy: Any) -> GatedFormation:
        return self._formation

    @classmethod
    def answers(cls, route: RouteConfig, settings: Any) -> str:
        """A ``call`` route answers its model's task (``embed``, ``classify``, ``generate``); one
        that names no model, the task its models share (``call`` when they differ)."""
        if route.operation != "call":
            return route.operation
        models: dict[str, ModelSpec] = settings.models
        name = route.extra.get("model")
        if isinstance(name, str) and name in models:
            return models[name].task
        tasks = {spec.task for spec in models.values()}
        return tasks.pop() if len(tasks) == 1 else route.operation

    # -- admission -------------------------------------------------------------
    def _model_for(self, item: Item) -> str:
        models = self.settings.models
        name = item.options.get("model")
        if name is None:
            asked = item.params.get("model") if isinstance(item.params, dict) else None
            if isinstance(asked, str) and asked in models:
                name = asked
            elif len(models) == 1:
                name = next(iter(models))
            else:
                raise invalid_params(
                    f"route {item.route} names no model: and the call none of {sorted(models)}"
                )
        if not isinstance(name, str) or name not in models:
            raise invalid_params(f"unknown local model {name!r} (known: {', '.join(sorted(models))})")
        return name

    def prepare(self, route: RouteConfig, item: Item) -> None:
        name = self._model_for(item)
        spec = self.settings.models[name]
        params = item.params if isinstance(item.params, dict) else None
        if params is None:
            raise invalid_params("params must be an object with an input")
        texts = texts_of(params, spec.task)
        truncate = params.get("truncate", spec.truncate)
        if not isinstance(truncate, bool):
            raise invalid_params("truncate must be a boolean")
        extra = options_of(params, spec.task, max_new_tokens=spec.max_new_tokens,
                           limit=spec.max_new_tokens_limit)
        extra["priority"] = item.priority
        prepared = Prepared(name, texts, truncate, extra=extra,
                            estimate=max(len(t) for t in texts) // 4 + 2)
        handle = self.pool.handles[name] if self.pool is not None else None
        small = sum(map(len, texts)) <= PREPARE_TOKENIZE_CHARS
        if handle is not None and handle.loaded is not None and small:
            error = self._tokenize(handle, prepared)
            if error is not None:
                raise error
        item.group = (name,)
        item.tokens = prepared.real + extra.get("max_new_tokens", 0)
        item.options[KEY] = prepared

    @staticmethod
    def _tokenize(handle: Any, p: Prepared) -> RpcError | None:
        messages = p.extra.get("messages")
        if messages and handle.task == "generate" and handle.loaded is not None:
            try:
                p.texts = [chat_prompt(handle.loaded.tokenizer, messages)]
            except Exception as e:  # a template may refuse a conversation (roles out of order)
                return invalid_params(f"the model's chat template refused the messages ({e})",
                                      param="messages")
        ids, over = handle.tokenize(p.texts, p.truncate)
        if over and not p.truncate:
            index, tokens = over[0]
            limit = handle.limit - 1 if handle.task == "generate" else handle.limit
            return too_long(p.model, index, tokens, limit)
        if handle.task == "generate" and any(not x for x in ids):
            return invalid_params("prompt is empty after tokenisation")
        p.tokenized(ids)
        return None

    def dedup_safe(self, item: Item) -> bool:
        p = prepared_of(item)
        if p is None:
            return False
        return p.extra.get("temperature", 0.0) == 0.0 or p.extra.get("seed") is not None

    async def list_tools(self) -> list[ToolSpec]:
        return [
            ToolSpec(name, f"{spec.task} with local model {name}",
                     {"type": "object", "properties": {"input": {}}, "required": ["input"]})
            for name, spec in self.settings.models.items()
        ]

    # -- execution ---------------------------------------------------------------
    async def execute(self, operation: str, items: Sequence[Item]) -> list[Outcome]:
        outcomes: list[Outcome | None] = [None] * len(items)
        by_model: dict[str, list[int]] = {}
        for i, item in enumerate(items):
            p = prepared_of(item)
            if p is None:
                outcomes[i] = Outcome.fail(internal_error("item was not prepared by the local provider"))
            else:
                by_model.setdefault(p.model, []).append(i)
        for name, idxs in by_model.items():
            results = await self._execute_model(name, [prepared_of(items[i]) for i in idxs])  # type: ignore[misc]
            for i, o in zip(idxs, results, strict=True):
                outcomes[i] = o
        return outcomes  # type: ignore[return-value]

    async def _execute_model(self, name: str, preps: list[Prepared]) -> list[Outcome]:
        if self.pool is None:
            return [Outcome.fail(upstream_unavailable(f"{self.name}:{name}", self._missing))] * len(preps)
        try:
            handle = await self.pool.ready(name)
        except RpcError as e:
            return [Outcome.fail(e)] * len(preps)
        errors: dict[int, RpcError] = {}
        if any(p.ids is None for p in preps):
            def tokenize_rest() -> None:
                for i, p in enumerate(preps):
                    if p.ids is None:
                        error = self._tokenize(handle, p)
                        if error is not None:
                            errors[i] = error
            await anyio.to_thread.run_sync(tokenize_rest)
        ok = [i for i in range(len(preps)) if i not in errors]
        try:
            if handle.task == "generate":
                results = await self._generate(name, [preps[i] for i in ok])
            else:
                results = await self._forward(handle, name, [preps[i] for i in ok])
        except RpcError as e:
            results = [Outcome.fail(e)] * len(ok)
        except Exception as e:
            log.exception("local model %s failed a batch", name)
            # the exception's text may hold paths or tensor shapes: the log has it, callers get the kind
            error = upstream_error(f"{self.name}:{name}",
                                   f"{type(e).__name__} in the model's batch (details in the gateway log)")
            results = [Outcome.fail(error)] * len(ok)
        outcomes = [Outcome.fail(errors[i]) if i in errors else None for i in range(len(preps))]
        for i, o in zip(ok, results, strict=True):
            outcomes[i] = o
        return outcomes  # type: ignore[return-value]

    async def _forward(self, handle: Any, name: str, preps: list[Prepared]) -> list[Outcome]:
        from local_models.tasks.classify import labelled
        from local_models.wire import classification_response, embeddings_outcome

        assert self.pool is not None
        rows = [ids for p in preps for ids in (p.ids or [])]
        if not rows:
            return []
        id2label = getattr(handle.loaded.model.config, "id2label", None) or {}

        def finish(out: Any) -> list[Outcome]:
            results, start = [], 0
            for p in preps:
                part = out[start:start + p.rows]
                start += p.rows
                if handle.task == "embed":
                    results.append(embeddings_outcome(p, part))
                else:
                    rows = labelled(part, id2label, p.extra.get("top_k"))
                    results.append(Outcome(result=classification_response(p, rows)))
            return results

        self.ctx.metrics.upstream_requests.labels(self.name).inc()
        return await self.pool.run_rows(name, rows, finish)

    # -- streaming (generate models: token by token from the continuous batcher) -------------
    async def stream(self, item: Item, sink: ChunkSink) -> Outcome:
        """One prompt, its text sent as ``text_completion`` chunks while the engine decodes it,
        then a usage chunk. Cancelling the call takes the request out of the batch."""
        from local_models.tasks.generate import GenRequest
        from local_models.tasks.text_stream import TextStream
        from local_models.wire import usage

        p = prepared_of(item)
        if p is None or p.rows != 1:
            return Outcome.fail(invalid_params("a streamed call takes exactly one prompt"))
        if self.pool is None:
            return Outcome.fail(upstream_unavailable(f"{self.name}:{p.model}", self._missing))
        try:
            handle = await self.pool.ready(p.model)
        except RpcError as e:
            return Outcome.fail(e)
        if handle.task != "generate" or handle.engine is None:
            return Outcome.fail(invalid_params(f"model {p.model} ({handle.task}) does not stream"))
        if p.ids is None and (error := await anyio.to_thread.run_sync(self._tokenize, handle, p)):
            return Outcome.fail(error)
        assert p.ids is not None
        text = TextStream(handle.engine.tokenizer, p.extra["stop"])

        def chunk(delta: str, finish: str | None = None) -> dict[str, Any]:
            return {"object": "text_completion", "model": p.model,
                    "choices": [{"index": 0, "text": delta, "finish_reason": finish}]}

        def on_step(r: GenRequest) -> None:
            if delta := text.step(r.tokens):
                sink.send_nowait(chunk(delta))  # unbounded: the face drains it

        x = p.extra
        request = GenRequest(p.ids[0], x["max_new_tokens"], x["temperature"], x["top_p"], x["seed"],
                             x["stop"], x["priority"], on_step=on_step)
        self.ctx.metrics.upstream_requests.labels(self.name).inc()
        await self.pool.generate(p.model, [request])
        if request.finish_reason in ("error", "cancelled"):
            detail = request.error or "the generation was cancelled"
            return Outcome.fail(upstream_error(f"{self.name}:{p.model}", detail))
        spent = usage(p, len(request.tokens))
        try:
            sink.send_nowait(chunk(text.finish(request.text), request.finish_reason))
            sink.send_nowait({"object": "text_completion", "model": p.model, "choices": [],
                              "usage": spent})
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return Outcome.fail(cancelled("the client stopped reading the stream"))
        return Outcome(result={"usage": spent})

    async def _generate(self, name: str, preps: list[Prepared]) -> list[Outcome]:
        from local_models.tasks.generate import GenRequest
        from local_models.wire import completion_response

        assert self.pool is not None
        per_call = [
            [GenRequest(ids, p.extra["max_new_tokens"], p.extra["temperature"], p.extra["top_p"],
                        p.extra["seed"], p.extra["stop"], p.extra["priority"]) for ids in (p.ids or [])]
            for p in preps
        ]
        self.ctx.metrics.upstream_requests.labels(self.name).inc()
        await self.pool.generate(name, [r for rs in per_call for r in rs])
        outcomes = []
        for p, rs in zip(preps, per_call, strict=True):
            failed = next((r for r in rs if r.finish_reason == "error"), None)
            if failed is not None:
                outcomes.append(Outcome.fail(upstream_error(f"{self.name}:{name}", failed.error or "failed")))
            else:
                outcomes.append(Outcome(result=completion_response(p, rs)))
        return outcomes
