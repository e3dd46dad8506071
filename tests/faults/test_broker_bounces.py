"""The broker is bounced every 1-3 s while agents publish 5,000 events: every event reaches its tenant controller
exactly once; the duplicates the bounces cause are delivered and suppressed, never handled twice.

Real processes throughout: a nats-server restarted (SIGTERM or SIGKILL, seeded) on its port with its JetStream
store; four agent processes publishing through the product's `JetStreamPublisher` (retry until PubAck, `Nats-Msg-Id`
= CloudEvent id), one in fifty events also re-sent under a second message id, so the stream holds some CloudEvents
twice; the tenant's controller as its own process (`tenant_controllers.cli run`, durable pull consumer, SQLite
record of handled CloudEvent ids), whose handler appends each id it runs for to a file. The real API serves the
controller's consumer and job.

Checked by CloudEvent id, on exact counts: the stream stores each event once plus each re-send once (no publisher
retry stored a second copy), the handler ran exactly once for each of the 5,000 ids and for nothing else, and the
controller's own counters add up: deliveries = first deliveries (5,000) + suppressed duplicates.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from pathlib import Path

import pytest
from nats.js.errors import NotFoundError

from broker_config.render import tenant_stream_name
from harmonaize.event_loop import resolve_event_loop
from tests.controllers.live_cloud import LiveCloud
from tests.faults.scripts.agent_publisher import event_id
from tests.faults.support import (
    SCRIPTS,
    BrokerBouncer,
    Process,
    clean_env,
    duplicates,
    python,
    scaled,
    stored_event_ids,
)
from tests.support import eventually

pytestmark = [pytest.mark.slow, pytest.mark.timeout(scaled(240, 1800))]

JOB = "fleet-job"
AGENTS = 4
EVENTS = scaled(5_000, 40_000)
RATE = 100  # events/s per agent: 5,000 events take ~12.5 s, long enough for several bounces
MIN_BOUNCES = scaled(6, 40)
RESEND_EVERY = 50
SEED = 20260301
CONSUMER = f"ctl-{JOB}-counter"
STATS = re.compile(r"controller counter stopped \(RuntimeStats\((?P<fields>[^)]*)\)\)")


def runtime_stats(log: str) -> dict[str, int]:
    found = STATS.findall(log)
    assert len(found) == 1, f"expected one stop line with the controller's counters, found {len(found)}"
    return {k: int(v) for k, v in (item.split("=") for item in found[0].split(", "))}


async def test_every_event_is_handled_exactly_once_while_the_broker_bounces(
    cloud: LiveCloud, tmp_path: Path, provider_secret: bytes
) -> None:
    await cloud.create_job(JOB)
    runs = tmp_path / "runs.txt"
    controller = Process(
        "controller",
        python("-m", "tenant_controllers.cli", "run", str(SCRIPTS / "counting_controller.py"),
               "--state-dir", str(tmp_path / "state"), "--ack-wait", "2", "--resync-interval", "0"),
        cloud.env(COUNTER_JOB=JOB, COUNTER_RUNS=str(runs)),
        tmp_path / "controller.log",
    ).start()
    per_agent = EVENTS // AGENTS
    agents = [
        Process(
            f"agent-{i}",
            python(str(SCRIPTS / "agent_publisher.py"), "--servers", cloud.nats_url, "--tenant", cloud.tenant,
                   "--job", JOB, "--prefix", f"a{i}", "--count", str(per_agent), "--rate", str(RATE),
                   "--resend-every", str(RESEND_EVERY), "--out", str(tmp_path / f"agent-{i}.json")),
            clean_env(HZ_PROVIDER_SECRET=provider_secret.decode()),
            tmp_path / f"agent-{i}.log",
        )
        for i in range(AGENTS)
    ]
    expected = {event_id(f"a{i}", n) for i in range(AGENTS) for n in range(per_agent)}
    bouncer = BrokerBouncer(cloud.nats_server, seed=SEED)
    try:
        await eventually(lambda: "controller counter running" in controller.tail(100_000), timeout=30,
                         what="the controller pulling from its durable consumer")
        started = time.monotonic()
        for agent in agents:
            agent.start()
        bouncer.start()
        await eventually(lambda: not any(a.alive() for a in agents), timeout=scaled(150, 1500), interval=0.2,
                         what="every agent acknowledged all its events")
        published_s = time.monotonic() - started
        await eventually(lambda: len(bouncer.bounces) >= MIN_BOUNCES, timeout=30, interval=0.1,
                         what=f"at least {MIN_BOUNCES} bounces (the controller still catching up meanwhile)")
        bouncer.stop()
        for agent in agents:
            assert agent.proc is not None and agent.proc.returncode == 0, f"{agent.name} failed:\n{agent.tail()}"

        def handled_ids() -> set[str]:
            return set(runs.read_text().split()) if runs.exists() else set()

        await eventually(lambda: handled_ids() >= expected, timeout=120, interval=0.2,
                         what="the controller handling every event")

        async def settled() -> bool:
            try:
                info = await cloud.consumer_info(CONSUMER)
            except NotFoundError:  # kept in the broker's memory: gone with the last restart until the controller
                return False  # notices and asks for it again, from the position it recorded
            return info.num_pending == 0 and info.num_ack_pending == 0

        await eventually(settled, timeout=60, interval=0.2, what="every delivery (redeliveries included) acked")
        received_s = time.monotonic() - started
        assert controller.terminate() == 0, controller.tail()
    finally:
        bouncer.stop()
        for process in (*agents, controller):
            process.kill()

    summaries = [json.loads((tmp_path / f"agent-{i}.json").read_text()) for i in range(AGENTS)]
    resent = sum(s["resent"] for s in summaries)
    stored = await stored_event_ids(cloud.provider, tenant_stream_name(cloud.tenant))
    runs_per_id = Counter(runs.read_text().split())
    stats = runtime_stats(controller.tail(1_000_000))
    assert f"event loop: {resolve_event_loop('auto')}" in controller.tail(1_000_000), "the CLI's default loop"
    print(
        f"\nbroker bounces: {bouncer.summary()}; publishing took {published_s:.1f} s\n"
        f"published {len(expected)} events from {AGENTS} agents (+{resent} re-sent under a second message id); "
        f"publisher retries {sum(s['retries'] for s in summaries)}, PubAcks flagged duplicate "
        f"{sum(s['duplicate_acks'] for s in summaries)} (retries the broker had already stored)\n"
        f"stream stores {sum(stored.values())} messages for {len(stored)} CloudEvent ids\n"
        f"controller: {stats['received']} deliveries, {stats['handled']} handled, {stats['duplicates']} duplicates "
        f"suppressed; every event handled after {received_s:.1f} s"
    )
    assert set(stored) == expected, "the stream lost an acknowledged event, or holds one nobody published"
    assert sum(stored.values()) == len(expected) + resent, (
        f"publisher retries were stored twice: {len(duplicates(stored)) - resent} beyond the re-sends")
    assert len(duplicates(stored)) == resent
    assert set(runs_per_id) == expected, "handled something unexpected, or missed an event"
    assert duplicates(runs_per_id) == {}, f"handled more than once: {duplicates(runs_per_id)}"
    assert stats["handled"] == len(expected) and stats["gave_up"] == 0
    assert stats["duplicates"] >= resent, "every re-sent copy is a duplicate the controller must have suppressed"
    assert stats["received"] == len(expected) + stats["duplicates"] + stats["handed_back"]
