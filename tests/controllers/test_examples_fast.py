"""Fast tier: the three example controllers, loaded from their files as the runner loads them, make the negotiations
they promise (in-memory bus, fake REST API). The real tier runs them against the real API: test_examples_real.py.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import tenant_controllers.examples
from harmonaize.events import CongestionLevel, CongestionScope, FailureKind, MaintenanceKind, MaintenanceStatus
from harmonaize.negotiation import NegotiationKind, NegotiationState
from tenant_controllers.api_client import ProviderApi
from tenant_controllers.memory import MemoryBroker, MemoryEventSource
from tenant_controllers.runner import load_controllers
from tenant_controllers.store import HandledStore
from tests.controllers.fake_provider import FakeProvider
from tests.controllers.support import HOST, T0, capacity, carbon, congestion, failure, maintenance, running
from tests.support import eventually

EXAMPLES = Path(tenant_controllers.examples.__file__).parent


def negotiations(provider: FakeProvider) -> list[dict[str, Any]]:
    return sorted(provider.negotiations.values(), key=lambda n: n["created_at"])


async def test_carbon_aware_scaler_grows_under_a_carbon_cap_and_shrinks_when_dirty(
    provider: FakeProvider, api: ProviderApi, bus: MemoryBroker, store: HandledStore
) -> None:
    provider.capacity["llm-finetune"] = 3
    [ctl] = load_controllers(EXAMPLES / "carbon_aware_scaler.py")
    async with running(ctl, source=MemoryEventSource(bus), api=api, store=store) as runtime:
        bus.publish(carbon(280, at=T0))
        bus.publish(carbon(120, at=T0 + timedelta(hours=1)))
        await eventually(lambda: provider.jobs["llm-finetune"]["desired_workers"] == 3, what="grown to 3")
        bus.publish(carbon(420, at=T0 + timedelta(hours=2)))
        await eventually(lambda: provider.jobs["llm-finetune"]["desired_workers"] == 1, what="shrunk to 1")
        await eventually(lambda: runtime.stats.handled == 3, what="all handled")
    grow, shrink = negotiations(provider)
    assert grow["terms"] == {"desired_workers": 4, "accept_workers": {"min": 3, "max": 4},
                             "constraints": {"carbon_cap_g_per_kwh": 200.0}}
    assert grow["state"] == "accepted" and shrink["state"] == "accepted"
    assert shrink["terms"]["desired_workers"] == 1
    outcomes = [r.outcome for r in store.records()]
    assert outcomes[0] == "keep 2 workers at 280 g/kWh" and outcomes[1] == "scaled to 3 workers at 120 g/kWh"


async def test_failure_guard_asks_for_a_replacement_or_one_fewer_before_the_predicted_failure(
    provider: FakeProvider, api: ProviderApi, bus: MemoryBroker, store: HandledStore
) -> None:
    provider.capacity["llm-finetune"] = 2
    [ctl] = load_controllers(EXAMPLES / "failure_guard.py")
    predicted = failure(kind=FailureKind.PREDICTED_FAILURE)
    async with running(ctl, source=MemoryEventSource(bus), api=api, store=store) as runtime:
        bus.publish(predicted)
        await eventually(lambda: runtime.stats.handled == 1, what="handled")
    [negotiation] = negotiations(provider)
    assert negotiation["kind"] == NegotiationKind.SCALE and negotiation["state"] == NegotiationState.ACCEPTED
    assert negotiation["terms"]["desired_workers"] == 2
    assert negotiation["terms"]["accept_workers"] == {"min": 1, "max": 2}
    assert negotiation["terms"]["replace_hosts"] == [predicted.data.host], "keeping the size replaces the host"
    eta = predicted.data.eta
    assert eta is not None
    assert negotiation["terms"]["constraints"]["deadline"].startswith(eta.isoformat().replace("+00:00", ""))
    assert store.records()[0].outcome.endswith("replaced the worker")


async def test_failure_guard_moves_the_worker_off_first_when_the_notice_is_shorter_than_a_start(
    provider: FakeProvider, api: ProviderApi, bus: MemoryBroker, store: HandledStore
) -> None:
    """A replacement joins only once started: with 6 s of notice the guard leaves the host first, one worker fewer
    (a make-before-break swap would still be waiting for its joiner when the host dies)."""
    provider.capacity["llm-finetune"] = 2
    [ctl] = load_controllers(EXAMPLES / "failure_guard.py")
    predicted = failure(kind=FailureKind.PREDICTED_FAILURE, lead=timedelta(seconds=6))
    async with running(ctl, source=MemoryEventSource(bus), api=api, store=store) as runtime:
        bus.publish(predicted)
        await eventually(lambda: runtime.stats.handled == 1, what="handled")
    [negotiation] = negotiations(provider)
    assert negotiation["state"] == NegotiationState.ACCEPTED
    assert negotiation["terms"]["desired_workers"] == 1
    assert negotiation["terms"]["accept_workers"] == {"min": 1, "max": 1}
    assert negotiation["terms"]["replace_hosts"] == [predicted.data.host], "the worker leaves the failing host"
    assert provider.jobs["llm-finetune"]["desired_workers"] == 1
    assert store.records()[0].outcome.endswith("left first, 1 workers (notice too short)")


async def test_failure_guard_with_a_short_notice_at_the_minimum_size_still_asks_for_a_replacement(
    provider: FakeProvider, api: ProviderApi, bus: MemoryBroker, store: HandledStore
) -> None:
    """Leaving first is not possible at the job's minimum: the replacement is the only way to keep it running."""
    provider.jobs["llm-finetune"]["min_workers"] = 2
    provider.capacity["llm-finetune"] = 2
    [ctl] = load_controllers(EXAMPLES / "failure_guard.py")
    async with running(ctl, source=MemoryEventSource(bus), api=api, store=store) as runtime:
        bus.publish(failure(kind=FailureKind.PREDICTED_FAILURE, lead=timedelta(seconds=6)))
        await eventually(lambda: runtime.stats.handled == 1, what="handled")
    [negotiation] = negotiations(provider)
    assert negotiation["terms"]["desired_workers"] == 2
    assert negotiation["terms"]["accept_workers"] == {"min": 2, "max": 2}
    assert store.records()[0].outcome.endswith("replaced the worker")


