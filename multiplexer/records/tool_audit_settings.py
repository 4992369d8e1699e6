"""The MCP tool-call audit's keys of the config: ``audit:``."""

from __future__ import annotations

from pydantic import Field

from multiplexer.core.policy import Strict


class AuditConfig(Strict):
    tools: bool = Field(
        default=True, description="one record per MCP tools/call (time, key or OAuth subject, virtual "
        "server, tool, status, duration, a sha256 of the arguments), written off the call path and "
        "read at GET /admin/audit/tools")
    arguments: bool = Field(
        default=False, description="also keep each call's arguments, through the redaction hook "
        "(records/redact.py: secrets' values masked) and cut to max_argument_bytes")
    max_argument_bytes: int = Field(default=16_384, ge=64, description="the most bytes of arguments kept")
    retention_days: float = Field(
        default=90, gt=0, description="days a tool call's record is kept (older ones are deleted "
        "about hourly)")
    queue: int = Field(
        default=100_000, ge=1, description="records waiting for the writer; beyond this a record is "
        "dropped and counted (multiplexer_records_dropped{sink=\"tool_audit\"}), never waited for")
    flush_interval_s: float = Field(default=1.0, gt=0, description="records are written at least "
                                                                   "this often")
