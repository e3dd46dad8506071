"""The tenant SDK: controllers that react to a job's provider events and negotiate changes with the provider.

A controller script declares handlers; the runner connects them (`harmonaize controller run my_controller.py`,
credentials from HZ_TENANT, HZ_TENANT_TOKEN, HZ_TENANT_NATS_SEED, HZ_NATS_URL, HZ_API_URL):

    from harmonaize.events import Failure
    from tenant_controllers import Controller, Job

    ctl = Controller(tenant="acme", job="llm-finetune")

    @ctl.on(Failure)
    async def on_failure(event: Failure, job: Job) -> None:
        offer = await job.negotiate(scale_to=job.workers, accept=(job.workers - 1, job.workers))
        await offer.accept()

Guarantees: events arrive through a durable consumer (a restart of the controller or of the broker resumes where it
stopped: the broker keeps the consumer in memory and the controller records its position); each handler finishes
each CloudEvent once (its outcome is recorded with the event id before the ack, so redeliveries and duplicate publishes
are skipped); a handler's errors decide retries (`TemporaryError`, `PermanentError`, `retries=`, `backoff=`);
`@ctl.on_resync` handlers run periodically against the job's current state, so a lost event cannot leave the
controller wrong. Layout: `controller` (declarations), `runtime` (delivery, lanes, acks), `execution` (retries),
`store` (de-duplication), `sources`/`nats_source`/`memory` (transports), `api_client`/`job`/`offer` (negotiation).
"""

from harmonaize.rest import NegotiationPublic as Negotiation
from harmonaize.rest import RoundPublic as Round
from tenant_controllers.controller import Controller
from tenant_controllers.errors import (
    ApiError,
    ApiUnavailableError,
    AuthenticationError,
    ConfigurationError,
    ConflictError,
    ControllerError,
    Declined,
    InvalidRequestError,
    NotFoundError,
    PermanentError,
    TemporaryError,
)
from tenant_controllers.job import Job
from tenant_controllers.offer import Offer

__all__ = [
    "ApiError",
    "ApiUnavailableError",
    "AuthenticationError",
    "ConfigurationError",
    "ConflictError",
    "Controller",
    "ControllerError",
    "Declined",
    "InvalidRequestError",
    "Job",
    "Negotiation",
    "NotFoundError",
    "Offer",
    "PermanentError",
    "Round",
    "TemporaryError",
]
