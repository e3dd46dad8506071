"""`harmonaize conformance`, real tier: against a local cloud (`harmonaize up`, free ports, its own data dir).

Our own feed conforms: the command, run as a subprocess with nothing but the demo tenant's env file, sees the events
of a job submitted while it listens, passes, and its JSON report shows the events checked and every isolation probe
refused (another tenant, `rival`, exists with a job of its own, so the probes aim at something real). Then a
deliberately broken feed: a test-only publisher with the provider's credentials, on the same broker, puts two events
on the demo tenant's subject, one whose payload breaks its schema and one with specversion 0.3; the command exits 1
and its report names both, by event id.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
import pytest

from harmonaize.asyncapi import EXAMPLE_DATA
from harmonaize.subjects import tenant_event_subject
from provider_agents.runtime import connect_provider

pytestmark = pytest.mark.timeout(120)

HARMONAIZE = [sys.executable, "-m", "harmonaize_cli"]
RIVAL, RIVAL_JOB = "rival", "rival-job"
LISTENING = "conformance: listening on"


class Lines:
    """The lines of a child's stream, read in a thread so the child never blocks on a full pipe."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: list[str] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            with self._lock:
                self.lines.append(line.rstrip("\n"))

    def text(self) -> str:
        with self._lock:
            return "\n".join(self.lines)

    def wait_for(self, needle: str, *, proc: subprocess.Popen[str], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.text():
            if proc.poll() is not None:
                raise AssertionError(f"{what}: the process exited with {proc.returncode}:\n{self.text()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}:\n{self.text()}")
            time.sleep(0.05)


def read_env_file(path: Path) -> dict[str, str]:
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        values[key] = shlex.split(value)[0]
    return values


@dataclass
class Cloud:
    data_dir: Path
    tenant_env: dict[str, str]
    admin_env: dict[str, str]


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cloud]:
    """A quiet local cloud on free ports, plus a second tenant `rival` with a submitted job."""
    data_dir = tmp_path_factory.mktemp("conformance") / "hz"
    proc = subprocess.Popen(
        [*HARMONAIZE, "up", "--data-dir", str(data_dir), "--api-port", "0", "--nats-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={key: value for key, value in os.environ.items() if not key.startswith("HZ_")},
    )
    assert proc.stdout is not None
    output = Lines(proc.stdout)
    try:
        output.wait_for("data dir", proc=proc, timeout=60, what="harmonaize up to come up")
        cloud = Cloud(data_dir, read_env_file(data_dir / "tenant-demo.env"), read_env_file(data_dir / "admin.env"))
        admin = {"Authorization": f"Bearer {cloud.admin_env['HZ_ADMIN_TOKEN']}"}
        created = httpx.post(f"{cloud.admin_env['HZ_API_URL']}/v1/tenants", headers=admin, timeout=30,
                             json={"id": RIVAL, "display_name": "Rival"})
        assert created.status_code == 201, created.text
        rival = {"Authorization": f"Bearer {created.json()['api_token']}"}
        submitted = httpx.post(f"{cloud.admin_env['HZ_API_URL']}/v1/jobs", headers=rival, timeout=30,
                               json=_job(RIVAL_JOB))
        assert submitted.status_code == 201, submitted.text
        yield cloud
    finally:
        _stop(proc)
    assert "Traceback" not in output.text(), output.text()[-6000:]


def _job(job_id: str) -> dict[str, Any]:
    return {"id": job_id, "min_workers": 1, "max_workers": 2, "gpus_per_worker": 4, "initial_workers": 1,
            "entrypoint": ["-m", "workloads.examples.mlp", "--step-delay-ms", "20"]}


class Conformance:
    """`harmonaize conformance` as a tenant runs it: the tenant's env file and nothing else of ours."""

    def __init__(self, cloud: Cloud, report: Path, *args: str) -> None:
        env = {key: value for key, value in os.environ.items() if not key.startswith("HZ_")}
        self.report = report
        self.proc = subprocess.Popen(
            [*HARMONAIZE, "conformance", "--json", str(report), "--other-tenant", RIVAL, "--other-job", RIVAL_JOB,
             *args],
            env={**env, **cloud.tenant_env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.stdout, self.stderr = Lines(self.proc.stdout), Lines(self.proc.stderr)

    def wait_listening(self) -> None:
        self.stderr.wait_for(LISTENING, proc=self.proc, timeout=30, what="the command to listen")

    def finish(self, *, timeout: float = 45) -> tuple[int, dict[str, Any], str]:
        try:
            code = self.proc.wait(timeout)
        finally:
            _stop(self.proc)
        self.stdout.wait_for("isolation", proc=self.proc, timeout=5, what="the report on stdout")
        assert self.report.exists(), f"no JSON report:\n{self.stdout.text()}\n{self.stderr.text()}"
        return code, json.loads(self.report.read_text()), self.stdout.text()


def test_our_own_feed_conforms_and_every_isolation_probe_is_refused(cloud: Cloud, tmp_path: Path) -> None:
    run = Conformance(cloud, tmp_path / "report.json", "--duration", "30", "--events", "3")
    run.wait_listening()
    tenant = {"Authorization": f"Bearer {cloud.tenant_env['HZ_TENANT_TOKEN']}"}
    submitted = httpx.post(f"{cloud.tenant_env['HZ_API_URL']}/v1/jobs", headers=tenant, json=_job("conformance-job"),
                           timeout=30)
    assert submitted.status_code == 201, submitted.text
    code, report, text = run.finish()
    assert code == 0, f"{text}\n{run.stderr.text()}"
    assert report["passed"] is True and report["failures"] == []
    assert report["feed"]["events"] >= 3
    for group in ("binding", "envelope", "subject", "schema", "duplicates"):
        assert report["groups"][group]["checked"] >= 3 and report["groups"][group]["failed"] == 0, group
    probes = report["probes"]
    assert len(probes) >= 25 and all(probe["refused"] for probe in probes), probes
    targets = {probe["target"]: probe["detail"] for probe in probes}
    assert targets[f"subscribe hz.t.{RIVAL}.>"] == "refused (permissions violation)"
    assert targets["subscribe $KV.hz_desired.>"] == "refused (permissions violation)"
    assert targets[f"request $JS.hz.API.STREAM.INFO.HZ_T_{RIVAL}"] == "refused (permissions violation)"
    assert targets[f"GET /v1/jobs/{RIVAL_JOB}"] == "refused (404)"
    assert targets["GET /v1/tenants"] == "refused (403)"
    assert "isolation   PASS" in text


def test_a_broken_feed_fails_naming_the_schema_violation_and_the_old_specversion(
    cloud: Cloud, tmp_path: Path
) -> None:
    job = "broken-feed"
    run = Conformance(cloud, tmp_path / "report.json", "--job", job, "--duration", "30", "--events", "2")
    run.wait_listening()
    bad_payload, old_spec = f"bad-payload-{os.getpid()}", f"old-specversion-{os.getpid()}"
    asyncio.run(_publish_broken(cloud, job, bad_payload=bad_payload, old_spec=old_spec))
    code, report, text = run.finish()
    assert code == 1, f"{text}\n{run.stderr.text()}"
    assert report["passed"] is False and report["feed"]["events"] == 2
    by_id: dict[str, list[tuple[str, str]]] = {}
    for item in report["failures"]:
        by_id.setdefault(item["event_id"], []).append((item["group"], item["reason"]))
    assert any(group == "schema" and "data.confidence" in reason for group, reason in by_id[bad_payload]), by_id
    assert any(group == "envelope" and "specversion '0.3'" in reason for group, reason in by_id[old_spec]), by_id
    assert report["groups"]["schema"]["failed"] == 1 and report["groups"]["envelope"]["failed"] >= 1
    assert all(probe["refused"] for probe in report["probes"]), "a broken feed does not break isolation"
    assert f"id {bad_payload}" in text and f"id {old_spec}" in text


async def _publish_broken(cloud: Cloud, job: str, *, bad_payload: str, old_spec: str) -> None:
    """Two events on the demo tenant's failure subject, published with the provider's credentials."""
    source, data = EXAMPLE_DATA["io.harmonaize.failure.v1"]
    event = {"specversion": "1.0", "source": source, "type": "io.harmonaize.failure.v1", "subject": job,
             "time": "2025-03-14T02:00:05Z", "datacontenttype": "application/json", "data": dict(data)}
    broken: list[dict[str, Any]] = [
        {**event, "id": bad_payload, "data": {**data, "confidence": 5}},
        {**event, "id": old_spec, "specversion": "0.3"},
    ]
    nc = await connect_provider(cloud.admin_env["HZ_NATS_URL"], cloud.admin_env["HZ_PROVIDER_SECRET"].encode(),
                                name="test-broken-feed")
    try:
        for item in broken:
            await nc.publish(tenant_event_subject("demo", "failure", job), json.dumps(item).encode(),
                             headers={"Nats-Msg-Id": item["id"]})
        await nc.flush()
    finally:
        await nc.close()
