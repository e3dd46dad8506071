"""Which event loop HarmonAIze's long-running processes run on: uvloop where it is installed, asyncio's own otherwise.

Why it matters: at 1,000 events/s an agent fleet and a tenant controller spend much of their CPU in the event loop
itself (waking tasks, a socket read or write for every publish, PubAck, delivery and ack), and on a small host they
share the cores with the fsyncing broker, so that CPU becomes queueing delay in front of every event. uvloop runs the
loop in libuv; bench/README.md ("The event loop") has the A/B figures of bench/bench_events.py.

The CLI's long-running commands (`up`, `demo`, `api serve`, `agent`, `fleet-monitor`, `controller run`, `events
tail`, `scenario run`) start their loop here, so the API, which uvicorn serves inside that loop, follows the same
choice. One-shot database commands keep `asyncio.run`: they do a few queries and exit.

uvloop is a dependency on the platforms it supports (CPython outside Windows); `HZ_EVENT_LOOP=asyncio` turns it off,
e.g. to rule it out when chasing a bug, and `uvloop` insists on it: an error where it cannot be imported instead of a
silent fallback that would make benchmark figures mean something else.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Literal, TypeVar, get_args

__all__ = [
    "EVENT_LOOPS",
    "EventLoopChoice",
    "EventLoopUnavailableError",
    "resolve_event_loop",
    "run",
    "running_loop_name",
]

T = TypeVar("T")

EventLoopChoice = Literal["auto", "uvloop", "asyncio"]
EVENT_LOOPS: tuple[EventLoopChoice, ...] = get_args(EventLoopChoice)


class EventLoopUnavailableError(ValueError):
    """`uvloop` was asked for and cannot be imported.

    A ValueError so that, raised from a settings validator, it becomes a ValidationError naming HZ_EVENT_LOOP.
    """


def _uvloop_importable() -> bool:
    """Importing it, not just finding it: a wheel built for another platform or Python is found, then fails."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_event_loop(choice: EventLoopChoice | str = "auto") -> Literal["uvloop", "asyncio"]:
    """The loop `choice` means on this machine; raises EventLoopUnavailableError for `uvloop` where it cannot be
    imported and ValueError for a name that is not a choice."""
    if choice == "asyncio":
        return "asyncio"
    if choice == "auto":
        return "uvloop" if _uvloop_importable() else "asyncio"
    if choice == "uvloop":
        if not _uvloop_importable():
            raise EventLoopUnavailableError("uvloop is not installed (pip install uvloop, or choose auto or asyncio)")
        return "uvloop"
    raise ValueError(f"unknown event loop {choice!r}: choose one of {', '.join(EVENT_LOOPS)}")


def run(main: Coroutine[Any, Any, T], *, choice: EventLoopChoice | str = "auto") -> T:
    """`asyncio.run(main)` on the loop `choice` resolves to (the coroutine is closed unrun if resolving fails)."""
    try:
        kind = resolve_event_loop(choice)
    except BaseException:
        main.close()  # never awaited: closed here rather than left for the collector to warn about
        raise
    if kind == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


def running_loop_name() -> str:
    """'uvloop' or 'asyncio': what the current process actually runs on (for its start-up log line)."""
    return type(asyncio.get_running_loop()).__module__.partition(".")[0]
