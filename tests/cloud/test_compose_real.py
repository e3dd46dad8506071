"""docker-compose.yml run for real: `docker compose up --wait` of the project's own file, then the cloud must work.

tests/cloud/test_compose.py checks the file without Docker; these tests run it in a Docker engine (tests/cloud/
compose_real.py says where the engine comes from, and when the tests skip or fail without one), with nothing added
but the machine's override that builds our image from local stand-ins of the official base images.

The default topology: the API healthy; four agents heartbeating; the demo tenant's job training across the agents'
containers (its steps increasing at 2+ workers, one torchrun node in each allocated agent's container); the demo
controller's negotiation in the tenant's history, round by round, and the job at the size it agreed in its timeline.
The `cluster` profile (three NATS nodes): of the two nodes whose ports are not published here, the one more of our
services are connected to is made the leader of a tenant's replicated stream and killed mid-training, while the test
publishes acknowledged events into that stream; the job keeps stepping, the agents keep heartbeating, the lost node's
clients reconnect to the others, and every event the broker acknowledged is in the stream at its acked sequence. Each
test ends with `docker compose down -v`, after which nothing of its project may be left.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import APIError

from broker_config.keys import ProviderKeys
from harmonaize_cli.services import read_credentials
from provider_agents.fleet_monitor import HEARTBEAT_FILTER
from provider_agents.telemetry.scenario import load_scenario
from tests.cloud.compose_env import load_compose
from tests.cloud.compose_real import ROOT, ComposeProject, Engine, prepare_engine

pytestmark = [pytest.mark.slow]

SCENARIO = load_scenario(ROOT / "provider_agents/scenarios/demo.yaml")


def _bootstrap_option(name: str) -> str:
    command: list[str] = load_compose(
        {"HZ_ADMIN_TOKEN": "x", "HZ_PROVIDER_SECRET": "x", "POSTGRES_PASSWORD": "x"}
    )["services"]["bootstrap"]["command"]
    return command[command.index(name) + 1]


JOB = _bootstrap_option("--job")
TENANT = _bootstrap_option("--tenant")
CREDENTIALS = _bootstrap_option("--credentials-dir") + "/.env"


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    engine = prepare_engine()
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture
def project_factory(engine: Engine, tmp_path: Path) -> Iterator[Callable[..., ComposeProject]]:
    """Makes the test's compose projects; each is brought down (-v) afterwards, and nothing of it may be left."""
    made: list[ComposeProject] = []

    def make(*, cluster: bool = False) -> ComposeProject:
        made.append(ComposeProject(engine, tmp_path / "compose", cluster=cluster))
        return made[-1]

    yield make
    for project in made:
        down = project.down()
        assert down.returncode == 0, f"docker compose down -v failed:\n{down.stdout}\n{down.stderr}"
        assert project.leftovers() == {}, f"{project.name} left behind: {project.leftovers()}"


async def wait_for(
    probe: Callable[[], Awaitable[Any]], *, timeout: float, what: str, interval: float = 1.0
) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = await probe()
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


async def provider_connection(project: ComposeProject) -> Client:
    seed = ProviderKeys(project.env["HZ_PROVIDER_SECRET"].encode()).provider.seed
    return await nats.connect(
        project.nats_url, nkeys_seed_str=seed, name="hz-compose-test", max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
    )


