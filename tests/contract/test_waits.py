"""`wait_set`: a poll loop stopped by cancellation stops, even when its event is set in the same loop iteration.

The race is made deterministic: the event is set, one loop iteration lets the inner wait finish, then the task is
cancelled before it resumes. `asyncio.wait_for` on Python 3.11 returns the result there and the loop goes on; the
first test shows that on the interpreters that have the bug and is skipped where `wait_for` was fixed (3.12+).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable

import pytest

from harmonaize.waits import cancel_and_wait, wait_set

Waiter = Callable[[asyncio.Event, float], Awaitable[object]]


async def _wait_for(event: asyncio.Event, timeout: float) -> object:
    try:
        return await asyncio.wait_for(event.wait(), timeout)
    except TimeoutError:
        return False


async def _cancel_as_the_event_fires(wait: Waiter, *, yields: int = 1) -> tuple[asyncio.Task[None], list[int]]:
    """A poll loop like the outbox relay's, cancelled `yields` loop iterations after its wake-up event is set."""
    event = asyncio.Event()
    passes: list[int] = []

    async def loop() -> None:
        while True:
            event.clear()
            passes.append(1)
            await wait(event, 30.0)

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)  # the loop is waiting now
    event.set()
    for _ in range(yields):  # with wait_for and one yield: its inner task has finished, the loop has not resumed
        await asyncio.sleep(0)
    task.cancel()
    await asyncio.wait({task}, timeout=2.0)
    return task, passes


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="asyncio.wait_for keeps the cancellation from Python 3.12 on")
async def test_wait_for_loses_the_cancellation_in_that_race_on_this_python() -> None:
    task, passes = await _cancel_as_the_event_fires(_wait_for)
    try:
        assert not task.done() and len(passes) == 2, "the loop went round again instead of stopping"
    finally:
        task.cancel()  # the next cancellation finds it waiting and is delivered
        await asyncio.wait({task}, timeout=2.0)
    assert task.cancelled()


@pytest.mark.parametrize("yields", [0, 1, 2, 3])
async def test_wait_set_keeps_the_cancellation_in_that_race(yields: int) -> None:
    task, passes = await _cancel_as_the_event_fires(wait_set, yields=yields)
    assert task.cancelled(), "the loop stopped at the first cancellation"
    assert len(passes) <= 2


async def test_wait_set_reports_whether_the_event_was_set() -> None:
    event = asyncio.Event()
    assert await wait_set(event, 0.01) is False
    assert await wait_set(event, 0.0) is False
    event.set()
    assert await wait_set(event, 0.0) is True
    event.clear()
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_set(event, 30.0) is True


async def test_cancel_and_wait_cancels_again_a_task_that_swallowed_its_cancellation() -> None:
    swallowed: list[int] = []

    async def stubborn_once() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            swallowed.append(1)  # what a library catching CancelledError does
        await asyncio.Event().wait()

    task = asyncio.create_task(stubborn_once())
    await asyncio.sleep(0)
    left = await cancel_and_wait([task], grace_s=5.0, recancel_every_s=0.01)
    assert left == set() and task.cancelled() and swallowed == [1]


async def test_cancel_and_wait_gives_up_on_a_task_that_never_stops_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = asyncio.Event()

    async def never_stops() -> None:
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue

    task = asyncio.create_task(never_stops(), name="never-stops")
    await asyncio.sleep(0)
    try:
        left = await cancel_and_wait([task], grace_s=0.1, recancel_every_s=0.01)
        assert left == {task} and not task.done()
        assert "never-stops did not stop" in caplog.text
    finally:
        release.set()
        await asyncio.wait({task}, timeout=2.0)
    assert task.done()


async def test_cancel_and_wait_logs_a_task_that_had_crashed(caplog: pytest.LogCaptureFixture) -> None:
    async def crashes() -> None:
        raise RuntimeError("boom")

    task = asyncio.create_task(crashes(), name="crasher")
    await asyncio.wait({task})
    assert await cancel_and_wait([task]) == set()
    assert "crasher had failed: RuntimeError('boom')" in caplog.text


async def test_cancel_and_wait_lets_the_callers_own_cancellation_through() -> None:
    inner = asyncio.create_task(asyncio.Event().wait())
    outer = asyncio.create_task(cancel_and_wait([inner], grace_s=30.0))
    await asyncio.sleep(0)
    outer.cancel()
    await asyncio.wait({outer}, timeout=2.0)
    assert outer.cancelled()
    assert inner.cancelled()
