"""The JSON of every proxied call: orjson where it gives what the stdlib gives, the stdlib where not.

A chat call parses and writes JSON four times (the caller's body, the upstream's request, its
reply, the answer): 14 us with the stdlib for a small one, 6 us here. orjson's edges differ
from the stdlib's, and each difference either makes orjson raise, which hands the whole job to
the stdlib, or is checked for here, so what is accepted, the values and the errors (messages
included) stay the stdlib's:

- reading, orjson refuses NaN, Infinity, a lone-surrogate escape, a UTF-8 BOM and UTF-16/32
  (raises); reads an int past 64 bits as a float (a run of 19 digits is left to the stdlib); and
  reads 1024 levels where the stdlib reads 1000 less the caller's stack (a body that may be that
  deep is read wrapped in enough brackets that orjson refuses what the stdlib might);
- writing, orjson refuses an int past 64 bits, a non-str key, a lone surrogate, 254 levels and,
  told to, subclasses, dataclasses and datetimes (raises); and writes NaN and Infinity as
  ``null`` (an output with a ``null`` has its floats checked). It writes a float in its own
  shortest spelling (``0.00001`` where the stdlib writes ``1e-05``: the same number), and an
  ``Enum`` member or a ``UUID``, which the stdlib refuses, as its value.
"""

from __future__ import annotations

import json
import math
from typing import Any

import orjson

__all__ = ["dumps", "loads", "loads_lenient"]


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError("number out of range")
    return value


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


# Made once: ``json.loads``/``json.dumps`` build a new decoder or encoder per call when given
# options, which cost as much as decoding or encoding a small call itself.
_DECODER = json.JSONDecoder(parse_float=_finite_float, parse_constant=_reject_constant)
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
_ENCODER_ASCII = json.JSONEncoder(separators=(",", ":"), allow_nan=False)

_MISS = object()
_DIGITS = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))  # each digit a 0, the rest blank
_LONG_INT = b"0" * 19  # the fewest digits of an int orjson reads as a float (-9223372036854775809)
# The stdlib reads 1000 levels less the caller's stack (RecursionError past it); orjson 1024.
# A body that may nest deeper than _SURE_DEPTH (which leaves the caller 200 frames) is read
# inside _WRAP more brackets, so orjson refuses any deeper and the stdlib decides. Counting its
# brackets tells (~0.5 ns a byte); past _COUNT_BYTES wrapping costs less (~10 us, a copy).
_SURE_DEPTH = 800
_WRAP = 1024 - _SURE_DEPTH
_COUNT_BYTES = 16384
_WRAP_OPEN, _WRAP_CLOSE = b"[" * _WRAP, b"]" * _WRAP
# Subclasses (whose ``items`` or ``__repr__`` the stdlib calls), dataclasses and datetimes (which
# the stdlib refuses) make orjson raise instead of writing them its own way.
_PASSTHROUGH = (orjson.OPT_PASSTHROUGH_SUBCLASS | orjson.OPT_PASSTHROUGH_DATACLASS
                | orjson.OPT_PASSTHROUGH_DATETIME)


def _stdlib_loads(body: bytes | str) -> Any:
    """``json.loads`` with NaN, Infinity and out-of-range numbers refused (the same steps)."""
    if isinstance(body, str):
        if body.startswith("\ufeff"):
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", body, 0)
    else:
        body = body.decode(json.detect_encoding(body), "surrogatepass")
    return _DECODER.decode(body)


def _unwrapped(value: Any) -> Any:
    for _ in range(_WRAP):
        if len(value) != 1:  # '1],[2' wrapped is valid JSON, but not one value in each bracket
            return _MISS
        value = value[0]
    return value


def _fast_loads(body: bytes | str) -> Any:
    """What orjson reads where the stdlib would read the same, else ``_MISS``."""
    if isinstance(body, str):
        try:
            data: bytes | bytearray = body.encode()
        except UnicodeEncodeError:  # a lone surrogate
            return _MISS
    elif isinstance(body, bytes | bytearray):
        data = body
    else:
        return _MISS
    size = len(data)
    deep = size > 2 * _SURE_DEPTH and (  # each level takes two bytes
        size > _COUNT_BYTES or data.count(b"[") + data.count(b"{") > _SURE_DEPTH)
    try:
        value = orjson.loads(_WRAP_OPEN + data + _WRAP_CLOSE if deep else data)
    except orjson.JSONDecodeError:
        return _MISS
    if _LONG_INT in data.translate(_DIGITS):  # an int past 64 bits: orjson made it a float
        return _MISS
    return _unwrapped(value) if deep else value


def loads(body: bytes | str) -> Any:
    """``json.loads`` with NaN, Infinity and out-of-range numbers refused: a caller's body."""
    value = _fast_loads(body)
    return _stdlib_loads(body) if value is _MISS else value


def loads_lenient(body: bytes | str) -> Any:
    """``json.loads`` itself (NaN and Infinity read): an upstream's reply, taken as it comes."""
    value = _fast_loads(body)
    return json.loads(body) if value is _MISS else value


def _finite(obj: Any) -> bool:
    """Whether no float in ``obj`` is NaN or infinite (those orjson writes as ``null``)."""
    stack = [obj]
    while stack:
        node = stack.pop()
        kind = type(node)
        if kind is dict:
            stack.extend(node.values())
        elif kind is list or kind is tuple:
            stack.extend(node)
        elif kind is float and node - node != 0.0:  # inf - inf and nan - nan are nan
            return False
    return True


def _stdlib_dumps(obj: Any) -> bytes:
    text = _ENCODER.encode(obj)
    try:
        return text.encode()
    except UnicodeEncodeError:  # a lone surrogate (valid JSON as a \ud800 escape): keep it escaped
        return _ENCODER_ASCII.encode(obj).encode()


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON; NaN and Infinity refused (``ValueError``), as the stdlib's encoder."""
    try:
        out = orjson.dumps(obj, option=_PASSTHROUGH)
    except TypeError:  # orjson.JSONEncodeError: something it leaves to the stdlib
        return _stdlib_dumps(obj)
    if b"null" in out and not _finite(obj):
        return _stdlib_dumps(obj)  # raises the stdlib's ValueError
    return out
