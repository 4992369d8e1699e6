"""The keys a provider kind adds to its provider's and its routes' config, checked at load.

``ProviderConfig`` and ``RouteConfig`` hold the keys every kind shares and let the rest
through (the core does not know the kinds); each kind declares the rest (``Settings`` for its
providers, ``RouteSettings`` for routes to them), so a key no model takes is refused here,
with its full path, instead of being ignored at run time. Checked on the file's own mapping,
so these lines come with every other problem of the file, not after they are fixed.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from multiplexer.core.policy import ProviderConfig, RouteConfig
from multiplexer.gateway.config_errors import keys_of, problems
from multiplexer.gateway.registry import route_settings_model, settings_model

_PROVIDER_KEYS = keys_of(ProviderConfig)
_ROUTE_KEYS = keys_of(RouteConfig)


def kind_problems(data: dict[str, Any], context: dict[str, Any] | None = None) -> list[str]:
    """One line per problem in the kind-specific keys of ``providers`` and ``routes``."""
    lines: list[str] = []
    kinds: dict[str, str] = {}
    providers = data.get("providers")
    for name, raw in (providers or {}).items() if isinstance(providers, dict) else ():
        kind = raw.get("kind") if isinstance(raw, dict) else None
        if not isinstance(kind, str):
            continue  # the common model reports it
        try:
            model = settings_model(kind)
        except KeyError as e:
            lines.append(f"providers.{name}.kind: {e.args[0]}")
            continue
        kinds[name] = kind
        lines += own_keys(raw, _PROVIDER_KEYS, model, f"providers.{name}", context)
    routes = data.get("routes")
    for name, raw in (routes or {}).items() if isinstance(routes, dict) else ():
        provider = raw.get("provider") if isinstance(raw, dict) else None
        if isinstance(provider, str) and provider in kinds:  # else the common model reports it
            lines += own_keys(raw, _ROUTE_KEYS, route_settings_model(kinds[provider]), f"routes.{name}",
                              context)
    return lines


def own_keys(raw: dict[str, Any], shared: set[str], model: type[BaseModel], where: str,
             context: dict[str, Any] | None = None) -> list[str]:
    """The problems of ``raw``'s keys outside ``shared``, which ``model`` (the kind's) must take."""
    mine = {k: v for k, v in raw.items() if k not in shared}
    try:
        model.model_validate(mine, context=context)
    except ValidationError as e:
        return problems(e, model, mine, where, also_known=shared)
    return []
