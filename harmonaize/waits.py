"""Waiting with a timeout, and stopping background tasks, without losing a cancellation.

Every background loop here sleeps as "until woken or the poll interval passes", and most are stopped by cancelling
their task. On Python 3.11, `asyncio.wait_for(event.wait(), timeout)` runs the wait as a task of its own, and a
cancellation that arrives in the loop iteration where that task finishes (the event set just then, e.g. by the
commit that preceded a shutdown) is swallowed: `wait_for` returns the result and the loop goes round again as if
never cancelled, so whoever awaits its end waits forever (CPython gh-86296, fixed in 3.12). `asyncio.timeout` waits in
the caller's own task, so the cancellation always arrives.

A task can still swallow a cancellation in code that is not ours (a library catching `CancelledError`), so
`cancel_and_wait` cancels again until it ends and, past a grace period, leaves it with an error in the log: a
shutdown must end.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

__all__ = ["cancel_and_wait", "wait_set"]

_log = logging.getLogger(__name__)


async def wait_set(event: asyncio.Event, timeout: float) -> bool:
    """Wait until `event` is set or `timeout` seconds have passed; whether it was set. Cancellation propagates."""
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(max(0.0, timeout)):
            await event.wait()
    except TimeoutError:
        return event.is_set()
    return True


async def cancel_and_wait(tasks: Iterable[asyncio.Task[object]], *, grace_s: float = 10.0,
                          recancel_every_s: float = 0.5) -> set[asyncio.Task[object]]:
    """Cancel `tasks` and wait until they end; those still running after `grace_s` (logged as errors).

    A task that swallowed its cancellation is cancelled again every `recancel_every_s`. A cancellation of the caller
    itself propagates (it is not absorbed while waiting). A task that ended with an exception other than its
    cancellation has it logged, so a shutdown does not hide a crash.
    """
    tasks = list(tasks)  # read twice below: an iterator would be empty the second time
    pending = {task for task in tasks if not task.done()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    for task in pending:
        task.cancel()
    ended: set[asyncio.Task[object]] = {task for task in tasks if task.done()}
    while pending:
        remaining = deadline - loop.time()
        if remaining <= 0:
            for task in pending:
                _log.error("task %s did not stop within %.1f s of being cancelled; leaving it", task.get_name(),
                           grace_s)
            break
        done, pending = await asyncio.wait(pending, timeout=min(recancel_every_s, remaining))
        ended |= done
        for task in pending:
            task.cancel()
    for task in ended:
        if not task.cancelled() and task.exception() is not None:
            _log.error("task %s had failed: %r", task.get_name(), task.exception())
    return pending
