"""What the suite leaves in the checkout: the files git does not track, before and after a run.

A test that writes a store, a log or an output file where it runs (the checkout root, under
``pytest``) leaves state that changes the next run's results and a developer's ``git status``.
``git status --porcelain --ignored=matching`` lists untracked files (a new folder as one entry) and
ignored ones (each path an ignore pattern matched: a cache folder as itself, wherever it is); the
tools' own caches are left out (``is_cache``)."""

from __future__ import annotations

import fnmatch
import subprocess
from pathlib import Path

# Written by the tools, not by the code under test, and never read as state by it: folders of these
# names anywhere, and these paths from the root.
CACHE_NAMES = ("__pycache__", ".pytest_cache", ".hypothesis", ".mypy_cache", ".ruff_cache", "*.egg-info")
CACHE_PATHS = ("benchmarks/results",)


def untracked(root: Path) -> set[str] | None:
    """Paths under ``root`` that git does not track, untracked or ignored; a folder ends in ``/``
    (None: not a git checkout, or no git)."""
    try:
        done = subprocess.run(["git", "status", "--porcelain", "--ignored=matching", "-z"], cwd=root,
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    entries = done.stdout.split("\0")
    return {entry[3:] for entry in entries if entry[:2] in ("??", "!!")}


def is_cache(path: str) -> bool:
    return (any(fnmatch.fnmatch(part, name) for part in path.rstrip("/").split("/") for name in CACHE_NAMES)
            or any(path.rstrip("/") == cache or path.startswith(cache + "/") for cache in CACHE_PATHS))


def left_behind(before: set[str], after: set[str]) -> list[str]:
    """Entries that appeared during the run, the caches aside."""
    return sorted(path for path in after - before if not is_cache(path))
