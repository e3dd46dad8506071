"""One host agent's publishing path, as a process of its own: `count` tenant events through the product's
`JetStreamPublisher` (each retried until its PubAck, `Nats-Msg-Id` = CloudEvent id), paced at `rate` events/s.

Event ids are deterministic (`<prefix>-<n>`), so the test knows the exact set to expect without reading anything
back. Every `resend_every`-th event is also published a second time under another `Nats-Msg-Id` (an agent that
restarted and sent again what it had sent): the stream stores that CloudEvent twice, and only the tenant's
de-duplication by CloudEvent id can keep it from being handled twice.

On exit, a JSON summary goes to `--out`: what was published, the publisher's retries, the PubAcks flagged duplicate
(a retry of a message the broker had already stored) and the resends. Exit 0 once everything is acknowledged.

    HZ_PROVIDER_SECRET=... python agent_publisher.py --servers nats://127.0.0.1:4222 --tenant acme --job j \
        --prefix a0 --count 1250 --rate 100 --out a0.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from harmonaize import event_loop
from harmonaize.events import CarbonIntensity, make_event
from harmonaize.subjects import tenant_event_subject
from provider_agents.publisher import Backoff, JetStreamPublisher
from provider_agents.runtime import connect_provider

T0 = datetime(2026, 3, 1, tzinfo=UTC)
SOURCE = "/hz/provider/carbon"


def event_id(prefix: str, n: int) -> str:
    return f"{prefix}-{n:05d}"


async def resend(js: object, subject: str, payload: bytes, msg_id: str) -> None:
    """A second copy under its own message id, retried until acknowledged like everything else."""
    while True:
        try:
            headers = {"Nats-Msg-Id": msg_id}
            await js.publish(subject, payload, timeout=1.0, headers=headers)  # type: ignore[attr-defined]
            return
        except Exception:  # broker away: try again
            await asyncio.sleep(0.1)


async def main(args: argparse.Namespace) -> int:
    secret = os.environ["HZ_PROVIDER_SECRET"].encode()
    nc = await connect_provider(args.servers.split(","), secret, name=f"fault-agent-{args.prefix}")
    js = nc.jetstream()
    publisher = JetStreamPublisher(js, ack_timeout_s=1.0, backoff=Backoff(initial_s=0.05, max_s=0.5))
    publisher.start()
    subject = tenant_event_subject(args.tenant, "carbon", args.job)
    resent = 0
    resends: list[asyncio.Task[None]] = []
    started = time.monotonic()
    for n in range(args.count):
        due = started + n / args.rate
        if (wait := due - time.monotonic()) > 0:
            await asyncio.sleep(wait)
        data = CarbonIntensity(region="US-CAL-CISO", g_per_kwh=50.0 + n % 400, observed_at=T0 + timedelta(seconds=n))
        event = make_event(data, source=SOURCE, subject=args.job, event_id=event_id(args.prefix, n),
                           time=T0 + timedelta(seconds=n))
        await publisher.submit(subject, event)
        if args.resend_every and n % args.resend_every == args.resend_every - 1:
            resent += 1
            resends.append(asyncio.create_task(resend(js, subject, event.to_json_bytes(), f"{event.id}.resent")))
    drained = await publisher.drain(args.drain_timeout)
    await asyncio.wait_for(asyncio.gather(*resends), args.drain_timeout)
    summary = {
        "prefix": args.prefix,
        "submitted": args.count,
        "published": publisher.published,
        "retries": publisher.retries,
        "duplicate_acks": publisher.duplicates,
        "dropped": publisher.dropped,
        "resent": resent,
        "drained": drained,
        "seconds": round(time.monotonic() - started, 2),
    }
    await publisher.close()
    await nc.close()
    Path(args.out).write_text(json.dumps(summary))
    return 0 if drained and publisher.dropped == 0 else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", required=True, help="comma-separated broker URLs")
    parser.add_argument("--tenant", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--prefix", required=True, help="event ids are <prefix>-<n>")
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--rate", type=float, required=True, help="events per second")
    parser.add_argument("--resend-every", type=int, default=0)
    parser.add_argument("--drain-timeout", type=float, default=120.0)
    parser.add_argument("--out", required=True)
    sys.exit(event_loop.run(main(parser.parse_args())))  # the loop `harmonaize agent` runs on
