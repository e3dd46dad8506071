"""A torchrun agent started ahead of need: a Python process that has already imported `torch.distributed.run` and
waits on stdin for the arguments of the node it is to become.

Why: after a host failure the survivors' nodes must restart into a new rendezvous, and every Python process that
imports torch spends seconds on it before it can do anything, more under load (bench/README.md, 'Noise on this
machine'). Recovery pays that twice in a row (the torchrun agent, then its worker); a warm agent removes the first.
The launcher keeps one warm process per host and starts a fresh one after each use.

The request is one JSON line: `{"args": [...torchrun arguments...], "env": {...}, "log": path}`. The process applies
the environment (the node's marker, its spec, the torch settings: all read at call time by torchrun and inherited by
the workers it spawns), sends its output to the node's log and runs torchrun's `main`. EOF on stdin (the launcher
went away) ends it. Its own /proc environ still carries the marker it was started with (`warm_marker`), so the
launcher records that one for the agent process and the node's marker for the workers.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from harmonaize.job_runtime import ENV_NODE_MARKER
from provider_agents.processes import stopped

__all__ = ["BOOT", "WarmTorchrun"]

BOOT = """
import json, os, sys
import torch.distributed.run as run
line = sys.stdin.readline()
if not line:
    sys.exit(0)
request = json.loads(line)
os.environ.update(request["env"])
fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
sys.stdout.flush(); sys.stderr.flush()
os.dup2(fd, 1); os.dup2(fd, 2)
sys.argv = ["torchrun", *request["args"]]
run.main(request["args"])
"""


@dataclass
class WarmTorchrun:
    """One waiting process; `take()` turns it into a node, once."""

    process: asyncio.subprocess.Process
    marker: str

    @classmethod
    async def spawn(cls, python: str, *, env: Mapping[str, str], marker: str, log: Path) -> WarmTorchrun:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            process = await asyncio.create_subprocess_exec(
                python, "-c", BOOT,
                stdin=asyncio.subprocess.PIPE, stdout=out, stderr=asyncio.subprocess.STDOUT,
                env={**env, ENV_NODE_MARKER: marker, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )
        return cls(process=process, marker=marker)

    @property
    def ready(self) -> bool:
        """It can take a node now: running (not stopped by a signal, which a host's hang may have done to it too)."""
        stdin = self.process.stdin
        running = self.process.returncode is None and not stopped(self.process.pid)
        return running and stdin is not None and not stdin.is_closing()

    async def take(self, args: list[str], *, env: Mapping[str, str], log: Path) -> asyncio.subprocess.Process:
        """Hand the node's arguments over; the process is the node's torchrun agent from now on."""
        assert self.process.stdin is not None
        request = {"args": args, "env": dict(env), "log": str(log)}
        self.process.stdin.write(json.dumps(request).encode() + b"\n")
        await self.process.stdin.drain()
        self.process.stdin.close()
        return self.process

    async def discard(self) -> None:
        if self.process.returncode is None:
            if self.process.stdin is not None and not self.process.stdin.is_closing():
                self.process.stdin.close()
            try:
                await asyncio.wait_for(self.process.wait(), 5.0)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()


def node_env(base: Mapping[str, str]) -> dict[str, str]:
    """Only what differs from the launcher's own environment needs to travel in the request."""
    return {key: value for key, value in base.items() if os.environ.get(key) != value}
