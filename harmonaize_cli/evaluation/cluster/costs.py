"""What each action costs a job in the simulation, read from our own elastic benchmark
(`python bench/bench_elastic.py --json PATH`), so the simulated benefit follows the runtime: a faster rescale or
recovery there is a smaller pause here. The shipped figures are `harmonaize_cli/evaluation/data/bench_elastic.json`;
pass another file to simulate another run of the bench.

Every field names the row of the bench's `summary` (or, where the summary has no such figure, the stage of its
`repeats`) it comes from. The bench does not measure a checkpoint's write time: that one is an assumption, stated
in `ASSUMED`, the same for every arm.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from importlib.resources import files
from pathlib import Path
from statistics import median
from typing import Any

__all__ = ["ASSUMED", "ActionCosts", "default_costs_path", "load_costs"]

CHECKPOINT_WRITE_S = 10.0
NEGOTIATION_FALLBACK_S = 5.0
ASSUMED = {
    "checkpoint_write_s": f"{CHECKPOINT_WRITE_S:g} s, assumed (the bench does not time a checkpoint save): the "
                          "blocking part of one save, the same for every arm",
    "negotiation_s": f"{NEGOTIATION_FALLBACK_S:g} s, assumed only when the bench JSON has no repeats with the "
                     "'negotiation opened' stage",
}


@dataclass(frozen=True)
class ActionCosts:
    """Seconds a job stands still (or waits) for each action; `source` says where each came from."""

    rescale_ours_s: float
    """Negotiated grow, in place: accept -> first step at the new size (`scale_up.ours_s`)."""
    rescale_ours_gap_s: float
    """The running ranks' longest step gap around it (`scale_up.ours_gap_s`); reported, the pause uses the above."""
    shrink_ours_s: float
    """Negotiated shrink, in place: accept -> first step at the smaller size (`scale_down.ours_s`)."""
    negotiation_s: float
    """Offer opened -> accepted, the joiner warmed up meanwhile (median of `repeats[].ours.{scale_up,grow*}.stages`
    'negotiation opened (before the accept)'); the job keeps stepping at its old size meanwhile."""
    rescale_torchrun_s: float
    """torchrun: a node added -> first step at the new size, every worker restarted (`scale_up.torchrun_s`)."""
    launch_ours_s: float
    """A job's launch, or restart from its checkpoint, on our runtime (`launch.ours_s`)."""
    launch_torchrun_s: float
    """torchrun's launch when every node is there (`launch_vs_launch_max.torchrun_s`, its favourable case)."""
    recovery_event_s: float
    """Host killed -> first step in place, the provider's event included (`kill.ours_s`)."""
    detection_event_s: float
    """Host killed -> the provider's failure event (`kill.ours_s - kill_after_event_s`)."""
    recovery_after_event_s: float
    """The failure event -> first step (`kill_after_event_s`)."""
    recovery_timeout_s: float
    """torchrun: node killed -> first step again, restarted from the checkpoint (`kill.torchrun_s`): detection
    (sockets close, then keep-alive), re-rendezvous and restart."""
    detection_timeout_s: float | None
    """torchrun: node killed -> its agent sees the change (median of `repeats[].torchrun.kill.stages`
    'torchrun: change seen'); None if absent."""
    hang_torchrun_s: float | None
    """torchrun after a frozen host (`freeze.torchrun_s`): None when it never recovered within the bench's cap."""
    hang_cap_s: float | None
    """The bench's cap on that wait (`args.freeze_cap`)."""
    checkpoint_write_s: float
    """Assumed (ASSUMED): the bench does not time a save."""
    source: str
    """The file read, and its bench run (date, commit)."""
    assumed: tuple[str, ...] = ()
    """Fields the file did not give, set from an assumption (ASSUMED says which value and why)."""

    def describe(self) -> list[str]:
        """One line per figure, for the report's notes."""
        lines = [f"action costs from {self.source}:"]
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name not in ("source", "assumed"):
                lines.append(f"  {f.name} = {value if value is None else f'{value:.3g} s'}")
        return lines


def default_costs_path() -> Path:
    return Path(str(files("harmonaize_cli") / "evaluation" / "data" / "bench_elastic.json"))


def _row(summary: dict[str, Any], row: str, key: str) -> float:
    value = summary.get(row, {}).get(key)
    if not isinstance(value, int | float):
        raise ValueError(f"bench JSON: summary[{row!r}][{key!r}] is {value!r}, a number is needed")
    return float(value)


def _stage_median(body: dict[str, Any], side: str, prefixes: tuple[str, ...], stage: str) -> float | None:
    values: list[float] = []
    for rep in body.get("repeats", []):
        for key, t in rep.get(side, {}).items():
            value = (t.get("stages") or {}).get(stage) if key.startswith(prefixes) and isinstance(t, dict) else None
            if isinstance(value, int | float):
                values.append(abs(float(value)))
    return median(values) if values else None


def load_costs(path: Path | None = None) -> ActionCosts:
    """The costs in `path` (default: the shipped bench_elastic.json)."""
    path = path or default_costs_path()
    body: dict[str, Any] = json.loads(Path(path).read_text())
    s: dict[str, Any] = body["summary"]
    kill_ours = _row(s, "kill", "ours_s")
    after = s.get("kill_after_event_s")
    after_event = float(after) if isinstance(after, int | float) else kill_ours
    freeze = s.get("freeze", {}).get("torchrun_s")
    cap = body.get("args", {}).get("freeze_cap")
    negotiation = _stage_median(body, "ours", ("scale_up", "grow"), "negotiation opened (before the accept)")
    meta = body.get("meta", {})
    return ActionCosts(
        rescale_ours_s=_row(s, "scale_up", "ours_s"),
        rescale_ours_gap_s=_row(s, "scale_up", "ours_gap_s"),
        shrink_ours_s=_row(s, "scale_down", "ours_s"),
        negotiation_s=negotiation if negotiation is not None else NEGOTIATION_FALLBACK_S,
        rescale_torchrun_s=_row(s, "scale_up", "torchrun_s"),
        launch_ours_s=_row(s, "launch", "ours_s"),
        launch_torchrun_s=_row(s, "launch_vs_launch_max", "torchrun_s"),
        recovery_event_s=kill_ours,
        detection_event_s=max(kill_ours - after_event, 0.0),
        recovery_after_event_s=after_event,
        recovery_timeout_s=_row(s, "kill", "torchrun_s"),
        detection_timeout_s=_stage_median(body, "torchrun", ("kill",), "torchrun: change seen"),
        hang_torchrun_s=float(freeze) if isinstance(freeze, int | float) else None,
        hang_cap_s=float(cap) if isinstance(cap, int | float) else None,
        checkpoint_write_s=CHECKPOINT_WRITE_S,
        source=f"{path.name} (bench_elastic run {meta.get('date', '?')}, commit {meta.get('git', '?')})",
        assumed=("checkpoint_write_s",) + (() if negotiation is not None else ("negotiation_s",)),
    )
