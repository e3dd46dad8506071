"""O6 on the real runtime: a job with a fixed amount of work and a deadline, under the real CAISO carbon trace
replayed fast, carbon-blind against carbon-aware.

Both arms run **at the same time** in the same cloud, so they see the same grid hour by hour:
- `status_quo`: the job is placed at once at a fixed 2 workers and runs until its work is done; no carbon signal.
- `cooperative`: the tenant asks for 4 workers with a carbon cap and a deadline (a `scale` negotiation with
  `carbon_cap_g_per_kwh` and `deadline`); the provider offers the first start whose forecast is under the cap (a
  deferred placement: the workers start at `start_at`), and the tenant accepts. From then on the shipped example
  `carbon_aware_scaler` runs as the job's controller: down to 1 worker when the grid is dirtier than HIGH, back up
  below LOW. If no start under the cap meets the deadline, the tenant takes 4 workers now.
Work is counted in samples from the jobs' own progress reports (steps x batch x accumulation x world size); each
job is released the moment its work is done. Energy and carbon follow `evaluation.energy`: each of a job's GPUs
draws TDP while the job steps and idle power while it is running but not stepping (a rescale, a recovery), times
the trace's intensity at that moment. A job's launch (before its first step) is left out of both arms.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from harmonaize_cli.evaluation.energy import H100_SXM
from harmonaize_cli.evaluation.results import COOPERATIVE, STATUS_QUO, ScenarioResult
from harmonaize_cli.evaluation.runtime.cloud import EvalContext, carbon_speedup
from provider_agents.telemetry.carbon import curve_from_spec
from provider_agents.telemetry.scenario import load_scenario

__all__ = ["KEY", "carbon_scenario", "plot_carbon"]

KEY = "o6_carbon"
REGION = "US-CAL-CISO"
LOW, HIGH = 250.0, 300.0
"""The tenant's thresholds (g/kWh), fixed for the trace: its solar dips run 205-260, its nights 340-380."""
SCALER = Path(str(importlib.resources.files("tenant_controllers") / "examples" / "carbon_aware_scaler.py"))
STATUS_QUO_WORKERS, MAX_WORKERS = 2, 4
WORK_HOURS = 10.0
"""The work: what the status quo's 2 workers do in about this many trace hours (at the nominal step time)."""
DEADLINE_HOURS = 30.0
NOMINAL_STEP_S = 0.22
STEP_DELAY_MS = 200.0
BATCH = 32
POLL_S = 0.5


@dataclass
class _Track:
    """One arm's job: samples done, energy and carbon drawn, sampled every POLL_S from its progress reports."""

    arm: str
    job: str
    work: int
    samples: float = 0.0
    joules: float = 0.0
    grams: float = 0.0
    busy_s: float = 0.0
    last_step: int | None = None
    last_at: float | None = None
    finished_at: float | None = None
    series: list[tuple[float, int, float]] = field(default_factory=list)
    """(seconds from the start, world size stepping (0: not), intensity)."""

    def observe(self, now: float, since_start: float, status: dict[str, Any], g_per_kwh: float) -> None:
        progress = status.get("progress")
        world, stepping = 0, False
        if progress is not None:
            step = int(progress["step"])
            world = int(progress["world_size"])
            per_step = int(progress["batch_size"]) * int(progress["gradient_accumulation"]) * world
            if self.last_step is not None and step > self.last_step:
                self.samples += (step - self.last_step) * per_step
                stepping = True
            self.last_step = step
        if self.last_at is not None and self.finished_at is None:
            seconds = now - self.last_at
            running = status.get("phase") in ("running", "restarting")
            gpus = world if stepping else (int(status.get("desired_workers", 0)) if running else 0)
            joules = H100_SXM.joules(gpus, 1.0 if stepping else 0.0, seconds)
            self.joules += joules
            self.grams += H100_SXM.grams_co2(joules, g_per_kwh)
            self.busy_s += seconds if stepping else 0.0
        self.last_at = now
        self.series.append((since_start, world if stepping else 0, g_per_kwh))


def _spec(job: str, arm: str) -> dict[str, Any]:
    fixed = arm == STATUS_QUO
    return {
        "id": job, "min_workers": STATUS_QUO_WORKERS if fixed else 1,
        "max_workers": STATUS_QUO_WORKERS if fixed else MAX_WORKERS,
        **({"initial_workers": STATUS_QUO_WORKERS} if fixed else {}),
        "gpus_per_worker": 1,
        "entrypoint": ["-m", "workloads.examples.mlp", "--step-delay-ms", str(STEP_DELAY_MS), "--batch-size",
                       str(BATCH), "--log-every", "50"],
    }


