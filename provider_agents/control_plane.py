"""The provider components' client for the control plane's provider routes (admin token, HTTP).

Node launchers relay job progress and report failed nodes, the fleet monitor reports host outages, the micro loop
proposes directives, agents report what became of the maintenance approvals they were asked to carry out. All calls
are idempotent on the server side, so a caller simply retries on a transport error or a 5xx; a 4xx is the control
plane refusing the request, raised with its reason (`ControlPlaneRefusal`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from harmonaize.job_runtime import JobProgress
from harmonaize.negotiation import RoundAction
from harmonaize.node_failures import NodeFailureReport

__all__ = ["ControlPlane", "ControlPlaneRefusal"]

log = logging.getLogger(__name__)


class ControlPlaneRefusal(Exception):
    """The control plane answered 4xx: the request is wrong, retrying it would not help."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"{status}: {reason}")
        self.status = status
        self.reason = reason


class ControlPlane:
    def __init__(self, base_url: str, admin_token: str, *, timeout_s: float = 5.0, attempts: int = 5) -> None:
        self._client = httpx.AsyncClient(
            base_url=base_url.rstrip("/"), headers={"Authorization": f"Bearer {admin_token}"}, timeout=timeout_s
        )
        self._attempts = attempts

    async def close(self) -> None:
        await self._client.aclose()

    async def _call(self, method: str, path: str, *, json: Any = None) -> Any:
        delay = 0.1
        for attempt in range(1, self._attempts + 1):
            try:
                response = await self._client.request(method, path, json=json)
            except httpx.TransportError as exc:
                if attempt == self._attempts:
                    raise
                log.info("control plane %s %s: %r; retrying", method, path, exc)
            else:
                if response.status_code < 400:
                    return response.json() if response.content else None
                if response.status_code < 500:
                    reason = response.json().get("reason", response.text) if response.content else ""
                    raise ControlPlaneRefusal(response.status_code, str(reason))
                if attempt == self._attempts:
                    response.raise_for_status()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
        raise AssertionError("unreachable")

    async def report_progress(self, progress: JobProgress) -> bool:
        body = await self._call("POST", "/v1/provider/progress", json=progress.model_dump(mode="json"))
        return bool(body and body.get("newer"))

    async def report_node_failure(self, failure: NodeFailureReport) -> str:
        """What the control plane did: 'released' (the node left the job), 'recorded', 'duplicate' or 'stale'."""
        body = await self._call("POST", "/v1/provider/node-failures", json=failure.model_dump(mode="json"))
        return str(body.get("outcome", "")) if body else ""

    async def report_host_down(self, host: str) -> list[str]:
        body = await self._call("POST", f"/v1/provider/hosts/{host}/down")
        return list(body.get("jobs_shrunk", [])) if body else []

    async def report_host_up(self, host: str) -> None:
        await self._call("POST", f"/v1/provider/hosts/{host}/up")

    async def propose_directives(self, tenant: str, job: str, proposal: dict[str, Any]) -> dict[str, Any] | None:
        """The issued directive record, or None when the proposal changed nothing; ControlPlaneRefusal if refused."""
        record: dict[str, Any] | None = await self._call(
            "PUT", f"/v1/provider/jobs/{tenant}/{job}/directives", json=proposal
        )
        return record

    async def report_approval(self, negotiation: str, outcome: RoundAction, note: str) -> str:
        """Add `outcome` to the negotiation's rounds: 'recorded', or 'duplicate' when it is there already."""
        body = await self._call(
            "POST",
            "/v1/provider/approvals",
            json={"negotiation": negotiation, "outcome": outcome.value, "note": note},
        )
        return str(body.get("outcome", "")) if body else ""
