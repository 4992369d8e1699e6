"""``/v1/files`` with bounds: uploads streamed to disk and into the store a chunk at a time (cut
off with a 413 as soon as they pass ``server.max_file_bytes``), storage quotas per key and team,
and OpenAI's ``expires_after`` (expired files are not served, and a sweep deletes them)."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from multiplexer.faces.v1.file_store import STALE_S
from multiplexer.faces.v1.file_sweep import sweep_files
from multiplexer.faces.v1.store import V1Store
from multiplexer.gateway.config import parse_config
from multiplexer.jobs.v1_files import CHUNK
from multiplexer.server import running
from tests.remote_helpers import fakes
from tests.test_v1_batches import config, jsonl, line, until_ended
from tests.test_v1_openai import KEY

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.anyio

BOB, CAROL = "sk-files-bob", "sk-files-carol"
DAY = 86400


class Wall:
    """The store's wall clock, moved by the test."""

    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@asynccontextmanager
async def gateway(tmp_path: Path, **server: Any) -> AsyncIterator[tuple[Any, str, Wall]]:
    async with fakes() as f, running(parse_config(config(f, tmp_path, **server)), port=0) as (gw, url):
        wall = Wall()
        gw.faces["v1_batches"].store.wall = wall
        yield gw, url, wall


def client(url: str, key: str = KEY) -> Any:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def error_of(e: Any) -> dict[str, Any]:
    return e.response.json()["error"]  # type: ignore[no-any-return]


def leftovers(tmp_path: Path) -> list[str]:
    folder = tmp_path / "jobs.db.uploads"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


async def test_a_file_goes_up_and_comes_back_byte_for_byte_across_chunks(tmp_path):
    content = bytes(range(256)) * (CHUNK * 5 // 2 // 256) + b"tail"  # two and a half chunks
    async with gateway(tmp_path) as (gw, url, _), client(url) as c:
        up = await c.files.create(file=("data.bin", content), purpose="user_data")
        assert up.bytes == len(content) and up.filename == "data.bin"
        assert (await c.files.content(up.id)).content == content
        empty = await c.files.create(file=("empty.jsonl", b""), purpose="user_data")
        assert empty.bytes == 0 and (await c.files.content(empty.id)).content == b""
        st = gw.faces["v1_batches"].store.store()
        assert st._x("SELECT COUNT(*) FROM v1_file_chunks WHERE file_id=?", (up.id,)).fetchone() == (3,)
    assert leftovers(tmp_path) == []  # each upload's temporary file is gone


async def test_an_upload_over_max_file_bytes_is_cut_off_early_with_a_413(tmp_path):
    """A body without a length is read only until its file part passes the limit: the 413 comes
    back while the client is still sending, and nothing is left on disk."""
    limit = 64 * 1024
    async with gateway(tmp_path, max_file_bytes=limit) as (_, url, _):
        port = int(url.rsplit(":", 1)[1])
        head = (b"POST /v1/files HTTP/1.1\r\nhost: x\r\nauthorization: Bearer " + KEY.encode()
                + b"\r\ncontent-type: multipart/form-data; boundary=b\r\ntransfer-encoding: chunked\r\n\r\n")
        part = b'--b\r\ncontent-disposition: form-data; name="file"; filename="big"\r\n\r\n'
        sent, reply, meant = 0, b"", 1024 * limit  # 64 MiB, more than any socket buffers
        async with await anyio.connect_tcp("127.0.0.1", port) as sock:
            await sock.send(head + b"%x\r\n%s\r\n" % (len(part), part))
            piece = b"x" * limit
            with anyio.fail_after(20):
                while b"\r\n\r\n" not in reply and sent < meant:
                    try:
                        await sock.send(b"%x\r\n%s\r\n" % (len(piece), piece))
                        sent += len(piece)
                    except (anyio.BrokenResourceError, OSError):
                        break
                    with anyio.move_on_after(0.001):
                        reply += await sock.receive()
                while b"\r\n\r\n" not in reply:
                    reply += await sock.receive()
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        assert sent < meant // 2  # cut off early: answered long before the body was sent
        async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {KEY}"}) as h:
            declared = await h.post("/v1/files", data={"purpose": "batch"},
                                    files={"file": ("big.jsonl", b"x" * (limit + 1))})
            assert declared.status_code == 413
            error = declared.json()["error"]
            assert error["param"] == "file" and str(limit) in error["message"]
            assert "server.max_file_bytes" in error["message"]
    assert leftovers(tmp_path) == []


async def test_bad_forms_get_a_400_naming_the_field_and_leave_nothing_behind(tmp_path):
    async with gateway(tmp_path) as (_, url, _), client(url) as c:
        with pytest.raises(openai.BadRequestError) as e:
            await c.files.create(file=("in.jsonl", b"{}\n"), purpose="nope")  # type: ignore[arg-type]
        assert error_of(e.value)["param"] == "purpose"
        async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {KEY}"}) as h:
            no_file = await h.post("/v1/files", data={"purpose": "batch"}, files={"other": ("x", b"1")})
            assert no_file.status_code == 400 and no_file.json()["error"]["param"] == "file"
            not_a_form = await h.post("/v1/files", json={"purpose": "batch"})
            assert not_a_form.status_code == 400
            assert "multipart/form-data" in not_a_form.json()["error"]["message"]
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize(("fields", "param"), [
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "3599"}, "expires_after[seconds]"),
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "2592001"},
     "expires_after[seconds]"),
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "-3600"}, "expires_after[seconds]"),
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "1e4"}, "expires_after[seconds]"),
    ({"expires_after[anchor]": "created_at"}, "expires_after[seconds]"),
    ({"expires_after[seconds]": "3600"}, "expires_after[anchor]"),
    ({"expires_after[anchor]": "last_active_at", "expires_after[seconds]": "3600"},
     "expires_after[anchor]"),
    ({"expires_after": '{"anchor": "created_at", "seconds": 3600}'}, "expires_after"),
])
async def test_a_bad_expires_after_is_refused_naming_it(tmp_path, fields, param):
    async with gateway(tmp_path) as (_, url, _), \
            httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {KEY}"}) as h:
        r = await h.post("/v1/files", data={"purpose": "batch", **fields},
                         files={"file": ("in.jsonl", b"{}\n")})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param


