"""multiplexer: one gateway in front of models and tools, batching many small calls."""

from .client import Client, SyncClient
from .errors import Code, RpcError

__all__ = ["Client", "Code", "RpcError", "SyncClient"]
__version__ = "0.1.0"
