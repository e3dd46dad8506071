"""The broker's fsync policy: `always` unless configured otherwise, a period only in a form nats-server accepts."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from broker_config.render import ServerOptions, render_server
from broker_config.server import validate_config_file
from harmonaize.settings import Settings
from harmonaize_cli.main import app


def test_the_default_fsyncs_every_write_and_a_period_renders_a_config_nats_server_accepts(tmp_path: Path) -> None:
    default = render_server(ServerOptions(host="127.0.0.1", port=4222, store_dir=tmp_path / "js"))
    assert "  sync_interval: always\n" in default
    config = tmp_path / "nats.conf"
    config.write_text(
        render_server(ServerOptions(host="127.0.0.1", port=4222, store_dir=tmp_path / "js", sync_interval="10s"))
        .replace('include "accounts.conf"\n', "")
    )
    assert '  sync_interval: "10s"\n' in config.read_text()
    validate_config_file(config)  # nats-server -t: the period is one the server understands


@pytest.mark.parametrize("bad", ["sometimes", "10", "0s", "-1s", "10 s", "1h", "10s\n  store_dir: /", ""])
def test_anything_else_is_refused_before_it_reaches_a_config_file(bad: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sync interval must be 'always' or a period"):
        ServerOptions(host="127.0.0.1", port=4222, store_dir=tmp_path, sync_interval=bad)
    with pytest.raises(ValueError, match="broker_sync_interval"):
        Settings(_env_file=None, broker_sync_interval=bad)


def test_render_config_follows_the_setting_and_names_a_bad_value(tmp_path: Path) -> None:
    env = {"HZ_PROVIDER_SECRET": "s" * 32, "HZ_BROKER_SYNC_INTERVAL": "2m"}
    result = CliRunner().invoke(app, ["broker", "render-config", "--out", str(tmp_path)], env=env)
    assert result.exit_code == 0, result.output
    assert '  sync_interval: "2m"\n' in (tmp_path / "nats.conf").read_text()  # validated by nats-server -t

    result = CliRunner().invoke(app, ["broker", "render-config", "--out", str(tmp_path)],
                                env={**env, "HZ_BROKER_SYNC_INTERVAL": "often"})
    assert result.exit_code == 2
    assert "HZ_BROKER_SYNC_INTERVAL" in result.output and "'often'" in result.output
