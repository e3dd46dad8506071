"""Where a run's configuration comes from: the launcher's `WorkerSpec`, or flags and env under plain torchrun.

Under HarmonAIze the node launcher writes a `WorkerSpec` and points `$HZ_RUN_SPEC` at it; the spec is the provider's
word on the checkpoint and control directories, the parallel plan and this node's locality group, so it wins over
flags. The same script must also run under a bare `torchrun` on a laptop (the elastic contract stays
tiny), so without a spec the runtime falls back to `--checkpoint-dir` / `$HZ_CHECKPOINT_DIR` and friends.

This module imports neither torch nor the process group: it is pure configuration, tested without processes.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from harmonaize.job_runtime import ENV_RUN_SPEC, JobRanges, WorkerSpec, read_model
from harmonaize.jobs import ParallelPlan

__all__ = [
    "ENV_CHECKPOINT_DIR",
    "ENV_CONTROL_DIR",
    "ENV_DUMP_DIR",
    "ENV_LOCALITY_GROUP",
    "ENV_PARALLEL_PLAN",
    "ENV_TEST_CRASH_SAVE",
    "LOCAL_JOB",
    "RunConfig",
    "SpecError",
    "load_run_config",
    "runtime_argument_parser",
]

ENV_CHECKPOINT_DIR = "HZ_CHECKPOINT_DIR"
ENV_CONTROL_DIR = "HZ_CONTROL_DIR"
"""Optional under plain torchrun: where to read `directives.json` and write `progress.json`."""
ENV_PARALLEL_PLAN = "HZ_PARALLEL_PLAN"
ENV_LOCALITY_GROUP = "HZ_LOCALITY_GROUP"
ENV_DUMP_DIR = "HZ_RUN_DUMP_DIR"
"""Test hook: rank 0 writes the full model state dict here after every checkpoint load and save."""
ENV_TEST_CRASH_SAVE = "HZ_RUN_TEST_CRASH_SAVE"
"""Test hook, `<step>` or `<step>:<point>`: the highest rank SIGKILLs itself inside the save of that step."""

LOCAL_JOB = "local"
"""Tenant and job id reported in progress when no spec names them."""

_log = logging.getLogger(__name__)


class SpecError(ValueError):
    """The run cannot start: no checkpoint directory, or an unreadable spec."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything the runtime needs to know about its job, whichever way it was told."""

    tenant: str = LOCAL_JOB
    job: str = LOCAL_JOB
    epoch: int = 0
    parallel_plan: ParallelPlan = ParallelPlan.DDP
    locality_group: str = ""
    checkpoint_dir: Path
    control_dir: Path | None = None
    ranges: JobRanges = JobRanges()
    has_spec: bool = False
    dump_dir: Path | None = None
    crash_save: tuple[int, str] | None = None
    store_endpoint: str | None = None
    """The job's provider-hosted store: set for an in-place node (`workloads.elastic`)."""
    standby_until: datetime | None = None
    """A warm joiner started during an open offer: it waits for its first membership until then (and a margin)."""

    @property
    def in_place(self) -> bool:
        """The workers form the job's group themselves and change size without restarting (DDP only)."""
        return self.store_endpoint is not None and self.control_dir is not None

    @classmethod
    def from_spec(cls, spec: WorkerSpec, *, env: Mapping[str, str]) -> RunConfig:
        """The launcher's spec; only the test hooks still come from the environment."""
        return cls(
            tenant=spec.tenant,
            job=spec.job,
            epoch=spec.epoch,
            parallel_plan=spec.parallel_plan,
            locality_group=spec.locality_group,
            checkpoint_dir=spec.checkpoint_dir,
            control_dir=spec.control_dir,
            ranges=spec.ranges,
            has_spec=True,
            dump_dir=_optional_path(env.get(ENV_DUMP_DIR)),
            crash_save=parse_crash_save(env.get(ENV_TEST_CRASH_SAVE)),
            store_endpoint=spec.store_endpoint,
            standby_until=spec.standby_until,
        )


