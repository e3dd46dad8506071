"""Which event loop HarmonAIze's processes run on: uvloop where it is installed, asyncio's own otherwise.

Why it matters: at 1,000 events/s an agent fleet and a tenant controller spend much of their CPU in the event loop
itself (waking tasks, a socket read or write for every publish, PubAck, delivery and ack), and on a small host they
share the cores with the fsyncing broker, so that CPU becomes queueing delay in front of every event. uvloop runs the
loop in libuv; bench/README.md has the A/B figures of bench/bench_events.py (`HZ_EVENT_LOOP=asyncio` against the
default). uvicorn makes the same choice for the API by default.

uvloop is a dependency on the platforms it supports (not Windows); `HZ_EVENT_LOOP=asyncio` turns it off, e.g. to
rule it out when chasing a bug, and `uvloop` insists on it (a clear error where it is missing, instead of a silent
fallback that would make benchmark figures mean something else).
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Coroutine
from typing import Any, Literal, TypeVar

__all__ = ["EVENT_LOOPS", "EventLoopChoice", "EventLoopUnavailableError", "resolve_event_loop", "run", "running_loop_name"]

T = TypeVar("T")

EventLoopChoice = Literal["auto", "uvloop", "asyncio"]
EVENT_LOOPS: tuple[EventLoopChoice, ...] = ("auto", "uvloop", "asyncio")


class EventLoopUnavailableError(ValueError):
    """`uvloop` was asked for and cannot be imported."""


def _uvloop_installed() -> bool:
    try:
        return importlib.util.find_spec("uvloop") is not None
    except (ImportError, ValueError):  # a broken or half-removed install
        return False


def resolve_event_loop(choice: EventLoopChoice | str = "auto") -> Literal["uvloop", "asyncio"]:
    """The loop `choice` means on this machine; raises EventLoopUnavailableError for `uvloop` where it is missing
    and ValueError for a name that is not a choice."""
    if choice == "asyncio":
        return "asyncio"
    if choice == "auto":
        return "uvloop" if _uvloop_installed() else "asyncio"
    if choice == "uvloop":
        if not _uvloop_installed():
            raise EventLoopUnavailableError("uvloop is not installed (pip install uvloop, or choose auto or asyncio)")
        return "uvloop"
    raise ValueError(f"unknown event loop {choice!r}: choose one of {', '.join(EVENT_LOOPS)}")


def run(main: Coroutine[Any, Any, T], *, loop: EventLoopChoice | str = "auto") -> T:
    """`asyncio.run(main)` on the loop `loop` resolves to (the coroutine is closed unrun if resolving fails)."""
    try:
        kind = resolve_event_loop(loop)
    except BaseException:
        main.close()  # never awaited: closing it spares a "coroutine was never awaited" warning
        raise
    if kind == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


def running_loop_name() -> str:
    """'uvloop' or 'asyncio': what the current process actually runs on (for its start-up log line)."""
    return type(asyncio.get_running_loop()).__module__.partition(".")[0]
