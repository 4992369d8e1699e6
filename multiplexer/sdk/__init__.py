"""The Python SDK: ``Client`` / ``SyncClient`` over HTTP JSON-RPC, needing only httpx and the codec."""
