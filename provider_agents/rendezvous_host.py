"""The provider hosts each job's rendezvous store, so that losing any worker host cannot take the job down with it.

torchrun's c10d rendezvous keeps its state in a TCPStore; by default the first node to arrive hosts it, and when
that node's host dies the whole job dies (all other nodes lose the store). Here the provider runs one TCPStore per
job (a few threads each, in this process) and every node connects as a client (`is_host=0`). The store's endpoint
is published in the KV bucket `RENDEZVOUS_BUCKET` under `job_key(tenant, job)`, where node launchers look it up.

One store per job rather than one for all: a job's nodes can then only ever reach their own job's rendezvous keys.
Epochs of a job share its store (each epoch is its own rendezvous id inside it). If this process restarts, every job
gets a new store and a new endpoint; launchers treat a changed endpoint like a new epoch and restart their nodes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

from nats.js.client import JetStreamContext
from nats.js.errors import KeyNotFoundError, NoKeysError
from nats.js.kv import KeyValue

from broker_config.buckets import RENDEZVOUS_BUCKET, ensure_bucket, rendezvous_bucket
from harmonaize.ids import validate_id
from harmonaize.waits import wait_set
from provider_agents.desired import DesiredState

__all__ = ["RENDEZVOUS_BUCKET", "RendezvousHost", "ensure_rendezvous_bucket", "job_key", "lookup_endpoint"]

log = logging.getLogger(__name__)

def job_key(tenant: str, job: str) -> str:
    return f"job.{validate_id('tenant', tenant)}.{validate_id('job', job)}"


async def ensure_rendezvous_bucket(js: JetStreamContext, *, replicas: int = 1) -> KeyValue:
    """Bind to the bucket, creating it when missing or scaling it up to `replicas` (`broker_config.buckets`)."""
    return await ensure_bucket(js, rendezvous_bucket(replicas=replicas))


async def lookup_endpoint(kv: KeyValue, tenant: str, job: str) -> str | None:
    """The `host:port` of the job's rendezvous store, or None while the provider has not started one."""
    try:
        entry = await kv.get(job_key(tenant, job))
    except KeyNotFoundError:
        return None
    return entry.value.decode() if entry.value else None


def _start_store(bind_host: str) -> Any:
    # torch only where stores are hosted. torch re-exports TCPStore from torch._C without listing it as an export.
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    return TCPStore(bind_host, 0, None, True, timeout=timedelta(seconds=30), wait_for_workers=False)


class RendezvousHost:
    """Keeps one store per job that the desired state places anywhere, and publishes where it is."""

    def __init__(
        self,
        *,
        desired: DesiredState,
        bucket: Callable[[], Awaitable[KeyValue]],
        bind_host: str = "127.0.0.1",
        advertise_host: str | None = None,
        interval_s: float = 0.25,
    ) -> None:
        self._desired = desired
        self._bucket = bucket
        self._kv: KeyValue | None = None
        self._bind_host = bind_host
        self._advertise = advertise_host or bind_host
        self._interval_s = interval_s
        self._stores: dict[tuple[str, str], Any] = {}
        self._stop = asyncio.Event()

    def endpoint(self, tenant: str, job: str) -> str | None:
        store = self._stores.get((tenant, job))
        return None if store is None else f"{self._advertise}:{store.port}"

    async def reconcile(self) -> None:
        """Start stores for new jobs, drop those of jobs placed nowhere any more, publish every endpoint."""
        fleet = self._desired.snapshot()
        if fleet is None:
            return
        if self._kv is None:
            self._kv = await self._bucket()
            await self._forget_stale_keys()
        wanted = {(job.tenant, job.job) for assignment in fleet.values() for job in assignment.jobs if job.entrypoint}
        for key in sorted(wanted - set(self._stores)):
            # in a thread: the first store imports torch (seconds), which must not stall the fleet monitor's
            # heartbeat checks sharing this event loop (a stall made a beating host look silent)
            self._stores[key] = await asyncio.to_thread(_start_store, self._bind_host)
            endpoint = self.endpoint(*key)
            await self._kv.put(job_key(*key), (endpoint or "").encode())
            log.info("rendezvous store for %s/%s at %s", *key, endpoint)
        for key in sorted(set(self._stores) - wanted):
            await self._kv.delete(job_key(*key))
            del self._stores[key]
            log.info("rendezvous store for %s/%s closed", *key)

    async def _forget_stale_keys(self) -> None:
        """Endpoints a previous process published point to stores that died with it."""
        assert self._kv is not None
        try:
            keys = await self._kv.keys()
        except NoKeysError:
            return
        for key in keys:
            await self._kv.delete(key)

    async def run(self) -> None:
        while not self._stop.is_set():
            try:
                await self.reconcile()
            except Exception as exc:  # a broker hiccup must not end the loop; the next pass retries
                log.warning("rendezvous host: %r", exc)
            await wait_set(self._stop, self._interval_s)

    def stop(self) -> None:
        self._stop.set()
