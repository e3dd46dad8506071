"""The broker's JetStream fsync policy as a setting: `always`, or a period nats-server accepts.

It lives in the contract because `Settings` checks it when it loads (a bad value is refused in one line before any
process starts), and `broker_config` renders it into nats-server's configuration.
"""

from __future__ import annotations

import re

__all__ = ["SYNC_ALWAYS", "check_sync_interval"]

SYNC_ALWAYS = "always"
_PERIOD = re.compile(r"[1-9][0-9]{0,5}(ms|s|m)")


def check_sync_interval(value: str) -> str:
    """`always`, or a period nats-server accepts (`500ms`, `10s`, `2m`); anything else is refused before rendering.

    Trade-off (docs/building-blocks.md): with `always` an acknowledged event survives an OS crash or power loss of the
    broker's host, at the price of one fsync per stored event (its latency and jitter are the disk's); with a period,
    acknowledged events of the last period can be lost in such a crash (a process crash or restart loses nothing
    either way, the page cache survives it). A replicated stream (the `cluster` profile) also holds each event on other
    hosts, but Jepsen (2025) found acknowledged writes lost there too without `always`, so the default is `always`.
    """
    if value != SYNC_ALWAYS and not _PERIOD.fullmatch(value):
        raise ValueError(f"sync interval must be 'always' or a period like 500ms, 10s or 2m; got {value!r}")
    return value
