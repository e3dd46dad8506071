"""Keep the running broker in step with the tenant registry, without restarting it.

`apply(tenants)` is level-triggered: it renders the accounts file from the whole registry, reloads the server if the
file changed, then makes sure the provider's stream and every tenant's sourced stream exist. The control plane calls
it at start-up (repairing whatever a crash left half done) and whenever a tenant is created or removed.

Why config reload rather than JWT operator mode or auth callout: the registry is small and lives in the provider's
database already; a reload is one signal, keeps existing connections, needs no extra signing service or key
hierarchy, and leaves the whole authorization policy readable in one rendered file. The cost is that the control plane
must be able to reach the server: by signal on the same host (`reload_by_pid_file`), or through the system account
from anywhere (`reload.SystemAccountReload`, what `harmonaize api serve` uses in a container of its own); operator
mode would be the step up for a broker run by a separate team.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import nats
from nats.aio.client import Client
from nats.js.api import StreamConfig
from nats.js.errors import NotFoundError

from broker_config import keys as nkeys_util
from broker_config.accounts import EventConsumer, TenantAccount, TenantNatsCredentials, UserKeys
from broker_config.keys import ProviderKeys
from broker_config.reload import SystemAccountReload
from broker_config.render import (
    TENANT_JS_PREFIX,
    render_accounts,
    tenant_account_name,
    tenant_stream_name,
    write_atomically,
)
from broker_config.server import BrokerError, check_accounts_text
from broker_config.streams import (
    ACK_WAIT_S,
    TENANT_STREAM_MAX_BYTES,
    ConsumerPosition,
    tenant_events_stream,
    tenant_pull_consumer,
)
from harmonaize.subjects import tenant_subject_prefix


def reload_by_pid_file(pid_file: Path) -> Callable[[], None]:
    """A reload function that signals the nats-server whose pid is in `pid_file`."""

    def reload() -> None:
        try:
            pid = int(pid_file.read_text().strip())
            os.kill(pid, signal.SIGHUP)
        except (OSError, ValueError) as exc:
            raise BrokerError(f"cannot reload the broker through {pid_file}: {exc}") from exc

    return reload


async def connect_with_seed(servers: Sequence[str], seed: str, *, timeout: float = 2.0, **options: object) -> Client:
    """One bounded connection attempt, no reconnect loop: for probing whether credentials are accepted yet.

    nats-py keeps retrying a refused initial connection even with reconnects disabled, so the attempt is bounded
    here with `wait_for`.
    """
    options.setdefault("error_cb", _ignore)
    return await asyncio.wait_for(
        nats.connect(
            servers=list(servers),
            nkeys_seed_str=seed,
            connect_timeout=timeout,
            allow_reconnect=False,
            max_reconnect_attempts=0,
            **options,
        ),
        timeout,
    )


async def _connect_until_accepted(
    servers: Sequence[str], seed: str, *, deadline: float, unreachable_after: float = 1.0
) -> Client:
    """Connect, retrying while the server is still loading an account (authorization refused) until `deadline`.

    A server that cannot be reached at all is reported after `unreachable_after` seconds rather than at the deadline,
    so a caller (a tenant being created) gets its 503 quickly.
    """
    start = time.monotonic()
    while True:
        try:
            return await connect_with_seed(servers, seed, timeout=1.0)
        except Exception as exc:  # nats-py raises several types for "not yet authorized" and "unreachable"
            authorizing = "authorization" in str(exc).lower()
            now = time.monotonic()
            if now >= deadline or (not authorizing and now - start >= unreachable_after):
                reason = "did not accept the account in time" if authorizing else "cannot be reached"
                raise BrokerError(f"the broker at {', '.join(servers)} {reason}: {exc!r}") from exc
            await asyncio.sleep(0.05)


async def _ignore(_: Exception) -> None:
    return None


async def ensure_stream(client: Client, config: StreamConfig) -> None:
    """Create the stream, or update it when its configuration drifted."""
    if config.name is None:
        raise ValueError("a stream config needs a name")  # nats-py refuses it too; checked here to narrow the type
    js = client.jetstream()
    try:
        info = await js.stream_info(config.name)
    except NotFoundError:
        await js.add_stream(config)
        return
    current = info.config
    drifted = (current.subjects or []) != (config.subjects or []) or (current.sources or []) != (config.sources or [])
    if drifted or current.max_bytes != config.max_bytes:  # a new quota applies to streams made before it
        await js.update_stream(config)


async def _config_load_time(system: Client) -> str:
    """When the server last (re)loaded its config, asked through the system account."""
    reply = await system.request("$SYS.REQ.SERVER.PING.VARZ", b"{}", timeout=2.0)
    return str(json.loads(reply.data)["data"]["config_load_time"])


async def _reload_and_wait(system: Client, reload: Callable[[], None], *, deadline: float) -> None:
    """Signal a reload and return once the server reports it done, so nobody connects mid-reload."""
    before = await _config_load_time(system)
    reload()
    while time.monotonic() < deadline:
        if await _config_load_time(system) != before:
            return
        # a reload is quick, so a coarse poll would dominate adding a tenant (bench/README.md, bench_broker.py)
        await asyncio.sleep(0.003)
    raise BrokerError("the broker did not finish reloading its config in time (see its log)")


class NatsTenantBroker:
    """The control plane's handle on the broker: tenant accounts, credentials, streams and consumers."""

    def __init__(
        self,
        *,
        servers: Sequence[str],
        provider_secret: bytes,
        accounts_file: Path,
        reload: Callable[[], None] | SystemAccountReload,
        replicas: int = 1,
        stream_max_bytes: int = TENANT_STREAM_MAX_BYTES,
        ready_timeout: float = 10.0,
    ) -> None:
        self.servers = list(servers)
        self.keys = ProviderKeys(provider_secret)
        self.accounts_file = Path(accounts_file)
        self._reload = reload
        self.replicas = replicas
        self.stream_max_bytes = stream_max_bytes
        self.ready_timeout = ready_timeout
        self._lock = asyncio.Lock()
        self._streams_ready: set[str] = set()

    def new_user_keys(self) -> UserKeys:
        return nkeys_util.new_user_keys()

    def credentials(self, tenant: str, keys: UserKeys) -> TenantNatsCredentials:
        return TenantNatsCredentials(
            servers=self.servers,
            account=tenant_account_name(tenant),
            user_public_key=keys.public_key,
            seed=keys.seed,
            stream=tenant_stream_name(tenant),
            js_api_prefix=TENANT_JS_PREFIX,
            subject_prefix=tenant_subject_prefix(tenant),
        )

    async def provider_connection(self, **options: object) -> Client:
        """A connection in the provider's account (agents, control plane)."""
        return await nats.connect(servers=self.servers, nkeys_seed_str=self.keys.provider.seed, **options)

    async def apply(self, tenants: Sequence[TenantAccount]) -> None:
        async with self._lock:
            text = render_accounts(self.keys, tenants)
            current = self.accounts_file.read_text() if self.accounts_file.exists() else None
            deadline = time.monotonic() + self.ready_timeout
            if text != current:
                check_accounts_text(text, scratch_dir=self.accounts_file.parent / ".check")
                system = await _connect_until_accepted(self.servers, self.keys.system.seed, deadline=deadline)
                try:
                    write_atomically(self.accounts_file, text)
                    await self._reload_once(system, deadline=deadline)
                    # nats-server 2.15 leaves a service import with a streamed response (the pull API) unanswered
                    # ("no responders") when its account is added by a reload, until the next reload.
                    await self._reload_once(system, deadline=deadline)
                finally:
                    await system.close()
            wanted = {t.tenant for t in tenants}
            self._streams_ready &= wanted
            missing = sorted(wanted - self._streams_ready)
            if not missing:
                return
            provider = await _connect_until_accepted(self.servers, self.keys.provider.seed, deadline=deadline)
            try:
                for tenant in missing:
                    await ensure_stream(provider, tenant_events_stream(
                        tenant, replicas=self.replicas, max_bytes=self.stream_max_bytes))
                    self._streams_ready.add(tenant)
            finally:
                await provider.close()

    async def _reload_once(self, system: Client, *, deadline: float) -> None:
        if isinstance(self._reload, SystemAccountReload):
            await self._reload(system, deadline=deadline)  # the reply comes once the reload is done
        else:
            await _reload_and_wait(system, self._reload, deadline=deadline)

    async def ensure_consumer(
        self,
        tenant: str,
        name: str,
        *,
        filter_subjects: Sequence[str] = (),
        ack_wait_s: float = ACK_WAIT_S,
        position: ConsumerPosition = "broker",
        start_after: int | None = None,
        stream_created: str | None = None,
    ) -> EventConsumer:
        """Create (or update) a tenant's durable pull consumer; its filters must lie inside the tenant's slice.

        Tenants cannot create consumers themselves (see render.py), so the provider does it for them, as a pull
        consumer with no delivery subject. `start_after` applies only to a consumer that does not exist yet (one
        kept by its reader and lost to a broker restart), and only if the stream is still the one created at
        `stream_created` (when given); an existing consumer keeps where it is. A consumer asked for with the other
        `position` is re-created from its ack floor: nats-server cannot change a consumer's storage.
        """
        tenant_pull_consumer(  # refuse a bad request before reaching for the broker
            tenant, name, filter_subjects=filter_subjects, ack_wait_s=ack_wait_s, position=position,
            start_after=start_after,
        )
        try:
            provider = await connect_with_seed(self.servers, self.keys.provider.seed, timeout=self.ready_timeout)
        except Exception as exc:
            raise BrokerError(f"cannot reach the broker: {exc!r}") from exc
        stream = tenant_stream_name(tenant)
        js = provider.jetstream()
        try:
            stream_info = await js.stream_info(stream)
            created = stream_info.created.isoformat() if stream_info.created else None
            try:
                existing = await js.consumer_info(stream, name)
            except NotFoundError:
                existing = None
            if existing is not None and bool(existing.config.mem_storage) != (position == "reader"):
                start_after = existing.ack_floor.stream_seq if existing.ack_floor else None
                with contextlib.suppress(NotFoundError):  # another replica moved it first
                    await js.delete_consumer(stream, name)
                existing = None
            elif existing is None and stream_created is not None and stream_created != created:
                start_after = None  # counted in a stream that has been re-created since: start from the beginning
            config = tenant_pull_consumer(
                tenant, name, filter_subjects=filter_subjects, ack_wait_s=ack_wait_s, position=position,
                start_after=start_after if existing is None else None,
            )
            if existing is not None:  # where it delivers from is fixed at creation
                config.deliver_policy = existing.config.deliver_policy
                config.opt_start_seq = existing.config.opt_start_seq
                config.opt_start_time = existing.config.opt_start_time
            info = await js.add_consumer(stream, config)
        except Exception as exc:
            raise BrokerError(f"the broker refused consumer {name!r}: {exc}") from exc
        finally:
            await provider.close()
        filters = (
            [info.config.filter_subject] if info.config.filter_subject else list(info.config.filter_subjects or [])
        )
        return EventConsumer(
            name=name,
            stream=info.stream_name,
            js_api_prefix=TENANT_JS_PREFIX,
            filter_subjects=filters,
            ack_wait_s=float(info.config.ack_wait or ack_wait_s),
            position="reader" if info.config.mem_storage else "broker",
            stream_created=created,
        )