async def _defer(ctx: EvalContext, job: str, deadline: datetime, hour_s: float) -> str:
    """The cooperative tenant's one negotiation: 4 workers, first start under LOW that still finishes by the
    deadline; else 4 workers now. Returns what was agreed, in words."""
    at_four_s = WORK_HOURS * hour_s * STATUS_QUO_WORKERS / MAX_WORKERS
    latest_start = deadline - timedelta(seconds=at_four_s * 1.5)
    terms: dict[str, Any] = {"desired_workers": MAX_WORKERS, "accept_workers": {"min": 2, "max": MAX_WORKERS},
                             "constraints": {"carbon_cap_g_per_kwh": LOW,
                                             "deadline": latest_start.isoformat().replace("+00:00", "Z")}}
    for attempt in (terms, {"desired_workers": MAX_WORKERS, "accept_workers": {"min": 2, "max": MAX_WORKERS}}):
        opened = await ctx.probe.tenant.post(
            "/v1/negotiations", json={"job": job, "kind": "scale", "terms": attempt},
            headers={"Idempotency-Key": str(uuid.uuid4())})
        if opened.status_code != 201:
            raise RuntimeError(f"{job}: negotiation refused: {opened.status_code} {opened.text}")
        body = opened.json()
        if body["state"] != "offered":
            continue  # declined: no start under the cap before the deadline; ask again without the cap
        offer = body["offer"]["options"][0]
        accepted = await ctx.probe.tenant.post(f"/v1/negotiations/{body['id']}/accept", json={"option": 0})
        if accepted.status_code != 200:
            raise RuntimeError(f"{job}: accept failed: {accepted.status_code} {accepted.text}")
        return _agreed_text(offer, hour_s)
    raise RuntimeError(f"{job}: the provider declined 4 workers even without a carbon cap")


def _agreed_text(option: dict[str, Any], hour_s: float) -> str:
    """The accepted option in words, its start as trace hours from now."""
    start = option.get("start_at")
    when = "now" if start is None else (
        f"{(datetime.fromisoformat(start.replace('Z', '+00:00')) - datetime.now(UTC)).total_seconds() / hour_s:.1f}"
        " trace hours later")
    return f"{option.get('workers')} workers {when} (forecast {option.get('expected_carbon_g_per_kwh')} g/kWh)"


async def _one_run(ctx: EvalContext, result: ScenarioResult, run: int) -> None:
    speed = carbon_speedup(ctx.quick)
    hour_s = 3600.0 / speed
    scenario = load_scenario(ctx.info.data_dir / "scenario.yaml")
    assert scenario.start is not None, "the local cloud pins its scenario's start"
    anchor = scenario.start
    curve = curve_from_spec(REGION, scenario.carbon_for(REGION))

    def intensity(at: datetime) -> float:
        return float(curve.reading(start=anchor, offset_s=(at - anchor).total_seconds()).g_per_kwh)

    work = round(WORK_HOURS * hour_s / NOMINAL_STEP_S) * BATCH * STATUS_QUO_WORKERS
    begin = datetime.now(UTC)
    started = time.monotonic()
    deadline = begin + timedelta(seconds=DEADLINE_HOURS * hour_s)
    suffix = f"{run}-{uuid.uuid4().hex[:4]}"
    tracks = {arm: _Track(arm=arm, job=f"carbon-{arm.replace('_', '-')}-{suffix}", work=work)
              for arm in (STATUS_QUO, COOPERATIVE)}
    for arm, track in tracks.items():
        await ctx.probe.submit(_spec(track.job, arm))
    agreed = await _defer(ctx, tracks[COOPERATIVE].job, deadline, hour_s)
    controller = ctx.probe.start_controller(SCALER, tracks[COOPERATIVE].job, env={
        "HZ_CARBON_LOW": f"{LOW:g}", "HZ_CARBON_HIGH": f"{HIGH:g}"})
    hard_stop = started + DEADLINE_HOURS * hour_s * 1.5
    try:
        while any(t.finished_at is None for t in tracks.values()):
            now = time.monotonic()
            if now > hard_stop:
                break
            g = intensity(datetime.now(UTC))
            for track in tracks.values():
                if track.finished_at is not None:
                    continue
                status = await ctx.probe.job_status(track.job)
                track.observe(now, now - started, status, g)
                if track.samples >= track.work:
                    track.finished_at = now
                    await ctx.probe.release(track.job)
            await asyncio.sleep(POLL_S)  # a sampling period: the measurement, not a wait for a condition
    finally:
        await ctx.probe.stop_controller(controller)
        for track in tracks.values():
            if track.finished_at is None:
                await ctx.probe.release(track.job)
    first_hour = (begin - anchor).total_seconds() / hour_s
    result.notes.append(f"Run {run + 1}: trace hours {first_hour:.1f}-{first_hour + DEADLINE_HOURS:.1f} "
                        f"(deadline); the cooperative tenant agreed {agreed}.")
    hours = range(int(first_hour), int(first_hour + DEADLINE_HOURS) + 2)
    result.series.setdefault("curves", []).append(
        {"run": run, "points": [(h, intensity(anchor + timedelta(seconds=h * hour_s))) for h in hours]})
    for arm, track in tracks.items():
        done_h = None if track.finished_at is None else (track.finished_at - started) / hour_s
        per_k = track.grams / (track.samples / 1000) if track.samples else float("nan")
        result.metric("g_co2_per_1k_samples", unit="gCO2", better="lower", target="<= 0.6x").add(arm, per_k)
        result.metric("deadline_met", unit="fraction", better="higher", target="1 in both arms").add(
            arm, 1.0 if done_h is not None and done_h <= DEADLINE_HOURS else 0.0)
        result.metric("completion_trace_hours", unit="h", better="lower").add(
            arm, float("nan") if done_h is None else done_h)
        result.metric("energy_wh_per_1k_samples", unit="Wh", better="lower").add(
            arm, track.joules / 3600 / (track.samples / 1000) if track.samples else float("nan"))
        result.series.setdefault("runs", []).append(
            {"run": run, "arm": arm, "hour_s": hour_s, "first_hour": first_hour, "points": track.series})


