"""Paths written in a config file are relative to that file's folder, not to the working folder.

So one config works whichever folder ``multiplexer serve`` starts in. The loader passes the
folder in pydantic's validation context (``context={"base_dir": folder}``); a config given as a
dict without one keeps paths as written (relative to the working folder). Lives in the core so
provider kinds' settings models can mark their own path keys. A key the config leaves out has
no folder of its own: ``store.path``'s default is the user's data directory
(``gateway/home.py``); the local models' compile verdicts live in the user's cache
(``verdict_file``, here so ``multiplexer paths`` names it without importing torch).
"""

from __future__ import annotations

import os
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


VERDICTS_FILE = "local_compile.json"


def verdict_file() -> Path:
    """Where the local models' compile verdicts live (``local_models/verdicts.py``): read at each
    pool's start, so a test or user can point elsewhere with ``MULTIPLEXER_CACHE_DIR``."""
    base = os.environ.get("MULTIPLEXER_CACHE_DIR")
    if base:
        return Path(base) / VERDICTS_FILE
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "multiplexer" / VERDICTS_FILE
