"""The cluster simulation: conservation (GPUs, jobs, work), determinism, costs read from the bench's JSON, a static
job's duration against a hand computation from the raw trace, and what a failure costs in each arm."""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest

from harmonaize_cli.evaluation.cluster import plot_cluster, run_cluster_scenarios
from harmonaize_cli.evaluation.cluster.apps import APPS
from harmonaize_cli.evaluation.cluster.arms import TENANT_ONLY, ArmSpec, make_arms
from harmonaize_cli.evaluation.cluster.costs import ActionCosts, default_costs_path, load_costs
from harmonaize_cli.evaluation.cluster.failures import LLAMA3, FailureEvent, FailureSource, event_stream
from harmonaize_cli.evaluation.cluster.large_job import LargeJobSetup, large_job_arms, replay, simulate_large_job
from harmonaize_cli.evaluation.cluster.policies import FifoStatic, JobView, Negotiated
from harmonaize_cli.evaluation.cluster.simulator import SimConfig, SimResult, simulate
from harmonaize_cli.evaluation.cluster.throughput import compact_placement, load_throughput, placement_key
from harmonaize_cli.evaluation.cluster.trace import JobSpec, load_workload, pollux_data
from harmonaize_cli.evaluation.results import COOPERATIVE, STATUS_QUO

INTERVAL = SimConfig().checkpoint_interval_s
NO_FAILURES = SimConfig(failure_multiplier=0.0)


@pytest.fixture(scope="module")
def costs() -> ActionCosts:
    return load_costs()


@pytest.fixture(scope="module")
def arms(costs: ActionCosts) -> dict[str, ArmSpec]:
    return make_arms(costs)


def _factor(costs: ActionCosts) -> float:
    return INTERVAL / (INTERVAL + costs.checkpoint_write_s)


def _hand_rate(app: str, placement: str, gpus: int, batch: int) -> float:
    """Samples/s from placements.csv by hand: the two measured batches around batch/gpus, linear in between."""
    text = (pollux_data() / "throughput" / app / "placements.csv").read_text()
    rows = [(float(r["local_bsz"]), float(r["step_time"])) for r in csv.DictReader(text.splitlines())
            if r["placement"] == placement]
    local = batch / gpus
    (b0, s0), (b1, s1) = max(r for r in rows if r[0] <= local), min(r for r in rows if r[0] >= local)
    step = s0 + (s1 - s0) * (local - b0) / (b1 - b0)
    return gpus * local / step


# -- inputs ---------------------------------------------------------------------------------------------------------


def test_compact_placement_and_its_key() -> None:
    assert compact_placement(6) == (4, 2) and placement_key((4, 2)) == "24"
    assert compact_placement(16) == (4, 4, 4, 4) and placement_key(compact_placement(9)) == "144"
    table = load_throughput("imagenet")
    assert {24, 32, 48, 64} <= set(table.curves) and table.max_gpus == 64
    assert table.samples_per_s(20, 3200) > table.samples_per_s(16, 3200)  # interpolated between 16 and 24


def test_workload_is_the_pollux_file() -> None:
    jobs = load_workload(6)
    assert len(jobs) == 160 and jobs == sorted(jobs, key=lambda j: (j.submit_s, j.name))
    assert {j.app for j in jobs} <= set(APPS)
    with pytest.raises(ValueError):
        load_workload(9)


# -- conservation and determinism -----------------------------------------------------------------------------------


def _check_conserved(result: SimResult, jobs: list[JobSpec]) -> None:
    assert result.max_gpus_in_use <= 64
    assert all(0 <= n <= 64 for _, n in result.usage)
    assert len(result.jobs) == len(jobs)
    for record in result.jobs:
        assert math.isfinite(record.end_s) and record.end_s >= record.start_s >= record.submit_s
        assert record.processed - record.lost == pytest.approx(record.work, rel=1e-9)


@pytest.mark.parametrize("arm_name", [STATUS_QUO, TENANT_ONLY, COOPERATIVE])
def test_every_job_completes_and_gpus_and_work_are_conserved(arms: dict[str, ArmSpec], arm_name: str) -> None:
    jobs = load_workload(6)
    result = simulate(jobs, arms[arm_name], seed=3, config=SimConfig(failure_multiplier=1000.0))
    assert any(f.job is not None for f in result.failures)  # the stress rate interrupts jobs
    _check_conserved(result, jobs)
    assert result.max_gpus_in_use == 64  # the workload fills the cluster


def test_same_seed_same_run_other_seed_other_failures(arms: dict[str, ArmSpec]) -> None:
    jobs = load_workload(6)
    config = SimConfig(failure_multiplier=1000.0)
    first = simulate(jobs, arms[COOPERATIVE], seed=7, config=config)
    again = simulate(jobs, arms[COOPERATIVE], seed=7, config=config)
    other = simulate(jobs, arms[COOPERATIVE], seed=8, config=config)
    assert first.jcts == again.jcts and first.failures == again.failures and first.kg_co2 == again.kg_co2
    assert [f.t_s for f in first.failures] != [f.t_s for f in other.failures]


