"""Each tenant's stream gets the configured quota (`HZ_TENANT_STREAM_MAX_BYTES`), a changed quota reaches streams made
before it, and tenants beyond what the broker's storage can reserve are refused rather than half made.
"""

from __future__ import annotations

import pytest

from broker_config.accounts import TenantAccount
from broker_config.provisioner import NatsTenantBroker
from broker_config.server import NatsServer
from broker_config.streams import TENANT_STREAM_MAX_BYTES


def _broker(nats_server: NatsServer, provider_secret: bytes, quota: int) -> NatsTenantBroker:
    return NatsTenantBroker(servers=[nats_server.url], provider_secret=provider_secret,
                            accounts_file=nats_server.accounts_file, reload=nats_server.reload,
                            stream_max_bytes=quota)


async def _quota(broker: NatsTenantBroker, tenant: str) -> int | None:
    provider = await broker.provider_connection()
    try:
        return (await provider.jetstream().stream_info(f"HZ_T_{tenant}")).config.max_bytes
    finally:
        await provider.close()


async def test_streams_get_the_quota_and_a_new_quota_reaches_old_streams(
    nats_server: NatsServer, tenant_broker: NatsTenantBroker, provider_secret: bytes
) -> None:
    acme = TenantAccount("acme", tenant_broker.new_user_keys().public_key)
    await tenant_broker.apply([acme])
    assert await _quota(tenant_broker, "acme") == TENANT_STREAM_MAX_BYTES == 128 << 20

    smaller = _broker(nats_server, provider_secret, 8 << 20)  # an API restarted with a new HZ_TENANT_STREAM_MAX_BYTES
    globex = TenantAccount("globex", smaller.new_user_keys().public_key)
    await smaller.apply([acme, globex])
    assert await _quota(smaller, "acme") == 8 << 20, "the stream made before the change has the new quota"
    assert await _quota(smaller, "globex") == 8 << 20


async def test_a_tenant_beyond_the_brokers_storage_is_refused(
    nats_server: NatsServer, provider_secret: bytes
) -> None:
    huge = _broker(nats_server, provider_secret, 1 << 40)  # 1 TiB reserved: more than this machine's store
    with pytest.raises(Exception, match="insufficient storage"):
        await huge.apply([TenantAccount("acme", huge.new_user_keys().public_key)])
