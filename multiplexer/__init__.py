"""multiplexer: one gateway in front of models and tools, batching many small calls."""

from multiplexer.core.errors import Code, RpcError
from multiplexer.core.version import VERSION as __version__
from multiplexer.sdk.client import Client, SyncClient

__all__ = ["Client", "Code", "RpcError", "SyncClient", "__version__"]
