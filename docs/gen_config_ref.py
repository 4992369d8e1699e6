"""The configuration reference, generated from the pydantic models the gateway validates with.

Walks ``multiplexer.gateway.config.Config`` (every top-level section it has) and, for every provider
kind in ``multiplexer.gateway.registry.KINDS``, the kind's ``Settings`` model and any other pydantic
model the provider class carries (route settings, say), writing each key's type, default and
``description``. Nothing here names a key: a key, section or kind added to the models appears with
no edit.

The page it writes, ``docs/config-reference.md``, is committed, so the reference reads on a code host
as on the site: ``python3 docs/gen_config_ref.py`` rewrites it, ``--check`` only says whether it is
current. As an MkDocs hook (``hooks:`` in mkdocs.yml) it warns when the committed page is out of date,
which fails the strict build; tests/test_docs.py fails the same way without building.
"""

from __future__ import annotations

import enum
import json
import logging
import sys
import types
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # this checkout's code, not another installed copy
    sys.path.insert(0, str(ROOT))

from pydantic import BaseModel, SecretStr  # noqa: E402
from pydantic.fields import FieldInfo  # noqa: E402
from pydantic_core import PydanticUndefined  # noqa: E402

PAGE = ROOT / "docs" / "config-reference.md"
REFRESH = "python3 docs/gen_config_ref.py"
HEADER = f"""<!-- Generated from the config models by docs/gen_config_ref.py: edit the models, then run
{REFRESH} -->
# Configuration reference

Every key the gateway accepts, with its type, default and description, generated from the pydantic
models that validate a config (`multiplexer.gateway.config.Config` and each provider kind's
`Settings` in `multiplexer/gateway/registry.py`) by `docs/gen_config_ref.py`:
`{REFRESH}` rewrites this page after a model changes, and the tests fail while it
is out of date. `<provider>`, `<route>` and the like stand for names you choose. How the parts fit
together: [Configuration](configuration.md).
"""
log = logging.getLogger("mkdocs.hooks.config_reference")
UNAVAILABLE = "Not available where these docs were built"


def _model(tp: Any) -> type[BaseModel] | None:
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def _args(tp: Any) -> tuple[Any, ...]:
    return typing.get_args(tp)


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _strip_none(tp: Any) -> Any:
    if _is_union(tp):
        rest = [a for a in _args(tp) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return tp


def type_name(tp: Any) -> str:
    """A type as a config author reads it: ``int | null``, ``"closed" | "open"``, ``list[string]``."""
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    if tp is SecretStr:
        return "secret string"
    names = {str: "string", int: "int", float: "number", bool: "bool", dict: "mapping", list: "list"}
    if tp in names:
        return names[tp]
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in _args(tp))
    if _is_union(tp):
        return " | ".join(type_name(a) for a in _args(tp))
    if origin is typing.Annotated:
        return type_name(_args(tp)[0])
    if origin in (list, tuple, set, frozenset):
        inner = ", ".join(type_name(a) for a in _args(tp) if a is not Ellipsis) or "any"
        return f"list[{inner}]"
    if origin is dict:
        key, value = _args(tp) or (str, Any)
        return f"mapping[{type_name(key)}, {type_name(value)}]"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " | ".join(json.dumps(m.value) for m in tp)
    model = _model(tp)
    if model is not None:
        return "mapping (keys below)"
    return getattr(tp, "__name__", str(tp))


def constraints(field: FieldInfo) -> str:
    words = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<",
             "min_length": "length >=", "max_length": "length <="}
    out = []
    for meta in field.metadata:
        for attr, word in words.items():
            value = getattr(meta, attr, None)
            if value is not None:
                out.append(f"{word} {value}")
    return ", ".join(out)


def default_text(field: FieldInfo) -> str:
    if field.default_factory is not None:
        try:
            value: Any = field.default_factory()  # type: ignore[call-arg]
        except TypeError:
            return "(computed)"
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(keys below)"
    if isinstance(value, SecretStr):
        return "(secret)"
    if isinstance(value, enum.Enum):
        value = value.value
    try:
        text = json.dumps(value)
    except TypeError:
        text = repr(value)
    return f"`{text}`"


def _cell(text: str) -> str:
    """Text for a table cell: Markdown's and HTML's special characters escaped outside code spans
    (``package:<module>`` would otherwise be read as a tag)."""
    parts = text.replace("\n", " ").split("`")
    for i in range(0, len(parts), 2):  # outside backticks
        parts[i] = (parts[i].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
                    .replace("|", "\\|").replace("*", "\\*").replace("_", "\\_"))
    return "`".join(parts).strip()


def _placeholder(key: str) -> str:
    """What a mapping's keys are called in a path: ``providers`` -> ``<provider>``."""
    return f"<{key[:-1]}>" if key.endswith("s") and len(key) > 1 else "<name>"


def _nested(tp: Any, key: str = "") -> tuple[type[BaseModel], str] | None:
    """A model to document below a key, and the path part that reaches it: a model itself,
    a mapping of names to models (``.<name>``), or a list of models (``[]``)."""
    tp = _strip_none(tp)
    model = _model(tp)
    if model is not None:
        return model, ""
    origin = typing.get_origin(tp)
    if origin is dict and len(_args(tp)) == 2:
        inner = _model(_strip_none(_args(tp)[1]))
        if inner is not None:
            return inner, "." + _placeholder(key)
    if origin is list and _args(tp):
        inner = _model(_strip_none(_args(tp)[0]))
        if inner is not None:
            return inner, "[]"
    if _is_union(tp):
        for arg in _args(tp):
            found = _nested(arg, key)
            if found is not None:
                return found
    return None


