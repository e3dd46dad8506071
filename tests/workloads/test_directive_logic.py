"""Directive decisions, the agreement encoding and the file watcher, without processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harmonaize.job_runtime import (
    CONTROL_DIRECTIVES_FILE,
    MAX_COUNT,
    MAX_WORLD,
    Directives,
    DirectiveState,
    JobRanges,
)
from harmonaize.jobs import Compression, ParallelPlan
from harmonaize.ranges import IntRange
from workloads.directives import DirectiveReader, Settings, decide, decode, effective_settings, encode

RANGES = JobRanges(
    checkpoint_interval_steps=IntRange(min=10, max=500),
    compression_allowed=(Compression.NONE, Compression.FP16, Compression.POWERSGD),
    powersgd_max_rank=4,
    batch_size=IntRange(min=16, max=128),
    gradient_accumulation=IntRange(min=1, max=8),
)
DEFAULTS = Settings(checkpoint_interval_steps=100, batch_size=32, gradient_accumulation=1)


def test_an_in_range_version_is_applied_over_the_jobs_defaults() -> None:
    directives = Directives(version=3, compression=Compression.POWERSGD, powersgd_rank=2, batch_size=64)
    settings, outcome = decide(DEFAULTS, directives, ranges=RANGES, plan=ParallelPlan.DDP, step=57)
    assert outcome.status is DirectiveState.APPLIED and (outcome.version, outcome.step) == (3, 57)
    assert settings == Settings(
        checkpoint_interval_steps=100,
        compression=Compression.POWERSGD,
        powersgd_rank=2,
        batch_size=64,
        gradient_accumulation=1,
    )


def test_none_fields_return_to_the_jobs_own_choice() -> None:
    settings = effective_settings(DEFAULTS, Directives(version=9, gradient_accumulation=4))
    assert settings == Settings(checkpoint_interval_steps=100, batch_size=32, gradient_accumulation=4)
    assert effective_settings(DEFAULTS, None) == DEFAULTS


def test_any_violation_refuses_the_whole_version_with_every_reason() -> None:
    directives = Directives(
        version=4, checkpoint_requests=1, checkpoint_interval_steps=20, batch_size=4096, powersgd_rank=9,
        compression=Compression.POWERSGD,
    )
    settings, outcome = decide(DEFAULTS, directives, ranges=RANGES, plan=ParallelPlan.DDP, step=5)
    assert settings is None
    assert outcome.status is DirectiveState.REFUSED
    assert any("batch_size 4096" in reason for reason in outcome.reasons)
    assert any("powersgd_rank 9" in reason for reason in outcome.reasons)
    assert len(outcome.reasons) == 2


@pytest.mark.parametrize("plan", [ParallelPlan.FSDP, ParallelPlan.HSDP])
def test_compression_is_refused_under_sharded_plans(plan: ParallelPlan) -> None:
    directives = Directives(version=1, compression=Compression.FP16)
    settings, outcome = decide(DEFAULTS, directives, ranges=RANGES, plan=plan, step=0)
    assert settings is None and outcome.status is DirectiveState.REFUSED
    assert "DDP communication hooks" in outcome.reasons[0] and plan.value in outcome.reasons[0]
    ok, outcome = decide(DEFAULTS, Directives(version=2, compression=Compression.NONE, batch_size=16),
                         ranges=RANGES, plan=plan, step=0)
    assert ok is not None and outcome.status is DirectiveState.APPLIED


def test_a_tenant_without_a_batch_size_range_keeps_its_batch_size() -> None:
    settings, outcome = decide(DEFAULTS, Directives(version=1, batch_size=64), ranges=JobRanges(),
                               plan=ParallelPlan.DDP, step=0)
    assert settings is None and "no batch_size range" in outcome.reasons[0]


optional_count = st.one_of(st.none(), st.integers(min_value=1, max_value=MAX_COUNT))


@given(
    version=st.integers(min_value=0, max_value=MAX_COUNT),
    requests=st.integers(min_value=0, max_value=MAX_COUNT),
    interval=optional_count,
    compression=st.one_of(st.none(), st.sampled_from(list(Compression))),
    rank=st.one_of(st.none(), st.integers(min_value=1, max_value=MAX_WORLD)),
    batch=optional_count,
    accumulation=optional_count,
)
def test_the_agreement_encoding_round_trips(
    version: int, requests: int, interval: int | None, compression: Compression | None, rank: int | None,
    batch: int | None, accumulation: int | None,
) -> None:
    directives = Directives(
        version=version, checkpoint_requests=requests, checkpoint_interval_steps=interval, compression=compression,
        powersgd_rank=rank, batch_size=batch, gradient_accumulation=accumulation,
    )
    assert decode(encode(directives)) == directives


def test_the_agreement_encoding_of_nothing_is_zeros_so_a_sum_carries_rank_0_alone() -> None:
    nothing = encode(None)
    assert set(nothing) == {0.0} and decode(nothing) is None
    mine = encode(Directives(version=7, batch_size=16))
    summed = [a + b + c for a, b, c in zip(mine, nothing, nothing, strict=True)]
    assert decode(summed) == Directives(version=7, batch_size=16)


def test_the_reader_parses_only_on_change_and_reports_newer_versions(tmp_path: Path) -> None:
    reader = DirectiveReader(tmp_path)
    assert reader.current() is None and reader.pending(-1) is None
    path = tmp_path / CONTROL_DIRECTIVES_FILE
    path.write_text(Directives(version=2, batch_size=16).model_dump_json())
    assert reader.pending(-1) == Directives(version=2, batch_size=16)
    assert reader.pending(2) is None, "an already handled version is not pending"
    path.write_text("{not json")
    os.utime(path, ns=(1, 1))
    assert reader.current() == Directives(version=2, batch_size=16), "a broken file keeps the last good version"
    path.write_text(Directives(version=3).model_dump_json())
    os.utime(path, ns=(2, 2))
    assert reader.pending(2) == Directives(version=3)
    path.unlink()
    assert reader.current() is None


def test_no_control_dir_means_no_directives() -> None:
    assert DirectiveReader(None).pending(-1) is None
