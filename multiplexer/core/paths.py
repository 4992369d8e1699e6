"""Paths written in a config file are relative to that file's folder, not to the working folder.

So one config works whichever folder ``multiplexer serve`` starts in. The loader passes the
folder in pydantic's validation context (``context={"base_dir": folder}``); a config given as a
dict without one keeps paths as written (relative to the working folder). Lives in the core so
provider kinds' settings models can mark their own path keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, ValidationInfo

BASE_DIR = "base_dir"


def base_dir(info: ValidationInfo) -> Path | None:
    """The config file's folder, when the loader knows it."""
    context = info.context
    base = context.get(BASE_DIR) if isinstance(context, Mapping) else None
    return Path(base) if base is not None else None


def relative_to_config(value: str, info: ValidationInfo) -> str:
    """``value`` joined to the config's folder when it is relative (``~`` paths are left as written)."""
    base = base_dir(info)
    if base is None or value.startswith("~") or Path(value).is_absolute():
        return value
    return str(base / value)


ConfigPath = Annotated[str, AfterValidator(relative_to_config)]


def context_for(base: str | Path | None) -> dict[str, Any] | None:
    """The validation context that resolves paths against ``base`` (None: as written)."""
    return None if base is None else {BASE_DIR: Path(base)}
