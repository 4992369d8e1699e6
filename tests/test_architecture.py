"""The layering in ARCHITECTURE.md, checked on the source: no import cycles, no arrow pointing up.

Every ``import`` statement counts, wherever it is (module level, inside a function,
under ``TYPE_CHECKING``): a lazy import hides a cycle from Python, not from a reader.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("multiplexer", "providers", "local_models")

# layer -> the layers it may import (its own included)
ALLOWED = {
    "core": {"core"},
    "local_models": {"local_models", "core"},
    "transport": {"transport"},  # the lean HTTP/1.1 client transport: httpx and httptools only
    "jobs": {"jobs", "core"},  # the durable job store (SQLite or PostgreSQL): jobs, /v1 files, batches
    "providers": {"providers", "local_models", "core", "transport", "jobs"},
    "backends": {"backends", "core"},  # shared-state engines (Redis), chosen by URL in the registry
    "money": {"money", "core", "jobs"},  # prices, cost, the savings ledger, spend and budgets
    "access": {"access", "core", "jobs"},  # the admin key, keys and teams as data, OAuth
    "cache": {"cache", "core"},  # the semantic cache: its guard, vector index and log
    "records": {"records", "core", "jobs", "money"},  # sinks off the hot path, the request log
    # provider classes come from the registry's strings, by kind
    "gateway": {"gateway", "core", "money", "access", "records", "cache"},
    "faces": {"faces", "gateway", "core", "jobs", "money", "access", "records", "cache"},
    "sdk": {"sdk", "core", "transport"},
    # the CLI, the server and the public facade
    "top": {"top", "sdk", "faces", "gateway", "core", "transport", "jobs", "money", "access", "records",
            "cache"},
}
CORE_THIRD_PARTY = {"anyio", "orjson", "pydantic", "prometheus_client", "tenacity"}


def layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "multiplexer":
        return parts[0]
    if len(parts) > 1 and parts[1] in ("core", "gateway", "faces", "sdk", "transport", "backends", "jobs",
                                            "money", "access", "records", "cache"):
        return parts[1]
    return "top"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> tuple[set[str], set[str]]:
    """(modules of ours, top-level third-party names) that ``path`` imports."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    ours: set[str] = set()
    others: set[str] = set()
    known = modules()

    def add(target: str, names: list[str]) -> None:
        if target.split(".")[0] not in PACKAGES:
            others.add(target.split(".")[0])
            return
        for n in names:  # `from pkg import module` imports that module
            if f"{target}.{n}" in known:
                ours.add(f"{target}.{n}")
                break
        else:
            ours.add(target)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, [])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            add(target, [a.name for a in node.names])
    return ours, others - set(sys.stdlib_module_names) - {"__future__"}


_MODULES: dict[str, Path] = {}


def modules() -> dict[str, Path]:
    if not _MODULES:
        for pkg in PACKAGES:
            for path in sorted((ROOT / pkg).rglob("*.py")):
                _MODULES[module_name(path)] = path
    return _MODULES


def graph() -> dict[str, set[str]]:
    return {name: imports_of(path)[0] - {name} for name, path in modules().items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_checker_sees_a_cycle_and_a_lazy_import() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    source = ast.parse("def f():\n    from multiplexer.faces.http import create_app\n")
    assert any(isinstance(n, ast.ImportFrom) for n in ast.walk(source))


def test_no_import_cycles() -> None:
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_every_arrow_points_down() -> None:
    wrong = []
    for name, deps in graph().items():
        src = layer(name)
        if src not in ALLOWED:
            continue
        for dep in deps:
            dst = layer(dep)
            if dep == "multiplexer":  # the public facade: for users, not for our own layers
                wrong.append(f"{name} -> multiplexer (import from the layer that defines it)")
            elif dst not in ALLOWED[src]:
                wrong.append(f"{name} ({src}) -> {dep} ({dst})")
    assert not wrong, "arrows pointing up or sideways:\n  " + "\n  ".join(sorted(wrong))


def test_core_needs_only_its_few_libraries() -> None:
    extra = {name: sorted(imports_of(path)[1] - CORE_THIRD_PARTY)
             for name, path in modules().items() if layer(name) == "core"}
    assert not {k: v for k, v in extra.items() if v}


@pytest.mark.parametrize("forbidden", ["providers", "faces"])
def test_core_imports_neither_providers_nor_faces(forbidden: str) -> None:
    offenders = [name for name, deps in graph().items() if layer(name) == "core"
                 and any(layer(d) == forbidden for d in deps)]
    assert offenders == []
