#!/usr/bin/env python
"""Congestion benchmark on the testbed: what cooperation buys a DDP job when another tenant's bulk flow shares the
inter-group link, beside the status quo (the job keeps its plan), in one run.

A local cloud on the testbed (`harmonaize up --testbed`'s `run_local_cloud`, in this process, a fresh data dir):
4 hosts as network namespaces in 2 locality groups, each group's uplink shaped to `--uplink-mbit` (50 by default).
One job at a time, 4 workers (one per host), DDP, the example MLP at `--hidden` (700: ~0.5 M parameters, 2 MB of
gradients all-reduced per step) with `--step-delay-ms` of compute stand-in. Cross-traffic: a congestion episode
injected as `harmonaize scenario run` would, which the testbed plays as a bulk TCP flow between the neighbour
namespaces of the two groups (another tenant's machines) over the same uplinks. The agents measure the uplink's
qdisc counters and publish the congestion; nothing in the job or the controllers is told the episode.

Arms (`harmonaize_cli.local_cloud.congestion_trial`), each measuring samples/s over `--window` s uncongested, then
congested once the arm's answer is in place:
* **status quo**: no compression allowed, no controller: the job keeps DDP, uncompressed.
* **cooperative**: fp16 and PowerSGD allowed: the provider's micro loop turns compression on, in place.
* **repartition**: no compression allowed; the tenant runs the example congestion repartitioner, which negotiates
  HSDP grouped by locality at the congestion event (the job restarts into it from its checkpoint).
The baseline is the same job on the same uncongested link in the same run; the figure is the fraction of it kept
under congestion (target: cooperative >= 80 %, status quo < 60 %), and the time from the flow's start to the job's
congestion event at the tenant (target <= 2 s).

The cross-traffic is a congestion episode of slowdown 3 (`--slowdown`): the testbed plays it as 2 bulk flows (a link
shared fairly by n flows leaves a new one 1/(n+1) of it).

Needs root and iproute2 (the testbed); elsewhere it says so in one line and exits 2. Run from the repository root:
`python bench/bench_congestion.py [--json PATH]` (~6-7 min; `--arms status_quo cooperative` ~4 min). No timed
assertions: it prints figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _benchutil import ensure_repo_on_path, fmt, git_state, loadavg, machine_line, table

ensure_repo_on_path()

from harmonaize.settings import Settings  # noqa: E402
from harmonaize_cli.local_cloud.congestion_trial import ARMS, ArmResult, TrialShape, run_arm  # noqa: E402
from harmonaize_cli.local_cloud.fleet import LocalFleet, fleet_of  # noqa: E402
from harmonaize_cli.local_cloud.launcher import LocalCloudInfo, run_local_cloud  # noqa: E402
from harmonaize_cli.local_cloud.tenant_probe import TenantProbe  # noqa: E402
from harmonaize_cli.local_cloud.testbed import testbed_unavailable  # noqa: E402


async def measure(args: argparse.Namespace, data_dir: Path) -> tuple[list[ArmResult], str]:
    shape = TrialShape(hidden=args.hidden, step_delay_ms=args.step_delay_ms, window_s=args.window,
                       slowdown=args.slowdown)
    results: list[ArmResult] = []
    network: list[str] = []

    async def trial(info: LocalCloudInfo, fleet: LocalFleet | None) -> None:
        network.append(info.network)
        if fleet is None or fleet.testbed is None:
            raise RuntimeError(f"the cloud did not start on the testbed: {info.network}")
        probe = TenantProbe(info.data_dir)
        await probe.listen()
        try:
            for arm in args.arms:
                started = time.monotonic()
                result = await run_arm(probe, arm, shape)
                print(f"  {arm}: {result.uncongested.samples_per_s:.0f} -> {result.congested.samples_per_s:.0f} "
                      f"samples/s ({result.kept:.0%} kept, {result.compression}, {result.plan}), event after "
                      f"{fmt(result.detected_s, 's')} s; {time.monotonic() - started:.0f} s", flush=True)
                results.append(result)
        finally:
            await probe.close()

    settings = Settings(_env_file=None, data_dir=data_dir, api_port=0)
    await run_local_cloud(settings, hosts=fleet_of(4), story=trial, testbed_mbit=args.uplink_mbit)
    return results, network[0] if network else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--uplink-mbit", type=float, default=50.0)
    parser.add_argument("--hidden", type=int, default=500)
    parser.add_argument("--step-delay-ms", type=float, default=250.0)
    parser.add_argument("--window", type=float, default=20.0, help="seconds per samples/s measurement")
    parser.add_argument("--slowdown", type=float, default=3.0,
                        help="the congestion episode's (played as round(slowdown) - 1 bulk flows)")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--data-dir", type=Path, default=None, help="keep the cloud's state and logs here (new dir)")
    args = parser.parse_args()
    reason = testbed_unavailable()
    if reason is not None:
        print(f"bench_congestion needs the testbed: {reason.split(';')[0]}", file=sys.stderr)
        sys.exit(2)
    print(machine_line())
    print(f"commit {git_state()}; load {loadavg()}")
    started = time.monotonic()
    if args.data_dir is not None:
        if args.data_dir.exists() and any(args.data_dir.iterdir()):
            parser.error(f"--data-dir {args.data_dir} is not empty: the bench needs a fresh cloud")
        results, network = asyncio.run(measure(args, args.data_dir))
    else:
        with tempfile.TemporaryDirectory(prefix="hz-bench-congestion-") as tmp:
            results, network = asyncio.run(measure(args, Path(tmp)))
    print(network)
    rows = [
        [r.arm, fmt(r.uncongested.samples_per_s, "/s"), fmt(r.congested.samples_per_s, "/s"), f"{r.kept:.0%}",
         f"{r.compression} / {r.plan}", fmt(r.measured_s, "s"), fmt(r.detected_s, "s")]
        for r in results
    ]
    print(table(["arm", "uncongested samples/s", "congested samples/s", "kept", "congested with", "measured s",
                 "event s"], rows))
    by_arm = {r.arm: r for r in results}
    if "status_quo" in by_arm:
        status_quo = by_arm["status_quo"]
        for arm in ("cooperative", "repartition"):
            if arm in by_arm:
                with_ = by_arm[arm]
                gain = with_.congested.samples_per_s / status_quo.congested.samples_per_s
                print(f"target: {arm} kept {with_.kept:.0%} (>= 80 %) where the status quo kept {status_quo.kept:.0%} "
                      f"(< 60 %); congested with/without {gain:.2f}x")
    events = ", ".join(f"{r.arm} {fmt(r.detected_s, 's')}" for r in results)
    print(f"congestion event at the tenant after the episode began (target <= 2 s): {events}; 'measured' is when "
          "the agents first measured the link congested (the event's since)")
    print(f"total {time.monotonic() - started:.0f} s")
    if args.json is not None:
        report: dict[str, Any] = {
            "bench": "congestion", "commit": git_state(), "machine": machine_line(), "network": network,
            "args": {k: v for k, v in vars(args).items() if k != "json"},
            "arms": {r.arm: r.as_dict() for r in results},
        }
        args.json.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
