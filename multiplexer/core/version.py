"""The package version, importable from anywhere without pulling in the SDK.

Read from the installed package's metadata, so ``multiplexer --version``, the MCP client
info and the trace resource all say what ``pip`` installed rather than a copy kept by hand.
"""

from importlib.metadata import PackageNotFoundError, version


def _installed() -> str:
    try:
        return version("multiplexer")
    except PackageNotFoundError:  # a source tree on sys.path that was never installed
        return "0+unknown"


VERSION = _installed()
