"""Acceptance: a multi-round negotiation made through the tenant SDK is recorded round by round in the REST history,
and is invisible to another tenant (404, exactly like an id that never existed)."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest

from broker_config.provisioner import NatsTenantBroker
from broker_config.server import NatsServer
from harmonaize.negotiation import NegotiationState
from tenant_controllers import Job
from tenant_controllers.api_client import ProviderApi
from tests.controllers.live_cloud import live_cloud

pytestmark = pytest.mark.asyncio


async def test_sdk_negotiation_rounds_are_all_in_rest_history_and_hidden_from_other_tenants(
    tmp_path: Path, nats_server: NatsServer, tenant_broker: NatsTenantBroker, provider_secret: bytes
) -> None:
    async with live_cloud(
        tmp_path / "hz", nats_server=nats_server, tenant_broker=tenant_broker, provider_secret=provider_secret
    ) as cloud:
        await cloud.add_host("h1", gpus=2, group="rack-a")
        await cloud.add_host("h2", gpus=1, group="rack-b")
        await cloud.create_job("llm-finetune", min_workers=1, max_workers=4, initial_workers=2)

        async with ProviderApi(base_url=cloud.api_url, token=cloud.token) as api:
            job = await Job("llm-finetune", api=api).refresh()
            first = await job.negotiate(scale_to=job.workers + 1)  # round 1: ask for one more
            second = await first.counter(scale_to=4, accept=(2, 4))  # round 2: counter for the maximum
            assert second.round == 2 and second.state is NegotiationState.OFFERED
            chosen = await second.accept(0)
            assert (await job.refresh()).workers == chosen.workers

        reply = await cloud.tenant_client.get(f"/v1/negotiations/{second.id}")
        assert reply.status_code == 200, reply.text
        history = reply.json()
        steps = [(r["round"], r["actor"], r["action"]) for r in history["rounds"]]
        assert steps == [
            (1, "tenant", "request"),
            (1, "provider", "offer"),
            (2, "tenant", "counter"),
            (2, "provider", "offer"),
            (2, "tenant", "accept"),
        ]
        assert history["rounds"][2]["terms"]["desired_workers"] == 4
        assert history["rounds"][-1]["option"] == 0 and history["state"] == "accepted"
        assert history["accepted_option"]["workers"] == chosen.workers
        listed = await cloud.negotiations(job="llm-finetune")
        assert [n["id"] for n in listed] == [second.id]

        created = await cloud.admin.post("/v1/tenants", json={"id": "globex", "display_name": "Globex"})
        assert created.status_code == 201, created.text
        globex = {"Authorization": f"Bearer {created.json()['api_token']}"}
        async with httpx.AsyncClient(base_url=cloud.api_url, headers=globex) as other:
            theirs = await other.get(f"/v1/negotiations/{second.id}")
            never = await other.get(f"/v1/negotiations/{uuid.uuid4()}")
            assert theirs.status_code == never.status_code == 404
            assert theirs.json() == never.json()
            for action, body in (("accept", {"option": 0}), ("reject", {}), ("cancel", {}),
                                 ("counter", {"desired_workers": 1})):
                moved = await other.post(f"/v1/negotiations/{second.id}/{action}", json=body)
                assert moved.status_code == 404, (action, moved.text)
            assert (await other.get("/v1/negotiations")).json()["items"] == []
