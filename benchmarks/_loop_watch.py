"""The gateway's own event-loop stalls, measured inside its process, for benchmarks that ask
how long the loop was held.

A client's probe latency mixes the gateway's stalls with the machine's: on a loaded host the
process (or the prober) is simply not scheduled for tens of milliseconds. Here a callback on
the loop beats every 2 ms, and each gap over ``STALL_MS`` between two beats is one stall,
written as a JSON line: its wall time, the loop thread's CPU time within it (what the loop
itself spent: a busy machine stretches the wall, not this), the whole process's (the loop
waiting for the GIL that a worker thread holds shows here), and where the loop thread was,
sampled every 2 ms by a watchdog thread (``sys._current_frames``), and the time garbage
collections took: a stall with little CPU whose samples say the loop's thread was runnable (or
in its poll) was the machine's, not the gateway's.

Only the loop thread's frames are read: walking the worker threads' frames as well (tried)
made the job store's ``executemany`` fail with ``sqlite3.InterfaceError`` (API misuse) in two
runs of two, a perturbation no benchmark should add.

    python -m benchmarks._loop_watch OUT.jsonl serve --config ...   (the CLI, watched)
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

STALL_MS = float(os.environ.get("LOOP_WATCH_MS", "20"))
BEAT_S = 0.002
OWN = ("multiplexer", "providers", "local_models", "starlette", "uvicorn", "anyio", "sqlite3")


SYSCALLS = {"232": "epoll_wait (idle)", "281": "epoll_pwait (idle)", "7": "poll (idle)",
            "202": "futex (the GIL, or a lock)", "running": "runnable (on a CPU, or waiting for one)"}


def native(thread: int) -> str:
    """What the thread is doing in the kernel (Linux): the system call it waits in, if any."""
    try:
        call = Path(f"/proc/self/task/{thread}/syscall").read_text().split()[0]
    except (OSError, IndexError):
        return "unknown"
    return SYSCALLS.get(call, f"syscall {call}")


def where(frame: Any, thread: int) -> str:
    """The innermost frame of the project (or its server stack), as file:line function; in the
    event loop's own C code (no Python frame inside ``anyio.run``), the system call the loop's
    thread waits in: its poll (idle), the GIL, or none (runnable)."""
    if frame.f_code.co_name in ("run", "run_until_complete", "run_forever"):
        return "loop in C: " + native(thread)
    inner = frame
    while frame is not None:
        name = frame.f_code.co_filename
        if any(f"/{part}/" in name for part in OWN):
            return f"{'/'.join(Path(name).parts[-2:])}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return f"{Path(inner.f_code.co_filename).name}:{inner.f_lineno} {inner.f_code.co_name}" \
        if inner is not None else "idle (the loop's poll)"


class Watch:
    def __init__(self, out: Path) -> None:
        self.out = out.open("a", buffering=1)
        self.ident = threading.get_ident()  # the loop's thread: the one that starts the watch
        self.native = threading.get_native_id()
        self.last = time.perf_counter()
        self.last_cpu = time.thread_time()
        self.last_proc = time.process_time()
        self.samples: list[tuple[float, str]] = []
        self.lock = threading.Lock()
        self.gc_ms = 0.0  # the garbage collections since the last beat
        self.gc_gen = -1
        self._gc_at = 0.0
        gc.callbacks.append(self.collected)

    def collected(self, phase: str, info: dict[str, Any]) -> None:
        """Collections on any thread: one on a worker thread holds the GIL the loop waits for."""
        if phase == "start":
            self._gc_at = time.perf_counter()
        else:
            self.gc_ms += (time.perf_counter() - self._gc_at) * 1000
            self.gc_gen = max(self.gc_gen, info["generation"])

    def beat(self, loop: Any) -> None:
        now, cpu, proc = time.perf_counter(), time.thread_time(), time.process_time()
        gap_ms = (now - self.last) * 1000
        if gap_ms > STALL_MS:
            with self.lock:
                seen = [w for t, w in self.samples if self.last <= t <= now]
                self.samples.clear()
            self.out.write(json.dumps({"at": round(time.time(), 3), "wall_ms": round(gap_ms, 1),
                                       "cpu_ms": round((cpu - self.last_cpu) * 1000, 1),
                                       "proc_cpu_ms": round((proc - self.last_proc) * 1000, 1),
                                       "gc_ms": round(self.gc_ms, 1), "gc_gen": self.gc_gen,
                                       "where": Counter(seen).most_common(4)}) + "\n")
        self.last, self.last_cpu, self.last_proc = now, cpu, proc
        self.gc_ms, self.gc_gen = 0.0, -1
        loop.call_later(BEAT_S, self.beat, loop)

    def sample(self) -> None:
        """The watchdog: the loop thread's frame, whenever the loop is late."""
        while True:
            time.sleep(BEAT_S)
            now = time.perf_counter()
            if (now - self.last) * 1000 > BEAT_S * 1000 + 3:
                frame = sys._current_frames().get(self.ident)
                if frame is not None:
                    with self.lock:
                        self.samples.append((now, where(frame, self.native)))
            else:
                with self.lock:
                    self.samples.clear()


def watched(fn: Any, out: Path) -> Any:
    async def run(*args: Any) -> Any:
        import asyncio

        watch = Watch(out)
        asyncio.get_running_loop().call_soon(watch.beat, asyncio.get_running_loop())
        threading.Thread(target=watch.sample, daemon=True, name="loop-watch").start()
        return await fn(*args)

    return run


def main() -> int:
    import anyio

    from multiplexer.cli import main as cli

    out = Path(sys.argv[1])
    plain = anyio.run
    anyio.run = lambda fn, *args, **kw: plain(watched(fn, out), *args, **kw)  # type: ignore[assignment]
    return int(cli(sys.argv[2:]) or 0)


def stalls(path: Path) -> list[dict[str, Any]]:
    """The stalls a watched gateway wrote."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


if __name__ == "__main__":
    sys.exit(main())