def runtime_argument_parser() -> argparse.ArgumentParser:
    """The runtime's own flags, for a script's parser.

    Use as `argparse.ArgumentParser(parents=[runtime_argument_parser()])`, so the script's `parse_args` accepts them.
    """
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group("HarmonAIze runtime (ignored when $HZ_RUN_SPEC names a spec)")
    group.add_argument("--checkpoint-dir", type=Path, default=None, help=f"checkpoints (or ${ENV_CHECKPOINT_DIR})")
    group.add_argument("--control-dir", type=Path, default=None, help=f"directives/progress (or ${ENV_CONTROL_DIR})")
    group.add_argument(
        "--parallel-plan",
        choices=[plan.value for plan in ParallelPlan],
        default=None,
        help=f"ddp, fsdp or hsdp (or ${ENV_PARALLEL_PLAN}; default ddp)",
    )
    group.add_argument(
        "--locality-group", default=None, help=f"this node's group for HSDP (or ${ENV_LOCALITY_GROUP})"
    )
    return parser


def load_run_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> RunConfig:
    """The run's configuration: the spec named by `$HZ_RUN_SPEC` if set, else the runtime flags in `argv`, else env.

    Unknown flags in `argv` are the script's own and ignored here.
    """
    env = os.environ if env is None else env
    spec_path = env.get(ENV_RUN_SPEC)
    if spec_path:
        try:
            spec = read_model(Path(spec_path), WorkerSpec)
        except ValueError as error:
            raise SpecError(f"{ENV_RUN_SPEC}={spec_path} is not a valid WorkerSpec: {error}") from error
        if spec is None:
            raise SpecError(f"{ENV_RUN_SPEC}={spec_path} does not exist")
        return RunConfig.from_spec(spec, env=env)
    args, _ = runtime_argument_parser().parse_known_args(list(argv) if argv is not None else None)
    checkpoint_dir = args.checkpoint_dir or _optional_path(env.get(ENV_CHECKPOINT_DIR))
    if checkpoint_dir is None:
        raise SpecError(
            f"no checkpoint directory: pass --checkpoint-dir, or set {ENV_CHECKPOINT_DIR} or {ENV_RUN_SPEC}"
        )
    plan = args.parallel_plan or env.get(ENV_PARALLEL_PLAN) or ParallelPlan.DDP.value
    try:
        parallel_plan = ParallelPlan(plan)
    except ValueError as error:
        raise SpecError(f"unknown parallel plan {plan!r}") from error
    return RunConfig(
        parallel_plan=parallel_plan,
        locality_group=args.locality_group if args.locality_group is not None else env.get(ENV_LOCALITY_GROUP, ""),
        checkpoint_dir=checkpoint_dir,
        control_dir=args.control_dir or _optional_path(env.get(ENV_CONTROL_DIR)),
        dump_dir=_optional_path(env.get(ENV_DUMP_DIR)),
        crash_save=parse_crash_save(env.get(ENV_TEST_CRASH_SAVE)),
    )


CRASH_POINTS = ("before-commit", "before-write")


def parse_crash_save(value: str | None) -> tuple[int, str] | None:
    """`"12"` -> (12, "before-commit"); `"12:before-write"` -> (12, "before-write"); unset -> None."""
    if not value:
        return None
    step_text, _, point = value.partition(":")
    point = point or CRASH_POINTS[0]
    if point not in CRASH_POINTS:
        raise SpecError(f"{ENV_TEST_CRASH_SAVE}: unknown crash point {point!r} (known: {', '.join(CRASH_POINTS)})")
    try:
        return int(step_text), point
    except ValueError as error:
        raise SpecError(f"{ENV_TEST_CRASH_SAVE}={value!r}: the step must be an integer") from error


def default_interval(script_default: int, config: RunConfig) -> int:
    """The script's checkpoint interval, clamped into the tenant's declared range when a spec declares one."""
    if not config.has_spec:
        return max(1, script_default)
    allowed = config.ranges.checkpoint_interval_steps
    return min(max(script_default, allowed.min), allowed.max)


def _optional_path(value: str | None) -> Path | None:
    return Path(value) if value else None