class Cloud:
    """The test's view of a running project: REST as admin and as the demo tenant, heartbeats over NATS."""

    def __init__(self, project: ComposeProject, client: httpx.AsyncClient) -> None:
        self.project = project
        self.client = client
        self.admin = {"Authorization": f"Bearer {project.env['HZ_ADMIN_TOKEN']}"}
        self.tenant: dict[str, str] = {}
        self.beats: dict[str, int] = {}
        self.provider: Client | None = None

    async def get(self, path: str, headers: dict[str, str], **params: Any) -> Any:
        response = await self.client.get(path, headers=headers, params=params)
        assert response.status_code == 200, f"GET {path}: {response.status_code} {response.text}"
        return response.json()

    async def on_heartbeat(self, msg: Msg) -> None:
        host = msg.subject.split(".")[3]
        self.beats[host] = self.beats.get(host, 0) + 1

    async def all_beating(self, *, beats: int) -> bool:
        """Every host of the scenario has sent `beats` more heartbeats from now on."""
        start = dict(self.beats)

        async def more() -> bool:
            return all(self.beats.get(h, 0) - start.get(h, 0) >= beats for h in SCENARIO.hosts)

        return bool(await wait_for(more, timeout=60, what=f"{beats} heartbeats from every host ({self.beats})"))

    def read_tenant_credentials(self, scratch: Path) -> dict[str, str]:
        credentials = read_credentials(self.project.copy_out("bootstrap", CREDENTIALS, scratch / "tenant.env"))
        assert credentials["HZ_TENANT"] == TENANT
        self.tenant = {"Authorization": f"Bearer {credentials['HZ_TENANT_TOKEN']}"}
        return credentials

    async def progress(self) -> dict[str, Any] | None:
        status = await self.get(f"/v1/jobs/{JOB}/status", self.tenant)
        progress: dict[str, Any] | None = status.get("progress")
        return progress

    async def training(self, *, steps: int, min_world_size: int, timeout: float) -> dict[str, Any]:
        """Waits until the job has made `steps` more steps, at `min_world_size` workers or more; its last progress.

        The demo scenario lives through failures, congestion and maintenance, so the job's size may change on its own.
        """
        first: dict[str, Any] = {}

        async def stepped() -> dict[str, Any] | None:
            progress = await self.progress()
            if not progress or progress["world_size"] < min_world_size or progress["step"] == 0:
                first.clear()
                return None
            first.setdefault("step", progress["step"])
            return progress if progress["step"] >= first["step"] + steps else None

        result: dict[str, Any] = await wait_for(
            stepped, timeout=timeout, what=f"{JOB} making {steps} steps at {min_world_size}+ workers"
        )
        return result

    async def across_containers(self, *, workers: int) -> set[str]:
        """The hosts whose agent containers run the job's torchrun nodes: the job's allocations, `workers` of them."""

        async def agree() -> set[str] | None:
            placed = await self.hosts_of_job()
            running = await asyncio.to_thread(self.containers_training)
            return placed if len(placed) >= workers and running == placed else None

        result: set[str] = await wait_for(
            agree, timeout=120, what=f"{workers}+ agent containers running the job's nodes, as allocated", interval=2
        )
        return result

    async def hosts_of_job(self) -> set[str]:
        allocations = await self.get("/v1/allocations", self.admin, job_id=JOB)
        return {a["host_id"] for a in allocations if a["tenant_id"] == TENANT}

    def containers_training(self) -> set[str]:
        """The agent containers in which a torchrun node of the job's training script runs."""
        running = set()
        for host in SCENARIO.hosts:
            if any("workloads.examples.mlp" in line for line in self.project.processes(f"agent-{host}")):
                running.add(host)
        return running

    def restarted(self) -> dict[str, int]:
        """Services whose container the engine restarted (a crash), with their restart counts."""
        counts = {}
        for record in self.project.services():
            count = self.project.inspect(record["Service"])["RestartCount"]
            if count:
                counts[record["Service"]] = count
        return counts


@asynccontextmanager
async def start_cloud(project: ComposeProject, scratch: Path) -> AsyncIterator[Cloud]:
    """`docker compose up --wait`, then the checks every topology shares: API, hosts, heartbeats, the job training."""
    started = time.monotonic()
    await asyncio.to_thread(project.build)
    built = time.monotonic()
    await asyncio.to_thread(project.up)
    print(f"{project.name}: build took {built - started:.0f} s, up --wait {time.monotonic() - built:.0f} s")
    try:
        async with httpx.AsyncClient(base_url=project.api_url, timeout=20) as client:
            cloud = Cloud(project, client)
            health = await client.get("/v1/healthz")
            assert health.status_code == 200, health.text
            states = {r["Service"]: (r["State"], r.get("ExitCode")) for r in project.services()}
            for one_shot in ("broker-init", "bootstrap"):
                assert states.pop(one_shot) == ("exited", 0), f"{one_shot}: {states}"
            assert {s for s, (state, _) in states.items() if state != "running"} == set(), states

            hosts = await cloud.get("/v1/hosts", cloud.admin)
            assert {h["id"]: h["locality_group"] for h in hosts} == {
                h: spec.locality_group for h, spec in SCENARIO.hosts.items()
            }
            cloud.read_tenant_credentials(scratch)

            provider = await provider_connection(project)
            try:
                await provider.subscribe(HEARTBEAT_FILTER, cb=cloud.on_heartbeat)
                await cloud.all_beating(beats=2)

                # Training across containers: steps increasing at 2+ workers, one torchrun node in each of 2+ agent
                # containers, as the job's allocations say.
                progress = await cloud.training(steps=5, min_world_size=2, timeout=300)
                await cloud.across_containers(workers=2)
                print(f"{project.name}: {JOB} at step {progress['step']}, world size {progress['world_size']}")
                cloud.provider = provider
                yield cloud
            finally:
                await provider.close()
    except BaseException:
        print(project.logs())
        raise