async def test_expires_after_sets_expires_at_and_an_expired_file_is_not_served(tmp_path):
    async with gateway(tmp_path) as (gw, url, wall), client(url) as c:
        rows = [line("e0", {"model": "mock-embed", "input": "t0"}, "/v1/embeddings")]
        kept = await c.files.create(file=("keep.jsonl", b"{}\n"), purpose="user_data")
        short = await c.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch",
                                     expires_after={"anchor": "created_at", "seconds": 3600})
        default = await c.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
        assert kept.expires_at is None  # only batch files expire unless asked
        assert short.expires_at == short.created_at + 3600 == int(wall.now) + 3600
        assert default.expires_at == default.created_at + 30 * DAY  # OpenAI's default for batch
        assert (await c.files.retrieve(short.id)).expires_at == short.expires_at

        wall.now += 3600  # expired at expires_at
        for call in (c.files.retrieve(short.id), c.files.content(short.id),
                     c.batches.create(input_file_id=short.id, endpoint="/v1/embeddings",
                                      completion_window="24h")):
            with pytest.raises(openai.NotFoundError):
                await call
        assert {f.id async for f in c.files.list()} == {kept.id, default.id}
        batch = await c.batches.create(input_file_id=default.id, endpoint="/v1/embeddings",
                                       completion_window="24h")
        assert (await until_ended(c, batch.id)).status == "completed"

        store = gw.faces["v1_batches"].store
        assert await sweep_files(store, gw.faces["v1_batches"], step=1) == 1
        st = store.store()
        assert st._x("SELECT COUNT(*) FROM v1_files WHERE id=?", (short.id,)).fetchone() == (0,)
        assert st._x("SELECT COUNT(*) FROM v1_file_chunks WHERE file_id=?", (short.id,)).fetchone() == (0,)
        wall.now += 30 * DAY
        assert await sweep_files(store, gw.faces["v1_batches"], step=1) == 1  # the default one
        assert [f.id async for f in c.files.list()] == [kept.id]


async def test_the_sweep_runs_by_itself_every_sweep_s(tmp_path):
    async with gateway(tmp_path, files={"sweep_s": 0.05}) as (gw, url, wall), client(url) as c:
        up = await c.files.create(file=("in.jsonl", b"{}\n"), purpose="batch",
                                  expires_after={"anchor": "created_at", "seconds": 3600})
        st = gw.faces["v1_batches"].store.store()
        wall.now += 7200
        with anyio.fail_after(10):
            while st._x("SELECT COUNT(*) FROM v1_files WHERE id=?", (up.id,)).fetchone() != (0,):
                await anyio.sleep(0.02)


