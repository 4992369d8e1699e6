"""What ``multiplexer check-config`` finds wrong in a config that validates.

Validation (``config.py``) reads the file alone. These checks read what it names: the programs
and scripts its stdio children start, which a gateway would only find missing once serving (a
child that never comes up, a tool that never answers), and ``models:`` on a route that answers
nothing ``/v1`` serves, which ``/v1`` refuses call by call. They are not run at load: a gateway
may start where a child's program is installed after it, and a config may list models on a route
for other reasons than ``/v1``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from multiplexer.core.policy import RouteConfig
from multiplexer.gateway.config import Config
from multiplexer.gateway.registry import provider_class, settings_model

# A stdio child's ``python`` is the gateway's own interpreter (providers/mcp_transport.py), found
# whether or not a ``python`` is on PATH.
THIS_PYTHON = {"python", "python3"}
SCRIPT_FIX = ("put it there, name it by its full path, or start a module instead "
              "(command: python, args: [-m, package.module])")
OPERATION_FIX = "add operation: chat, operation: embeddings or operation: messages"


def problems(config: Config) -> list[str]:
    """One line per problem: ``providers.NAME.FIELD: what is wrong; the fix``."""
    lines: list[str] = []
    settings: dict[str, Any] = {}
    for name, pconf in config.providers.items():
        settings[name] = settings_model(pconf.kind).model_validate(
            pconf.extra, context=config.paths_context())  # as the provider gets them: paths resolved
        lines += child_problems(f"providers.{name}", settings[name])
    for name, route in config.routes.items():
        kind = provider_class(config.providers[route.provider].kind)
        lines += route_problems(f"routes.{name}", route, kind.answers(route, settings[route.provider]))
    return lines


def child_problems(where: str, settings: Any) -> list[str]:
    """A kind that starts a child program (its settings name a ``command``, with ``args`` and the
    ``cwd`` it runs in): that the folder, the program and each script argument are there, looked
    up as the child's start looks them up."""
    command = getattr(settings, "command", None)
    if not isinstance(command, str):
        return []
    cwd = getattr(settings, "cwd", None)
    folder = Path(cwd) if cwd else Path.cwd()
    if not folder.is_dir():
        return [f"{where}.cwd: no folder {folder}; create it, or name the folder the child runs in"]
    lines = []
    env = getattr(settings, "env", None)
    path = env.get("PATH") if isinstance(env, dict) and "PATH" in env else os.environ.get("PATH")
    if (line := _program_problem(command, folder, path)) is not None:
        lines.append(f"{where}.command: {line}")
    lines += [f"{where}.args: no script {arg} in {folder} (the child's folder: its cwd, else the "
              f"config's); {SCRIPT_FIX}"
              for arg in _scripts(getattr(settings, "args", [])) if not (folder / arg).is_file()]
    return lines


def _program_problem(command: str, folder: Path, path: str | None) -> str | None:
    """A bare name is looked up on PATH (the child's, when its ``env`` sets one); a path is the
    child's folder's when relative."""
    if command in THIS_PYTHON:
        return None
    if os.sep not in command:
        if shutil.which(command, path=path) is None:
            return f"no program {command!r} on PATH; install it, or name it by its path"
        return None
    program = folder / command
    if not program.is_file():
        return (f"no program {program} (a relative command is the child's folder's: {folder}); "
                "fix the path, or name a program on PATH")
    if not os.access(program, os.X_OK):
        return f"{program} is not executable; chmod +x it"
    return None


def _scripts(args: list[str]) -> list[str]:
    """The arguments that name a Python script: ``*.py``, not an option, not ``-c``'s code."""
    return [arg for i, arg in enumerate(args)
            if arg.endswith(".py") and not arg.startswith("-") and (i == 0 or args[i - 1] != "-c")]


def route_problems(where: str, route: RouteConfig, answers: str) -> list[str]:
    """A route that lists ``/v1`` models must answer something ``/v1`` serves: ``operation``
    defaults to ``call`` (JSON-RPC and MCP), which only a kind that infers what its routes answer
    (a local model's task) turns into one."""
    if not route.models or answers != "call":
        return []
    how = "no operation" if "operation" not in route.model_fields_set else f"operation {route.operation}"
    return [f"{where}: lists models ({', '.join(route.models)}) but {how}, so /v1 refuses them "
            f"(the route answers {answers}); {OPERATION_FIX}"]
