"""The fake provider API the fast tier runs the SDK against: it ships with the SDK, in `tenant_controllers.testing`,
so tenants test their controllers with the same fake; this module keeps the tests' import path."""

from tenant_controllers.testing.provider import FakeProvider, ScriptedFault

__all__ = ["FakeProvider", "ScriptedFault"]
