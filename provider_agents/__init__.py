"""Provider host agents: one per GPU host, turning raw host telemetry into per-tenant, privacy-preserving events.

The parts, one job each:

    telemetry/        where raw, provider-internal readings come from (simulated host, NVML, carbon traces, scenarios)
    projection.py     the privacy boundary: raw telemetry + desired state -> per-(tenant, job) CloudEvents (pure)
    changes.py        which projected events are news (change detection per tenant-job), so the feed is no firehose
    publisher.py      JetStream publishing that retries until the PubAck, behind a bounded queue (back-pressure)
    desired.py        the desired-state KV bucket the control plane writes and agents watch (level-triggered)
    agent.py          the host agent's loop: observe, branch on the observed state, publish changes; heartbeats
    fleet_monitor.py  the provider-side watchdog: missed heartbeats -> host_down to every tenant-job on that host
    runtime.py        process wiring (connect, build, run until a signal) for the two commands in cli.py

Nothing here imports `api` or `tenant_controllers`: agents learn what to do from the KV bucket and speak only NATS.
"""
