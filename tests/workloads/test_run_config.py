"""Where a run's configuration comes from, without processes: the launcher's spec, flags, environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from harmonaize.job_runtime import ENV_RUN_SPEC, JobRanges, WorkerSpec, write_model_atomically
from harmonaize.jobs import ParallelPlan
from harmonaize.ranges import IntRange
from workloads.spec import (
    ENV_CHECKPOINT_DIR,
    ENV_CONTROL_DIR,
    ENV_DUMP_DIR,
    ENV_PARALLEL_PLAN,
    ENV_TEST_CRASH_SAVE,
    RunConfig,
    SpecError,
    default_interval,
    load_run_config,
    parse_crash_save,
)


def write_spec(tmp_path: Path) -> Path:
    spec = WorkerSpec(
        tenant="acme", job="train-1", epoch=4, parallel_plan=ParallelPlan.HSDP, locality_group="g-7",
        checkpoint_dir=tmp_path / "ckpt", control_dir=tmp_path / "ctl",
        ranges=JobRanges(checkpoint_interval_steps=IntRange(min=50, max=200)),
    )
    path = tmp_path / "spec.json"
    write_model_atomically(path, spec)
    return path


def test_the_spec_wins_over_flags(tmp_path: Path) -> None:
    env = {ENV_RUN_SPEC: str(write_spec(tmp_path)), ENV_DUMP_DIR: str(tmp_path / "dump")}
    config = load_run_config(["--checkpoint-dir", "/elsewhere", "--parallel-plan", "ddp"], env)
    assert config.has_spec and (config.tenant, config.job, config.epoch) == ("acme", "train-1", 4)
    assert config.parallel_plan is ParallelPlan.HSDP and config.locality_group == "g-7"
    assert config.checkpoint_dir == tmp_path / "ckpt" and config.control_dir == tmp_path / "ctl"
    assert config.dump_dir == tmp_path / "dump"


def test_plain_torchrun_uses_flags_then_environment(tmp_path: Path) -> None:
    config = load_run_config(["--checkpoint-dir", str(tmp_path), "--max-steps", "5"], {})
    assert not config.has_spec and config.checkpoint_dir == tmp_path
    assert config.control_dir is None and config.parallel_plan is ParallelPlan.DDP
    env = {ENV_CHECKPOINT_DIR: "/c", ENV_CONTROL_DIR: "/d", ENV_PARALLEL_PLAN: "fsdp"}
    config = load_run_config([], env)
    assert (config.checkpoint_dir, config.control_dir, config.parallel_plan) == (Path("/c"), Path("/d"),
                                                                                ParallelPlan.FSDP)


def test_without_a_checkpoint_dir_the_run_refuses_to_start() -> None:
    with pytest.raises(SpecError, match="--checkpoint-dir"):
        load_run_config([], {})


def test_a_missing_or_broken_spec_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="does not exist"):
        load_run_config([], {ENV_RUN_SPEC: str(tmp_path / "nope.json")})
    (tmp_path / "bad.json").write_text('{"tenant": "acme"}')
    with pytest.raises(SpecError, match="not a valid WorkerSpec"):
        load_run_config([], {ENV_RUN_SPEC: str(tmp_path / "bad.json")})


def test_the_scripts_interval_is_clamped_into_the_tenants_range_only_under_a_spec(tmp_path: Path) -> None:
    spec_config = load_run_config([], {ENV_RUN_SPEC: str(write_spec(tmp_path))})
    assert [default_interval(n, spec_config) for n in (10, 100, 1000)] == [50, 100, 200]
    plain = RunConfig(checkpoint_dir=tmp_path)
    assert [default_interval(n, plain) for n in (10, 100, 1000)] == [10, 100, 1000]


def test_the_crash_hook_value() -> None:
    assert parse_crash_save(None) is None
    assert parse_crash_save("12") == (12, "before-commit")
    assert parse_crash_save("12:before-write") == (12, "before-write")
    with pytest.raises(SpecError):
        parse_crash_save("12:sometime")
    config = load_run_config(["--checkpoint-dir", "/c"], {ENV_TEST_CRASH_SAVE: "3"})
    assert config.crash_save == (3, "before-commit")