# -- a single job, by hand ------------------------------------------------------------------------------------------


def test_static_job_takes_its_work_over_the_measured_rate(arms: dict[str, ArmSpec], costs: ActionCosts) -> None:
    job = JobSpec(name="c", submit_s=100.0, app="cifar10", requested=6, batch_size=2048)
    result = simulate([job], arms[STATUS_QUO], seed=0, config=NO_FAILURES)
    rate = _hand_rate("cifar10", "24", 6, 2048) * _factor(costs)
    expected = costs.launch_torchrun_s + 100 * 50_000 / rate
    assert result.jobs[0].jct_s == pytest.approx(expected, rel=1e-9)
    assert result.gpu_hours == pytest.approx(6 * expected / 3600, rel=1e-9)


def _one_job(arm: ArmSpec, event: FailureEvent) -> SimResult:
    """deepspeech2 on 6 GPUs: about an hour at its requested size, so the events below land while it runs."""
    job = JobSpec(name="j", submit_s=0.0, app="deepspeech2", requested=6, batch_size=320)
    return simulate([job], arm, seed=0, failures=[event])


def test_status_quo_loses_exactly_the_work_since_the_last_checkpoint(arms: dict[str, ArmSpec],
                                                                     costs: ActionCosts) -> None:
    arm = arms[STATUS_QUO]
    start = costs.launch_torchrun_s
    rate = _hand_rate("deepspeech2", "24", 6, 320) * _factor(costs)
    baseline = _one_job(arm, FailureEvent(t_s=1e9, planned=False, notice=False, gpu=0.0)).jobs[0]
    for notice in (False, True):  # the status quo has no notice of maintenance either
        event = FailureEvent(t_s=start + INTERVAL + 300.0, planned=notice, notice=notice, gpu=0.0)
        result = _one_job(arm, event)
        (failure,) = result.failures
        assert failure.handling == "restart" and failure.pause_s == costs.recovery_timeout_s
        assert result.jobs[0].lost == pytest.approx(300.0 * rate, rel=1e-9)
        assert result.jobs[0].end_s == pytest.approx(baseline.end_s + 300.0 + costs.recovery_timeout_s, rel=1e-9)
        assert failure.lost_gpu_h == pytest.approx(300.0 * 6 / 3600, rel=1e-9)


def test_cooperative_loses_nothing_with_notice_or_in_place(arms: dict[str, ArmSpec], costs: ActionCosts) -> None:
    arm = arms[COOPERATIVE]
    t = costs.launch_ours_s + INTERVAL + 300.0
    with_notice = _one_job(arm, FailureEvent(t_s=t, planned=True, notice=True, gpu=0.0))
    without = _one_job(arm, FailureEvent(t_s=t, planned=False, notice=False, gpu=0.0))
    assert with_notice.failures[0].handling == "notice" and with_notice.jobs[0].lost == 0.0
    assert without.failures[0].handling == "in_place" and without.jobs[0].lost == 0.0
    assert without.failures[0].pause_s == pytest.approx(costs.recovery_event_s + costs.negotiation_s
                                                        + costs.rescale_ours_s)
    for result in (with_notice, without):
        assert result.jobs[0].processed == pytest.approx(result.jobs[0].work, rel=1e-9)


def test_cooperative_single_gpu_job_falls_back_to_its_checkpoint(arms: dict[str, ArmSpec],
                                                                costs: ActionCosts) -> None:
    job = JobSpec(name="n", submit_s=0.0, app="bert", requested=1, batch_size=12)
    arm = replace(arms[COOPERATIVE], policy=FifoStatic())  # keep it at 1 GPU: no peer holds its state
    t = costs.launch_ours_s + INTERVAL + 120.0
    result = simulate([job], arm, seed=0, failures=[FailureEvent(t_s=t, planned=False, notice=False, gpu=0.0)])
    rate = load_throughput("bert").samples_per_s(1, 12) * _factor(costs)
    assert result.failures[0].handling == "restart"
    assert result.jobs[0].lost == pytest.approx(120.0 * rate, rel=1e-9)


def test_an_idle_gpu_failing_interrupts_nobody(arms: dict[str, ArmSpec]) -> None:
    result = _one_job(arms[STATUS_QUO], FailureEvent(t_s=1000.0, planned=False, notice=False, gpu=0.99))
    assert result.failures[0].job is None and result.jobs[0].interruptions == 0


# -- costs come from the bench's JSON -------------------------------------------------------------------------------


def test_costs_are_read_from_the_bench_json(tmp_path: Path, costs: ActionCosts) -> None:
    body = json.loads(default_costs_path().read_text())
    body["summary"]["kill"]["ours_s"] += 100.0
    body["summary"]["scale_up"]["torchrun_s"] = 77.0
    changed = tmp_path / "elastic.json"
    changed.write_text(json.dumps(body))
    slower = load_costs(changed)
    assert slower.recovery_event_s == pytest.approx(costs.recovery_event_s + 100.0)
    assert slower.rescale_torchrun_s == 77.0 and slower.source.startswith("elastic.json")

    event = FailureEvent(t_s=costs.launch_ours_s + 600.0, planned=False, notice=False, gpu=0.0)
    before = _one_job(make_arms(costs)[COOPERATIVE], event)
    after = _one_job(make_arms(slower)[COOPERATIVE], event)
    assert after.failures[0].pause_s - before.failures[0].pause_s == pytest.approx(100.0)
    assert after.jobs[0].end_s - before.jobs[0].end_s == pytest.approx(100.0, rel=1e-6)


