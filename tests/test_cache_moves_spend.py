"""The spend record of a call carries what its prompt-cache writes cost beyond plain input and,
for a call affinity sent away from its pick, the move and what it cost at most; the ledger sums
them per key and route and ``/admin/spend``'s body shows them."""

from __future__ import annotations

from datetime import UTC
from decimal import Decimal
from types import SimpleNamespace

from multiplexer.core.cache_affinity import CACHE_MOVED
from multiplexer.core.call import Outcome
from multiplexer.core.clock import ManualClock
from multiplexer.core.metrics import Metrics
from multiplexer.core.policy import ProviderConfig
from multiplexer.money.meter import Meter, MoneyMetrics
from multiplexer.money.prices import Prices
from multiplexer.money.report import sums_json
from tests.test_prompt_cache_spend import CLAUDE_USAGE, plan

PICO = Decimal(10) ** 12
M = Decimal(1_000_000)


def test_writes_and_a_moves_cost_are_booked_with_the_call() -> None:
    prices = Prices({"claude": ProviderConfig(kind="anthropic")}, {})
    meter = Meter(prices, ManualClock(), MoneyMetrics(Metrics()))
    body = Outcome({"usage": CLAUDE_USAGE})
    meter.bill(plan("r", "claude", "claude-sonnet-4-5"), body, body, None)
    moved = plan("r", "claude", "claude-sonnet-4-5")
    moved.item.options[CACHE_MOVED] = True
    meter.bill(moved, body, body, None)
    meter.bill(moved, body, body, "dedup")  # a shared answer moved nothing and wrote nothing
    home, away, shared = meter.take()
    # writes beyond plain input ($3): 100 x $0.75 (five minutes) + 200 x $3 (an hour)
    writes = (100 * Decimal("0.75") + 200 * 3) / M
    assert Decimal(home[10]) / PICO == writes and home[11:13] == (0, 0)
    # the move: 100 plain at $3 - $0.3, 100 written at $3.75 - $0.3, 200 at $6 - $0.3
    unread = (100 * Decimal("2.7") + 100 * Decimal("3.45") + 200 * Decimal("5.7")) / M
    assert away[11] == 1 and Decimal(away[12]) / PICO == unread
    assert shared[10:13] == (0, 0, 0)


def test_the_ledger_sums_them_and_the_report_shows_them() -> None:
    from multiplexer.money.ledger import Money

    prices = Prices({"claude": ProviderConfig(kind="anthropic")}, {})
    meter = Meter(prices, ManualClock(), MoneyMetrics(Metrics()))
    body = Outcome({"usage": CLAUDE_USAGE})
    moved = plan("r", "claude", "claude-sonnet-4-5")
    moved.item.options[CACHE_MOVED] = True
    meter.bill(plan("r", "claude", "claude-sonnet-4-5"), body, body, None)
    meter.bill(moved, body, body, None)
    ledger = SimpleNamespace(zone=UTC, team_of=lambda key: None)
    [row] = Money.rows(ledger, meter.take())  # type: ignore[arg-type]
    shown = sums_json(row[5:])
    assert shown["calls"] == 2 and shown["cache_moves"] == 1
    assert shown["cache_writes_usd"] == float(2 * (100 * Decimal("0.75") + 200 * 3) / M)
    assert shown["cache_moves_usd"] == float((100 * Decimal("2.7") + 100 * Decimal("3.45")
                                              + 200 * Decimal("5.7")) / M)


def test_the_spend_table_shows_the_cache_columns_when_asked() -> None:
    from multiplexer.money.report import table

    row = {"route": "chat", "calls": 2, "cost_usd": 0.003, "saved_usd": 0.001, "unknown_cost_calls": 0,
           "cache_read_share": 0.5, "cache_writes_usd": 0.00135, "cache_moves": 1, "cache_moves_usd": 0.0017}
    body = {"rows": [row], "total": row}
    plain = table(body, ["route"]).splitlines()
    assert plain[0].split()[-1] == "cache_read_share"  # the default table as it was
    wide = table(body, ["route"], cache=True).splitlines()
    assert wide[0].split()[-3:] == ["cache_writes_usd", "cache_moves", "cache_moves_usd"]
    assert wide[1].split()[-3:] == ["0.001350", "1", "0.001700"]
