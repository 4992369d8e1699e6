"""An upload to ``/v1/files`` and its download do not pass through the gateway's memory: a real
``multiplexer serve`` process, its RSS sampled while a large file goes up and comes back down.

The floor is 64 MB above idle for a 150 MB file (``benchmarks/bench_uploads.py`` measures that
one); here a 48 MB file must stay under the same floor scaled to its size, 20.5 MB, where a
gateway holding the file whole rises by three times the file's size."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks._gateway import GatewayProc, RssSampler, gateway
from benchmarks.bench_uploads import write_file

MB = 1024 * 1024
FLOOR_150 = 64 * MB  # the floor for a 150 MB upload
SIZE = 48 * MB
KEY = "sk-files-memory"

CONFIG = """
server: {{port: {{port}}, api_keys: {{alice: {key}}}, access_log: false}}
store: {{path: {store}}}
providers: {{mock: {{kind: mock}}}}
routes: {{chat: {{provider: mock, operation: chat, models: [mock-gpt]}}}}
"""


def big_file(path: Path, size: int) -> str:
    """A JSONL-looking file of ``size`` bytes; its sha256 (the benchmark's own maker)."""
    return write_file(path, size)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[GatewayProc]:
    with gateway(CONFIG.format(key=KEY, store=tmp_path / "jobs.db")) as proc:
        yield proc


def upload(url: str, path: Path) -> dict:
    with path.open("rb") as f:
        r = httpx.post(f"{url}/v1/files", files={"file": (path.name, f)}, data={"purpose": "batch"},
                       headers={"authorization": f"Bearer {KEY}"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def download(url: str, file_id: str) -> str:
    digest = hashlib.sha256()
    with httpx.stream("GET", f"{url}/v1/files/{file_id}/content", timeout=120,
                      headers={"authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        for chunk in r.iter_bytes():
            digest.update(chunk)
    return digest.hexdigest()


def test_a_large_upload_and_its_download_keep_the_gateways_memory_flat(served, tmp_path):
    small, large = tmp_path / "small.jsonl", tmp_path / "large.jsonl"
    big_file(small, 2 * MB)
    want = big_file(large, SIZE)
    warm = upload(served.url, small)  # the upload and download paths' code and buffers, loaded
    download(served.url, warm["id"])
    floor = FLOOR_150 * SIZE // (150 * MB)
    with RssSampler(served.pid, interval=0.01) as rss:
        rss.mark("upload")
        stored = upload(served.url, large)
        rss.mark("download")
        assert download(served.url, stored["id"]) == want
        rss.mark("end")
    idle = min(r for _, _, r in rss.samples)
    up, down = rss.peak("upload") - idle, rss.peak("download") - idle
    assert stored["bytes"] == SIZE
    assert up < floor, f"upload of {SIZE // MB} MB: +{up / MB:.1f} MB over idle (floor {floor / MB:.1f})"
    assert down < floor, f"download: +{down / MB:.1f} MB over idle (floor {floor / MB:.1f})"
