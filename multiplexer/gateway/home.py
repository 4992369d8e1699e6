"""Where the gateway keeps its state when the config does not say: the user's data directory.

The default store (keys, spend, batch jobs, ``/v1`` files) used to be ``multiplexer.db`` in the
folder ``serve`` started in, so a gateway started elsewhere saw other keys, and a file left in a
checkout changed what its tests saw. ``platformdirs`` names the one folder per user and platform
(``$XDG_DATA_HOME/multiplexer``, else ``~/.local/share/multiplexer`` on Linux); the store makes it
on first use. It is read each time a config is made, never at import, so a test that sets
``XDG_DATA_HOME`` first gets its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import platformdirs

APP = "multiplexer"
STORE_FILE = "multiplexer.db"


def data_dir() -> Path:
    """This user's folder for the gateway's state (not created here)."""
    return Path(platformdirs.user_data_dir(APP, appauthor=False))


def default_store_path(_validated: dict[str, Any]) -> str:
    """``store.path`` when the config leaves it out. Takes the fields validated so far, as pydantic
    passes them to a one-argument ``default_factory``: the value is this user's, so the generated
    config reference shows it as computed rather than the path of the machine that built it."""
    return str(data_dir() / STORE_FILE)
