"""Fakes of Azure OpenAI, Groq and Together: the OpenAI fake's answers behind each vendor's
addresses, auth and Batch API quirks, written from ``shared/notes/batch-providers.md``.

- Azure OpenAI (section 2): ``api-key`` header; classic deployment URLs
  ``/openai/deployments/{deployment}/{chat/completions|embeddings}?api-version=`` and the v1 API
  ``/openai/v1/...``; files and batches at ``/openai/files`` and ``/openai/batches`` (or
  ``/openai/v1/...``) with ``api-version`` required on the classic ones; a create names
  ``/chat/completions``; only ``24h``; every line's ``model`` a known batch deployment; statuses
  spelled ``Validating``, ``Completed`` (the samples); ``token_limit_exceeded`` on a full quota.
- Groq (section 4): under ``/openai/v1``; windows ``24h`` to ``7d``; cursor listing.
- Together (section 4): ``purpose=batch-api``; the create reply wrapped in ``{"job": ...}``,
  retrieve bare; upper-case statuses; no metadata kept; listing a bare array.
"""

from __future__ import annotations

from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.fakes.common import ApiError, Dialect, guarded_route, json_body, not_found_handlers
from tests.fakes.openai_batch import BatchVariant, batch_routes
from tests.fakes.openai_fake import (
    DIALECT,
    FakeOpenAIState,
    chat_completion,
    embeddings,
    stream_chat,
)

__all__ = ["AZURE_API_VERSION", "create_azure_app", "create_groq_app", "create_together_app"]

AZURE_API_VERSION = "2024-10-21"
GROQ_WINDOWS = frozenset({"24h", "48h", "72h", "4d", "5d", "6d", "7d"})


def _azure_auth(request: Request) -> ApiError | None:
    if request.headers.get("api-key", "").strip():
        return None
    return ApiError(401, "Access denied due to invalid subscription key or wrong API endpoint. "
                    "Make sure to provide a valid key for an active subscription.")


AZURE_DIALECT = Dialect(check_auth=_azure_auth, render_error=DIALECT.render_error,
                        limit_headers=DIALECT.limit_headers, request_id_header="apim-request-id")


def _capitalised(status: str) -> str:
    return status[:1].upper() + status[1:]


def _endpoints(state: FakeOpenAIState) -> dict[str, Any]:
    return {"/v1/chat/completions": chat_completion, "/v1/embeddings": embeddings}


def _generation(state: FakeOpenAIState, path: str, body: dict[str, Any]) -> Response:
    if path.endswith("/embeddings"):
        result = embeddings(state, body)
        state.embedding_batch_sizes.append(len(result["data"]))
        return JSONResponse(result)
    result = chat_completion(state, body)
    state.bodies.setdefault(path, []).append(body)
    if body.get("stream"):
        return stream_chat(state, body, result)
    return JSONResponse(result)


def create_azure_app(state: FakeOpenAIState | None = None, deployments: frozenset[str] = frozenset(
        {"gpt-4o-batch", "gpt-4o", "embed-3"})) -> Starlette:
    """Azure OpenAI: classic deployment routes and the v1 API side by side on one resource."""
    fake = FakeOpenAIState() if state is None else state

    def deployed(model: Any) -> str:
        if model not in deployments:
            raise ApiError(404, f"The API deployment for this resource does not exist: {model}",
                           code="DeploymentNotFound")
        return str(model)

    def classic(kind: str) -> Any:
        async def endpoint(request: Request) -> Response:
            if request.query_params.get("api-version") is None:
                raise ApiError(404, "Resource not found")
            body = await json_body(request)
            deployment = deployed(request.path_params["deployment"])
            return _generation(fake, f"/openai/deployments/{{deployment}}/{kind}",
                               {**body, "model": deployment})
        return endpoint

    def v1(kind: str) -> Any:
        async def endpoint(request: Request) -> Response:
            body = await json_body(request)
            deployed(body.get("model"))
            return _generation(fake, f"/openai/v1/{kind}", body)
        return endpoint

    def batch_line(answer: Any) -> Any:
        def run(st: FakeOpenAIState, body: dict[str, Any]) -> dict[str, Any]:
            deployed(body.get("model"))
            return answer(st, body)
        return run

    operations = {"/v1/chat/completions": batch_line(chat_completion),
                  "/v1/embeddings": batch_line(embeddings)}
    creates = {"/chat/completions": "/v1/chat/completions", "/embeddings": "/v1/embeddings"}
    common = {"purpose": "batch", "spell": _capitalised, "create_endpoints": creates}
    routes: list[Route] = []
    for kind in ("chat/completions", "embeddings"):
        routes.append(guarded_route(f"/openai/deployments/{{deployment}}/{kind}", ["POST"],
                                    classic(kind), fake, AZURE_DIALECT))
        routes.append(guarded_route(f"/openai/v1/{kind}", ["POST"], v1(kind), fake, AZURE_DIALECT))
    routes += batch_routes(fake, AZURE_DIALECT, operations, BatchVariant(
        files="/openai/files", batches="/openai/batches", query=("api-version",), **common))
    routes += batch_routes(fake, AZURE_DIALECT, operations, BatchVariant(
        files="/openai/v1/files", batches="/openai/v1/batches", **common))
    app = Starlette(routes=routes, exception_handlers=not_found_handlers(AZURE_DIALECT))
    app.state.fake = fake
    return app


def _openai_shaped(state: FakeOpenAIState | None, prefix: str, variant: BatchVariant) -> Starlette:
    fake = FakeOpenAIState() if state is None else state

    def generation(path: str) -> Any:
        async def endpoint(request: Request) -> Response:
            return _generation(fake, path, await json_body(request))
        return endpoint

    routes = [guarded_route(prefix + p, ["POST"], generation(prefix + p), fake, DIALECT)
              for p in ("/chat/completions", "/embeddings")]
    routes += batch_routes(fake, DIALECT, _endpoints(fake), variant)
    app = Starlette(routes=routes, exception_handlers=not_found_handlers(DIALECT))
    app.state.fake = fake
    return app


def create_groq_app(state: FakeOpenAIState | None = None) -> Starlette:
    """Groq: the OpenAI API under ``/openai/v1``, windows up to 7 days, cursor listing."""
    return _openai_shaped(state, "/openai/v1", BatchVariant(
        files="/openai/v1/files", batches="/openai/v1/batches", windows=GROQ_WINDOWS,
        listing="cursor"))


def create_together_app(state: FakeOpenAIState | None = None) -> Starlette:
    """Together: ``batch-api`` files, a wrapped create reply, upper-case statuses, no metadata."""
    return _openai_shaped(state, "/v1", BatchVariant(
        purpose="batch-api", wrap_create=True, spell=str.upper, metadata=False, listing="array"))
