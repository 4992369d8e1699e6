"""The SDK: call, call_many chunking and order, errors in place, the sync form, the CLI call."""

from __future__ import annotations

import contextlib
import socket
import sys
from collections.abc import AsyncIterator

import anyio
import anyio.abc
import pytest

from multiplexer import Client, RpcError, SyncClient
from tests.jsonrpc_helpers import closed_port, gateway_with_upstream

pytestmark = pytest.mark.anyio


async def test_call_many_chunks_under_the_server_limit_and_keeps_order() -> None:
    async with gateway_with_upstream(server={"max_batch_items": 50}) as (url, _, _):
        async with Client(url, batch_size=50) as client:
            calls = [("subtract", [i, 1]) if i % 7 else ("nope", {}) for i in range(523)]
            results = await client.call_many(calls)
        assert len(results) == 523
        for i, r in enumerate(results):
            if i % 7:
                assert r == i - 1
            else:
                assert isinstance(r, RpcError) and r.code == -32601
        async with Client(url, batch_size=50) as client:
            with pytest.raises(RpcError):
                await client.call_many(calls, raise_errors=True)


async def test_client_reports_batch_too_large_when_misconfigured() -> None:
    async with gateway_with_upstream(server={"max_batch_items": 10}) as (url, _, _):
        async with Client(url, batch_size=20) as client:
            results = await client.call_many([("subtract", [1, 1])] * 20)
        assert all(isinstance(r, RpcError) and r.code == -32600 for r in results)


async def test_sync_client_and_cli_call() -> None:
    async with gateway_with_upstream() as (url, _, _):
        def sync_part() -> tuple[int, list]:
            client = SyncClient(url)
            return client.call("subtract", [5, 2]), client.call_many([("get_data", None)] * 3)

        one, many = await anyio.to_thread.run_sync(sync_part)
        assert one == 3 and many == [["hello", 5]] * 3
        proc = await anyio.run_process(
            [sys.executable, "-m", "multiplexer", "call", "subtract", "[10, 4]", "--url", url],
            check=False)
        assert proc.returncode == 0 and proc.stdout.decode().strip() == "6"
        proc = await anyio.run_process(
            [sys.executable, "-m", "multiplexer", "call", "nope", "--url", url], check=False)
        assert proc.returncode == 1 and b"-32601" in proc.stderr


@contextlib.asynccontextmanager
async def counting_proxy(target: str) -> AsyncIterator[tuple[str, list[int]]]:
    """A TCP relay in front of ``target`` (http://host:port) that counts the connections it accepts."""
    host, port = target.removeprefix("http://").split(":")
    accepted: list[int] = []
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")

    async def pipe(src: anyio.abc.ByteStream, dst: anyio.abc.ByteStream) -> None:
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            while True:
                await dst.send(await src.receive())

    async def relay(client: anyio.abc.SocketStream) -> None:
        accepted.append(1)
        async with client, await anyio.connect_tcp(host, int(port)) as up, anyio.create_task_group() as tg:
            tg.start_soon(pipe, client, up)
            await pipe(up, client)
            tg.cancel_scope.cancel()

    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, relay)
        yield f"http://127.0.0.1:{listener.extra(anyio.abc.SocketAttribute.local_port)}", accepted
        tg.cancel_scope.cancel()


async def test_sync_client_in_a_with_block_reuses_one_connection() -> None:
    async with gateway_with_upstream() as (url, _, _), counting_proxy(url) as (proxied, accepted):
        def kept() -> list[int]:
            with SyncClient(proxied) as client:
                return [client.call("subtract", [i, 1]) for i in range(20)]

        def loose() -> list[int]:
            client = SyncClient(proxied)
            return [client.call("subtract", [i, 1]) for i in range(3)]

        assert await anyio.to_thread.run_sync(kept) == [i - 1 for i in range(20)]
        assert len(accepted) == 1  # one loop and one client for the whole block
        assert await anyio.to_thread.run_sync(loose) == [-1, 0, 1]
        assert len(accepted) == 4  # outside a with block, each call opens its own


