"""CloudEvents `source` values for the provider's publishers.

The source is visible to the tenant, so it is built here from the same pseudonyms the payloads use rather than
formatted ad hoc by each publisher: a host agent identifies itself to a tenant as `/hz/provider/agent/h-<hex>`,
never by its provider-internal hostname.
"""

from __future__ import annotations

from harmonaize.events.fields import is_host_pseudonym

__all__ = ["CONTROL_PLANE_SOURCE", "agent_source"]

CONTROL_PLANE_SOURCE = "/hz/provider/control-plane"
"""Events the provider's API publishes itself (capacity, negotiated topology changes)."""


def agent_source(host_pseudonym: str) -> str:
    """The source of events published by the host agent that a tenant knows as `host_pseudonym`."""
    if not is_host_pseudonym(host_pseudonym):
        raise ValueError(f"agent source needs a per-tenant host pseudonym (h-<hex>), got {host_pseudonym!r}")
    return f"/hz/provider/agent/{host_pseudonym}"
