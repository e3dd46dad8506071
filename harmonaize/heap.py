"""Keep the garbage collector's full passes short in the processes that carry events.

CPython's collector walks every tracked object on a full (generation 2) pass. An agent or a controller holds on the
order of 100k objects from start-up (modules, pydantic schemas, the NATS client) that live as long as the process;
a full pass over them took 25-30 ms in bench/bench_events.py's fleet process, stalling every event in flight for that
long (at 1,000 events/s, a few such passes a minute are the p99). `gc.freeze()` moves what is alive at that moment to
a permanent generation that collections skip, so later full passes walk only what was created since (~1 ms there).
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
