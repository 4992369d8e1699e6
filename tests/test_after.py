"""Bookkeeping held until a request's answer is written (core/after.py), and on the direct HTTP
path: the answer leaves first, the held work runs before the request's task yields."""

from __future__ import annotations

import asyncio
import logging

import anyio
import pytest

from multiplexer.core.after import after, hold, release

pytestmark = pytest.mark.anyio


def test_nothing_held_runs_at_once() -> None:
    ran: list[int] = []
    after(ran.append, 1)
    assert ran == [1]


async def test_held_work_runs_in_order_on_release_and_a_failure_stops_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    ran: list[str] = []

    def fail() -> None:
        raise RuntimeError("boom")

    async def request() -> None:
        held = hold()
        after(ran.append, "span")
        after(fail)
        after(ran.append, "budget")
        assert ran == []  # the answer is not written yet
        with caplog.at_level(logging.ERROR, "multiplexer.core.after"):
            release(held)
        assert ran == ["span", "budget"]
        after(ran.append, "later")  # released: at once again
        assert ran == ["span", "budget", "later"]

    async with anyio.create_task_group() as tg:
        tg.start_soon(request)
    assert "bookkeeping after an answer failed" in caplog.text


async def test_each_request_task_holds_its_own() -> None:
    ran: list[str] = []
    first_holds, second_ran = anyio.Event(), anyio.Event()

    async def first() -> None:
        held = hold()
        after(ran.append, "first")
        first_holds.set()
        await second_ran.wait()
        release(held)

    async def second() -> None:
        await first_holds.wait()
        after(ran.append, "second")  # this task holds nothing: at once
        second_ran.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(first)
        tg.start_soon(second)
    assert ran == ["second", "first"]


async def test_what_a_request_started_while_holding_runs_at_once_after_its_release() -> None:
    """A callback or task made while the request held (a copy of its context) runs after the
    release: its work must not land in the released list, where nothing would run it."""
    ran: list[str] = []
    late = anyio.Event()

    async def request() -> None:
        held = hold()
        loop = asyncio.get_running_loop()
        loop.call_soon(lambda: (after(ran.append, "timer"), late.set()))  # copies this context
        release(held)

    async with anyio.create_task_group() as tg:
        tg.start_soon(request)
    await late.wait()
    assert ran == ["timer"]
