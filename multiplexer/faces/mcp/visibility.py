"""Which tools a caller of an MCP server may see and call, and which upstreams' resources and
prompts: its key's rules (``access.rules``) and the server's own tool set (a virtual server's,
fixed, or picked per request for those made through the admin API). ``tools/list`` and
``tools/call`` ask the same question, so a tool a caller may not call is one it never sees."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Filter = Callable[[str], bool]
Pick = Callable[[Any], tuple[Filter, Filter] | None]  # a request's context -> (tools, prefixes)


def everything(name: str) -> bool:
    return True


def nothing(name: str) -> bool:
    return False


class Visibility:
    def __init__(self, keys: Any, only: Filter | None = None, only_prefix: Filter | None = None,
                 per_request: Pick | None = None) -> None:
        self.keys = keys  # access.directory.KeyDirectory: each identity's rules
        self.only = only  # a virtual server's tools; None: every tool
        self.only_prefix = only_prefix
        self.per_request = per_request

    def _server(self, ctx: Any, which: int) -> Filter | None:
        if self.per_request is None:
            return self.only if which == 0 else self.only_prefix
        picked = self.per_request(ctx)
        return picked[which] if picked is not None else nothing

    def tools(self, identity: str | None, ctx: Any) -> Filter:
        rules = self.keys.rules_of(identity)
        only = self._server(ctx, 0)
        if rules is None and only is None:
            return everything
        return lambda name: (rules is None or rules.tool_ok(name)) and (only is None or only(name))

    def prefixes(self, identity: str | None, ctx: Any) -> Filter:
        """The same for an upstream's resources and prompts, by its wildcard route's prefix."""
        rules = self.keys.rules_of(identity)
        only = self._server(ctx, 1)
        if rules is None and only is None:
            return everything
        return lambda prefix: (rules is None or rules.prefix_ok(prefix)) and (
            only is None or only(prefix))