async def test_the_sweep_keeps_a_running_batchs_bodies_before_deleting_its_input(tmp_path):
    """A batch still running on an expired input file keeps its bodies first: keep_bodies sees the
    expired file (as it does a file its owner deletes), the sweep deletes it after."""
    store = V1Store(tmp_path / "jobs.db")
    store.wall = wall = Wall()
    up = await store.put_file("alice", "in.jsonl", "batch", b'{"a": 1}\n', expires_s=3600)
    seen: list[bytes | None] = []

    class Batches:
        async def keep_bodies(self, file_id: str, owner: str | None) -> None:
            found = await store.file(file_id, owner)
            seen.append(None if found is None else await store.content(found))

    wall.now += 3600
    assert await store.file(up.id, "alice") is None
    assert await sweep_files(store, Batches(), step=10) == 1  # type: ignore[arg-type]
    assert seen == [b'{"a": 1}\n']
    wall.now -= 3600  # even unexpired, it is gone
    assert await store.file(up.id, "alice") is None
    store.close()


async def test_an_upload_that_never_finished_and_its_temporary_file_are_swept(tmp_path):
    from multiplexer.faces.v1.upload_form import clear_stale
    from multiplexer.jobs.v1_files import NewFile

    store = V1Store(tmp_path / "jobs.db")
    store.wall = wall = Wall()
    st = store.store()
    st.reserve_file(NewFile("file-gone", "alice", "", "in.jsonl", "batch", 10, int(wall.now), None),
                    [("owner", 100)], int(wall.now))
    st.put_file_chunk("file-gone", 0, b"0123456789")
    assert await store.file("file-gone", "alice") is None  # never served
    assert st.file_usage("owner", "alice", int(wall.now)) == 10  # but counted, until swept
    assert await sweep_files(store, _NoBatches(), step=10) == 0  # type: ignore[arg-type]
    wall.now += STALE_S + 1
    assert await sweep_files(store, _NoBatches(), step=10) == 1  # type: ignore[arg-type]
    assert st._x("SELECT COUNT(*) FROM v1_file_chunks").fetchone() == (0,)
    store.uploads.mkdir()
    (store.uploads / "upload-old.part").write_bytes(b"x")
    assert clear_stale(store.uploads, older_than=0) == 0
    assert clear_stale(store.uploads, older_than=wall.now * 2) == 1
    store.close()


class _NoBatches:
    async def keep_bodies(self, file_id: str, owner: str | None) -> None:
        return None


def quota_keys(**files: Any) -> dict[str, Any]:
    return {"api_keys": {"alice": {"key": KEY, "team": "red"},
                         "bob": {"key": BOB, "team": "red", "files_max_bytes": 5000},
                         "carol": {"key": CAROL}},
            "teams": {"red": {"files_max_bytes": 12000}},
            "files": {"max_bytes_per_key": 8000, **files}}


async def test_uploads_over_a_key_or_team_storage_quota_are_refused_naming_it(tmp_path):
    async with gateway(tmp_path, **quota_keys()) as (_, url, wall), \
            client(url) as alice, client(url, BOB) as bob, client(url, CAROL) as carol:
        first = await alice.files.create(file=("a.jsonl", b"a" * 6000), purpose="user_data")
        with pytest.raises(openai.APIStatusError) as e:
            await alice.files.create(file=("b.jsonl", b"b" * 3000), purpose="user_data")
        error = error_of(e.value)
        assert e.value.status_code == 413
        assert (error["code"], error["param"]) == ("storage_quota_exceeded", "file")
        assert error["message"] == (
            "File storage quota exceeded: key 'alice' may keep 8000 bytes of files "
            "(server.files.max_bytes_per_key); 6000 bytes are kept and this file is 3000 bytes")

        await bob.files.create(file=("c.jsonl", b"c" * 5000), purpose="user_data")  # his own 5000
        with pytest.raises(openai.APIStatusError) as e:
            await alice.files.create(file=("d.jsonl", b"d" * 1500), purpose="user_data")
        assert error_of(e.value)["message"] == (
            "File storage quota exceeded: team 'red' may keep 12000 bytes of files "
            "(server.teams.red.files_max_bytes); 11000 bytes are kept and this file is 1500 bytes")
        with pytest.raises(openai.APIStatusError) as e:
            await bob.files.create(file=("e.jsonl", b"e"), purpose="user_data")
        assert "key 'bob' may keep 5000 bytes of files (server.api_keys.bob.files_max_bytes)" in \
            error_of(e.value)["message"]

        await carol.files.create(file=("f.jsonl", b"f" * 8000), purpose="user_data")  # no team
        with pytest.raises(openai.APIStatusError):
            await carol.files.create(file=("g.jsonl", b"g"), purpose="user_data")

        await alice.files.delete(first.id)  # deleting frees the quota at once
        await alice.files.create(file=("d.jsonl", b"d" * 1500), purpose="user_data")
        short = await alice.files.create(file=("h.jsonl", b"h" * 5500), purpose="batch",
                                         expires_after={"anchor": "created_at", "seconds": 3600})
        wall.now += 3600  # expired files count no more, swept or not
        await alice.files.create(file=("i.jsonl", b"i" * 5000), purpose="user_data")
        assert short.id not in {f.id async for f in alice.files.list()}
    assert leftovers(tmp_path) == []


