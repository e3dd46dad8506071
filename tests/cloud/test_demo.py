"""`harmonaize demo` end to end, as a user runs it: the story completes and the summary says so, from the system's
own records (the REST history, the job's timeline, the tenant's event feed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(420)


def test_the_demo_tells_the_whole_story(tmp_path: Path) -> None:
    summary_file = tmp_path / "summary.json"
    result = subprocess.run(
        [sys.executable, "-m", "harmonaize_cli", "demo", "--data-dir", str(tmp_path / "cloud"),
         "--summary-json", str(summary_file), "--no-live"],
        capture_output=True, text=True, timeout=400,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    summary = json.loads(summary_file.read_text())
    assert summary["scale_up"] and summary["recovered"] and summary["repartitioned"], summary
    assert summary["history_complete"], summary
    sizes = [(entry["world_size"], entry["parallel_plan"]) for entry in summary["world_sizes"]]
    assert sizes[0] == (2, "ddp")
    assert (3, "ddp") in sizes, "the counter-offer of 3 workers was carried out"
    assert sizes[-1][1] == "hsdp"
    kinds = {(n["kind"], n["state"]) for n in summary["negotiations"]}
    assert ("scale", "accepted") in kinds and ("repartition", "accepted") in kinds
    accepted_scale = next(n for n in summary["negotiations"] if n["kind"] == "scale" and n["state"] == "accepted")
    assert accepted_scale["actions"] == ["tenant:request", "provider:offer", "tenant:accept"]
    assert summary["steps_lost"] is not None and summary["steps_lost"] <= 1, (
        "in place, a failure without warning loses at most the step it interrupted"
    )
    changes = [(entry["change"], entry["parallel_plan"]) for entry in summary["world_sizes"]]
    assert changes[0] == ("fresh", "ddp") and ("in_place", "ddp") in changes, changes
    assert changes[-1] == ("checkpoint", "hsdp"), "a repartition restarts and resumes from the checkpoint"
    assert all(entry["pause_s"] is not None for entry in summary["world_sizes"][1:]), "every change's pause"
    assert summary["world_sizes"][-1]["pause_s"] > max(
        entry["pause_s"] for entry in summary["world_sizes"] if entry["change"] == "in_place"
    ), "a restart from the checkpoint stands the job still longer than any change in place"
    assert summary["moved_before_failure"], "the failure guard's replacement moved the job off the predicted host"
    assert summary["move_steps_lost"] == 0, summary
    assert any("maintenance is scheduled" in d["reason"] for d in summary["directives"]), (
        "the micro loop answered the announced migration on its own, inside the tenant's ranges"
    )
    for kind in ("carbon", "failure", "congestion", "negotiation", "job", "directive"):
        assert summary["events"].get(kind, 0) >= 1, (kind, summary["events"])
    assert summary["duration_s"] < 180
    assert "Demo summary" in result.stdout and "in place, paused" in result.stdout


def test_the_readme_configuration_reference_is_generated_from_settings() -> None:
    from harmonaize_cli.config_reference import README_END, README_START, render_reference

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme[readme.index(README_START) + len(README_START) : readme.index(README_END)]
    assert block.strip() == render_reference().strip(), "regenerate the README's reference with `harmonaize config`"
