"""Provider directives at step boundaries: read (rank 0), agree (all ranks), decide (pure), apply (the trainer).

Directives are level state with a version (see `harmonaize.job_runtime`). Global rank 0 watches
`<control_dir>/directives.json` with a stat per step (mtime_ns and size; parsing only on change) and, while the file
holds a version newer than the last one handled, puts it into the step's agreement vector (`encode`); every rank
decodes the same values from the all-reduced vector (`decode`) and runs the same pure `decide`, so all ranks apply
or refuse the same version at the same step without a second collective.

`decide` is where the tenant's ranges are enforced a second time: any violation (or compression under a plan that
has no DDP communication hook) refuses the whole version with the reasons; otherwise the version's fields replace the
job's own defaults (a None field means "the job's own choice").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from pydantic import ValidationError

from harmonaize.job_runtime import (
    CONTROL_DIRECTIVES_FILE,
    DirectiveOutcome,
    Directives,
    DirectiveState,
    JobRanges,
    violations,
)
from harmonaize.jobs import Compression, ParallelPlan

__all__ = [
    "DIRECTIVE_FIELDS",
    "DirectiveReader",
    "Settings",
    "decide",
    "decode",
    "effective_settings",
    "encode",
]

_log = logging.getLogger(__name__)

_COMPRESSION_CODES: dict[Compression | None, int] = {None: 0, Compression.NONE: 1, Compression.FP16: 2,
                                                     Compression.POWERSGD: 3}
_CODE_COMPRESSIONS = {code: compression for compression, code in _COMPRESSION_CODES.items()}
MAX_REASONS = 16
MAX_REASON_CHARS = 500
"""What a `DirectiveOutcome` may carry (the contract's limits)."""
DIRECTIVE_FIELDS = 8
"""Length of an encoded directive: present, version, checkpoint_requests, then the five optional settings."""


@dataclass(frozen=True, kw_only=True)
class Settings:
    """The knobs a directive can turn, as in effect for the job."""

    checkpoint_interval_steps: int
    compression: Compression = Compression.NONE
    powersgd_rank: int | None = None
    batch_size: int
    gradient_accumulation: int = 1


def effective_settings(defaults: Settings, directives: Directives | None) -> Settings:
    """`defaults` with every non-None field of `directives` laid over it (the directives were already accepted)."""
    if directives is None:
        return defaults
    compression = directives.compression if directives.compression is not None else defaults.compression
    return Settings(
        checkpoint_interval_steps=directives.checkpoint_interval_steps or defaults.checkpoint_interval_steps,
        compression=compression,
        powersgd_rank=(directives.powersgd_rank or defaults.powersgd_rank)
        if compression is Compression.POWERSGD
        else None,
        batch_size=directives.batch_size or defaults.batch_size,
        gradient_accumulation=directives.gradient_accumulation or defaults.gradient_accumulation,
    )


def plan_violations(plan: ParallelPlan, directives: Directives) -> list[str]:
    """Reasons the plan in use cannot honour `directives` (compression exists only as DDP communication hooks)."""
    if directives.compression not in (None, Compression.NONE) and plan is not ParallelPlan.DDP:
        return [
            f"compression {directives.compression.value!r} needs DDP communication hooks, but the job runs "
            f"{plan.value} (which reduces gradients itself)"
        ]
    return []


def decide(
    defaults: Settings,
    directives: Directives,
    *,
    ranges: JobRanges,
    plan: ParallelPlan,
    step: int,
) -> tuple[Settings | None, DirectiveOutcome]:
    """Apply or refuse one version: (new settings, outcome) when applied, (None, outcome with reasons) when refused."""
    found = violations(ranges, directives) + plan_violations(plan, directives)
    reasons = [reason[:MAX_REASON_CHARS] for reason in found[:MAX_REASONS]]
    if reasons:
        outcome = DirectiveOutcome(
            version=directives.version, status=DirectiveState.REFUSED, step=step, reasons=tuple(reasons)
        )
        return None, outcome
    outcome = DirectiveOutcome(version=directives.version, status=DirectiveState.APPLIED, step=step)
    return effective_settings(defaults, directives), outcome


def encode(directives: Directives | None) -> list[float]:
    """The directive as floats for the step's agreement vector (all zeros = nothing new).

    float64 holds every integer up to 2**53 exactly, which is the contract's MAX_COUNT for every counter.
    """
    if directives is None:
        return [0.0] * DIRECTIVE_FIELDS
    return [
        1.0,
        float(directives.version),
        float(directives.checkpoint_requests),
        float(directives.checkpoint_interval_steps or 0),
        float(_COMPRESSION_CODES[directives.compression]),
        float(directives.powersgd_rank or 0),
        float(directives.batch_size or 0),
        float(directives.gradient_accumulation or 0),
    ]


def decode(values: list[float]) -> Directives | None:
    """Inverse of `encode` (without `reason`, which only rank 0 read and logs)."""
    if len(values) != DIRECTIVE_FIELDS:
        raise ValueError(f"expected {DIRECTIVE_FIELDS} values, got {len(values)}")
    present, version, requests, interval, compression, powersgd_rank, batch_size, accumulation = (
        round(value) for value in values
    )
    if not present:
        return None
    return Directives(
        version=version,
        checkpoint_requests=requests,
        checkpoint_interval_steps=interval or None,
        compression=_CODE_COMPRESSIONS[compression],
        powersgd_rank=powersgd_rank or None,
        batch_size=batch_size or None,
        gradient_accumulation=accumulation or None,
    )


class DirectiveReader:
    """Rank 0's cheap view of `directives.json`: one stat per call, a parse only when mtime or size changed."""

    def __init__(self, control_dir: Path | None) -> None:
        self.path = control_dir / CONTROL_DIRECTIVES_FILE if control_dir is not None else None
        self._signature: tuple[int, int] | None = None
        self._current: Directives | None = None

    def current(self) -> Directives | None:
        """The directives now in the file (None if there is no file); an unreadable file keeps the last good one."""
        if self.path is None:
            return None
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            self._signature, self._current = None, None
            return None
        signature = (stat.st_mtime_ns, stat.st_size)
        if signature != self._signature:
            self._signature = signature
            try:
                self._current = Directives.model_validate_json(self.path.read_bytes())
            except (OSError, ValidationError) as error:
                _log.warning("ignoring unreadable %s: %s", self.path, error)
        return self._current

    def pending(self, handled_version: int) -> Directives | None:
        """The file's directives when their version is newer than `handled_version`, else None."""
        current = self.current()
        if current is None or current.version <= handled_version:
            return None
        if current.reason:
            _log.info("directives v%d from the provider: %s", current.version, current.reason)
        return current


def with_compression_possible(settings: Settings, plan: ParallelPlan) -> tuple[Settings, str]:
    """Settings the plan can run: compression dropped (with the reason) when the plan has no DDP hook."""
    if settings.compression is Compression.NONE or plan is ParallelPlan.DDP:
        return settings, ""
    reason = f"compression {settings.compression.value!r} is not used under {plan.value}"
    return replace(settings, compression=Compression.NONE, powersgd_rank=None), reason
