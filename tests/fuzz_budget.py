"""How many cases a fuzzer or race test tries: its own count times ``MUX_FUZZ_SCALE``.

The README's run takes half of each (0.5: the suite stays within its minutes on two cores); CI
runs these files again at 2, four times as many cases (``.ci/run``), and a developer chasing a
bug may ask for more."""

from __future__ import annotations

import os

SCALE = float(os.environ.get("MUX_FUZZ_SCALE") or 0.5)


def examples(n: int) -> int:
    """``n`` scaled, never fewer than 10 (a count that still reaches every class of input)."""
    return max(10, round(n * SCALE))
