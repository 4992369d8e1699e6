"""The documentation: the MkDocs site builds with no warning, the README stays a front door, every
relative link points at a file, every whole config in the docs parses, and the generated
configuration reference covers every key the models have."""

from __future__ import annotations

import difflib
import functools
import importlib.util
import os
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from tests.md_helpers import ROOT, check_config, code_blocks, relative_links, whole_config

README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 250


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


@pytest.mark.timeout(300)
def test_mkdocs_builds_strict_without_warnings(tmp_path: Path) -> None:
    """`mkdocs build --strict` into a temporary folder: a broken link or anchor, a missing include,
    a page left out of the nav or a warning from the reference generator fails it."""
    try:
        import material  # noqa: F401
        import mkdocs  # noqa: F401
    except ImportError as e:
        pytest.fail(f"the docs need mkdocs and mkdocs-material (pip install -e '.[dev]'): {e}")
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    output = proc.stdout + proc.stderr
    warnings = [line for line in output.splitlines() if line.lstrip().startswith(("WARNING", "ERROR"))]
    assert proc.returncode == 0 and not warnings, output[-6000:]
    reference = (tmp_path / "site" / "config-reference" / "index.html").read_text()
    assert "providers.&lt;provider&gt;.kind" in reference and "kind: echo" in reference


def _included_pages() -> set[Path]:
    """Pages under docs/ that another page pulls in whole (``--8<-- "docs/..."``): parts, not pages."""
    found = set()
    for page in DOCS.rglob("*.md"):
        for line in page.read_text().splitlines():
            if line.strip().startswith("--8<--"):
                target = (ROOT / line.split("--8<--", 1)[1].strip().strip("\"'")).resolve()
                if target.is_relative_to(DOCS):
                    found.add(target)
    return found


def _site_pages() -> set[Path]:
    return {p.resolve() for p in DOCS.rglob("*.md")} - {(DOCS / "index.md").resolve()} - _included_pages()


def test_index_links_every_page() -> None:
    """docs/index.md is the table of contents a reader on a code host has: a page it does not link
    is found only through the site's navigation."""
    index = DOCS / "index.md"
    linked = {(DOCS / t.split("#", 1)[0]).resolve() for t in relative_links(index) if t.split("#", 1)[0]}
    missing = sorted(str(p.relative_to(ROOT)) for p in _site_pages() - linked)
    assert not missing, f"docs/index.md links none of {missing}: add each under Use, Operate or Reference"


def test_navigation_lists_every_page() -> None:
    """mkdocs.yml's nav, where there is one, lists every page (the strict build only warns, as
    'omitted', about a page that is missing, so a build with warnings allowed would hide it)."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    if "nav" not in config:
        pytest.skip("mkdocs.yml has no nav: MkDocs lists every page itself")

    def entries(node: object) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, list):
            return [e for item in node for e in entries(item)]
        if isinstance(node, dict):
            return [e for value in node.values() for e in entries(value)]
        return []

    listed = {(DOCS / e).resolve() for e in entries(config["nav"]) if "://" not in e}
    missing = sorted(str(p.relative_to(ROOT)) for p in _site_pages() - listed)
    assert not missing, f"mkdocs.yml's nav lists none of {missing}"
    absent = sorted(str(p.relative_to(ROOT)) for p in listed if not p.exists())
    assert not absent, f"mkdocs.yml's nav lists pages that do not exist: {absent}"


def test_config_reference_is_current() -> None:
    """docs/config-reference.md is committed so it reads on a code host; it must be what the
    generator writes from the models now, or it documents keys that are not there."""
    gen = generator()
    committed = gen.PAGE.read_text() if gen.PAGE.exists() else ""
    generated = gen.page()
    diff = list(difflib.unified_diff(committed.splitlines(), generated.splitlines(),
                                     "committed", "generated", lineterm="", n=0))
    assert committed == generated, (f"docs/config-reference.md is out of date with the config models; "
                                    f"refresh it with: {gen.REFRESH}\n" + "\n".join(diff[:40]))


def test_readme_is_a_front_door() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; reference material goes to docs/"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files_in_the_repo(path: Path) -> None:
    broken = []
    for target in relative_links(path):
        file = target.split("#", 1)[0].split("?", 1)[0]
        if not file:
            continue
        resolved = (path.parent / file).resolve()
        if not resolved.is_relative_to(ROOT):
            broken.append(f"{target} (outside the repository)")
        elif not resolved.exists():
            broken.append(f"{target} (no such file)")
    assert not broken, f"{path.relative_to(ROOT)}: " + ", ".join(broken)


DOC_CONFIGS = [b for p in sorted(DOCS.rglob("*.md")) for b in code_blocks(p)
               if b.lang in ("yaml", "yml") and whole_config(b) is not None]


@pytest.mark.parametrize("block", DOC_CONFIGS, ids=lambda b: b.id)
def test_whole_configs_in_the_docs_parse(block: typing.Any) -> None:
    check_config(block)


def test_example_configs_parse() -> None:
    from multiplexer.gateway.config import load_config

    for path in sorted((ROOT / "examples").glob("*.yaml")):
        load_config(path)


@functools.cache
def generator() -> types.ModuleType:
    """docs/gen_config_ref.py, the MkDocs hook, loaded by its path (docs/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gen_config_ref", DOCS / "gen_config_ref.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _leaf_keys(model: type[BaseModel], seen: tuple[type, ...] = ()) -> set[str]:
    keys = set()
    for name, field in model.model_fields.items():
        keys.add(field.alias or name)
        nested = generator()._nested(field.annotation, field.alias or name)
        if nested is not None and nested[0] not in seen:
            keys |= _leaf_keys(nested[0], (*seen, model))
    return keys


def test_config_reference_names_every_section_kind_and_key() -> None:
    """The generator walks the models, so a key, section or kind added to them is in the reference
    with no edit; this checks the walk misses none."""
    gen = generator()
    from multiplexer.gateway.config import Config
    from multiplexer.gateway.registry import KINDS

    text = gen.render()
    for section, field in Config.model_fields.items():
        assert f"## `{field.alias or section}`" in text
    for key in _leaf_keys(Config):
        assert f".{key}`" in text or f"`{key}`" in text, key
    for kind in KINDS:
        assert f"### `kind: {kind}`" in text
        for _, model in gen.provider_models(kind):
            for key in _leaf_keys(model):
                assert f".{key}`" in text, (kind, key)
