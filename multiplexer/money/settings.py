"""The money keys of the config: ``spend:`` (pricing and the spend store) and ``budgets:``."""

from __future__ import annotations

from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import Field, field_validator

from multiplexer.core.policy import Strict


class SpendConfig(Strict):
    enabled: bool = Field(
        default=True, description="price every call (x-multiplexer-cost-usd, /metrics, the spend store "
        "and budgets); false: none of it")
    flush_interval_s: float = Field(
        default=2.0, gt=0, description="spend is written to the job store's database this often, in "
        "one batch (never by the call that spent it)")
    retention_days: int | None = Field(
        default=400, ge=1, description="days of spend kept in the store; null: kept forever")


class BudgetsConfig(Strict):
    timezone: str = Field(default="UTC", description="where a daily budget's midnight and a monthly "
                          "one's 1st are (an IANA name: Europe/Paris)")
    default_max_output_tokens: int = Field(
        default=4096, ge=1, description="a call's most output tokens when neither it nor its route's "
        "params name max_tokens: what its budget reservation counts")

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, name: str) -> str:
        try:
            ZoneInfo(name)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {name!r} (an IANA name such as UTC or Europe/Paris)") \
                from None
        return name