def rows(model: type[BaseModel], prefix: str, seen: tuple[type, ...] = ()) -> list[tuple[str, ...]]:
    """(key, type, default, description) for every field, nested models flattened by dotted keys."""
    out: list[tuple[str, ...]] = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        path = f"{prefix}.{key}" if prefix else key
        nested = _nested(field.annotation, key)
        kind = type_name(field.annotation)
        limits = constraints(field)
        if limits:
            kind = f"{kind} ({limits})"
        out.append((f"`{path}`", _cell(kind), _cell(default_text(field)), _cell(field.description or "")))
        if nested is not None and nested[0] not in seen:
            out.extend(rows(nested[0], path + nested[1], (*seen, model)))
    return out


def table(model: type[BaseModel], prefix: str) -> str:
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows(model, prefix)]
    return "\n".join(lines)


def _doc(model: type[BaseModel]) -> str:
    text = (model.__doc__ or "").strip()
    if not text or text.startswith(("Usage docs:", "A base class")) or model.__doc__ == BaseModel.__doc__:
        return ""
    return _cell(" ".join(line.strip() for line in text.replace("``", "`").splitlines())) + "\n\n"


def provider_models(kind: str) -> list[tuple[str, type[BaseModel]]]:
    """The kind's ``Settings`` first, then every other model the registry gives for a kind (its
    ``*_model(kind)`` functions, a route model say) and every pydantic model its provider class
    carries."""
    from multiplexer.gateway import registry

    found = [("Settings", registry.settings_model(kind))]
    for name in sorted(vars(registry)):
        fn = getattr(registry, name)
        if name.endswith("_model") and name != "settings_model" and callable(fn):
            try:
                model = _model(fn(kind))
            except (KeyError, TypeError, ValueError):
                continue  # not a per-kind model, or none for this kind
            if model is not None and all(model is not m for _, m in found):
                found.append((name.removesuffix("_model"), model))
    cls = registry.provider_class(kind)
    for attr in sorted(dir(cls)):
        if attr.startswith("_") or attr == "Settings":
            continue
        value = getattr(cls, attr, None)
        model = _model(value)
        if model is not None and all(model is not m for _, m in found):
            found.append((attr, model))
    return found


def render() -> str:
    from multiplexer.gateway.config import Config
    from multiplexer.gateway.registry import KINDS

    parts: list[str] = []
    for name, field in Config.model_fields.items():
        key = field.alias or name
        parts.append(f"## `{key}`\n")
        nested = _nested(field.annotation, key)
        if field.description:
            parts.append(field.description + "\n")
        if nested is None:
            parts.append(f"Type {type_name(field.annotation)}, default {default_text(field)}.\n")
            continue
        model, step = nested
        parts.append(_doc(model) + table(model, key + step) + "\n")
        if key == "providers":
            parts.append("The keys above are common to every kind; the keys of each kind are under "
                         "[Provider kinds](#provider-kinds).\n")
        if key == "routes":
            parts.append("The keys above are common to every route; a route may also take the route "
                         "keys of its provider's kind, under [Provider kinds](#provider-kinds).\n")
    parts.append("## Provider kinds\n")
    parts.append("Each provider's `kind` selects one of these; its other keys are the kind's own.\n")
    for kind in KINDS:
        parts.append(f"### `kind: {kind}`\n")
        try:
            models = provider_models(kind)
        except KeyError as e:  # an optional dependency missing where the docs are built
            log.warning("config reference: kind %r left out: %s", kind, e.args[0])
            parts.append(f"{UNAVAILABLE}: {e.args[0]}\n")
            continue
        for attr, model in models:
            if attr == "Settings":
                intro, prefix = "Provider keys, beside the common ones:", "providers.<provider>"
            elif "route" in attr.lower():
                intro, prefix = f"Keys of a route to a provider of this kind (`{attr}`):", "routes.<route>"
            else:
                intro, prefix = f"`{attr}`:", f"providers.<provider> ({attr})"
            if not model.model_fields:
                if attr == "Settings":
                    parts.append("No provider keys beside the common ones.\n")
                continue
            parts.append(_doc(model) + intro + "\n\n" + table(model, prefix) + "\n")
    return "\n".join(parts)


def page() -> str:
    """The whole reference page, as it is committed."""
    return HEADER + "\n" + render().rstrip("\n") + "\n"


def stale() -> str | None:
    """Why the committed page differs from what the models give now; None when it is current."""
    if not PAGE.exists():
        return f"{PAGE.relative_to(ROOT)} is missing: run {REFRESH}"
    if PAGE.read_text() != page():
        return f"{PAGE.relative_to(ROOT)} is out of date with the config models: run {REFRESH}"
    return None


def on_pre_build(config: Any) -> None:
    """MkDocs hook: the site shows the committed page, so a stale one is a build warning."""
    reason = stale()
    if reason is not None:
        log.warning(reason)


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        reason = stale()
        print(reason or f"{PAGE.relative_to(ROOT)} is current")
        return 1 if reason else 0
    if argv:
        print(f"usage: {REFRESH} [--check]", file=sys.stderr)
        return 2
    text = page()
    if UNAVAILABLE in text:  # the committed page documents every kind: install what is missing
        print("not written: a provider kind could not be loaded (pip install -e '.[dev,local]')",
              file=sys.stderr)
        return 1
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
