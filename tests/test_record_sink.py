"""The record sink: callers never wait (a full queue drops and counts), batches keep the order
records were put in, a failed batch is counted, and closing writes what is left."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import anyio
import pytest
from prometheus_client import CollectorRegistry

from multiplexer.records.sink import RecordSink

pytestmark = pytest.mark.anyio


def _value(registry: CollectorRegistry, name: str, sink: str) -> float:
    return registry.get_sample_value(name + "_total", {"sink": sink}) or 0.0


async def test_a_full_queue_drops_and_counts_never_waits() -> None:
    registry = CollectorRegistry()
    written: list[int] = []
    sink: RecordSink[int] = RecordSink("t", written.extend, registry=registry, capacity=3, batch=2)
    assert [sink.put(i) for i in range(5)] == [True, True, True, False, False]
    assert sink.dropped == 2 and _value(registry, "multiplexer_records_dropped", "t") == 2
    await sink.aclose()
    assert written == [0, 1, 2]
    assert _value(registry, "multiplexer_records_written", "t") == 3
    assert not sink.put(9) and sink.dropped == 3  # closed: counted, not queued


async def test_batches_keep_order_by_size_and_close_flushes_the_rest() -> None:
    batches: list[list[int]] = []
    wrote = anyio.Event()
    loop_token = anyio.lowlevel.current_token()

    def write(batch: Sequence[int]) -> None:
        batches.append(list(batch))
        anyio.from_thread.run_sync(wrote.set, token=loop_token)

    sink: RecordSink[int] = RecordSink("order", write, capacity=100, batch=4, interval_s=3600,
                                       redact=lambda r: r * 10)
    async with anyio.create_task_group() as tg:
        tg.start_soon(sink.run)
        for i in range(6):
            sink.put(i)  # the 4th wakes the writer: no hour-long wait
        with anyio.fail_after(5):
            await wrote.wait()
        tg.cancel_scope.cancel()
    await sink.aclose()
    flat = [r for b in batches for r in b]
    assert flat == [0, 10, 20, 30, 40, 50]  # redacted on the writer, in order
    assert all(len(b) <= 4 for b in batches)
    assert len(sink) == 0 and sink.written == 6


async def test_a_record_the_store_refuses_costs_that_record_alone_and_the_writer_goes_on() -> None:
    registry = CollectorRegistry()
    seen: list[int] = []
    calls = threading.Lock()

    def write(batch: Sequence[int]) -> None:
        with calls:
            if 0 in batch:
                raise RuntimeError("not a value the store keeps")
            seen.extend(batch)

    sink: RecordSink[int] = RecordSink("f", write, registry=registry, batch=2)
    for i in range(4):
        sink.put(i)
    await sink.aclose()
    assert seen == [1, 2, 3] and (sink.failed, sink.written) == (1, 3)
    assert _value(registry, "multiplexer_records_failed", "f") == 1


async def test_a_store_that_is_down_fails_every_record_counted_once() -> None:
    registry = CollectorRegistry()

    def write(batch: Sequence[int]) -> None:
        raise RuntimeError("database gone")

    sink: RecordSink[int] = RecordSink("d", write, registry=registry, batch=3)
    for i in range(5):
        sink.put(i)
    await sink.aclose()
    assert (sink.failed, sink.written) == (5, 0)
    assert _value(registry, "multiplexer_records_failed", "d") == 5


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        RecordSink("x", lambda b: None, capacity=0)