async def carbon_scenario(ctx: EvalContext) -> ScenarioResult:
    speed = carbon_speedup(ctx.quick)
    result = ScenarioResult(
        key=KEY, title="O6 carbon: a job with a deadline under a real grid's carbon curve",
        how=(f"Real runtime, {ctx.info.network}. The CAISO trace (Electricity Maps via CarbonScaler, hourly "
             f"gCO2eq/kWh) replayed {speed:g}x faster than real time (a trace hour every {3600 / speed:g} s), by the "
             f"agents and by the provider's forecast alike (the forecast is the trace's own future: perfect). One "
             f"job per arm, both at once: the example MLP, {BATCH} samples per worker per step, work = what 2 "
             f"workers do in ~{WORK_HOURS:g} trace hours, deadline {DEADLINE_HOURS:g} trace hours after submission. "
             f"Energy: {H100_SXM.describe()}; one GPU per worker."),
        arms={
            STATUS_QUO: f"carbon-blind: {STATUS_QUO_WORKERS} workers placed at once, kept until the work is done.",
            COOPERATIVE: (f"carbon-aware: a scale negotiation for {MAX_WORKERS} workers with a cap of {LOW:g} g/kWh "
                          "and a deadline, so the provider defers the start to the first clean enough hour; then "
                          f"the shipped carbon_aware_scaler (1 worker above {HIGH:g}, {MAX_WORKERS} below {LOW:g})."),
        },
    )
    for run in range(ctx.repeats):
        await _one_run(ctx, result, run)
    result.seeds = ctx.repeats
    result.notes.append("Repeats start at later trace hours (the replay runs on): each sees its own window of the "
                        "curve, which is where the spread comes from; both arms of a repeat see the same window.")
    return result


def plot_carbon(result: ScenarioResult, out_dir: Path) -> list[str]:
    """The first run: each arm's GPUs stepping over trace hours, over the carbon intensity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result.series.get("runs", []) if r["run"] == 0]
    if not runs:
        return []
    fig, ax = plt.subplots(figsize=(8, 4))
    carbon_ax = ax.twinx()
    for entry in runs:
        hours = [entry["first_hour"] + t / entry["hour_s"] for t, _, _ in entry["points"]]
        ax.step(hours, [w for _, w, _ in entry["points"]], where="post", label=entry["arm"].replace("_", " "))
    curve = next(c["points"] for c in result.series.get("curves", []) if c["run"] == 0)
    carbon_ax.step([h for h, _ in curve], [g for _, g in curve], where="post", color="grey", linestyle=":",
                   label="gCO2/kWh")
    carbon_ax.axhline(LOW, color="green", linewidth=0.6)
    carbon_ax.axhline(HIGH, color="red", linewidth=0.6)
    ax.axvline(runs[0]["first_hour"] + DEADLINE_HOURS, color="black", linestyle="--", linewidth=0.8)
    ax.set_xlabel("trace hour (CAISO, 2020-01-01 00:00 UTC = 0)")
    ax.set_ylabel("workers stepping")
    carbon_ax.set_ylabel("gCO2eq/kWh")
    ax.legend(loc="upper left")
    carbon_ax.legend(loc="upper right")
    ax.set_title("Carbon-blind vs carbon-aware: when each arm's work ran (dashed: deadline)")
    fig.tight_layout()
    name = f"{result.key}.png"
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    return [name]
