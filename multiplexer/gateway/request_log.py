"""Composing the request log (``log:``) into a gateway; with ``log.enabled: false`` none of it
runs and the call's path does not look at it."""

from __future__ import annotations

from typing import Any

from multiplexer.core.clock import Clock
from multiplexer.core.metrics import Metrics
from multiplexer.gateway.config import Config
from multiplexer.money.budgets import team_of_config
from multiplexer.records.requests import RequestLog


class _Lookup:
    def __init__(self, find: Any) -> None:
        self.get = find


def request_log_for(config: Config, clock: Clock, metrics: Metrics,
                    directory: Any = None) -> RequestLog | None:
    """``directory``: the keys (YAML and stored), for each record's team."""
    if not config.log.enabled:
        return None
    keys: Any = config.server.api_keys if directory is None else _Lookup(directory.entry)

    def team_of(identity: str | None) -> str | None:
        return team_of_config(identity, keys)

    return RequestLog(config.log, store_path=config.store.path, store_url=config.store.url,
                      store_schema=config.store.schema_, registry=metrics.registry, wall=clock.wall,
                      team_of=team_of)
