"""Reading the tenant's live feed for a while: every message on its subscription, handed over as a `Received`.

A core subscription, not a JetStream consumer: it sees what the broker delivers to the tenant right now, headers
included, and needs no consumer to be created on the tenant's behalf (a conformance run leaves nothing behind). The
run ends at the deadline or after `max_events` events, whichever comes first. The kit's own isolation probes publish
with a marker header; should one of them be wrongly delivered here, it is skipped (its probe already fails).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from nats.aio.client import Client
from nats.aio.msg import Msg

from harmonaize.waits import wait_set
from harmonaize_cli.conformance.binding import Received
from harmonaize_cli.conformance.probes import PROBE_HEADER

__all__ = ["FeedRun", "read_feed"]


@dataclass(frozen=True, slots=True)
class FeedRun:
    """How a run of the feed went: events handed over, and seconds it listened."""

    events: int
    seconds: float


async def read_feed(
    nc: Client,
    subject: str,
    *,
    duration: float,
    max_events: int | None,
    on_message: Callable[[Received], None],
    nonce: str,
    on_listening: Callable[[], None] | None = None,
) -> FeedRun:
    """Subscribe to `subject` and hand every message to `on_message` until `duration` passes or `max_events` came."""
    done = asyncio.Event()
    count = 0

    async def on_msg(msg: Msg) -> None:
        nonlocal count
        headers = dict(msg.headers or {})
        if headers.get(PROBE_HEADER) == nonce or done.is_set():
            return
        on_message(Received(subject=msg.subject, body=bytes(msg.data), headers=headers))
        count += 1
        if max_events is not None and count >= max_events:
            done.set()

    subscription = await nc.subscribe(subject, cb=on_msg)
    await nc.flush()
    started = time.monotonic()
    if on_listening is not None:
        on_listening()
    try:
        await wait_set(done, duration)
    finally:
        done.set()
        await subscription.unsubscribe()
    return FeedRun(events=count, seconds=time.monotonic() - started)
