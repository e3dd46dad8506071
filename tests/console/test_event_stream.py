"""`GET /v1/events/stream` without a browser: a tenant's stream carries its own events and never another tenant's,
replays the latest and resumes after the last one a reader has (nothing missed, nothing twice), only a valid tenant
token opens one, and a stream ends cleanly when its reader leaves or the feed closes."""

from __future__ import annotations

import httpx
import pytest

from api.routes.event_stream import StreamLimits
from harmonaize.events import Failure, FailureKind, Severity
from tests.console.console_cloud import ADMIN_TOKEN, ConsoleCloud, carbon
from tests.console.sse import Message, SseReader
from tests.support import eventually

STREAM = "/v1/events/stream"
LIVE = f"{STREAM}?backlog=0"


async def test_a_stream_carries_the_tenants_own_events_and_never_another_tenants(cloud: ConsoleCloud) -> None:
    async with httpx.AsyncClient(base_url=cloud.url, timeout=30) as http:
        async with http.stream("GET", LIVE, headers=cloud.headers("acme")) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            reader = SseReader(response)
            ready = await reader.next()
            assert ready.event == "ready" and ready.json()["tenant"] == "acme"

            # globex's events first: had they leaked, they would arrive before acme's
            theirs = {
                await cloud.publish("globex", "globex-train", carbon(111.0)),
                await cloud.publish("globex", "acme-train", carbon(222.0)),  # globex may have a job named as acme's
            }
            own = await cloud.publish("acme", "acme-train", carbon(333.0))
            failure = Failure(kind=FailureKind.GPU_ERROR, host="h-0123456789abcdef",
                              detected_at=carbon(0).observed_at, severity=Severity.CRITICAL)
            own_failure = await cloud.publish("acme", "acme-train", failure)

            seen = await _until(reader, {own, own_failure})
            assert not theirs & {message.json()["id"] for message in seen}
            ours = [(m.event, m.json()["id"]) for m in seen if m.event != "capacity"]  # the API's own events may come
            assert ours == [("carbon", own), ("failure", own_failure)]
            first = next(m.json() for m in seen if m.event == "carbon")
            assert first["subject"] == "acme-train" and first["data"]["g_per_kwh"] == 333.0


async def test_a_stream_replays_the_latest_events_and_resumes_after_the_last_one_read(cloud: ConsoleCloud) -> None:
    earlier = [await cloud.publish("acme", "acme-train", carbon(100.0 + n)) for n in range(3)]
    await cloud.publish("globex", "acme-train", carbon(999.0))
    async with httpx.AsyncClient(base_url=cloud.url, timeout=30) as http:
        async with http.stream("GET", STREAM, headers=cloud.headers("acme")) as response:
            reader = SseReader(response)
            assert (await reader.next()).event == "ready"
            replayed = await _until(reader, set(earlier))
            carbons = [m for m in replayed if m.event == "carbon"]
            assert [m.json()["id"] for m in carbons] == earlier, "the latest events, in order, only acme's"
            assert all(m.id is not None and m.id.isdigit() for m in replayed)
            assert [int(m.id or 0) for m in replayed] == sorted(int(m.id or 0) for m in replayed)
            last_read = carbons[1]  # the reader stops here: the stream's third event is "missed"

        missed = await cloud.publish("acme", "acme-train", carbon(200.0))  # published while nobody reads
        resume_at = str(last_read.id)
        ways: list[tuple[dict[str, str], dict[str, str]]] = [
            ({"after": resume_at}, {}), ({}, {"Last-Event-ID": resume_at}),
        ]
        for params, extra in ways:
            how = params or extra
            async with http.stream("GET", STREAM, params=params, headers={**cloud.headers("acme"), **extra}) as again:
                reader = SseReader(again)
                ready = await reader.next()
                assert ready.event == "ready" and ready.json()["from"] == int(last_read.id or 0) + 1
                resumed = [m for m in await _until(reader, {missed}) if m.event == "carbon"]
                assert [m.json()["id"] for m in resumed] == [earlier[2], missed], how

        bad = await http.get(STREAM, headers={**cloud.headers("acme"), "Last-Event-ID": "yesterday"})
        assert bad.status_code == 422 and "Last-Event-ID" in bad.json()["reason"]
        assert (await http.get(STREAM, params={"backlog": 5000}, headers=cloud.headers("acme"))).status_code == 422