async def test_congestion_repartitioner_switches_to_hsdp_and_back_with_hysteresis(
    provider: FakeProvider, api: ProviderApi, bus: MemoryBroker, store: HandledStore
) -> None:
    [ctl] = load_controllers(EXAMPLES / "congestion_repartitioner.py")

    def plan() -> Any:
        return provider.jobs["llm-finetune"]["parallel_plan"]

    async with running(ctl, source=MemoryEventSource(bus), api=api, store=store) as runtime:
        bus.publish(congestion(CongestionLevel.HIGH, scope=CongestionScope.INTRA_GROUP, at=T0))
        bus.publish(congestion(CongestionLevel.HIGH, at=T0 + timedelta(minutes=1)))
        await eventually(lambda: plan() == "hsdp", what="HSDP under inter-group congestion")
        bus.publish(congestion(CongestionLevel.LOW, at=T0 + timedelta(minutes=2)))
        bus.publish(congestion(CongestionLevel.NONE, at=T0 + timedelta(minutes=3)))
        await eventually(lambda: plan() == "ddp", what="back to DDP once clear")
        await eventually(lambda: runtime.stats.handled == 3, what="three inter-group events handled")
    assert [(n["kind"], n["terms"]["parallel_plan"], n["state"]) for n in negotiations(provider)] == [
        ("repartition", "hsdp", "accepted"), ("repartition", "ddp", "accepted")]


async def test_capacity_scaler_grows_into_capacity_and_leaves_hosts_ahead_of_their_maintenance(
    provider: FakeProvider, api: ProviderApi, bus: MemoryBroker, store: HandledStore
) -> None:
    provider.capacity["llm-finetune"] = 3
    [ctl] = load_controllers(EXAMPLES / "capacity_scaler.py")
    async with running(ctl, source=MemoryEventSource(bus), api=api, store=store) as runtime:
        bus.publish(capacity(2, at=T0))
        bus.publish(capacity(3, at=T0 + timedelta(seconds=1)))
        await eventually(lambda: provider.jobs["llm-finetune"]["desired_workers"] == 3, what="grown to 3")
        bus.publish(maintenance(MaintenanceKind.LIVE_MIGRATE, at=T0 + timedelta(seconds=2)))
        bus.publish(maintenance(status=MaintenanceStatus.STARTED, at=T0 + timedelta(seconds=3)))
        provider.capacity["llm-finetune"] = 2
        notice = maintenance(at=T0 + timedelta(seconds=4))
        bus.publish(notice)
        await eventually(lambda: provider.jobs["llm-finetune"]["desired_workers"] == 2, what="left the host")
        await eventually(lambda: runtime.stats.handled == 3, what="capacity twice and the preemption handled")
    grow, leave = negotiations(provider)
    assert grow["terms"] == {"desired_workers": 3, "accept_workers": {"min": 3, "max": 3}, "constraints": {}}
    assert leave["terms"]["desired_workers"] == 3 and leave["terms"]["accept_workers"] == {"min": 1, "max": 3}
    assert leave["terms"]["replace_hosts"] == [HOST], "the hosts under maintenance, by the notice's names"
    not_before = notice.data.window.not_before
    assert leave["terms"]["constraints"]["deadline"].startswith(not_before.isoformat().replace("+00:00", ""))
    outcomes = [r.outcome for r in store.records()]
    assert "keep 2 workers (room for 2)" in outcomes and "grew to 3 workers" in outcomes
    assert outcomes[-1] == "left 1 host(s) ahead of preempt: 2 workers"