@pytest.mark.timeout(1800)  # a cold machine: the engine, the stand-in images and our image are built first
async def test_compose_up_runs_the_demo_cloud(
    project_factory: Callable[..., ComposeProject], tmp_path: Path
) -> None:
    project = project_factory()
    began = time.monotonic()
    async with start_cloud(project, tmp_path) as cloud:
        # The demo controller (carbon-aware scaler) negotiates for more workers when the replayed carbon trace dips
        # (about 190 s after the agents start); the provider offers, the controller accepts, the job grows.
        async def accepted() -> list[dict[str, Any]]:
            page = await cloud.get("/v1/negotiations", cloud.tenant, job=JOB)
            return [n for n in page["items"] if n["state"] == "accepted"]

        (summary, *_) = await wait_for(accepted, timeout=420, what="the demo controller's accepted negotiation")
        negotiation = await cloud.get(f"/v1/negotiations/{summary['id']}", cloud.tenant)
        assert negotiation["job"] == JOB and negotiation["kind"] == "scale"
        rounds = [(r["actor"], r["action"]) for r in negotiation["rounds"]]
        assert len(rounds) >= 3 and rounds[0][0] == "tenant" and rounds[-1][0] == "tenant", rounds
        assert any(actor == "provider" for actor, _ in rounds), rounds
        workers = negotiation["accepted_option"]["workers"]
        assert workers >= 2, negotiation["accepted_option"]

        # The job took that shape (the scenario's failure and maintenance may change it again afterwards).
        async def grown() -> bool:
            timeline = await cloud.get(f"/v1/jobs/{JOB}/timeline", cloud.tenant)
            return any(entry["world_size"] == workers for entry in timeline)

        await wait_for(grown, timeout=180, what=f"{JOB} at {workers} workers in its timeline")
        await cloud.training(steps=5, min_world_size=2, timeout=180)
        assert await asyncio.to_thread(cloud.restarted) == {}, "no container crashed"
    print(f"{project.name}: default topology checked in {time.monotonic() - began:.0f} s")


# --- the cluster profile: a broker node lost mid-training -----------------------------------------------------------

ACK_TENANT = "acks"
"""A tenant created for the test's own events, so the demo tenant's controller never sees them."""


