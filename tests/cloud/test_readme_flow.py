"""The README as a new user follows it: `./scripts/up`'s demo plays, then "Your first tenant controller" is typed in
order into one shell, as written (the README's own code blocks, read from the file), in the folder the cloud runs in.

The only liberties a person also takes: the API port is 0 instead of 8080 (one may be taken on this machine: the
env files carry the real URL), `<id>` is the negotiation the controller opened, and the test waits for the controller
to react before the history block, as a person would look before querying.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.timeout(720)

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Your first tenant controller"
DEMO_DONE = "The cloud keeps running; Ctrl-C stops it."


def readme_blocks() -> list[tuple[str, str]]:
    """(language, code) of every fenced block in the README's first-controller section, in order."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index(SECTION)
    end = readme.index("\n## ", start + len(SECTION))
    return re.findall(r"```(\w+)\n(.*?)```", readme[start:end], flags=re.S)


class Output:
    """Lines of a child's stdout, read in a thread so the child never blocks on a full pipe."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._lock = threading.Lock()
        assert proc.stdout is not None
        self._thread = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        self._thread.start()

    def _read(self, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            with self._lock:
                self.lines.append(line.rstrip("\n"))

    def text(self) -> str:
        with self._lock:
            return "\n".join(self.lines)

    def wait_for(self, needle: str, *, timeout: float, proc: subprocess.Popen[str], what: str) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.text():
            if proc.poll() is not None:
                raise AssertionError(f"{what}: the process exited with {proc.returncode}:\n{self.text()[-6000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}:\n{self.text()[-6000:]}")
            time.sleep(0.2)


def _live_members(pgid: int) -> list[int]:
    """Processes of the group that still run (zombies left out: an orphan's is reaped by init, whenever)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(stat.parent.name))
    return members


def _stop(proc: subprocess.Popen[str], sig: signal.Signals) -> None:
    """Stop `proc` (started with `start_new_session`) and everything in its process group, even after the leader
    itself exited: a shell whose stdin closed ends at once and leaves the commands it started with `&` running."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    deadline = time.monotonic() + 60
    while members := _live_members(proc.pid):  # the group's other members: not our children, so polled
        if time.monotonic() > deadline:
            for pid in members:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            assert time.monotonic() < deadline + 10, f"processes {members} outlived SIGKILL"
        time.sleep(0.1)


@pytest.fixture
def demo_cloud(tmp_path: Path) -> Iterator[tuple[Path, Output]]:
    """`./scripts/up` in a fresh folder (its `.hz` is the data dir the README's `source` lines read), until the demo
    story has ended and handed the cloud over."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "harmonaize_cli", "up", "--demo", "--api-port", "0"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    output = Output(proc)
    try:
        output.wait_for(DEMO_DONE, timeout=360, proc=proc, what="the demo to end and hand the cloud over")
        yield tmp_path, output
    finally:
        _stop(proc, signal.SIGINT)


def _client(folder: Path, env_file: str, token: str) -> httpx.Client:
    """An API client with the credentials of one of the env files the cloud wrote (admin or the demo tenant)."""
    values = {}
    for line in (folder / ".hz" / env_file).read_text().splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        values[key] = shlex.split(value)[0]
    return httpx.Client(
        base_url=values["HZ_API_URL"], headers={"Authorization": f"Bearer {values[token]}"}, timeout=30
    )


def _eventually(check: Callable[[], Any], *, timeout: float, what: str) -> Any:
    """Poll `check` until it returns something truthy (and return that), or fail naming `what`."""
    deadline = time.monotonic() + timeout
    while not (result := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.5)
    return result


def test_the_readme_first_controller_section_runs_as_written_after_the_demo(
    demo_cloud: tuple[Path, Output],
) -> None:
    folder, cloud_output = demo_cloud
    blocks = readme_blocks()
    assert [lang for lang, _ in blocks] == ["bash", "python", "bash", "bash"], blocks
    (_, submit), (_, controller), (_, react), (_, history) = blocks
    (folder / "my_controller.py").write_text(controller)

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    for key in [key for key in env if key.startswith("HZ_")]:
        del env[key]  # the README's shell knows only what it sources
    shell = subprocess.Popen(
        ["bash", "--norc", "--noprofile"], cwd=folder, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    output = Output(shell)
    assert shell.stdin is not None

    def type_in(block: str, marker: str, *, timeout: float) -> None:
        assert shell.stdin is not None
        shell.stdin.write(block + f"\necho {marker} $?\n")
        shell.stdin.flush()
        output.wait_for(marker, timeout=timeout, proc=shell, what=f"the README block ending in {marker}")

    admin = _client(folder, "admin.env", "HZ_ADMIN_TOKEN")
    tenant = _client(folder, "tenant-demo.env", "HZ_TENANT_TOKEN")

    def hosts_of_my_job() -> set[str]:
        reply = admin.get("/v1/allocations", params={"tenant_id": "demo", "job_id": "my-job"})
        assert reply.status_code == 200, reply.text
        return {allocation["host_id"] for allocation in reply.json()}

    try:
        type_in(submit, "__SUBMITTED__", timeout=60)
        created = output.text()
        assert "__SUBMITTED__ 0" in created, created
        assert '"id":"my-job"' in created.replace(" ", ""), f"the job was not created:\n{created}"
        assert "job not found" not in created, created
        before = hosts_of_my_job()
        assert len(before) == 2 and "h1" in before, f"my-job should run on h1 and one more host: {before}"

        type_in(react, "__INJECTED__", timeout=90)
        assert "__INJECTED__ 0" in output.text(), output.text()[-4000:]

        def accepted() -> dict[str, object] | None:
            page = tenant.get("/v1/negotiations", params={"job": "my-job", "state": "accepted"})
            items = page.json().get("items", []) if page.status_code == 200 else []
            return items[0] if items else None

        negotiation = _eventually(accepted, timeout=120, what="the controller's negotiation to be accepted")
        assert isinstance(negotiation, dict)
        after = _eventually(
            lambda: (hosts := hosts_of_my_job()) and "h1" not in hosts and hosts,
            timeout=30, what="my-job to move off the failing h1",
        )
        assert isinstance(after, set) and len(after) == 2, f"my-job kept its size on healthy hosts: {after}"
        _eventually(lambda: "failure" in output.text().split("__SUBMITTED__")[-1], timeout=30,
                    what="the tenant's event feed to show the failure")

        type_in(history.replace("<id>", str(negotiation["id"])), "__HISTORY__", timeout=60)
        shown = output.text().split("__INJECTED__")[-1]
        assert "__HISTORY__ 0" in shown, shown[-4000:]
        assert str(negotiation["id"]) in shown and '"rounds"' in shown.replace(" ", ""), shown[-4000:]
    finally:
        admin.close()
        tenant.close()
        if shell.stdin is not None:
            shell.stdin.close()
        _stop(shell, signal.SIGTERM)
    assert "Traceback" not in cloud_output.text(), cloud_output.text()[-6000:]
