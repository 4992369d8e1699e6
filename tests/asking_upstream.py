"""An upstream MCP server (``mcp`` 2.x) whose tools ask their client: elicitation (form and URL),
sampling and roots, in whichever era the connection speaks: 2026-07-28 as ``input_required``
results, the handshake eras as requests pushed mid-call.

    python tests/asking_upstream.py                    # MCP over stdio
    python tests/asking_upstream.py --http --port 9010  # Streamable HTTP at /mcp
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import anyio
import mcp_types as types
from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.resolve import Elicit, ListRoots, Resolve, Sample
from pydantic import BaseModel

server = MCPServer("asking-upstream")


class Name(BaseModel):
    name: str


def ask_name() -> Elicit[Name]:
    return Elicit("What is your name?", Name)


def sample_haiku(topic: str) -> Sample:
    hints = types.ModelPreferences(hints=[types.ModelHint(name="chat")])
    return Sample([types.SamplingMessage(role="user", content=types.TextContent(type="text", text=topic))],
                  max_tokens=16, model_preferences=hints)


def roots() -> ListRoots:
    return ListRoots()


@server.tool(description="Returns the text it was given (asks nothing)")
def plain(text: str) -> str:
    return text


@server.tool(description="Asks the user's name (a form), then greets them")
def greet(name: Annotated[Name, Resolve(ask_name)]) -> str:
    return f"hello {name.name}"


@server.tool(description="Asks the client's model to write about a topic")
def haiku(topic: str, reply: Annotated[types.CreateMessageResult, Resolve(sample_haiku)]) -> str:
    content = reply.content
    text = content.text if isinstance(content, types.TextContent) else "?"
    return f"{reply.model}: {text}"


def sample_with_tools() -> Sample:
    lookup = types.Tool(name="lookup", input_schema={"type": "object"})
    message = types.SamplingMessage(role="user", content=types.TextContent(type="text", text="look it up"))
    return Sample([message], max_tokens=16, tools=[lookup])


@server.tool(description="Asks the client's model, offering it a tool")
def tooled(reply: Annotated[types.CreateMessageResultWithTools, Resolve(sample_with_tools)]) -> str:
    return f"{reply.model}: {len(reply.content_as_list)} block(s)"


@server.tool(description="Lists the client's roots")
def where(found: Annotated[types.ListRootsResult, Resolve(roots)]) -> str:
    return ",".join(str(r.uri) for r in found.roots)


@server.tool(description="Sends the user to a URL (URL mode elicitation)")
async def visit(ctx: Context) -> str | types.InputRequiredResult:
    if ctx.protocol_version == "2026-07-28":
        answered = ctx.input_responses or {}
        if "visit" not in answered:
            params = types.ElicitRequestURLParams(message="Sign in", url="https://example.test/login",
                                                  elicitation_id="e1")
            return types.InputRequiredResult(input_requests={"visit": types.ElicitRequest(params=params)})
        answer = answered["visit"]
        assert isinstance(answer, types.ElicitResult)
        return answer.action
    result = await ctx.elicit_url("Sign in", "https://example.test/login", "e1")
    return result.action


ASKED_AT = [0.0]  # when ``timed`` last asked (2026-07-28: its answer comes with a later request)
NAME_FORM = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@server.tool(description="Asks a name; returns the ms its answer took to come back, as this server saw")
async def timed(ctx: Context) -> str | types.InputRequiredResult:
    if ctx.protocol_version == "2026-07-28":
        if not ctx.input_responses:
            ASKED_AT[0] = time.perf_counter()
            params = types.ElicitRequestFormParams(message="name?", requested_schema=NAME_FORM)
            return types.InputRequiredResult(input_requests={"name": types.ElicitRequest(params=params)})
        return f"{(time.perf_counter() - ASKED_AT[0]) * 1000:.4f}"
    began = time.perf_counter()
    await ctx.elicit("name?", Name)
    return f"{(time.perf_counter() - began) * 1000:.4f}"


@server.tool(description="Asks a name; writes `cancelled` to `marker` if the call is cancelled meanwhile")
async def held(marker: str, ctx: Context) -> str:
    try:
        if ctx.protocol_version == "2026-07-28":
            return "modern"
        result = await ctx.elicit("Still there?", Name)
        return result.action
    except anyio.get_cancelled_exc_class():
        Path(marker).write_text("cancelled")
        raise


def main() -> None:
    if "--http" not in sys.argv:
        server.run("stdio")
        return
    port = int(sys.argv[sys.argv.index("--port") + 1])
    server.run("streamable-http", host="127.0.0.1", port=port)  # type: ignore[call-arg]


if __name__ == "__main__":
    main()
