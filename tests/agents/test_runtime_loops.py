"""The agent's periodic loops stop when told, even with a pass stuck on an absent control plane."""

from __future__ import annotations

import asyncio

from provider_agents.runtime import _every


async def test_a_progress_pass_stuck_on_the_control_plane_does_not_hold_the_shutdown() -> None:
    stop = asyncio.Event()
    started = asyncio.Event()
    cancelled: list[bool] = []

    async def report() -> None:  # an API that never answers, as during a teardown that stopped it first
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    loop = asyncio.create_task(_every(0.05, report, stop, abandon_on_stop=True))
    await asyncio.wait_for(started.wait(), 5)
    stop.set()
    await asyncio.wait_for(loop, 1)  # not the pass's retry schedule
    assert cancelled == [True]


async def test_other_passes_finish_the_pass_they_are_in() -> None:
    """A converge pass may be starting or stopping a node: it completes rather than being cut in half."""
    stop = asyncio.Event()
    release = asyncio.Event()
    finished: list[bool] = []

    async def converge() -> None:
        stop.set()
        await release.wait()
        finished.append(True)

    loop = asyncio.create_task(_every(0.05, converge, stop))
    done, _ = await asyncio.wait({loop}, timeout=0.3)
    assert not done, "the pass was abandoned instead of finished"
    release.set()
    await asyncio.wait_for(loop, 1)
    assert finished == [True]
