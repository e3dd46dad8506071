"""The start-up heap is left out of later collections (harmonaize.heap), so full passes stay short."""

from __future__ import annotations

import gc

from harmonaize.heap import freeze_startup_heap


def test_objects_alive_at_start_up_are_no_longer_walked_by_the_collector() -> None:
    kept = [[n] for n in range(1000)]  # long-lived containers, as modules and schemas are
    try:
        frozen = freeze_startup_heap()
        assert frozen >= len(kept)
        walked = {id(o) for o in gc.get_objects()}
        assert not any(id(item) in walked for item in kept), "start-up objects are in the permanent generation"
        later = [[n] for n in range(10)]
        walked = {id(o) for o in gc.get_objects()}
        assert all(id(item) in walked for item in later), "what is created afterwards is collected as before"
    finally:
        gc.unfreeze()  # the rest of the test session keeps the default behaviour
