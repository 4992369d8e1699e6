"""OpenAI- and Anthropic-compatible HTTP surfaces (``/v1/...``), mounted next to ``/rpc``."""

from __future__ import annotations

import functools
from pathlib import Path

from starlette.routing import BaseRoute, Route

from multiplexer.faces.auth import Authenticator
from multiplexer.faces.v1.anthropic import ANTHROPIC, CountTokens, Messages
from multiplexer.faces.v1.batch_run import Batches, surfaces_for
from multiplexer.faces.v1.common import V1
from multiplexer.faces.v1.file_sweep import sweep_forever
from multiplexer.faces.v1.files import (
    CancelBatch,
    CreateBatch,
    DeleteFile,
    FileContent,
    FileInfo,
    GetBatch,
    ListBatches,
    ListFiles,
    Upload,
)
from multiplexer.faces.v1.message_batches import (
    CancelMessageBatch,
    CreateMessageBatch,
    DeleteMessageBatch,
    GetMessageBatch,
    ListMessageBatches,
    MessageBatches,
    MessageBatchResults,
)
from multiplexer.faces.v1.openai import OPENAI, ChatCompletions, Completions, Embeddings, Models, Responses
from multiplexer.faces.v1.store import V1Store
from multiplexer.gateway.gateway import Gateway


def v1_routes(gateway: Gateway, auth: Authenticator) -> list[BaseRoute]:
    """The routes; batches a stopped gateway left running resume in the background."""
    v1 = V1(gateway, auth)
    conf = gateway.config.store
    store = V1Store(Path(conf.path), conf.url, conf.lease_s, conf.schema_)
    batches = Batches(v1, store, surfaces_for(OPENAI, ANTHROPIC))
    retention = conf.retention_s
    purge = [functools.partial(batches.purge_forever, retention)] if retention is not None else []
    purge.append(functools.partial(sweep_forever, store, batches, gateway.config.server.files))
    gateway.start_background(batches.runner.run, Path(conf.path).exists() or conf.url is not None,
                             purge)  # the purge stops before the runner lets the store go
    gateway.faces["v1_batches"] = batches
    limit = gateway.config.server.max_file_bytes
    files = (v1, store, batches, limit)
    messages = (v1, MessageBatches(batches))
    return [
        Route("/v1/chat/completions", ChatCompletions(v1), methods=["POST"]),
        Route("/v1/responses", Responses(v1), methods=["POST"]),
        Route("/v1/completions", Completions(v1), methods=["POST"]),
        Route("/v1/embeddings", Embeddings(v1), methods=["POST"]),
        Route("/v1/models", Models(v1), methods=["GET"]),
        Route("/v1/models/{model:path}", Models(v1), methods=["GET"]),
        Route("/v1/messages", Messages(v1), methods=["POST"]),
        Route("/v1/messages/count_tokens", CountTokens(v1), methods=["POST"]),
        Route("/v1/files", Upload(*files), methods=["POST"]),
        Route("/v1/files", ListFiles(*files), methods=["GET"]),
        Route("/v1/files/{file_id}", FileInfo(*files), methods=["GET"]),
        Route("/v1/files/{file_id}", DeleteFile(*files), methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", FileContent(*files), methods=["GET"]),
        Route("/v1/batches", CreateBatch(*files), methods=["POST"]),
        Route("/v1/batches", ListBatches(*files), methods=["GET"]),
        Route("/v1/batches/{batch_id}", GetBatch(*files), methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", CancelBatch(*files), methods=["POST"]),
        Route("/v1/messages/batches", CreateMessageBatch(*messages), methods=["POST"]),
        Route("/v1/messages/batches", ListMessageBatches(*messages), methods=["GET"]),
        Route("/v1/messages/batches/{batch_id}", GetMessageBatch(*messages), methods=["GET"]),
        Route("/v1/messages/batches/{batch_id}", DeleteMessageBatch(*messages),
              methods=["DELETE"]),
        Route("/v1/messages/batches/{batch_id}/cancel", CancelMessageBatch(*messages),
              methods=["POST"]),
        Route("/v1/messages/batches/{batch_id}/results", MessageBatchResults(*messages),
              methods=["GET"]),
    ]
