"""Keep the garbage collector's full passes short in the processes that carry events and requests.

CPython's collector walks every tracked object on a full (generation 2) pass. An agent, a controller or an API
process holds on the order of 100k objects from start-up (modules, pydantic schemas, the NATS client, routes, the
ORM's mappings) that live as long as the process, so a full pass over them stalls every event or request in flight
long enough to set the p99 latency (an API process: ~100 ms, under an open loop of negotiations). `gc.freeze()`
moves what is alive at that moment to a permanent generation that collections skip, so later full passes walk only
what was created since. The figures: bench/HISTORY.md ("Then: the start-up heap frozen").
Start-up objects are not garbage; a cycle among them would simply never be collected.
"""

from __future__ import annotations

import gc

__all__ = ["freeze_startup_heap"]


def freeze_startup_heap() -> int:
    """Collect once, then exempt every object alive now from later collections; returns how many are exempt.

    Call it once a long-running process has imported and built what it keeps for its lifetime, before events flow.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
