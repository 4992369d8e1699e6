"""The shipped packages type-check: mypy, with the project's own settings (``[tool.mypy]`` in
pyproject.toml), finds no errors, so a change that breaks a type fails CI like a test. Marked
``typecheck``: without a cache mypy analyses torch and transformers too (about 90 s), so the default
run leaves it to its own CI step (``python3 -m pytest -m typecheck``), as ruff has its own."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.typecheck
@pytest.mark.timeout(600)  # a first run, with no cache, analyses torch and transformers too (~1 min)
def test_mypy_finds_no_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        from mypy import api
    except ImportError:
        pytest.skip("mypy is not installed (pip install -e '.[dev]')")
    monkeypatch.chdir(ROOT)  # the config's files are relative to the repository root
    report, errors, status = api.run(["--config-file", str(ROOT / "pyproject.toml")])
    assert status == 0, f"mypy exited {status}:\n{report}{errors}"
