"""When two identical chat calls may share one upstream execution without the route saying so."""

from __future__ import annotations

from typing import Any


def deterministic_chat(params: Any) -> bool:
    """Temperature exactly 0 and a single choice: the same request should give the same answer.

    Sampling settings left at their defaults (temperature 1) are not deterministic,
    so a call that does not say ``temperature: 0`` is never shared.
    """
    if not isinstance(params, dict):
        return False
    temperature = params.get("temperature")
    if isinstance(temperature, bool) or temperature != 0:
        return False
    return params.get("n", 1) == 1 and not params.get("stream")
