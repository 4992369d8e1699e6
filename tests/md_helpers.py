"""Reading Markdown as the docs tests need it: fenced code blocks, relative links, whole configs."""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from multiplexer.gateway.config import Config, parse_config

ROOT = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+-]*)[^\n]*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str  # dedented, without the fences

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}:{self.lang or 'text'}"

    @property
    def first_line(self) -> str:
        return self.text.splitlines()[0].strip() if self.text.strip() else ""


def code_blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file, in order."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        fence, start = m.group("fence"), i
        body: list[str] = []
        i += 1
        while i < len(lines) and not (lines[i].strip().startswith(fence[0] * len(fence))
                                      and lines[i].strip().strip(fence[0]) == ""):
            body.append(lines[i])
            i += 1
        blocks.append(Block(path, start + 1, m.group("lang").lower(), textwrap.dedent("\n".join(body))))
        i += 1
    return blocks


def without_code(text: str) -> str:
    """The text with fenced blocks and inline code spans blanked (links there are not links)."""
    out, fence = [], None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if fence is None and m is not None:
            fence = m.group("fence")[0]
            out.append("")
            continue
        if fence is not None:
            if line.strip().startswith(fence * 3) and line.strip().strip(fence) == "":
                fence = None
            out.append("")
            continue
        out.append(re.sub(r"(`+)(.+?)\1", "", line))
    return "\n".join(out)


_LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|^\s*\[[^\]]+\]:\s*(\S+)", re.M)


def relative_links(path: Path) -> list[str]:
    """Link targets in a Markdown file that point at files (not web addresses, not same-page anchors)."""
    found = []
    for m in _LINK.finditer(without_code(path.read_text())):
        target = m.group(1) or m.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # https:, mailto:, ... or an anchor on the same page
        found.append(target)
    return found


_ENV_NAME = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)")


def whole_config(block: Block) -> Any | None:
    """The parsed YAML of a block that is a whole config (its top-level keys are config sections,
    and routes come with the providers they name), else None. A first line ``# fragment`` marks
    a block as part of a config whatever its keys."""
    data = yaml.safe_load(block.text)
    if block.first_line.startswith("# fragment") or not isinstance(data, dict) or not data:
        return None
    if not set(data) <= set(Config.model_fields):
        return None
    if "routes" in data and "providers" not in data:
        return None
    return data


def check_config(block: Block) -> Config:
    """Parse a whole-config block with the gateway's own loader; ``${VAR}`` read as set."""
    data = whole_config(block)
    assert data is not None, f"{block.id} is not a whole config"
    env = {name: "set-for-the-docs-test" for name in _ENV_NAME.findall(block.text)}
    return parse_config(data, env=env)
