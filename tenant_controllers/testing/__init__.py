"""Test a tenant controller without a cloud, as `kopf.testing` or faststream's `TestNatsBroker` do for theirs.

    from tenant_controllers.testing import ControllerHarness

    async with ControllerHarness(ctl, workers=2) as h:
        await h.publish(Failure(...))
        negotiation = await h.provider.next_negotiation()
        await h.settle()
        assert h.job()["desired_workers"] == 2

What is here: `ControllerHarness` (runs the controller in the real runtime for a block), `MemoryBroker` and `Faults`
(the in-memory event stream and its misbehaviours), `FakeProvider` with `offer`/`decline` (the negotiation REST API,
answers scripted by the test, every request and round recorded) and `provider_event` (a payload wrapped as the
provider publishes it). It imports nothing of the provider's own stack, only the SDK, the shared contract and httpx.
"""

from tenant_controllers.memory import Faults, MemoryBroker, MemoryEventSource
from tenant_controllers.testing.harness import ControllerHarness, provider_event
from tenant_controllers.testing.provider import Answer, FakeProvider, Policy, ScriptedFault, decline, offer

__all__ = [
    "Answer",
    "ControllerHarness",
    "FakeProvider",
    "Faults",
    "MemoryBroker",
    "MemoryEventSource",
    "Policy",
    "ScriptedFault",
    "decline",
    "offer",
    "provider_event",
]