async def test_cli_failures_are_one_clear_line_and_a_nonzero_exit(tmp_path) -> None:
    """A taken port and a gateway that is not running: what failed and what to do, no traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        conf = tmp_path / "c.yaml"
        conf.write_text("providers: {b: {kind: echo}}\nroutes: {echo: {provider: b}}\n")
        proc = await anyio.run_process([sys.executable, "-m", "multiplexer", "serve", "--config",
                                        str(conf), "--port", str(port)], check=False)
    assert proc.returncode == 1
    assert proc.stderr.decode().strip().splitlines() == [
        f"multiplexer serve: cannot listen on 127.0.0.1:{port}: Address already in use "
        "(is another gateway running? choose another with --port)"]
    proc = await anyio.run_process([sys.executable, "-m", "multiplexer", "call", "echo",
                                    "--url", f"http://127.0.0.1:{port}"], check=False)
    lines = proc.stderr.decode().strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"multiplexer call: cannot reach the gateway at http://127.0.0.1:{port}")
    assert "is `multiplexer serve` running there?" in lines[0]


async def test_a_face_that_cannot_be_imported_fails_startup_with_a_clear_line() -> None:
    """A broken MCP install used to start the gateway without /mcp, silently."""
    script = ("import sys; sys.modules['mcp.server.streamable_http_manager'] = None; "
              "from multiplexer.cli import main; sys.exit(main(['serve', '--port', '0']))")
    with anyio.fail_after(60):
        proc = await anyio.run_process([sys.executable, "-c", script], check=False)
    lines = proc.stderr.decode().strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, lines
    assert lines[0].startswith("multiplexer serve: cannot load the server and its faces (ModuleNotFoundError")
    assert "mcp.server.streamable_http_manager" in lines[0]


async def test_a_gateway_that_is_down_is_an_rpc_error_naming_the_url_for_every_helper() -> None:
    """call, call_many (both modes), the sync form and the job helpers: -32007 with the URL and
    the transport's own error, never a raw httpx exception."""
    from multiplexer.sdk.jobs import job_results, wait_job

    def check(err: BaseException, url: str) -> None:
        assert isinstance(err, RpcError) and err.code == -32007, repr(err)
        assert err.message == "cannot reach the gateway"
        assert err.data is not None and err.data["url"] == url
        assert err.data["error"].startswith("ConnectError: ")

    with closed_port() as port:
        url = f"http://127.0.0.1:{port}"
        async with Client(url) as client:
            with pytest.raises(RpcError) as one:
                await client.call("echo", {})
            check(one.value, url)
            many = await client.call_many([("echo", {"i": i}) for i in range(3)])
            for err in many:
                check(err, url)
            with pytest.raises(RpcError) as job:
                await client.call_many([("echo", {})], mode="batch")
            check(job.value, url)
            with pytest.raises(RpcError) as waited:  # unreachable for longer than it waits: given up
                await wait_job(client, "job-1", poll_interval=0.01, unreachable_for=0.0)
            check(waited.value, url)
            with pytest.raises(RpcError) as paged:
                await job_results(client, "job-1", 1)
            check(paged.value, url)

        def sync_part() -> list[BaseException]:
            with pytest.raises(RpcError) as loose:  # a loop and a client of its own
                SyncClient(url).call("echo", {})
            with SyncClient(url) as client, pytest.raises(RpcError) as kept:  # the portal's client
                client.call("echo", {})
            return [loose.value, kept.value]

        errors = await anyio.to_thread.run_sync(sync_part)
    assert len(errors) == 2
    for err in errors:
        check(err, url)


async def test_url_and_key_come_from_the_environment_and_a_url_may_omit_its_scheme(monkeypatch) -> None:
    async with gateway_with_upstream(server={"api_keys": {"alice": "key-alice"}}) as (url, _, _):
        bare = url.removeprefix("http://")
        monkeypatch.setenv("MULTIPLEXER_URL", bare)
        monkeypatch.setenv("MULTIPLEXER_API_KEY", "key-alice")
        async with Client() as client:  # both from the environment, the URL without a scheme
            assert client.base_url == url
            assert await client.call("subtract", [5, 2]) == 3
        monkeypatch.delenv("MULTIPLEXER_URL")
        async with Client(bare + "/", api_key="key-alice") as client:
            assert client.base_url == url and await client.call("subtract", [7, 2]) == 5
        async with Client(bare, api_key="wrong") as client:  # an explicit key wins over the variable
            with pytest.raises(RpcError) as refused:
                await client.call("subtract", [1, 1])
        assert refused.value.code == -32005
        assert await anyio.to_thread.run_sync(lambda: SyncClient(bare).call("subtract", [9, 1])) == 8


def test_a_url_with_another_scheme_is_refused_in_one_line(monkeypatch) -> None:
    with pytest.raises(ValueError) as bad:
        Client("ftp://127.0.0.1:8080")
    assert str(bad.value) == ("gateway URL 'ftp://127.0.0.1:8080': the scheme must be http or https, "
                              "not 'ftp'")
    monkeypatch.setenv("MULTIPLEXER_URL", "redis://127.0.0.1:6379")
    with pytest.raises(ValueError, match="not 'redis'"):
        Client()
