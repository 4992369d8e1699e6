"""Validation errors as one line per problem, each naming its key path, near misses named.

A typo is the usual mistake, and pydantic alone reports it twice and unhelpfully: the
misspelt key as "Extra inputs are not permitted" (or not at all, where a model lets extra
keys through) and the key it meant as "Field required". Here both become one line, naming
the typo and what it resembles: ``routes.x.provder: unknown key (did you mean 'provider'?)``.
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Iterable, Sequence
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError


def keys_of(model: type[BaseModel]) -> set[str]:
    """The keys a model takes: its field names and their aliases."""
    out = set(model.model_fields)
    out.update(f.alias for f in model.model_fields.values() if f.alias)
    return out


def hint(word: str, known: Iterable[str]) -> str:
    """``did you mean 'x'?`` for the closest of ``known``, when one is close; else all of them."""
    near = difflib.get_close_matches(word, sorted(known), n=1)
    return f"did you mean {near[0]!r}?" if near else "known: " + (", ".join(sorted(known)) or "none")


def unknown_key(where: str, key: object, known: Iterable[str] | None) -> str:
    """One line for a key nothing takes (``known`` None: the keys that would fit are not known)."""
    line = f"{_join(where, key)}: unknown key"
    return line if known is None else f"{line} ({hint(str(key), known)})"


def problems(err: ValidationError, model: type[BaseModel], data: Any, where: str = "",
             also_known: Iterable[str] = ()) -> list[str]:
    """The lines for ``err``, raised by ``model`` validating ``data`` found at key path ``where``.

    ``also_known``: keys the top level may hold that another model takes (a route's common
    keys, beside its provider kind's own).
    """
    lines: list[str] = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not str(p).startswith("function-"))
        parent, key = loc[:-1], loc[-1] if loc else None
        at = _join(where, *parent)
        if e["type"] in ("extra_forbidden", "missing") and key is not None:
            known = _known(model, parent, also_known)
            if e["type"] == "extra_forbidden":
                lines.append(unknown_key(at, key, known))
                continue
            typos = _typos_of(str(key), _data_at(data, parent), known)
            if typos:  # the required key is there, misspelt: name the typo, not the absence
                lines.extend(unknown_key(at, t, known) for t in typos)
                continue
        message = e["msg"].removeprefix("Value error, ")
        lines.append(f"{_join(where, *loc)}: {message}" if loc or where else message)
    return list(dict.fromkeys(lines))


def _join(*parts: object) -> str:
    return ".".join(str(p) for p in parts if p != "")


def _known(model: type[BaseModel], loc: Sequence[Any], also_known: Iterable[str]) -> set[str] | None:
    found = _model_at(model, loc)
    if found is None:
        return None
    return keys_of(found) | (set(also_known) if not loc else set())


def _typos_of(key: str, data: Any, known: set[str] | None) -> list[str]:
    """Keys of ``data`` nothing takes that look like ``key``."""
    if not isinstance(data, dict) or known is None:
        return []
    strangers = [str(k) for k in data if str(k) not in known]
    return [k for k in strangers if difflib.get_close_matches(k, [key], n=1)]


def _data_at(data: Any, loc: Sequence[Any]) -> Any:
    for part in loc:
        if isinstance(data, dict):
            data = data.get(part)
        elif isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data):
            data = data[part]
        else:
            return None
    return data


def _model_at(model: type[BaseModel], loc: Sequence[Any]) -> type[BaseModel] | None:
    """The model that validated the mapping at ``loc`` (through dicts, lists and optionals)."""
    tp: Any = model
    for part in loc:
        tp = _unwrap(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            field = tp.model_fields.get(str(part)) or next(
                (f for f in tp.model_fields.values() if f.alias == part), None)
            if field is None:
                return None
            tp = field.annotation
        elif get_origin(tp) is dict:
            tp = get_args(tp)[1]
        elif get_origin(tp) is list:
            tp = get_args(tp)[0]
        else:
            return None
    tp = _unwrap(tp)
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def _unwrap(tp: Any) -> Any:
    """A union's member that can hold a mapping (a model, or a dict or list to walk through)."""
    if get_origin(tp) not in (Union, types.UnionType):
        return tp
    for arg in get_args(tp):
        if (isinstance(arg, type) and issubclass(arg, BaseModel)) or get_origin(arg) in (dict, list):
            return arg
    return tp
