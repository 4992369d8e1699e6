"""SIGKILL the gateway during a load run with batch jobs in flight; restart; count what survived.

Each round starts ``multiplexer serve`` (a real subprocess, one SQLite store for all
rounds), drives synchronous chat calls and ``jobs.submit`` calls at once, and kills
the gateway with SIGKILL at a random moment. A final gateway then waits for every
job whose submission was acknowledged. Proof: every acknowledged job delivers
every item with its own answer, and no call reached the batch API twice.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import tempfile
import time
from collections import Counter
from pathlib import Path

import anyio
import yaml

from benchmarks._procs import save, table
from multiplexer import Client, RpcError
from multiplexer.sdk.jobs import job_results, submit_job, wait_job
from tests.remote_helpers import fakes, remote_config_data, reply_text, user
from tests.test_batch_restart import free_port, gateway_process


async def load(client: Client, stop: anyio.Event, counts: Counter[str]) -> None:
    i = 0
    while not stop.is_set():
        results = await client.call_many([("chat", {"model": "gpt-test", **user(f"s{i}-{k}")})
                                          for k in range(50)])
        counts["sync_ok"] += sum(1 for r in results if not isinstance(r, RpcError))
        counts["sync_failed"] += sum(1 for r in results if isinstance(r, RpcError))
        i += 1


async def submitter(client: Client, accepted: dict[str, list[str]], rnd: int, size: int,
                    stop: anyio.Event) -> None:
    n = 0
    while not stop.is_set():
        prompts = [f"r{rnd}-j{n}-{k}" for k in range(size)]
        try:
            job_id = await submit_job(client, [("chat", {"model": "gpt-test", **user(p)})
                                               for p in prompts])
        except (RpcError, OSError, Exception):  # the gateway died mid-submit: not acknowledged
            return
        accepted[job_id] = prompts
        n += 1


async def run(rounds: int, size: int, seed: int) -> dict:
    rng = random.Random(seed)
    accepted: dict[str, list[str]] = {}
    counts: Counter[str] = Counter()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        async with fakes(polls_to_complete=3) as f:
            data = remote_config_data(f, Path(tmp))
            data["server"] = {"grace_period_s": 1}
            config = Path(tmp) / "gateway.yaml"
            config.write_text(yaml.safe_dump(data))
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            for rnd in range(rounds):
                async with Client(url, timeout=30) as client, gateway_process(config, port) as gw:
                    stop = anyio.Event()
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(load, client, stop, counts)
                        tg.start_soon(submitter, client, accepted, rnd, size, stop)
                        await anyio.sleep(rng.uniform(0.5, 1.5))
                        gw.send_signal(signal.SIGKILL)
                        await gw.wait()
                        stop.set()
                        tg.cancel_scope.cancel()
                counts["kills"] += 1
            delivered = lost = wrong = 0
            async with Client(url, timeout=60) as client, gateway_process(config, port) as gw:
                for job_id, prompts in accepted.items():
                    with anyio.fail_after(120):
                        await wait_job(client, job_id, poll_interval=0.05, max_poll_interval=0.5)
                    results = await job_results(client, job_id, len(prompts))
                    for prompt, result in zip(prompts, results, strict=True):
                        if isinstance(result, RpcError):
                            lost += 1
                            counts[f"error {result.code} {result.message}: "
                                   f"{(result.data or {}).get('detail', '')}"[:120]] += 1
                        elif reply_text(result) == f"echo: {prompt}":
                            delivered += 1
                        else:
                            wrong += 1
                gw.send_signal(signal.SIGTERM)
                await gw.wait()
            submitted: Counter[str] = Counter()
            for batch in f.openai.batches.values():  # what was submitted (an orphan upload is not)
                for line in f.openai.files[batch.input_file_id].content.splitlines():
                    submitted[json.loads(line)["custom_id"]] += 1
            uploads = sum(1 for s in f.openai.files.values() if s.purpose == "batch")
    return {
        "rounds": rounds, "kills": counts["kills"], "jobs_acknowledged": len(accepted),
        "items_acknowledged": sum(len(p) for p in accepted.values()), "delivered": delivered,
        "lost": lost, "wrong_answer": wrong,
        "custom_ids_submitted": len(submitted),
        "custom_ids_submitted_twice": sum(1 for c in submitted.values() if c > 1),
        "batches_created": len(f.openai.batches),
        "files_uploaded (a re-upload after a kill is harmless)": uploads,
        "sync_calls_ok": counts["sync_ok"], "sync_calls_failed_by_kill": counts["sync_failed"],
        "wall_s": time.perf_counter() - t0,
        "errors": {k: v for k, v in counts.items() if k.startswith("error")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--job-size", type=int, default=200)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    r = anyio.run(run, args.rounds, args.job_size, args.seed)
    rows = [[k.replace("_", " "), f"{v:.1f}" if isinstance(v, float) else v] for k, v in r.items()]
    print(table(["measure", "value"], rows))
    ok = r["lost"] == 0 and r["wrong_answer"] == 0 and r["custom_ids_submitted_twice"] == 0
    print("every acknowledged job delivered, nothing submitted twice:", "PASS" if ok else "FAIL")
    save("sigkill_jobs", r)


if __name__ == "__main__":
    main()
