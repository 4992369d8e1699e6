"""The request log's keys of the config: ``log:``."""

from __future__ import annotations

from pydantic import Field

from multiplexer.core.policy import Strict


class RequestLogConfig(Strict):
    enabled: bool = Field(
        default=True, description="record every call in the request log (the job store's database: "
        "GET /admin/requests); written off the call path, in batches")
    bodies: bool = Field(
        default=False, description="also keep each call's request and response bodies, redacted "
        "(secrets' values masked) and cut to max_body_bytes")
    max_body_bytes: int = Field(default=16_384, ge=64, description="the most bytes of a body kept")
    retention_days: float | None = Field(
        default=30, gt=0, description="days a call's record is kept; null: no age limit")
    max_rows: int | None = Field(
        default=10_000_000, ge=1, description="the most records kept (the oldest go first); "
        "null: no row limit")
    queue: int = Field(
        default=100_000, ge=1, description="records waiting for the writer; beyond this a record is "
        "dropped and counted (multiplexer_records_dropped{sink=\"requests\"}), never waited for")
    batch: int = Field(default=2000, ge=1, description="the most records written in one insert")
    flush_interval_s: float = Field(
        default=1.0, gt=0, description="records are written at least this often (sooner when a "
        "batch is full)")
    prune_interval_s: float = Field(
        default=60.0, gt=0, description="how often old records are deleted (in steps of 5,000 rows)")
