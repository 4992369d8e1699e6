"""Where a model's files are: an installed package, a directory, or the local Hugging Face cache.

Nothing here downloads: a Hugging Face id resolves only from the cache
(``local_files_only=True``, as with ``HF_HUB_OFFLINE=1``), and loaders are
then given the directory, never the id.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?(@[\w./-]+)?$")


class SourceError(ValueError):
    """A model source that cannot be resolved offline; the message says why."""


def resolve_source(source: str, *, cache_dir: str | Path | None = None) -> Path:
    """``package:<module>`` | ``/a/dir`` / ``./dir`` / ``~/dir`` | ``hf:org/name[@rev]`` or ``org/name``."""
    if source.startswith("package:"):
        return package_dir(source.removeprefix("package:"))
    path = Path(source).expanduser()
    if source.startswith(("/", ".", "~")) or path.is_dir():
        if not path.is_dir():
            raise SourceError(f"model directory {source!r} does not exist")
        return _checked(path.resolve(), source)
    return hf_cached(source.removeprefix("hf:"), cache_dir=cache_dir)


def package_dir(module_name: str) -> Path:
    """The model directory an installed package ships: ``get_model_path()``, ``MODEL_DIR`` or ``model/``."""
    if not _MODULE.match(module_name):
        raise SourceError(f"package source {module_name!r} is not a module name")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise SourceError(f"package {module_name!r} is not installed ({e})") from None
    candidates: list[Path] = []
    getter = getattr(module, "get_model_path", None)
    if callable(getter):
        candidates.append(Path(getter()))
    if getattr(module, "MODEL_DIR", None) is not None:
        candidates.append(Path(module.MODEL_DIR))
    if module_file := getattr(module, "__file__", None):
        candidates.append(Path(module_file).resolve().parent / "model")
    for path in candidates:
        if (path / "config.json").is_file():
            return path
    raise SourceError(f"package {module_name!r} ships no model directory (looked in {candidates})")


def hf_cached(repo: str, *, cache_dir: str | Path | None = None) -> Path:
    if not _HF_ID.match(repo):
        raise SourceError(f"{repo!r} is neither a directory, a package: source nor a Hugging Face id")
    repo_id, _, revision = repo.partition("@")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = snapshot_download(
            repo_id, revision=revision or None, cache_dir=cache_dir, local_files_only=True
        )
    except LocalEntryNotFoundError:
        raise SourceError(
            f"{repo!r} is not in the local Hugging Face cache and downloads are disabled; "
            "fetch it ahead of time or point source at a directory"
        ) from None
    return _checked(Path(path), repo)


def _checked(path: Path, source: str) -> Path:
    if not (path / "config.json").is_file():
        raise SourceError(f"{source!r}: {path} has no config.json")
    return path
