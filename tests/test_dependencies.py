"""Every library the shipped code imports is declared in pyproject.toml, not reached by chance
through another package's requirements (which may drop it in any release)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ("multiplexer", "providers", "local_models")


def declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        specs += extra
    return {normalise(re.split(r"[\s;<>=!~\[]", spec, maxsplit=1)[0]) for spec in specs}


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def imported() -> dict[str, set[str]]:
    """Top-level third-party module names -> the files that import them."""
    found: dict[str, set[str]] = {}
    for pkg in SHIPPED:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    names = [node.module]
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in SHIPPED and top != "__future__":
                        found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_imported_library_is_declared() -> None:
    dists = importlib.metadata.packages_distributions()
    ours = declared()
    missing = {}
    for module, files in imported().items():
        owners = {normalise(d) for d in dists.get(module, [module])}
        if not owners & ours:
            missing[module] = (sorted(owners), sorted(files)[:3])
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"
