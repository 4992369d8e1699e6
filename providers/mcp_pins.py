"""Tool pinning (``pin: true``): an upstream that changes a tool after it was trusted is held back.

Each tool's definition (name, description, input and output schemas, annotations) is hashed as
canonical JSON (sorted keys, no spaces, sha256) the first time the gateway sees it, and the hash
is kept in the job store's database (``jobs/tool_tables``). Every listing of the upstream (at
connect, on its ``list_changed``, when its ``ttlMs`` runs out) is checked at once, in the same step
that installs it: a tool whose hash differs from the approved one is quarantined (hidden from
``tools/list``, its calls refused with -32010 naming what changed) until an admin approves the new
definition; a tool that changes back is served again. Every change is a row in
``mcp_tool_changes``, a count in ``multiplexer_mcp_tool_changes_total`` and a gateway event.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

import anyio
import mcp_types as types
from prometheus_client import CollectorRegistry, Counter

from multiplexer.core.errors import Code, RpcError
from multiplexer.jobs.tool_tables import FIELDS, Pin, ToolTables, changed_fields

log = logging.getLogger(__name__)

RELOAD_S = 5.0  # while a tool is quarantined: how often approvals made by other replicas are read
OnChange = Callable[[str, str, Pin], None]  # (action, tool, its pin)


_COUNTERS: weakref.WeakKeyDictionary[CollectorRegistry, Counter] = weakref.WeakKeyDictionary()


def changes_counter(registry: CollectorRegistry) -> Counter:
    """``multiplexer_mcp_tool_changes_total{provider, action}``, one per registry (every MCP
    provider of a gateway counts in it)."""
    found = _COUNTERS.get(registry)
    if found is None:
        found = _COUNTERS[registry] = Counter(
            "multiplexer_mcp_tool_changes", "MCP tools pinned, changed (quarantined), approved or "
            "restored, by provider and action", ["provider", "action"], registry=registry)
    return found


def definition(tool: types.Tool) -> dict[str, Any]:
    """The parts of a tool a model reads or a client relies on, as the upstream sent them."""
    wire = tool.model_dump(by_alias=True, mode="json", exclude_none=True)
    return {k: wire[k] for k in FIELDS if k in wire}


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class ToolPins:
    """One provider's pins: in memory for the hot path (a set lookup per call), written behind."""

    def __init__(self, provider: str, tables: Callable[[], ToolTables], on_change: OnChange,
                 wall: Callable[[], float] = time.time) -> None:
        self.provider = provider
        self._open = tables
        self._tables: ToolTables | None = None
        self.on_change = on_change
        self.wall = wall
        self.pins: dict[str, Pin] = {}
        self.held: set[str] = set()  # quarantined tools' names
        self._pending: dict[str, tuple[Pin, bool]] = {}  # tool -> (its pin, approved here)
        self._changes: list[tuple[float, str, str, str, str, str]] = []
        self._wake = anyio.Event()
        self.loaded = False

    @property
    def tables(self) -> ToolTables:
        if self._tables is None:
            self._tables = self._open()
        return self._tables

    async def load(self) -> None:
        """The stored pins of this provider, before its first listing is checked."""
        stored = await anyio.to_thread.run_sync(self.tables.pins, self.provider)
        self.pins = {p.tool: p for p in stored}
        self.held = {p.tool for p in stored if p.quarantined}
        self.loaded = True

    def close(self) -> None:
        tables, self._tables = self._tables, None
        if tables is not None:
            tables.close()

    # -- the check, in the step that installs a listing ------------------------------
    def check(self, tools: dict[str, types.Tool]) -> None:
        now = self.wall()
        for name, tool in tools.items():
            text = canonical(definition(tool))
            h = digest(text)
            pin = self.pins.get(name)
            if pin is None:
                self._record("pinned", Pin(self.provider, name, h, text, h, text, now), "")
            elif h == pin.seen_hash:
                continue
            elif h == pin.approved_hash:
                old = pin.seen_hash
                pin.seen_hash, pin.seen_def, pin.updated_at = h, text, now
                self._record("restored", pin, old)
            else:
                old = pin.seen_hash
                pin.seen_hash, pin.seen_def, pin.updated_at = h, text, now
                self._record("changed", pin, old)

    def approve(self, tool: str) -> Pin | None:
        """The definition served now becomes the approved one (None: no such tool pinned)."""
        pin = self.pins.get(tool)
        if pin is None:
            return None
        if pin.quarantined:
            old = pin.approved_hash
            pin.approved_hash, pin.approved_def, pin.updated_at = pin.seen_hash, pin.seen_def, self.wall()
            self._record("approved", pin, old)
        return pin

    def _record(self, action: str, pin: Pin, old: str) -> None:
        self.pins[pin.tool] = pin
        if pin.quarantined:
            self.held.add(pin.tool)
        else:
            self.held.discard(pin.tool)
        approved = action == "approved" or (pin.tool in self._pending and self._pending[pin.tool][1])
        self._pending[pin.tool] = (pin, approved)
        new = pin.approved_hash if action == "approved" else pin.seen_hash
        self._changes.append((pin.updated_at, self.provider, pin.tool, action, old, new))
        if action == "changed":
            log.warning("mcp upstream %s: tool %r changed (%s); quarantined until an admin approves "
                        "it", self.provider, pin.tool, ", ".join(changed_fields(pin.approved_def,
                                                                                  pin.seen_def)))
        self.on_change(action, pin.tool, pin)
        self._wake.set()

    # -- the hot path --------------------------------------------------------------------
    def refusal(self, tool: str) -> RpcError | None:
        if tool not in self.held:
            return None
        pin = self.pins[tool]
        fields = changed_fields(pin.approved_def, pin.seen_def)
        return RpcError(Code.TOOL_QUARANTINED,
                        f"Tool {tool!r} of MCP upstream {self.provider!r} is quarantined: its "
                        f"{', '.join(fields)} changed since it was approved; an admin approves the "
                        f"new definition with POST /admin/mcp/tools/{self.provider}:{tool}/approve",
                        {"provider": self.provider, "tool": tool, "changed": fields,
                         "approved_hash": pin.approved_hash, "hash": pin.seen_hash})

    def describe(self) -> list[dict[str, Any]]:
        """The held tools for the dashboard: each one's id and what changed (approved, now)."""
        return [{"id": f"{self.provider}:{tool}", "tool": tool, "diff": self.pins[tool].diff()}
                for tool in sorted(self.held)]

    # -- written behind --------------------------------------------------------------------
    async def flush(self) -> None:
        if not self._pending and not self._changes:
            return
        pins, self._pending = list(self._pending.values()), {}
        changes, self._changes = self._changes, []
        try:
            await anyio.to_thread.run_sync(self.tables.save, pins, changes)
        except Exception:
            log.exception("mcp upstream %s: tool pins not saved; retrying", self.provider)
            for pin, approved in pins:
                self._pending.setdefault(pin.tool, (pin, approved))
            self._changes[:0] = changes

    async def reload(self) -> None:
        """Approvals made elsewhere (another replica's admin API) for the tools held here."""
        stored = await anyio.to_thread.run_sync(self.tables.pins, self.provider)
        for other in stored:
            mine = self.pins.get(other.tool)
            if mine is not None and mine.quarantined and other.approved_hash == mine.seen_hash:
                mine.approved_hash, mine.approved_def = other.approved_hash, other.approved_def
                self.held.discard(mine.tool)
                self.on_change("approved", mine.tool, mine)

    async def run(self) -> None:
        """Write changes as they come; while any tool is held, read approvals every few seconds."""
        while True:
            with anyio.move_on_after(RELOAD_S):
                await self._wake.wait()
            self._wake = anyio.Event()
            await self.flush()
            if self.held:
                try:
                    await self.reload()
                except Exception:
                    log.exception("mcp upstream %s: stored tool approvals not read", self.provider)
