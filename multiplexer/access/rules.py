"""What one key may use, as admission asks it: globs of models, routes and MCP tools.

A key's own lists narrow its team's, never widen them: a name must pass the team's globs *and*
the key's (an unset list passes everything). Built once per key when the directory loads, so
the check per call is a few ``fnmatch`` on a name, and a key without rules costs one dict miss.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from multiplexer.core.errors import Code, RpcError, method_not_found

DENIED = "permission_denied"


MEMO = 4096  # names remembered per list (model names come from clients: bounded)


class Layers:
    """One list's layers, each compiled to one regex; answers remembered per name."""

    __slots__ = ("_memo", "_patterns", "globs")

    def __init__(self, globs: tuple[tuple[str, ...], ...]) -> None:
        self.globs = globs
        # a layer with no globs matches nothing: "(?!)"
        self._patterns = [re.compile("|".join(fnmatch.translate(g) for g in layer) or "(?!)")
                          for layer in globs]
        self._memo: dict[str, bool] = {}

    def __bool__(self) -> bool:
        return bool(self.globs)

    def passes(self, name: str) -> bool:
        found = self._memo.get(name)
        if found is None:
            found = all(p.match(name) is not None for p in self._patterns)
            if len(self._memo) >= MEMO:
                self._memo.clear()
            self._memo[name] = found
        return found


@dataclass(frozen=True, slots=True, init=False)
class Rules:
    """The layers (team's, then key's) of each list; empty: that list restricts nothing."""

    models: Layers
    routes: Layers
    tools: Layers

    def __init__(self, models: tuple[tuple[str, ...], ...] = (), routes: tuple[tuple[str, ...], ...] = (),
                 tools: tuple[tuple[str, ...], ...] = ()) -> None:
        object.__setattr__(self, "models", Layers(models))
        object.__setattr__(self, "routes", Layers(routes))
        object.__setattr__(self, "tools", Layers(tools))

    @classmethod
    def of(cls, *accesses: Any) -> Rules | None:
        """From the team's ``Access`` then the key's (None where neither restricts anything)."""
        layers: dict[str, list[tuple[str, ...]]] = {"models": [], "routes": [], "tools": []}
        for access in accesses:
            if access is None:
                continue
            for field, out in layers.items():
                globs = getattr(access, field, None)
                if globs is not None:
                    out.append(tuple(globs))
        if not any(layers.values()):
            return None
        return cls(tuple(layers["models"]), tuple(layers["routes"]), tuple(layers["tools"]))

    def model_ok(self, *names: str | None) -> bool:
        """A model passes when the route's name or the model it asks for does."""
        if not self.models.globs:
            return True
        for name in names:  # noqa: SIM110 - a loop: no generator per call on the hot path
            if name is not None and self.models.passes(name):
                return True
        return False

    def route_ok(self, name: str) -> bool:
        return not self.routes.globs or self.routes.passes(name)

    def tool_ok(self, name: str) -> bool:
        """An MCP tool is a route under another name: both lists apply."""
        return (not self.tools.globs or self.tools.passes(name)) and self.route_ok(name)

    def prefix_ok(self, prefix: str) -> bool:
        """Whether any tool under a wildcard route's ``prefix`` may pass (its resources, prompts)."""
        def some(layers: Layers) -> bool:
            return all(prefix_matches(globs, prefix) for globs in layers.globs)
        return some(self.tools) and some(self.routes)

    def refusal(self, route: str, params: Any, face: str) -> RpcError | None:
        """Why this key may not make this call; None when it may. On MCP a refused tool is unknown."""
        model = params.get("model") if isinstance(params, dict) else None
        model = model if isinstance(model, str) else None
        if face == "mcp":
            if not self.tool_ok(route):
                return method_not_found(route)  # as if it did not exist
        elif not self.route_ok(route):
            return denied(f"this key may not use route {route!r}", route=route)
        if model is not None and not self.model_ok(route, model):
            return denied(f"this key may not use model {model!r}", model=model)
        if model is None and self.models.globs and face == "v1" and not self.model_ok(route):
            return denied(f"this key may not use model {route!r}", model=route)
        return None


def glob_matches(globs: Sequence[str], name: str) -> bool:
    return any(fnmatchcase(name, g) for g in globs)


def prefix_matches(globs: Sequence[str], prefix: str) -> bool:
    """Whether any of ``globs`` may match a name under ``prefix`` (a wildcard route's tools)."""
    return any(g.startswith(prefix) or fnmatchcase(prefix, g) or g.startswith("*") for g in globs)


def denied(detail: str, **extra: Any) -> RpcError:
    """-32003 with ``reason: permission_denied``: the faces answer 403 in their own shape."""
    return RpcError(Code.RATE_LIMITED, "Permission denied", {"reason": DENIED, "detail": detail, **extra})


def is_denied(error: RpcError) -> bool:
    return error.code == Code.RATE_LIMITED and isinstance(error.data, dict) \
        and error.data.get("reason") == DENIED
