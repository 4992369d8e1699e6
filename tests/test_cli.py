"""The command line in-process (``main([...])``): version, help, exit statuses, where the gateway is."""

from __future__ import annotations

import json
from importlib.metadata import version

import anyio
import pytest

from multiplexer.cli import main
from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.jsonrpc_helpers import closed_port, gateway_with_upstream
from tests.mcp_helpers import stdio_upstream

COMMANDS = {"serve": "run the gateway", "call": "make one call to a running gateway",
            "check-config": "validate a config file", "demo": "show the gateway at work, offline"}


async def cli(*argv: str) -> int:
    """``main`` off the event loop: ``call`` runs a loop of its own, as it does from a shell."""
    return await anyio.to_thread.run_sync(main, list(argv))


def test_version_is_the_installed_packages(capsys) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"multiplexer {version('multiplexer')}\n"


def test_help_is_plain_text_with_a_line_per_command_and_examples(capsys) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "``" not in out and out.startswith("usage: multiplexer [-h] [--version]")
    words = " ".join(out.split())  # argparse wraps a long command name onto a line of its own
    for name, summary in COMMANDS.items():
        assert f" {name} {summary} " in words, name
    examples = out.split("examples:\n", 1)[1].splitlines()
    assert [line.split()[:2] for line in examples] == [["multiplexer", "serve"], ["multiplexer", "call"]]
    for name in COMMANDS:
        assert main([name, "--help"]) == 0
        sub = capsys.readouterr().out
        assert sub.startswith(f"usage: multiplexer {name}") and "``" not in sub
        assert len(sub.split("examples:\n", 1)[1].strip().splitlines()) == 2, name


def test_a_usage_error_is_exit_status_2(capsys) -> None:
    assert main(["call"]) == 2
    assert "the following arguments are required: method" in capsys.readouterr().err


@pytest.mark.anyio
async def test_call_exits_1_on_an_mcp_tool_error_and_0_on_its_result(capsys) -> None:
    config = parse_config({"providers": {"tools": stdio_upstream()},
                           "routes": {"tools_*": {"provider": "tools"}}})
    async with running(config, port=0) as (_, url):
        failed = await cli("call", "tools_fail", '{"message": "it broke"}', "--url", url)
        failure = capsys.readouterr()
        ok = await cli("call", "tools_echo", '{"text": "hi"}', "--url", url)
        success = capsys.readouterr()
    assert failed == 1 and failure.out == ""
    result = json.loads(failure.err)
    assert result["isError"] is True and "it broke" in result["content"][0]["text"]
    assert ok == 0 and success.err == ""
    assert json.loads(success.out)["content"] == [{"type": "text", "text": "hi"}]


@pytest.mark.anyio
async def test_call_takes_url_and_key_from_the_environment_and_urls_without_a_scheme(
        capsys, monkeypatch) -> None:
    async with gateway_with_upstream(server={"api_keys": {"alice": "key-alice"}}) as (url, _, _):
        bare = url.removeprefix("http://")
        assert await cli("call", "subtract", "[10, 4]", "--url", bare, "--api-key", "key-alice") == 0
        assert capsys.readouterr().out == "6\n"
        monkeypatch.setenv("MULTIPLEXER_URL", bare)
        assert await cli("call", "subtract", "[10, 4]") == 1  # no key: refused by the gateway
        assert json.loads(capsys.readouterr().err)["code"] == -32005
        monkeypatch.setenv("MULTIPLEXER_API_KEY", "key-alice")
        assert await cli("call", "subtract", "[10, 5]") == 0
        assert capsys.readouterr().out == "5\n"


@pytest.mark.anyio
async def test_call_to_a_gateway_that_is_down_or_a_bad_url_is_one_line_and_exit_1(capsys) -> None:
    with closed_port() as port:
        assert await cli("call", "echo", "--url", f"127.0.0.1:{port}") == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"multiplexer call: cannot reach the gateway at http://127.0.0.1:{port} (ConnectError: ")
    assert lines[0].endswith("is `multiplexer serve` running there? (--url or MULTIPLEXER_URL picks another)")
    assert await cli("call", "echo", "--url", "ftp://127.0.0.1:8080") == 1
    assert capsys.readouterr().err.splitlines() == [
        "multiplexer call: gateway URL 'ftp://127.0.0.1:8080': the scheme must be http or https, not 'ftp'"]
