"""A service the config names cannot be used at start: one line for the operator, no traceback.

Raised where the connection is made (the shared state's engine, the job store), caught by
the CLI, which prints it and exits non-zero; it names the key and its URL (password hidden).
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit


class StartupError(RuntimeError):
    """``<key> <url>: <what is wrong>[; <what to do>]``."""

    def __init__(self, key: str, url: str, problem: str) -> None:
        super().__init__(f"{key} {shown_url(url)}: {problem}")


def shown_url(url: str) -> str:
    """``url`` with its password replaced by ``***``, fit for a log or a terminal."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def os_reason(error: BaseException) -> str | None:
    """The operating system's words for the first OS error in ``error``'s chain
    (``Connection refused``), or None when the chain holds none."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, TimeoutError):
            return "timed out"
        if isinstance(seen, OSError) and seen.errno is not None:  # asyncio words it its own way
            return os.strerror(seen.errno) if seen.errno > 0 else (seen.strerror or str(seen))
        seen = seen.__cause__ or seen.__context__
    return None
