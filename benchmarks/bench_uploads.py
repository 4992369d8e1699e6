"""A large upload to ``/v1/files`` and its download, through a real gateway process on 127.0.0.1:
the gateway's RSS sampled every 10 ms while the file goes up and comes back, against its RSS idle
(after a small upload and download have loaded their code). The floor: a 150 MB upload peaks
less than 64 MB above idle.

``--against REF`` runs the same on a copy of another commit's tree (``git archive``; nothing of
the repository changes) in the same run, for a before/after table; ``--store-url`` puts the store
in a PostgreSQL database (``store.url``) instead of a SQLite file.

    python -m benchmarks.bench_uploads [--mb 150] [--against HEAD~1] [--store-url postgresql://...]
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks._gateway import RssSampler
from benchmarks._procs import ROOT, free_port, logged_child, save, table

MB = 1 << 20
FLOOR_MB = 64  # above idle, for a 150 MB upload
KEY = "sk-bench-uploads"
CONFIG = """
server: {{port: {port}, api_keys: {{bench: {key}}}, access_log: false}}
store: {{path: {store}{url}}}
providers: {{mock: {{kind: mock}}}}
routes: {{chat: {{provider: mock, operation: chat, models: [mock-gpt]}}}}
"""


def write_file(path: Path, size: int) -> str:
    """``size`` bytes of JSONL-looking lines, written a block at a time; their sha256."""
    digest = hashlib.sha256()
    block = b"".join(b'{"custom_id": "r%06d", "body": {"text": "%s"}}\n' % (i, b"x" * 180)
                     for i in range(1024))
    with path.open("wb") as f:
        left = size
        while left:
            piece = block[:left]
            f.write(piece)
            digest.update(piece)
            left -= len(piece)
    return digest.hexdigest()


def upload(client: httpx.Client, path: Path) -> dict[str, Any]:
    with path.open("rb") as f:  # httpx streams a file object: the client holds none of it
        r = client.post("/v1/files", files={"file": (path.name, f)}, data={"purpose": "batch"})
    r.raise_for_status()
    return r.json()  # type: ignore[no-any-return]


def download(client: httpx.Client, file_id: str) -> str:
    digest = hashlib.sha256()
    with client.stream("GET", f"/v1/files/{file_id}/content") as r:
        r.raise_for_status()
        for chunk in r.iter_bytes():
            digest.update(chunk)
    return digest.hexdigest()


def run(tree: Path, big: Path, want: str, small: Path, store_url: str | None) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        conf = Path(tmp) / "gateway.yaml"
        url_key = "" if store_url is None else f", url: '{store_url}'"
        conf.write_text(CONFIG.format(port=port, key=KEY, store=Path(tmp) / "jobs.db", url=url_key))
        args = ["-c", f"import os, runpy, sys; os.chdir({str(tree)!r}); sys.path.insert(0, {str(tree)!r}); "
                "runpy.run_module('multiplexer', run_name='__main__')", "serve", "--config", str(conf)]
        with logged_child(args, f"{url}/healthz", Path(tmp) / "server.log", {"PYTHONPATH": str(tree)}) \
                as proc, httpx.Client(base_url=url, timeout=600,
                                      headers={"authorization": f"Bearer {KEY}"}) as client:
            warm = upload(client, small)
            download(client, warm["id"])
            with RssSampler(proc.pid, interval=0.01) as rss:
                time.sleep(0.5)
                rss.mark("upload")
                t0 = time.perf_counter()
                stored = upload(client, big)
                t1 = time.perf_counter()
                rss.mark("after")
                time.sleep(0.5)
                rss.mark("download")
                t2 = time.perf_counter()
                got = download(client, stored["id"])
                t3 = time.perf_counter()
                rss.mark("end")
                time.sleep(0.2)
    if got != want:
        raise RuntimeError(f"{tree}: the download differs from the upload")
    idle = min(rss.series("start"))
    return {"tree": str(tree), "bytes": stored["bytes"], "idle_mb": round(idle / MB, 1),
            "upload_peak_mb": round((rss.peak("upload") - idle) / MB, 1),
            "after_upload_mb": round((min(rss.series("after")) - idle) / MB, 1),
            "download_peak_mb": round((rss.peak("download") - idle) / MB, 1),
            "upload_s": round(t1 - t0, 2), "download_s": round(t3 - t2, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=150, help="the large file's size in MiB")
    parser.add_argument("--against", default=None, help="a git ref to compare with")
    parser.add_argument("--store-url", default=None, help="postgresql://...: the store there")
    args = parser.parse_args()
    trees: list[tuple[str, Path]] = [("this tree", ROOT)]
    with tempfile.TemporaryDirectory() as other, tempfile.TemporaryDirectory() as files:
        big, small = Path(files) / "big.jsonl", Path(files) / "small.jsonl"
        want = write_file(big, args.mb * MB)
        write_file(small, 2 * MB)
        if args.against:
            archive = subprocess.run(["git", "archive", args.against], cwd=ROOT, check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", other], input=archive, check=True)
            trees.insert(0, (args.against, Path(other)))
        results = [(name, run(tree, big, want, small, args.store_url)) for name, tree in trees]
    floor = FLOOR_MB * args.mb / 150
    where = "PostgreSQL" if args.store_url else "SQLite"
    print(f"{args.mb} MiB upload and download, store in {where}; RSS above idle (MB), sampled every "
          f"10 ms; floor {floor:.1f} MB")
    print(table(["tree", "idle RSS", "upload peak", "after upload", "download peak", "upload s",
                 "download s", "floor"],
                [[name, r["idle_mb"], f'{r["upload_peak_mb"]:+}', f'{r["after_upload_mb"]:+}',
                  f'{r["download_peak_mb"]:+}', r["upload_s"], r["download_s"],
                  "ok" if max(r["upload_peak_mb"], r["download_peak_mb"]) < floor else "over"]
                 for name, r in results]))
    save("bench_uploads", {"mb": args.mb, "floor_mb": floor, "runs": dict(results)})
    return 0 if max(results[-1][1]["upload_peak_mb"], results[-1][1]["download_peak_mb"]) < floor else 1


if __name__ == "__main__":
    sys.exit(main())
