"""Opening the job store's PostgreSQL connection (``store.url``), and why it failed, in one line.

libpq says what went wrong in a multi-line message under a 50-line traceback; the operator
needs the key, the URL and the fix (``createdb`` for a missing database), so a failed
connection becomes a ``StartupError``.
"""

from __future__ import annotations

from typing import Any

from multiplexer.core.startup import StartupError

CONNECT_TIMEOUT_S = 10  # unless the URL says otherwise: a host that never answers is an error too


def connect(url: str) -> Any:
    """An autocommit connection to ``url``; a ``StartupError`` naming the problem if there is none."""
    import psycopg
    from psycopg.conninfo import conninfo_to_dict

    params = conninfo_to_dict(url)
    options: dict[str, Any] = {} if "connect_timeout" in params else {"connect_timeout": CONNECT_TIMEOUT_S}
    try:
        return psycopg.connect(url, autocommit=True, **options)
    except psycopg.OperationalError as e:
        raise StartupError("store.url", url, why(str(e), params)) from None


def why(message: str, params: dict[str, Any]) -> str:
    """libpq's message (``connection failed: connection to server at ... failed: FATAL: ...``)
    as what the operator reads: the server's own words, a connection failure's cause, a fix."""
    reason = message.strip().splitlines()[0].rpartition("failed: ")[2].strip()
    if not reason.startswith("FATAL:"):
        return f"cannot connect ({reason or message.strip()})"
    reason = reason.removeprefix("FATAL:").strip()
    if reason.startswith("database ") and reason.endswith("does not exist"):
        return f"{reason}; create it with `{createdb(params)}`"
    if "authentication failed" in reason:
        return f"{reason}; check the user and password in store.url"
    return reason


def createdb(params: dict[str, Any]) -> str:
    """The command that creates the URL's database on its server, as its user."""
    words = ["createdb"]
    if params.get("host"):
        words += ["-h", str(params["host"])]
    if params.get("port") and str(params["port"]) != "5432":
        words += ["-p", str(params["port"])]
    if params.get("user"):
        words += ["-U", str(params["user"])]
    return " ".join([*words, str(params.get("dbname", ""))]).strip()