async def test_replicas_uploading_at_once_never_pass_a_quota_together(tmp_path):
    """Two replicas' stores on one PostgreSQL database reserve at the same moment: the quota's lock
    row orders them, so exactly as many files as fit are kept."""
    from tests.pg_helpers import throwaway_db

    with throwaway_db() as db:
        stores = [V1Store(tmp_path / f"r{n}.db", f"{db}?application_name=files{n}") for n in range(2)]
        for s in stores:  # both up to date before the race
            await anyio.to_thread.run_sync(s.store)
        kept, refused = [], []

        async def one(store: V1Store, n: int) -> None:
            import io

            from multiplexer.faces.v1.file_store import OverQuota

            try:
                kept.append(await store.add_file("alice", f"{n}.jsonl", "batch", io.BytesIO(b"x" * 1000),
                                                 1000, key_max=3000))
            except OverQuota as e:
                refused.append(e)

        async with anyio.create_task_group() as tg:
            for n in range(12):
                tg.start_soon(one, stores[n % 2], n)
        assert len(kept) == 3 and len(refused) == 9
        assert {e.over.usage for e in refused} == {3000}
        for s in stores:
            s.close()


LEGACY = """
CREATE TABLE v1_files (
  id TEXT PRIMARY KEY, owner TEXT NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
  bytes BIGINT NOT NULL, created BIGINT NOT NULL, content BLOB NOT NULL);
CREATE INDEX v1_files_owner ON v1_files(owner, created DESC, id DESC);
INSERT INTO v1_files VALUES ('file-old', 'alice', 'old.jsonl', 'batch', 6, 1700000000, x'7b7d0a7b7d0a');
"""


async def test_a_store_from_before_chunks_is_brought_up_to_date_and_serves_its_files(tmp_path):
    db = sqlite3.connect(tmp_path / "jobs.db")
    db.executescript(LEGACY)
    db.close()
    store = V1Store(tmp_path / "jobs.db")
    old = await store.file("file-old", "alice")
    assert old is not None and (old.bytes, old.expires_at) == (6, None)
    assert await store.content(old) == b"{}\n{}\n"
    new = await store.put_file("alice", "new.jsonl", "batch", b"new\n")
    assert [f.id for f in await store.list_files("alice")] == [new.id, "file-old"]
    columns = {r[1] for r in store.store()._x("PRAGMA table_info(v1_files)")}
    assert "content" not in columns and {"team", "expires_at", "state"} <= columns
    store.close()


async def test_a_postgres_store_from_before_chunks_is_brought_up_to_date(tmp_path):
    from tests.pg_helpers import throwaway_db

    with throwaway_db() as db:
        import psycopg

        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute("CREATE SCHEMA multiplexer")
            conn.execute("SET search_path TO multiplexer")
            conn.execute(LEGACY.replace("BLOB", "BYTEA").replace("x'7b7d0a7b7d0a'", "'\\x7b7d0a7b7d0a'"))
        stores = [V1Store(tmp_path / f"r{n}.db", f"{db}?application_name=old{n}") for n in range(2)]
        found = [await s.file("file-old", "alice") for s in stores]  # both migrate: one does it
        assert all(f is not None for f in found)
        assert [await s.content(f) for s, f in zip(stores, found, strict=True)] == [b"{}\n{}\n"] * 2
        for s in stores:
            s.close()


async def test_batch_output_files_expire_when_their_batch_is_forgotten(tmp_path):
    async with gateway(tmp_path) as (gw, url, _), client(url) as c:
        rows = [line("e0", {"model": "mock-embed", "input": "t0"}, "/v1/embeddings")]
        up = await c.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
        batch = await c.batches.create(input_file_id=up.id, endpoint="/v1/embeddings",
                                       completion_window="24h")
        done = await until_ended(c, batch.id)
        out = await c.files.retrieve(done.output_file_id)
        assert out.expires_at == done.completed_at + int(gw.config.store.retention_s)
