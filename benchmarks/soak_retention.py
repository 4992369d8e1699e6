"""Retention soak: jobs keep coming for many simulated days; the database stops growing.

Each simulated hour a batch of jobs is created, filled with items and results,
and ended; the retention sweep (the one ``jobs.*`` runs) then deletes what ended
more than ``retention`` hours ago. The wall clock is injected, so weeks pass in
seconds. Proof: once the first retention period is over, the file size (after a
WAL checkpoint) stays flat, because SQLite reuses the pages of deleted rows.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks._procs import save, table
from multiplexer.core.jobrows import NewItem
from multiplexer.jobs.store import JobStore


class Wall:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


def size(st: JobStore) -> int:
    st._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return st.path.stat().st_size


def soak(hours: int, retention_h: int, jobs_per_hour: int, items: int, tmp: Path) -> dict:
    wall = Wall()
    st = JobStore(tmp / "soak.db", wall=wall)
    sizes: list[int] = []
    purged = 0
    for hour in range(hours):
        for j in range(jobs_per_hour):
            job_id = f"job_{hour}_{j}"
            st.create_job(job_id, "key", "client", "running")
            st.add_items(job_id, [NewItem(i, "p", "r", "chat", "m", {"prompt": "x" * 200, "i": i}, {},
                                          3, f"{job_id}-{i}", "queued") for i in range(items)])
            st.record(job_id, [(i, "succeeded", {"text": "y" * 300}, None) for i in range(items)])
            st.finish_job_if_done(job_id)
        wall.t += 3600.0
        while st.purge(wall.t - retention_h * 3600.0):
            purged += 1
        sizes.append(size(st))
    jobs_left = st._db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0]
    st.close()
    steady = sizes[retention_h + 1:]
    return {"sizes": sizes, "jobs_left": jobs_left, "retention_h": retention_h,
            "after_retention_min": min(steady), "after_retention_max": max(steady)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hours", type=int, default=24 * 21)
    ap.add_argument("--retention-h", type=int, default=24 * 7)
    ap.add_argument("--jobs-per-hour", type=int, default=10)
    ap.add_argument("--items", type=int, default=50)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        r = soak(args.hours, args.retention_h, args.jobs_per_hour, args.items, Path(tmp))
    s = r["sizes"]
    rows = [[f"{h} h", f"{s[h - 1] / 1e6:.2f} MB"] for h in
            sorted({args.retention_h // 2, args.retention_h, args.retention_h + 1,
                    2 * args.retention_h, args.hours})]
    print(table(["simulated time", "database size"], rows))
    print(f"jobs kept: {r['jobs_left']}; after retention the size stays within "
          f"{r['after_retention_min'] / 1e6:.2f}-{r['after_retention_max'] / 1e6:.2f} MB")
    save("soak_retention", r)


if __name__ == "__main__":
    main()