async def _until(reader: SseReader, ids: set[str]) -> list[Message]:
    """Every message up to the last of `ids`."""
    seen: list[Message] = []
    while not ids <= {message.json().get("id") for message in seen}:
        seen.append(await reader.next())
    return seen


async def test_only_a_valid_tenant_token_opens_a_stream(cloud: ConsoleCloud) -> None:
    async with httpx.AsyncClient(base_url=cloud.url, timeout=30) as http:
        anonymous = await http.get(STREAM)
        assert anonymous.status_code == 401
        wrong = await http.get(STREAM, headers={"Authorization": "Bearer not-a-token"})
        assert wrong.status_code == 401
        admin = await http.get(STREAM, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        assert admin.status_code == 403 and "tenant" in admin.json()["reason"]
        assert (await cloud.admin.delete("/v1/tenants/globex")).status_code == 200
        revoked = await http.get(STREAM, headers=cloud.headers("globex"))
        assert revoked.status_code == 401 and revoked.json()["reason"] == "this tenant has been revoked"
        assert "/v1/events/stream" not in str(cloud.app.openapi()["paths"]), "an endless stream is not in the schema"


async def test_a_stream_ends_when_its_reader_leaves_and_when_the_feed_closes(cloud: ConsoleCloud) -> None:
    feed = cloud.app.state.event_feed
    async with httpx.AsyncClient(base_url=cloud.url, timeout=30) as http:
        async with http.stream("GET", LIVE, headers=cloud.headers("acme")) as response:
            assert (await SseReader(response).next()).event == "ready"
            assert feed.open_feeds == 1
        await eventually(lambda: feed.open_feeds == 0, timeout=20, what="the subscription of a reader that left")

        async with http.stream("GET", LIVE, headers=cloud.headers("acme")) as response:
            reader = SseReader(response)
            assert (await reader.next()).event == "ready"
            await feed.close()  # what the app's shutdown does
            end = await reader.next()
            while end.event == "capacity":
                end = await reader.next()
            assert (end.event, end.json()) == ("end", {"reason": "shutdown"})
        await eventually(lambda: feed.open_feeds == 0, timeout=20, what="the closed feed's subscription")
        refused = await http.get(STREAM, headers=cloud.headers("acme"))
        assert refused.status_code == 503


async def test_a_stream_ends_after_its_lifetime_so_the_client_reconnects_and_authenticates_again(
    cloud: ConsoleCloud,
) -> None:
    cloud.app.state.event_stream_limits = StreamLimits(max_s=1.0, keepalive_s=0.2)
    async with httpx.AsyncClient(base_url=cloud.url, timeout=30) as http:
        async with http.stream("GET", LIVE, headers=cloud.headers("acme")) as response:
            reader = SseReader(response)
            assert (await reader.next()).event == "ready"
            end = await reader.next()
            while end.event == "capacity":  # the API's own events about acme's job may come meanwhile
                end = await reader.next()
            assert (end.event, end.json()) == ("end", {"reason": "reconnect"})
            with pytest.raises(EOFError):
                await reader.next()
        await eventually(lambda: cloud.app.state.event_feed.open_feeds == 0, timeout=20, what="the ended stream's feed")
        assert (await cloud.admin.delete("/v1/tenants/acme")).status_code == 200
        again = await http.get(STREAM, headers=cloud.headers("acme"))
        assert again.status_code == 401, "the reconnect of a revoked tenant is refused"
