"""Real tier: `harmonaize controller run` stopped by Ctrl-C (SIGINT) once it pulls from the real broker exits 0 and its
log says it stopped, not that it lost the broker: closing our own connection is no disconnection to warn about."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.controllers.live_cloud import LiveCloud
from tests.support import eventually

SCRIPT = '''
from harmonaize.events import CarbonIntensity
from tenant_controllers import Controller, Job

ctl = Controller(job="llm-finetune")


@ctl.on(CarbonIntensity)
async def on_carbon(event: CarbonIntensity, job: Job) -> None:
    pass
'''


class ControllerProcess:
    """`harmonaize controller run quiet.py` as a shell user starts it, its output in a log file."""

    def __init__(self, cloud: LiveCloud, workdir: Path) -> None:
        script = workdir / "quiet.py"
        script.write_text(SCRIPT)
        self.log = workdir / "controller.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "harmonaize_cli", "controller", "run", str(script), "--state-dir",
                 str(workdir / "state"), "--resync-interval", "0"],
                env=cloud.env(), stdout=out, stderr=subprocess.STDOUT, cwd=workdir,
            )

    def text(self) -> str:
        return self.log.read_text()

    async def logged(self, needle: str, what: str) -> None:
        await eventually(lambda: needle in self.text() or self.proc.poll() is not None, timeout=60, what=what)
        assert needle in self.text() and self.proc.poll() is None, self.text()

    async def stop(self, sig: int) -> int:
        self.proc.send_signal(sig)
        return await asyncio.to_thread(self.proc.wait, 30)

    def kill_quietly(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
async def test_a_stopped_controller_exits_0_without_a_reconnect_warning(
    cloud: LiveCloud, tmp_path: Path, sig: signal.Signals
) -> None:
    await cloud.create_job("llm-finetune")
    controller = ControllerProcess(cloud, tmp_path)
    try:
        await controller.logged("pulling ctl-llm-finetune-quiet", "the controller pulling from its consumer")
        code = await controller.stop(sig)
    finally:
        controller.kill_quietly()
    text = controller.text()
    assert code == 0, text
    assert "stopping: finishing handlers in flight" in text
    assert "reconnect" not in text.lower() and "disconnected" not in text.lower(), text
    assert " WARNING " not in text and "Traceback" not in text, text


async def test_a_broker_lost_while_running_is_still_reported(cloud: LiveCloud, tmp_path: Path) -> None:
    """The other side of the test above: only our own close is quiet."""
    await cloud.create_job("llm-finetune")
    controller = ControllerProcess(cloud, tmp_path)
    try:
        await controller.logged("pulling ctl-llm-finetune-quiet", "the controller pulling from its consumer")
        cloud.nats_server.kill()
        await controller.logged("WARNING tenant_controllers.nats: disconnected from the broker; reconnecting",
                                "the controller reporting the lost broker")
        cloud.nats_server.start()
        await controller.logged("reconnected to the broker", "the controller reconnecting")
        code = await controller.stop(signal.SIGINT)
    finally:
        controller.kill_quietly()
    assert code == 0, controller.text()
    assert controller.text().count("disconnected from the broker") == 1, controller.text()
