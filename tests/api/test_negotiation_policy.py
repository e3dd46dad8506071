"""The provider's negotiation policy as a pure function: no database, no clock, no app; every rule in a few lines."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from api.services.carbon_forecast import CarbonPoint, TraceReplayForecast, carbon_at, load_trace
from api.services.negotiation_policy import (
    DEFAULT_OFFER_TTL,
    Decline,
    FreeCapacity,
    JobSnapshot,
    Regions,
    Replacement,
    decide,
)
from harmonaize.jobs import ParallelPlan
from harmonaize.negotiation import NegotiationKind, NegotiationTerms, Offer

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
REGIONS = Regions(current="US-CAL-CISO", known=("US-CAL-CISO",))
HOUR = timedelta(hours=1)


def job(**overrides: Any) -> JobSnapshot:
    values: dict[str, Any] = {
        "min_workers": 1, "max_workers": 4, "gpus_per_worker": 1, "desired_workers": 2,
        "parallel_plan": ParallelPlan.DDP,
    }
    values.update(overrides)
    return JobSnapshot(**values)


def room(*free: int, group: str = "rack-a") -> FreeCapacity:
    return FreeCapacity(hosts=tuple((group, gpus) for gpus in free))


def hourly(*values: float, start: datetime = NOW) -> list[CarbonPoint]:
    return [(start + index * HOUR, value) for index, value in enumerate(values)]


FLAT = hourly(*([300.0] * 25))
SOLAR_DIP = hourly(380, 370, 360, 300, 240, 205, 210, 260, 330, 380)


def ask(kind: NegotiationKind = NegotiationKind.SCALE, *, snapshot: JobSnapshot | None = None,
        capacity: FreeCapacity | None = None, carbon: list[CarbonPoint] = FLAT, **terms: Any) -> Offer | Decline:
    return decide(
        kind, NegotiationTerms(**terms), job=snapshot or job(), capacity=capacity or room(), carbon=carbon,
        regions=REGIONS, now=NOW,
    )


def offer(result: Offer | Decline) -> Offer:
    assert isinstance(result, Offer), result
    return result


def declined(result: Offer | Decline) -> str:
    assert isinstance(result, Decline), result
    return result.reason


def test_the_demo_case_ask_4_accept_2_to_4_with_room_for_1_more_is_3_now() -> None:
    result = offer(ask(desired_workers=4, accept_workers={"min": 2, "max": 4}, capacity=room(1)))
    (option,) = result.options
    assert option.workers == 3 and option.start_at is None
    assert "3 workers now" in option.reason and "room for 1 more" in option.reason
    assert result.expires_at == NOW + DEFAULT_OFFER_TTL


def test_desired_is_offered_now_when_it_fits() -> None:
    (option,) = offer(ask(desired_workers=4, capacity=room(1, 1))).options
    assert (option.workers, option.start_at) == (4, None)
    assert option.expected_carbon_g_per_kwh == 300.0


def test_room_outside_the_tenants_range_is_a_decline_with_the_numbers() -> None:
    reason = declined(ask(desired_workers=4, accept_workers={"min": 4, "max": 4}, capacity=room(1)))
    assert "room for 1 more" in reason and "you accept 4" in reason


def test_no_room_at_all_is_a_decline() -> None:
    assert "no room now" in declined(ask(desired_workers=3, accept_workers={"min": 3, "max": 4}, capacity=room(0)))


def test_a_worker_needs_all_its_gpus_on_one_host() -> None:
    """Two hosts with 1 free GPU each: 2 GPUs free in total, but no room for one 2-GPU worker."""
    two_gpu_job = job(gpus_per_worker=2, desired_workers=1)
    assert "no room now" in declined(ask(snapshot=two_gpu_job, desired_workers=2, capacity=room(1, 1)))
    (option,) = offer(ask(snapshot=two_gpu_job, desired_workers=3, capacity=room(1, 3, 2))).options
    assert option.workers == 3


def test_the_jobs_own_range_bounds_every_offer() -> None:
    (option,) = offer(ask(desired_workers=6, accept_workers={"min": 2, "max": 8}, capacity=room(8))).options
    assert option.workers == 4, "max_workers is 4"
    reason = declined(ask(accept_workers={"min": 5, "max": 8}, capacity=room(8)))
    assert "5-8" in reason and "1-4 workers" in reason


def test_scale_down_always_fits_and_is_immediate() -> None:
    (option,) = offer(ask(snapshot=job(desired_workers=4), desired_workers=2, capacity=room(0))).options
    assert (option.workers, option.start_at) == (2, None)
    assert "down from 4" in option.reason


def test_scale_needs_a_count() -> None:
    assert "desired_workers" in declined(ask(parallel_plan="fsdp"))


def test_carbon_cap_above_the_forecast_now_gives_later_options_only() -> None:
    first, cleanest = offer(ask(desired_workers=4, capacity=room(2), carbon=SOLAR_DIP,
                                constraints={"carbon_cap_g_per_kwh": 250})).options
    assert (first.workers, first.start_at, first.expected_carbon_g_per_kwh) == (4, NOW + 4 * HOUR, 240)
    assert "your cap: 250" in first.reason, "the first hour forecast under the cap; nothing now (380 > 250)"
    assert (cleanest.workers, cleanest.start_at, cleanest.expected_carbon_g_per_kwh) == (4, NOW + 5 * HOUR, 205)
    (only,) = offer(ask(desired_workers=4, capacity=room(2), carbon=SOLAR_DIP,
                        constraints={"carbon_cap_g_per_kwh": 220})).options
    assert only.start_at == NOW + 5 * HOUR, "nothing clearly cleaner than 205 follows"


def test_a_later_start_being_acceptable_adds_a_low_carbon_option() -> None:
    result = offer(ask(desired_workers=4, capacity=room(2), carbon=SOLAR_DIP,
                       constraints={"deadline": (NOW + 9 * HOUR).isoformat()}))
    now_option, later = result.options
    assert (now_option.workers, now_option.start_at, now_option.expected_carbon_g_per_kwh) == (4, None, 380)
    assert (later.workers, later.start_at, later.expected_carbon_g_per_kwh) == (4, NOW + 5 * HOUR, 205)
    assert "low-carbon" in later.reason


def test_the_deadline_bounds_the_low_carbon_option() -> None:
    result = offer(ask(desired_workers=4, capacity=room(2), carbon=SOLAR_DIP,
                       constraints={"deadline": (NOW + 5 * HOUR).isoformat()}))
    assert [option.start_at for option in result.options] == [None, NOW + 4 * HOUR]


def test_a_cap_that_is_never_met_before_the_deadline_is_a_decline() -> None:
    reason = declined(ask(desired_workers=3, capacity=room(2), carbon=SOLAR_DIP,
                          constraints={"carbon_cap_g_per_kwh": 100}))
    assert "above your cap of 100" in reason
    assert "no carbon forecast" in declined(ask(desired_workers=3, capacity=room(2), carbon=[],
                                                constraints={"carbon_cap_g_per_kwh": 300}))


def test_start_after_moves_every_option() -> None:
    (option,) = offer(ask(desired_workers=3, capacity=room(2), start_after=(NOW + 2 * HOUR).isoformat())).options
    assert option.start_at == NOW + 2 * HOUR
    assert "a shrink takes effect at once" in declined(
        ask(desired_workers=1, start_after=(NOW + HOUR).isoformat())
    )


def test_a_deadline_before_the_earliest_start_is_a_decline() -> None:
    reason = declined(ask(desired_workers=3, capacity=room(2), constraints={"deadline": NOW.isoformat()}))
    assert "deadline" in reason


def test_repartition_offers_the_plan_and_hsdp_needs_two_workers() -> None:
    (option,) = offer(ask(NegotiationKind.REPARTITION, parallel_plan="hsdp")).options
    assert option.parallel_plan is ParallelPlan.HSDP and option.workers is None
    assert "hsdp needs at least 2" in declined(
        ask(NegotiationKind.REPARTITION, snapshot=job(desired_workers=1), parallel_plan="hsdp")
    )
    assert "already runs ddp" in declined(ask(NegotiationKind.REPARTITION, parallel_plan="ddp"))
    assert "parallel_plan" in declined(ask(NegotiationKind.REPARTITION))


def test_defer_offers_the_lowest_carbon_start_in_the_window() -> None:
    (option,) = offer(ask(NegotiationKind.DEFER, carbon=SOLAR_DIP, start_after=(NOW + HOUR).isoformat(),
                          constraints={"deadline": (NOW + 9 * HOUR).isoformat()})).options
    assert (option.workers, option.start_at, option.expected_carbon_g_per_kwh) == (2, NOW + 5 * HOUR, 205)
    bounded = offer(ask(NegotiationKind.DEFER, carbon=SOLAR_DIP,
                        constraints={"deadline": (NOW + 3 * HOUR).isoformat()}))
    assert bounded.options[0].start_at == NOW + 2 * HOUR


def test_defer_can_place_an_unplaced_job_later_if_it_can_reserve_now() -> None:
    unplaced = job(desired_workers=0)
    (option,) = offer(ask(NegotiationKind.DEFER, snapshot=unplaced, desired_workers=2, capacity=room(2),
                          carbon=SOLAR_DIP)).options
    assert option.workers == 2 and option.start_at == NOW + 5 * HOUR
    assert "no room to reserve" in declined(
        ask(NegotiationKind.DEFER, snapshot=unplaced, desired_workers=2, capacity=room(1), carbon=SOLAR_DIP)
    )
    assert "give desired_workers" in declined(ask(NegotiationKind.DEFER, snapshot=unplaced, carbon=SOLAR_DIP))
    assert "ask for scale" in declined(ask(NegotiationKind.DEFER, desired_workers=1, carbon=SOLAR_DIP))


def test_migrate_region_only_to_a_region_that_exists() -> None:
    assert "does not exist in this cloud (regions: US-CAL-CISO)" in declined(
        ask(NegotiationKind.MIGRATE_REGION, region="DE")
    )
    assert "already runs in US-CAL-CISO" in declined(ask(NegotiationKind.MIGRATE_REGION, region="us-cal-ciso"))
    two = decide(NegotiationKind.MIGRATE_REGION, NegotiationTerms(region="DE"), job=job(), capacity=room(),
                 carbon=FLAT, regions=Regions(current="US-CAL-CISO", known=("US-CAL-CISO", "DE")), now=NOW)
    assert offer(two).options[0].region == "DE"


def test_reasons_never_name_provider_internals() -> None:
    results = [
        ask(desired_workers=4, accept_workers={"min": 2, "max": 4}, capacity=room(1, group="secret-rack-7")),
        ask(desired_workers=4, accept_workers={"min": 4, "max": 4}, capacity=room(1, group="secret-rack-7")),
    ]
    text = " ".join(
        r.reason if isinstance(r, Decline) else " ".join(o.reason for o in r.options) for r in results
    )
    assert "secret-rack-7" not in text


def test_the_shipped_trace_replays_onto_now_faster_than_real_time() -> None:
    trace = load_trace()
    assert trace.zone == "US-CAL-CISO" and len(trace.hourly_g_per_kwh) == 59
    forecast = TraceReplayForecast(anchor=NOW, speedup=3600.0, trace=trace)
    points = forecast.points(NOW + timedelta(seconds=2.5))
    assert points[0] == (NOW + timedelta(seconds=2), trace.hourly_g_per_kwh[2]), "a trace hour lasts 1 s"
    assert [at for at, _ in points] == sorted(at for at, _ in points) and len(points) == 25
    wrapped = forecast.points(NOW + timedelta(seconds=59))
    assert wrapped[0][1] == trace.hourly_g_per_kwh[0], "the trace loops"
    assert carbon_at(points, NOW + timedelta(seconds=3.9)) == trace.hourly_g_per_kwh[3]
    assert carbon_at(points, NOW) is None
    points.clear()  # a caller's list is its own: the answer kept for the rest of the hour is not touched
    again = forecast.points(NOW + timedelta(seconds=2.9))
    assert again[0] == (NOW + timedelta(seconds=2), trace.hourly_g_per_kwh[2]) and len(again) == 25
    assert forecast.points(NOW + timedelta(seconds=3))[0] == (NOW + timedelta(seconds=3), trace.hourly_g_per_kwh[3])


@pytest.mark.parametrize("bad", ["datetime_utc,zone,carbon_intensity_g_per_kwh\n",
                                 "datetime_utc,zone,carbon_intensity_g_per_kwh\n2020-01-01T00:00:00+00:00,A,1\n"
                                 "2020-01-01T02:00:00+00:00,A,1\n"])
def test_a_malformed_trace_is_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        load_trace(bad)


FAILING = "h-" + "a" * 16
GONE = "h-" + "b" * 16


def replacing(workers: int, *, absent: tuple[str, ...] = ()) -> Replacement:
    return Replacement(hosts=(FAILING,), workers=workers, absent=absent)


def test_a_replacement_moves_what_fits_drops_the_rest_inside_the_range_and_says_so() -> None:
    def answer(capacity: FreeCapacity, **terms: Any) -> Offer | Decline:
        return decide(NegotiationKind.SCALE, NegotiationTerms(replace_hosts=(FAILING,), **terms),
                      job=job(desired_workers=3), capacity=capacity, carbon=FLAT, regions=REGIONS, now=NOW,
                      replacing=replacing(2))

    (both,) = offer(answer(room(1, 1), desired_workers=3)).options
    assert (both.workers, both.replaced_hosts) == (3, (FAILING,))
    assert both.reason.startswith(f"3 workers now: 2 workers on {FAILING} move to a healthy host")
    (one,) = offer(answer(room(1), desired_workers=3, accept_workers={"min": 2, "max": 3})).options
    assert one.workers == 2
    assert one.reason == (f"2 workers now: 1 worker on {FAILING} moves to a healthy host, 1 worker on {FAILING} is "
                          "dropped (no healthy host has room to replace it), carbon forecast 300 g/kWh")
    (fewer,) = offer(answer(room(1, 1), desired_workers=1)).options
    assert fewer.workers == 1 and "2 workers on" in fewer.reason and "dropped (you asked for fewer)" in fewer.reason
    assert declined(answer(room(), desired_workers=3)).startswith(
        f"no healthy host has room to replace the job's 2 workers on {FAILING}")


def test_named_hosts_without_workers_only_add_a_note_and_other_kinds_refuse_them() -> None:
    result = decide(NegotiationKind.SCALE, NegotiationTerms(desired_workers=2, replace_hosts=(GONE,)), job=job(),
                    capacity=room(), carbon=FLAT, regions=REGIONS, now=NOW,
                    replacing=Replacement(absent=(GONE,)))
    (option,) = offer(result).options
    assert option.replaced_hosts is None
    assert option.reason == f"2 workers now (already running); no worker of this job runs on {GONE}"
    plan = NegotiationTerms(parallel_plan=ParallelPlan.HSDP, replace_hosts=(GONE,))
    assert declined(ask(NegotiationKind.REPARTITION, **plan.model_dump())) == (
        "replace_hosts is for scale requests, not repartition")
