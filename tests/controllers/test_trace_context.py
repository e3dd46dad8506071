"""One trace from the host agent's event to the events the tenant's reaction caused: the controller continues the
event's `traceparent` on its API calls (same trace id, new span), and the API stamps the negotiation events it
publishes with it. Over the real broker and API, with a real controller script."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from harmonaize.events import parse_event
from harmonaize.tracing import new_traceparent, trace_id
from tests.controllers.live_cloud import LiveCloud
from tests.controllers.support import failure
from tests.controllers.test_examples_real import placed, run_script  # noqa: F401
from tests.support import eventually

SCRIPT = '''
from harmonaize.events import Failure
from tenant_controllers import Controller, Job

ctl = Controller(job="llm-finetune")


@ctl.on(Failure)
async def on_failure(event: Failure, job: Job) -> None:
    offer = await job.negotiate(scale_to=job.workers, accept=(job.workers - 1, job.workers))
    await offer.accept()
'''


def _negotiation_events(database: Path) -> list[dict[str, Any]]:
    with sqlite3.connect(database) as db:
        rows = db.execute("SELECT payload FROM outbox WHERE subject LIKE 'hz.t.acme.events.negotiation.%'").fetchall()
    return [json.loads(payload) for (payload,) in rows]


async def test_the_events_a_reaction_caused_carry_the_trace_of_the_event_that_caused_it(
    placed: LiveCloud, tmp_path: Path  # noqa: F811
) -> None:
    script = tmp_path / "traced.py"
    script.write_text(SCRIPT)
    origin = new_traceparent()
    event = failure()
    with_origin = f'"traceparent":"{origin}","specversion"'.encode()
    traced = parse_event(event.to_json_bytes().replace(b'"specversion"', with_origin, 1))
    assert traced.traceparent == origin
    database = tmp_path / "hz" / "harmonaize.db"
    async with run_script(placed, script, tmp_path / "state"):
        await placed.publish(traced)
        await eventually(lambda: len(_negotiation_events(database)) >= 2, timeout=15,
                         what="offer and acceptance events")
    caused = _negotiation_events(database)
    assert {payload["traceparent"].split("-")[1] for payload in caused} == {trace_id(origin)}
    assert all(payload["traceparent"] != origin for payload in caused), "the controller's calls are a new span"