class AckedPublisher:
    """Publishes numbered events into a tenant's stream with a Nats-Msg-Id each, retrying one until it is acked."""

    def __init__(self, provider: Client, subject: str, stream: str) -> None:
        self.js = provider.jetstream(timeout=2.0)
        self.subject, self.stream = subject, stream
        self.acked: dict[str, int] = {}  # msg id -> stream sequence of its ack
        self.retries = 0
        self.stop = asyncio.Event()

    async def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            msg_id = f"ack-{n}"
            while True:
                try:
                    ack = await self.js.publish(self.subject, json.dumps({"n": n}).encode(),
                                                headers={"Nats-Msg-Id": msg_id})
                except (TimeoutError, nats.errors.Error, APIError):
                    self.retries += 1  # a leader election or a reconnect: the same id again (deduplicated)
                    await asyncio.sleep(0.2)
                    continue
                assert ack.stream == self.stream
                self.acked[msg_id] = ack.seq
                break
            n += 1
            await asyncio.sleep(0.02)

    async def missing(self, *, timeout: float = 90.0) -> dict[str, str]:
        """Acked ids the stream does not hold at their acked sequence, each with why.

        Only the broker's answer counts as a loss: no message at that sequence (10037), or another message there. A
        lookup that fails otherwise (a timeout, the stream between leaders) says nothing about the event and is tried
        again until `timeout`; one still unanswered then is reported as unreadable, with the last error."""
        lost: dict[str, str] = {}
        unread = dict(self.acked)
        deadline = time.monotonic() + timeout
        while unread:
            errors: dict[str, str] = {}
            for msg_id, seq in unread.items():
                try:
                    stored = await self.js.get_msg(self.stream, seq)
                except APIError as exc:
                    if exc.err_code == NO_MESSAGE_FOUND:
                        lost[msg_id] = f"seq {seq}: no message there"
                    else:
                        errors[msg_id] = f"seq {seq}: {exc!r}"
                    continue
                except (TimeoutError, nats.errors.Error) as exc:
                    errors[msg_id] = f"seq {seq}: {exc!r}"
                    continue
                found = (stored.headers or {}).get("Nats-Msg-Id")
                if found != msg_id:
                    lost[msg_id] = f"seq {seq} holds {found!r}"
            unread = {msg_id: self.acked[msg_id] for msg_id in errors}
            if unread and time.monotonic() >= deadline:
                lost.update({msg_id: f"unreadable, {why}" for msg_id, why in errors.items()})
                break
            if unread:
                await asyncio.sleep(1.0)
        return lost


NO_MESSAGE_FOUND = 10037
"""JetStream's error code for a stream sequence that holds no message."""


def stream_state(info: Any) -> str:
    """A stream's state and cluster in one line, for a failure's message."""
    state, cluster = info.state, info.cluster
    replicas = [(r.name, r.current, r.offline, r.lag) for r in (cluster.replicas or [])] if cluster else []
    return (f"messages {state.messages}, seq {state.first_seq}..{state.last_seq}, deleted {state.num_deleted}; "
            f"lost {state.lost}; leader {cluster.leader if cluster else None}, replicas {replicas}")


async def stream_info(provider: Client, stream: str) -> Any:
    return await provider.jetstream(timeout=5.0).stream_info(stream)


