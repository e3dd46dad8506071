"""Real tier: a controller process killed with SIGKILL while events flow, restarted, ends where one that never
stopped ends; both then stop cleanly on SIGTERM / SIGINT (drain, exit 0).

Both controllers run `python -m tenant_controllers.cli run recorder.py` against the real broker and API, each with its
own durable consumer and state dir. The victim is killed mid-stream; events keep arriving while it is dead; the new
process resumes from the consumer's ack point and its SQLite record of handled ids.

What is asserted, precisely: every event's outcome is recorded exactly once by both; every event published while the
victim was dead ran exactly once; only the last two events the victim ran before the kill may have run twice (the one
whose handler was running, and the one before it when the kill came before the group commit that records it: a lane
moves on to its next event in the turn of the event loop that ends with that commit), and their outcomes were still
recorded once; the final recorded state of victim and reference is identical.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

from harmonaize.events import CarbonIntensity, parse_event
from tenant_controllers.store import HandledStore, Status
from tests.controllers.live_cloud import LiveCloud
from tests.controllers.support import T0, carbon
from tests.support import eventually

SCRIPT = Path(__file__).parent / "scripts" / "recorder.py"


class ControllerProcess:
    def __init__(self, cloud: LiveCloud, workdir: Path, name: str) -> None:
        self.name = name
        self.state_dir = workdir / f"state-{name}"
        self.runs = workdir / f"runs-{name}.txt"
        self.log = workdir / f"{name}.log"
        self.env = cloud.env(RECORDER_NAME=name, RECORDER_RUNS=str(self.runs))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tenant_controllers.cli", "run", str(SCRIPT), "--state-dir", str(self.state_dir),
                 "--ack-wait", "2",
                 "--resync-interval", "0"],
                env=self.env, stdout=log, stderr=subprocess.STDOUT,
            )

    def run_count(self) -> int:
        return len(self.run_ids())

    def run_ids(self) -> list[str]:
        return self.runs.read_text().split() if self.runs.exists() else []

    def records(self) -> dict[str, Any]:
        path = self.state_dir / f"acme-ctl-llm-finetune-{self.name}.sqlite3"
        with HandledStore(path) as store:
            records = [r for r in store.records() if r.status == Status.DONE]
            latest = store.latest(self.name)
        ids = [r.event_id for r in records]
        assert len(ids) == len(set(ids))
        newest = parse_event(latest[("llm-finetune", CarbonIntensity.event_type())]).data.g_per_kwh
        return {"outcomes": {r.event_id: r.outcome for r in records}, "newest_g": newest}

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout=timeout)
        return code

    def kill_quietly(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


async def test_a_controller_killed_mid_stream_and_restarted_ends_like_one_that_never_stopped(
    cloud: LiveCloud, tmp_path: Path
) -> None:
    await cloud.create_job("llm-finetune")
    victim = ControllerProcess(cloud, tmp_path, "victim")
    reference = ControllerProcess(cloud, tmp_path, "reference")
    events = [carbon(50 + n, at=T0 + timedelta(seconds=n)) for n in range(90)]
    try:
        victim.start()
        reference.start()
        for event in events[:30]:
            await cloud.publish(event)
        await cloud.publish(events[5], msg_id="republished")  # a duplicate publish of one CloudEvent

        await eventually(lambda: victim.run_count() >= 10, timeout=20, what="victim handling events")
        victim.stop(signal.SIGKILL)  # mid-stream: it still has events to go
        ran_before_kill = victim.run_ids()
        killed_after = set(ran_before_kill)
        assert len(killed_after) < 30, "the kill happened while events were still flowing"
        for event in events[30:60]:
            await cloud.publish(event)
        victim.start()
        for event in events[60:]:
            await cloud.publish(event)

        everything = {e.id for e in events}
        await eventually(lambda: set(victim.run_ids()) == everything and set(reference.run_ids()) == everything,
                         timeout=30, what="both controllers handled all 90 events")
        assert victim.stop(signal.SIGTERM) == 0, victim.log.read_text()[-2000:]
        assert reference.stop(signal.SIGINT) == 0, reference.log.read_text()[-2000:]
    finally:
        victim.kill_quietly()
        reference.kill_quietly()

    victim_runs = Counter(victim.run_ids())
    reference_runs = Counter(reference.run_ids())
    assert set(reference_runs.values()) == {1}, "the reference ran each event once, the duplicate publish included"
    missed = {e.id for e in events[30:]} | ({e.id for e in events[:30]} - killed_after)
    assert all(victim_runs[event_id] == 1 for event_id in missed), "every event missed while dead ran exactly once"
    rerun = [event_id for event_id, count in victim_runs.items() if count > 1]
    assert set(rerun) <= set(ran_before_kill[-2:]), (
        f"only the handler running at the kill, and the one before it if its record was not yet committed, may have "
        f"run again; got {rerun}, the last run before the kill being {ran_before_kill[-3:]}")
    assert victim.records() == reference.records()
    assert len(victim.records()["outcomes"]) == 90
    assert victim.records()["newest_g"] == 50 + 89
    for process in (victim, reference):
        log = process.log.read_text()
        assert "stopping: finishing handlers in flight" in log and "Traceback" not in log
