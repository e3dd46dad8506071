"""Builders for events and a context manager that runs a controller for the duration of a block."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

from harmonaize.events import (
    Capacity,
    CarbonIntensity,
    CloudEvent,
    Congestion,
    CongestionLevel,
    CongestionScope,
    Failure,
    FailureKind,
    Maintenance,
    MaintenanceKind,
    MaintenanceStatus,
    MaintenanceWindow,
    Severity,
    make_event,
)
from tenant_controllers import Controller
from tenant_controllers.api_client import ProviderApi
from tenant_controllers.runtime import ControllerRuntime
from tenant_controllers.sources import EventSource
from tenant_controllers.store import HandledStore

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
HOST = "h-" + "a" * 16
GROUP_A = "g-" + "a" * 16
GROUP_B = "g-" + "b" * 16


def carbon(
    g: float, *, job: str = "llm-finetune", at: datetime | None = None, event_id: str | None = None
) -> CloudEvent[CarbonIntensity]:
    when = at or T0
    data = CarbonIntensity(region="US-CAL-CISO", g_per_kwh=float(g), observed_at=when)
    return make_event(data, source="/hz/provider/carbon", subject=job, time=when, event_id=event_id)


def failure(*, job: str = "llm-finetune", kind: FailureKind = FailureKind.HOST_DOWN, at: datetime | None = None,
            event_id: str | None = None, host: str = HOST, lead: timedelta = timedelta(minutes=5)
            ) -> CloudEvent[Failure]:
    """A critical failure of `host`; a predicted one has its eta `lead` after it was detected."""
    when = at or T0
    extra: dict[str, Any] = {}
    if kind is FailureKind.PREDICTED_FAILURE:
        extra = {"eta": when + lead, "confidence": 0.9}
    data = Failure(kind=kind, host=host, detected_at=when, severity=Severity.CRITICAL, **extra)
    return make_event(data, source="/hz/provider/agent", subject=job, time=when, event_id=event_id)


def congestion(
    level: CongestionLevel,
    *,
    job: str = "llm-finetune",
    scope: CongestionScope = CongestionScope.INTER_GROUP,
    at: datetime | None = None,
) -> CloudEvent[Congestion]:
    when = at or T0
    slowdown = 1.0 if level is CongestionLevel.NONE else 2.5
    groups = () if level is CongestionLevel.NONE else (GROUP_A, GROUP_B)
    data = Congestion(level=level, slowdown=slowdown, scope=scope, groups=groups, since=when)
    return make_event(data, source="/hz/provider/network", subject=job, time=when)



def capacity(max_workers: int, *, job: str = "llm-finetune", at: datetime | None = None) -> CloudEvent[Capacity]:
    when = at or T0
    data = Capacity(max_workers=max_workers, as_of=when)
    return make_event(data, source="/hz/provider/control-plane", subject=job, time=when)


def maintenance(
    kind: MaintenanceKind = MaintenanceKind.PREEMPT,
    *,
    job: str = "llm-finetune",
    hosts: tuple[str, ...] = (HOST,),
    lead: timedelta = timedelta(seconds=30),
    status: MaintenanceStatus = MaintenanceStatus.SCHEDULED,
    at: datetime | None = None,
) -> CloudEvent[Maintenance]:
    when = at or T0
    window = MaintenanceWindow(not_before=when + lead, not_after=when + lead + timedelta(minutes=10))
    data = Maintenance(notice_id="n-1", kind=kind, status=status, window=window, hosts=hosts)
    return make_event(data, source="/hz/provider/agent", subject=job, time=when)

@asynccontextmanager
async def running(
    controller: Controller,
    *,
    source: EventSource,
    api: ProviderApi,
    store: HandledStore,
    **options: Any,
) -> AsyncIterator[ControllerRuntime]:
    """Run `controller` in a task; on exit stop it, wait for the drain, and re-raise anything it raised."""
    if not controller.has_name:
        controller.set_default_name("test")
    options.setdefault("fetch_timeout", 0.05)
    options.setdefault("resync_interval", None)
    runtime = ControllerRuntime(controller, source=source, api=api, store=store, **options)
    stop = asyncio.Event()
    task = asyncio.create_task(runtime.run(stop), name="hz-test-controller")
    ready = asyncio.create_task(runtime.ready.wait())
    await asyncio.wait({task, ready}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():
        ready.cancel()
        await asyncio.gather(ready, return_exceptions=True)
        if task.done():
            task.result()
        raise AssertionError("the controller did not become ready within 10 s")
    try:
        yield runtime
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)