@pytest.mark.timeout(1500)
async def test_cluster_profile_survives_losing_a_broker_node_mid_training(
    project_factory: Callable[..., ComposeProject], tmp_path: Path
) -> None:
    project = project_factory(cluster=True)
    nodes = ["nats", "nats-2", "nats-3"]
    began = time.monotonic()
    async with start_cloud(project, tmp_path) as cloud:
        provider = cloud.provider
        assert provider is not None
        created = await cloud.client.post(
            "/v1/tenants", headers=cloud.admin, json={"id": ACK_TENANT, "display_name": "acked events"}
        )
        assert created.status_code == 201, created.text
        stream = f"HZ_T_{ACK_TENANT}"
        info = await stream_info(provider, stream)
        assert info.config.num_replicas == 3, "the tenant streams are replicated on the three nodes"
        demo = await stream_info(provider, f"HZ_T_{TENANT}")
        assert demo.config.num_replicas == 3 and demo.cluster.leader in nodes
        for bucket in ("KV_hz_desired", "KV_hz_rendezvous"):  # the agents' desired state, the jobs' rendezvous
            kept = await stream_info(provider, bucket)
            assert kept.config.num_replicas == 3, f"{bucket} is replicated on the three nodes"

        # The node to kill: not the one this test's own connections go through (the only node whose port is published
        # on this machine); of the other two, the one more of our services are connected to (Compose's DNS spreads
        # them over the nodes). It is made the leader of the stream the acked events go to, so its loss forces an
        # election there too.
        system = await nats.connect(project.nats_url, nkeys_seed_str=ProviderKeys(
            project.env["HZ_PROVIDER_SECRET"].encode()).system.seed, name="hz-compose-test-sys")
        try:
            clients = await clients_by_node(system, nodes)
            victim = max(("nats-2", "nats-3"), key=lambda node: len(clients[node]))
            print(f"clients by broker node: {clients}")

            async def led_by_victim() -> bool:
                info = await stream_info(provider, stream)
                if info.cluster and info.cluster.leader == victim:
                    return all(r.current for r in info.cluster.replicas or [])
                await provider.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", b"", timeout=5)
                return False

            await wait_for(led_by_victim, timeout=90, what=f"{stream} led by {victim}", interval=2)

            publisher = AckedPublisher(provider, f"hz.t.{ACK_TENANT}.events.test.{JOB}", stream)
            publishing = asyncio.create_task(publisher.run())
            try:
                await wait_for(lambda: _at_least(publisher.acked, 50), timeout=60, what="50 acked events")
                before = await cloud.progress()
                assert before and before["world_size"] >= 2
                killed_at = time.monotonic()
                await asyncio.to_thread(project.kill, victim)
                print(f"killed {victim} at step {before['step']}, {len(publisher.acked)} events acked")

                # The stream elects a new leader among the two nodes left; publishing goes on.
                acked_at_kill = len(publisher.acked)
                await wait_for(lambda: _at_least(publisher.acked, acked_at_kill + 50), timeout=90,
                               what="50 more acked events after the kill")
                new_leader = (await stream_info(provider, stream)).cluster.leader
                assert new_leader in set(nodes) - {victim}

                # The job keeps stepping at its size; every agent keeps heartbeating (clients on the lost node moved).
                # (The demo scenario's own failure of h2 may shrink the job meanwhile: any size will do.)
                after = await cloud.training(steps=10, min_world_size=1, timeout=120)
                assert after["step"] >= before["step"] + 10
                await cloud.all_beating(beats=3)
                # Every service that was connected to the lost node is connected to one of the two left.
                survivors = await clients_by_node(system, [n for n in nodes if n != victim])
                moved = set(clients[victim]) - {name for names in survivors.values() for name in names}
                assert moved == set(), f"clients of {victim} that did not reconnect elsewhere: {moved}"
                took = time.monotonic() - killed_at
                print(f"after the kill: {after['step'] - before['step']} steps in {took:.0f} s, "
                      f"{publisher.retries} publish retries, new leader {new_leader}, {victim}'s clients moved")
            finally:
                publisher.stop.set()
                await publishing

            # No acknowledged event is lost: each is in the stream, at the sequence its ack gave.
            lost = await publisher.missing()
            if lost:
                try:
                    state = stream_state(await stream_info(provider, stream))
                except (TimeoutError, nats.errors.Error) as exc:
                    state = f"no stream info: {exc!r}"
                first = dict(sorted(lost.items(), key=lambda item: publisher.acked[item[0]])[:5])
                raise AssertionError(f"{len(lost)} of {len(publisher.acked)} acked events not in {stream} as acked "
                                     f"(the first: {first}); the stream: {state}")
            print(f"every acked event in {stream}: {stream_state(await stream_info(provider, stream))}")
            sequences = set(publisher.acked.values())
            assert len(sequences) == len(publisher.acked), "each acked event at a sequence of its own"
            running = {r["Service"]: r["State"] for r in project.services()}
            stopped = {s for s, state in running.items() if state != "running"} - {victim, "broker-init", "bootstrap"}
            assert stopped == set(), running
        finally:
            await system.close()
    print(f"{project.name}: cluster profile checked in {time.monotonic() - began:.0f} s")


async def clients_by_node(system: Client, nodes: list[str], *, timeout: float = 5.0) -> dict[str, list[str]]:
    """The names of our services' connections on each broker node (CONNZ from every server, system account)."""
    inbox = system.new_inbox()
    sub = await system.subscribe(inbox)
    found: dict[str, list[str]] = {}
    try:
        await system.publish("$SYS.REQ.SERVER.PING.CONNZ", b"{}", reply=inbox)
        deadline = time.monotonic() + timeout
        while set(found) < set(nodes) and time.monotonic() < deadline:
            try:
                msg = await sub.next_msg(timeout=max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                break
            body = json.loads(msg.data)
            connections = (body.get("data") or {}).get("connections") or []
            names = [str(c.get("name", "")) for c in connections]
            found[body["server"]["name"]] = sorted(n for n in names if n.startswith("hz-") and "compose-test" not in n)
    finally:
        await sub.unsubscribe()
    assert set(found) == set(nodes), f"CONNZ answered by {sorted(found)}, expected {nodes}"
    return found


async def _at_least(acked: dict[str, int], count: int) -> bool:
    return len(acked) >= count
