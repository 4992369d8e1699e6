"""Odd bodies on ``/v1/files``: multipart forms with odd fields and part headers, huge and negative
numbers, wrong purposes, bad ``expires_after``, truncated bodies, wrong content types, odd ids and
queries. Each gets an answer in OpenAI's shape, never a 5xx; every temporary file is removed; and
the gateway still takes a good upload afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from anyio.from_thread import start_blocking_portal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from multiplexer.faces.v1.file_policy import PURPOSES
from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.fuzz_budget import examples
from tests.test_v1_openai import KEY

NAMES = ["purpose", "file", "expires_after[anchor]", "expires_after[seconds]", "expires_after",
         "expires_after[seconds][0]", "", "purpose\x00", "Purpose", "name\"x", "é"]
numbers = st.one_of(st.integers(-10**30, 10**30), st.sampled_from([0, 3599, 3600, 2592000, 2592001]),
                    st.floats(allow_nan=True, allow_infinity=True)).map(str)
values = st.one_of(st.sampled_from([*PURPOSES, "batch ", "BATCH", "", "created_at", "last_active_at"]),
                   numbers, st.text(max_size=40), st.binary(max_size=40).map(lambda b: b.decode("latin-1")))
names = st.one_of(st.sampled_from(NAMES), st.text(max_size=12))


def part(boundary: bytes, disposition: bytes, value: bytes, extra: bytes = b"") -> bytes:
    return b"--%s\r\ncontent-disposition: %s\r\n%s\r\n%s\r\n" % (boundary, disposition, extra, value)


def utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


@st.composite
def forms(draw: Any) -> tuple[bytes, bytes]:
    """(content-type, body) of a multipart form: mostly well formed with the fields an upload
    has (a file, a purpose, expires_after) holding odd values, plus odd parts; at times cut
    short or sent under the wrong content type."""
    boundary = draw(st.sampled_from([b"b0undary", b"x", b"-" * 70, b"a b"]))
    parts = []
    if draw(st.integers(0, 9)) < 7:
        filename = draw(st.one_of(st.none(), st.text(max_size=300)))
        disposition = b'form-data; name="file"' + (
            b"" if filename is None else b'; filename="%s"' % utf8(filename))
        content = draw(st.one_of(st.binary(max_size=300), st.integers(4000, 4200).map(b"x".__mul__)))
        parts.append(part(boundary, disposition, content))  # over 4096 bytes: a 413
    if draw(st.integers(0, 9)) < 7:
        purpose = draw(st.one_of(st.sampled_from(PURPOSES), values))
        parts.append(part(boundary, b'form-data; name="purpose"', utf8(purpose)))
    if draw(st.booleans()):
        for name in ("expires_after[anchor]", "expires_after[seconds]"):
            if draw(st.integers(0, 9)) < 8:
                value = draw(st.one_of(st.just("created_at"), numbers, values))
                parts.append(part(boundary, b'form-data; name="%s"' % name.encode(), utf8(value)))
    for _ in range(draw(st.sampled_from([0, 0, 0, 0, 1, 1, 2, 3]))):
        name = utf8(draw(names))
        disposition = draw(st.sampled_from([b"form-data", b'form-data; name="%s"' % name,
                                            b'form-data; name="%s"; filename="f"' % name]))
        extra = draw(st.sampled_from([b"", b"", b"content-type: application/jsonl\r\n",
                                      b"content-transfer-encoding: base64\r\n", b"x" * 5000 + b"\r\n"]))
        parts.insert(draw(st.integers(0, len(parts))),
                     part(boundary, disposition, utf8(draw(values)), extra))
    body = b"".join(parts) + b"--%s--\r\n" % boundary
    if draw(st.integers(0, 9)) == 0:
        body = body[:draw(st.integers(0, len(body)))]
    kind = b"multipart/form-data; boundary=" + boundary
    if draw(st.integers(0, 9)) == 0:
        kind = draw(st.sampled_from([b'multipart/form-data; boundary="' + boundary + b'"',
                                     b"multipart/form-data", b"application/json", b"",
                                     kind + b"; charset=utf-16"]))
    return kind, body


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    tmp = tmp_path_factory.mktemp("files_fuzz")
    config = parse_config({
        "server": {"api_keys": {"alice": KEY}, "max_file_bytes": 4096, "access_log": False,
                   "files": {"max_bytes_per_key": 10**6}},
        "store": {"path": str(tmp / "jobs.db")},
        "providers": {"mock": {"kind": "mock"}},
        "routes": {"chat": {"provider": "mock", "operation": "chat", "models": ["mock-gpt"]}}})
    with start_blocking_portal() as portal, \
            portal.wrap_async_context_manager(running(config, port=0)) as (_, url):
        yield url, tmp / "jobs.db.uploads"


def answered_well(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["type"], r.text


@given(form=forms())
@settings(max_examples=examples(300), deadline=None, suppress_health_check=list(HealthCheck))
def test_odd_upload_forms_are_answered_never_with_a_5xx(served, form):
    url, uploads = served
    kind, body = form
    headers = {"authorization": f"Bearer {KEY}", "content-type": kind.decode("latin-1")}
    r = httpx.post(f"{url}/v1/files", content=body, headers=headers, timeout=10)
    answered_well(r)
    if r.status_code == 200:
        assert r.json()["object"] == "file" and r.json()["purpose"] in PURPOSES
    assert not uploads.exists() or list(uploads.iterdir()) == []


@given(file_id=st.one_of(st.text(min_size=1, max_size=60), st.sampled_from(
    ["file-", "file-batch_-output", "file-batch_x-error", "file-" + "0" * 24, "%00", "\x00"])).filter(
        lambda i: i not in (".", "..") and "/" not in i),  # the URL's own path structure, not an id
       purpose=st.one_of(st.none(), st.text(max_size=20)))
@settings(max_examples=examples(150), deadline=None, suppress_health_check=list(HealthCheck))
def test_odd_ids_and_queries_are_answered_never_with_a_5xx(served, file_id, purpose):
    url, _ = served
    quoted = f"{url}/v1/files/" + quote(file_id, safe="", errors="surrogatepass")
    with httpx.Client(headers={"authorization": f"Bearer {KEY}"}, timeout=10) as h:
        for method, target in (("GET", quoted), ("DELETE", quoted), ("GET", quoted + "/content")):
            answered_well(h.request(method, target))
        answered_well(h.get(f"{url}/v1/files", params={} if purpose is None else {"purpose": purpose}))


def test_a_good_upload_after_the_fuzz(served):
    url, _ = served
    r = httpx.post(f"{url}/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", b"{}\n")},
                   headers={"authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 200, r.text
    got = httpx.get(f"{url}/v1/files/{r.json()['id']}/content",
                    headers={"authorization": f"Bearer {KEY}"}, timeout=10)
    assert got.content == b"{}\n"
