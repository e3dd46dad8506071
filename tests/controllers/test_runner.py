"""The runner as a user meets it: one clear line and exit 2 for a bad setup; scripts loaded by path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import SecretStr

from harmonaize.settings import Settings
from tenant_controllers import ConfigurationError
from tenant_controllers.runner import credentials_from, load_controllers

MINIMAL = '''
from harmonaize.events import Failure
from tenant_controllers import Controller, Job

ctl = Controller(tenant="acme", job="llm-finetune")

@ctl.on(Failure)
async def on_failure(event: Failure, job: Job) -> None:
    offer = await job.negotiate(scale_to=job.workers, accept=(job.workers - 1, job.workers))
    await offer.accept()
'''


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_missing_credentials_are_one_line_naming_the_variables_and_exit_2(tmp_path: Path) -> None:
    script = write(tmp_path, "my_controller.py", MINIMAL)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HZ_")}
    env["HZ_TENANT_NATS_SEED"] = "SUAEXAMPLE"
    result = subprocess.run(
        [sys.executable, "-m", "tenant_controllers.cli", "run", str(script)],
        env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines == [
        "harmonaize controller: missing credentials: HZ_TENANT_TOKEN is not set (source the tenant env file that "
        "'harmonaize up' printed, e.g. .hz/tenant-demo.env)"
    ]


def test_credentials_come_from_settings_and_the_script(tmp_path: Path) -> None:
    [ctl] = load_controllers(write(tmp_path, "my_controller.py", MINIMAL))
    assert ctl.name == "my_controller" and ctl.consumer == "ctl-llm-finetune-my_controller"
    settings = Settings(_env_file=None, tenant_token=SecretStr("token-xyz"), tenant_nats_seed=SecretStr("seed-xyz"),
                        nats_url="nats://127.0.0.1:1", api_url="http://127.0.0.1:2")
    creds = credentials_from(settings, [ctl])
    assert (creds.tenant, creds.token, creds.nats_seed, creds.api_url) == (
        "acme", "token-xyz", "seed-xyz", "http://127.0.0.1:2")
    assert "xyz" not in repr(creds), "secrets never reach logs"

    with pytest.raises(ConfigurationError, match="HZ_TENANT, HZ_TENANT_TOKEN, HZ_TENANT_NATS_SEED are not set"):
        credentials_from(Settings(_env_file=None), [load_controllers(write(tmp_path, "anon.py", MINIMAL.replace(
            'tenant="acme", ', "")))[0]])
    with pytest.raises(ConfigurationError, match="for tenant 'acme' but HZ_TENANT is 'globex'"):
        credentials_from(Settings(_env_file=None, tenant="globex"), [ctl])


def test_scripts_that_cannot_run_say_why(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="not found"):
        load_controllers(tmp_path / "nope.py")
    with pytest.raises(ConfigurationError, match="defines no Controller"):
        load_controllers(write(tmp_path, "empty.py", "x = 1\n"))
    with pytest.raises(ConfigurationError, match="failed to import: ZeroDivisionError"):
        load_controllers(write(tmp_path, "broken.py", "1 / 0\n"))
    two = load_controllers(write(tmp_path, "two.py", MINIMAL + "\nguard = Controller(job='llm-finetune')\n"))
    assert sorted(c.name for c in two) == ["two-ctl", "two-guard"]
