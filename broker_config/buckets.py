"""The provider's key-value buckets, defined once, so whichever process creates one creates it as the others would.

- `hz_desired` (`harmonaize.desired_state.DESIRED_STATE_BUCKET`): the control plane writes every host's assignment,
  the agents and the fleet monitor watch it. A few revisions of history, so an operator can see what changed.
- `hz_rendezvous`: the agent hosting a job's rendezvous store writes its address there; the latest only.

Both are replicated like the tenants' streams (`HZ_BROKER_REPLICAS`, 3 on the 3-node broker): a bucket kept on one
node of a cluster is gone while that node is, and with it every agent's desired state and every new worker's way to
its job's store. A bucket found with fewer replicas than asked (made before the broker grew, or by a process started
with the default) is scaled up in place by updating its backing stream; one found with more is left as it is, since
lowering durability is an operator's decision, not a side effect of a process starting with another setting.
"""

from __future__ import annotations

import dataclasses
import logging

from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BadRequestError, BucketNotFoundError
from nats.js.kv import KeyValue

from harmonaize.desired_state import DESIRED_STATE_BUCKET

__all__ = [
    "DESIRED_STATE_HISTORY",
    "MAX_REPLICAS",
    "RENDEZVOUS_BUCKET",
    "desired_state_bucket",
    "ensure_bucket",
    "rendezvous_bucket",
]

log = logging.getLogger(__name__)

RENDEZVOUS_BUCKET = "hz_rendezvous"
DESIRED_STATE_HISTORY = 5
MAX_REPLICAS = 5
"""JetStream's own limit on a stream's replicas."""


def _replicas(replicas: int) -> int:
    if not 1 <= replicas <= MAX_REPLICAS:
        raise ValueError(f"a bucket has 1..{MAX_REPLICAS} replicas, got {replicas}")
    return replicas


def desired_state_bucket(*, replicas: int = 1) -> KeyValueConfig:
    return KeyValueConfig(bucket=DESIRED_STATE_BUCKET, history=DESIRED_STATE_HISTORY, storage=StorageType.FILE,
                          replicas=_replicas(replicas))


def rendezvous_bucket(*, replicas: int = 1) -> KeyValueConfig:
    return KeyValueConfig(bucket=RENDEZVOUS_BUCKET, history=1, storage=StorageType.FILE, replicas=_replicas(replicas))


async def ensure_bucket(js: JetStreamContext, config: KeyValueConfig) -> KeyValue:
    """Bind `config`'s bucket, creating it when missing (racing creators both end up bound to the one bucket) and
    raising its replicas to `config.replicas` when it has fewer."""
    try:
        kv = await js.key_value(config.bucket)
    except BucketNotFoundError:
        try:
            return await js.create_key_value(config)
        except BadRequestError:  # created meanwhile by someone else
            kv = await js.key_value(config.bucket)
    await _scale_up(js, config)
    return kv


async def _scale_up(js: JetStreamContext, config: KeyValueConfig) -> None:
    stream = f"KV_{config.bucket}"
    info = await js.stream_info(stream)
    have = info.config.num_replicas or 1
    if have >= config.replicas:
        return
    log.info("bucket %s: %d replica(s), raising to %d", config.bucket, have, config.replicas)
    await js.update_stream(dataclasses.replace(info.config, num_replicas=config.replicas))
