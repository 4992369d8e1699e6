"""Amounts as text: the answer headers, ``_meta.cost_usd``, ``GET /admin/spend``'s sums and
``multiplexer spend``'s table."""

from __future__ import annotations

from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from multiplexer.money.spend_store import SUMS


def pico_text(pico: int) -> bytes:
    """An amount in integer pico-dollars as US dollars: ``0.000125``, a plain decimal string (no
    exponent) to the nano-dollar (finer than any provider bills), rounded half to even. Integer
    arithmetic: every priced answer's header is made with it, no ``Decimal`` on the call path."""
    nanos, rest = divmod(pico, 1000)
    if rest > 500 or (rest == 500 and nanos & 1):
        nanos += 1
    whole, part = divmod(nanos, 1_000_000_000)
    if not part:
        return b"%d" % whole
    return (b"%d.%09d" % (whole, part)).rstrip(b"0")


def cost_meta(outcome: Any) -> dict[str, str | None]:
    """``{"cost_usd": "0.0000021", "saved_usd": ...}`` for a result's ``_meta`` (null: unknown)."""
    cost, saved = outcome.cost_pico, outcome.saved_pico
    meta: dict[str, str | None] = {"cost_usd": None if cost is None else pico_text(cost).decode()}
    if saved:
        meta["saved_usd"] = pico_text(saved).decode()
    return meta


def _cell(row: dict[str, Any], group: str) -> str:
    """A group's value; a key as ``name (id)`` where its name says more than its id."""
    value = row.get(group)
    if value is None:
        return "-"
    name = row.get("key_name") if group == "key" else None
    return f"{name} ({value})" if name and name != value else str(value)


def table(body: dict[str, Any], groups: Sequence[str], cache: bool = False) -> str:
    """``GET /admin/spend``'s body as an aligned text table with a total line; ``cache``: also
    what prompt-cache writes cost beyond plain input, the cache moves and what they cost."""
    head = [*groups, "calls", "cost_usd", "saved_usd", "unknown_cost_calls", "cache_read_share"]
    if cache:
        head += ["cache_writes_usd", "cache_moves", "cache_moves_usd"]

    def sums(r: dict[str, Any]) -> list[str]:
        share = r.get("cache_read_share")
        out = [str(r.get("calls", 0)), f"{r.get('cost_usd', 0):.6f}", f"{r.get('saved_usd', 0):.6f}",
               str(r.get("unknown_cost_calls", 0)), "-" if share is None else f"{share:.4f}"]
        if cache:
            out += [f"{r.get('cache_writes_usd', 0):.6f}", str(r.get("cache_moves", 0)),
                    f"{r.get('cache_moves_usd', 0):.6f}"]
        return out

    lines = [[_cell(r, g) for g in groups] + sums(r) for r in body.get("rows", [])]
    lines.append((["total", *[""] * (len(groups) - 1)] if groups else []) + sums(body.get("total", {})))
    widths = [max(len(x) for x in col) for col in zip(head, *lines, strict=True)]
    numeric = len(groups)

    def fmt(row: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i >= numeric else c.ljust(w)
                         for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip()

    return "\n".join([fmt(head), *(fmt(r) for r in lines)])


def dollars(nanos: Any) -> float:
    """Integer nano-dollars (a stored sum, None for none) as dollars."""
    return float(Decimal(int(nanos or 0)) / Decimal(1_000_000_000))


def share(part: int, whole: int) -> float | None:
    """``part`` of ``whole`` to four places; None when there is no whole (no input tokens known)."""
    return round(part / whole, 4) if whole > 0 else None


def sums_json(values: Sequence[Any]) -> dict[str, Any]:
    """A row's SUMS as `GET /admin/spend` writes them: dollars, calls, savings by what saved them,
    input tokens and the share of them read from a provider's prompt cache."""
    v = dict(zip(SUMS, values, strict=True))
    sent, read = int(v["input_tokens"] or 0), int(v["cache_read_tokens"] or 0)
    return {"input_tokens": sent, "cache_read_tokens": read, "cache_read_share": share(read, sent),
            "cache_writes_usd": dollars(v["cache_writes"]), "cache_moves": int(v["cache_moves"] or 0),
            "cache_moves_usd": dollars(v["cache_move_cost"]),
            "calls": int(v["calls"] or 0), "cost_usd": dollars(v["cost"]), "saved_usd": dollars(v["saved"]),
            "unknown_cost_calls": int(v["unknown_calls"] or 0),
            "upstream_requests_saved": round(int(v["requests_saved"] or 0) / 1000, 3),
            "saved_by": {"batch": dollars(v["saved_batch"]), "dedup": dollars(v["saved_dedup"]),
                         "cache": dollars(v["saved_cache"]),
                         "semantic_cache": dollars(v["saved_semantic_cache"]),
                         "prompt_cache": dollars(v["saved_prompt_cache"])}}