def test_a_bench_json_without_a_needed_row_is_refused(tmp_path: Path) -> None:
    body = json.loads(default_costs_path().read_text())
    del body["summary"]["kill"]
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(body))
    with pytest.raises(ValueError, match="kill"):
        load_costs(broken)


# -- policies -------------------------------------------------------------------------------------------------------


def _view(key: int, requested: int, gpus: int, cap: int = 8) -> JobView:
    return JobView(key=key, submit_s=float(key), requested=requested, cap=cap, gpus=gpus, remaining=1e9,
                   thr=tuple(float(n) for n in range(cap + 1)))


def test_fifo_blocks_at_the_head_of_the_queue() -> None:
    assert FifoStatic().allocate(4, [], [_view(0, 8, 0), _view(1, 1, 0)]) == {}
    assert FifoStatic().allocate(9, [], [_view(0, 8, 0), _view(1, 1, 0)]) == {0: 8, 1: 1}


def test_negotiation_takes_surplus_back_before_going_below_requests() -> None:
    grown, at_request = _view(0, 2, 6), _view(1, 2, 2)
    decision = Negotiated(grow_pause_s=0.1).allocate(0, [grown, at_request], [_view(2, 3, 0)])
    assert decision == {0: 3, 2: 3}
    keep = Negotiated(grow_pause_s=0.1, floor_one=False).allocate(0, [_view(0, 2, 2)], [_view(1, 3, 0)])
    assert keep == {}
    squeeze = Negotiated(grow_pause_s=0.1).allocate(0, [_view(0, 2, 2)], [_view(1, 3, 0)])
    assert squeeze == {0: 1, 1: 1}


# -- O5 at scale ----------------------------------------------------------------------------------------------------


def test_large_job_loses_the_work_since_the_checkpoint_unless_noticed(costs: ActionCosts) -> None:
    setup = LargeJobSetup()
    status_quo, coop, *_ = large_job_arms(costs)
    cycle = setup.checkpoint_interval_s + costs.checkpoint_write_s
    events = [FailureEvent(t_s=3 * cycle + 500.0, planned=True, notice=True, gpu=0.0),
              FailureEvent(t_s=10 * cycle, planned=False, notice=False, gpu=0.0)]
    sq = replay(events, status_quo, setup, costs.checkpoint_write_s, [False, False])
    co = replay(events, coop, setup, costs.checkpoint_write_s, [False, False])
    assert sq.lost_h_notice == [pytest.approx(500.0 / 3600)] and co.lost_h_notice == [0.0]
    since = (10 * cycle - (3 * cycle + 500.0 + coop.notice_pause_s)) % cycle
    assert co.lost_h_no_notice == [pytest.approx(since / 3600)]
    quiet = FailureSource(reference="none", gpus=1, days=1.0, unexpected=0, planned=0)
    (run,) = simulate_large_job([status_quo], costs, seed=0, runs=1, setup=replace(setup, source=quiet))[STATUS_QUO]
    assert run.ettr == pytest.approx(setup.checkpoint_interval_s / cycle)


def test_llama3_rates_and_the_event_stream() -> None:
    assert LLAMA3.mtbf_h(16_384) == pytest.approx(54 * 24 / 466)
    assert 700 < 1 / (LLAMA3.unexpected_per_gpu_h * 64) < 900  # about one failure per 800 h on 64 GPUs
    events = event_stream(LLAMA3, gpus=16_384, horizon_s=54 * 86400.0, rng=random.Random(1))
    assert 380 < len(events) < 560 and all(e.notice == e.planned for e in events)


# -- the scenarios --------------------------------------------------------------------------------------------------


def test_quick_scenarios_and_plots(tmp_path: Path) -> None:
    results = {r.key: r for r in run_cluster_scenarios(quick=True, seeds=1)}
    assert set(results) == {"o3_cluster", "o5_cluster_stress", "o5_large_job"}
    o3 = results["o3_cluster"]
    assert {STATUS_QUO, TENANT_ONLY, COOPERATIVE} <= set(o3.arms)
    assert o3.metrics["avg_jct_s"].ratio() is not None and o3.metrics["avg_jct_s"].target
    assert any("2,446" in note for note in o3.notes) and any("checkpoint_write_s" in note for note in o3.notes)
    assert results["o5_large_job"].metrics["ettr"].target == ">= 0.97"
    json.dumps(o3.as_dict(), allow_nan=False)
    for result in results.values():
        names = plot_cluster(result, tmp_path)
        assert names and all((tmp_path / name).stat().st_size > 0 for name in names)
