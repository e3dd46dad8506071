"""The local cloud on the testbed (`harmonaize up --testbed`): each simulated host a network namespace, the job's
traffic between locality groups through shaped uplinks, the scenario's network episodes played for real.

What changes against the loopback cloud, and why:
- The broker, the API and the jobs' rendezvous stores listen on the testbed's services address (the management
  plane's end in this machine's namespace), the one address every host namespace reaches; this machine's own shell
  reaches it too, so the env files carry it.
- Each agent runs *inside* its host's namespace (`ip netns exec`), so its torchrun nodes inherit the host's network,
  gloo binds the host's data interface (`GLOO_SOCKET_IFNAME=data`), and a partitioned host is silent to the fleet
  monitor exactly as a real one would be.
- The agents measure their group's uplink (`provider_agents.testbed.source`) instead of replaying scripted congestion;
  this process plays the scenario's congestion, link-rate and partition episodes on the real links
  (`provider_agents.testbed.episodes`), including those `harmonaize scenario run` injects later.
- Everything built carries the cloud's id and is removed when the cloud stops; a start after a crash removes what the
  crashed run of the same cloud left, and nothing of another cloud.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from nats.aio.msg import Msg
from pydantic import ValidationError

from provider_agents.runtime import connect_provider
from provider_agents.telemetry.scenario import SCENARIO_INJECT_SUBJECT, ScenarioInjection, load_scenario
from provider_agents.testbed import netns, traffic
from provider_agents.testbed.episodes import EpisodePlayer
from provider_agents.testbed.layout import TestbedLayout

__all__ = ["DEFAULT_UPLINK_MBIT", "LocalTestbed", "testbed_unavailable"]

log = logging.getLogger(__name__)

DEFAULT_UPLINK_MBIT = 50.0
"""Well below what two cores push through a veth (several Gbit/s), so the shaping, not the CPU, is the bottleneck."""
INJECTION_REPLY_HOST = "testbed"
"""How the episode player answers `harmonaize scenario run` beside the hosts: the network's episodes were applied."""


def testbed_unavailable() -> str | None:
    """Why this machine cannot build a testbed (one line, ending in what happens instead), or None."""
    return netns.unavailable()


@dataclass
class LocalTestbed:
    """One local cloud's testbed: its layout (also written where the agents read it) and its episode player."""

    layout: TestbedLayout
    layout_file: Path
    _player: EpisodePlayer | None = field(default=None, repr=False)

    @classmethod
    def build(cls, data_dir: Path, cloud: str, groups: dict[str, str], *, uplink_mbit: float) -> LocalTestbed:
        """Build the namespaces of `cloud` (host -> locality group), after removing what a crashed run of the same
        cloud left; raises `netns.TestbedError` (nothing left behind) when the kernel refuses."""
        traffic.stop_all(cloud)
        layout = netns.build(cloud, groups, uplink_mbit=uplink_mbit)
        layout_file = data_dir / "testbed.json"
        layout_file.write_text(layout.to_json())
        return cls(layout=layout, layout_file=layout_file)

    @property
    def services_address(self) -> str:
        return self.layout.services_address

    def agent_command(self, host: str, command: list[str]) -> list[str]:
        """`command` run inside `host`'s namespace, told its testbed."""
        return ["ip", "netns", "exec", self.layout.host(host).namespace, *command,
                "--testbed-layout", str(self.layout_file)]

    agent_env = {"GLOO_SOCKET_IFNAME": "data"}
    """gloo binds the host's data interface (the job's plane), never the management one."""

    async def play(self, scenario: Path, *, start: datetime, nats_url: str, secret: bytes,
                   stop: asyncio.Event) -> None:
        """Play the scenario's network episodes (and every injected one) until `stop`; then undo all of them."""
        player = EpisodePlayer(self.layout, load_scenario(scenario), start=start)
        self._player = player
        nc = await connect_provider(nats_url, secret, name="hz-testbed-episodes")

        async def on_inject(msg: Msg) -> None:
            try:
                request = ScenarioInjection.model_validate_json(msg.data)
            except ValidationError:
                return  # the hosts answer a malformed injection; the network has nothing to add
            player.inject(request.scenario, at=request.at)
            if msg.reply:
                await nc.publish(msg.reply, json.dumps({"host": INJECTION_REPLY_HOST, "applied": True}).encode())

        try:
            await nc.subscribe(SCENARIO_INJECT_SUBJECT, cb=on_inject)
            await player.run(stop)
        finally:
            await nc.close()

    def remove(self) -> list[str]:
        """Stop the cloud's traffic and delete its namespaces; what was removed."""
        traffic.stop_all(self.layout.cloud)
        removed = netns.remove(self.layout.cloud)
        self.layout_file.unlink(missing_ok=True)
        return removed
