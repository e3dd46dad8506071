"""`harmonaize eval`: the command's options, checked, handed to `run_evaluation`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from harmonaize.cli_errors import fail

__all__ = ["eval_command"]


def eval_command(
    out: Annotated[Path, typer.Option(help="Where report.md, results.json and the plots go (created).")] = Path(
        "harmonaize-eval"
    ),
    quick: Annotated[
        bool, typer.Option(help="A few minutes: one seed, short windows, fewer events (a smoke test).")
    ] = False,
    seeds: Annotated[
        int | None,
        typer.Option(help="Seeds of the simulation and repeats of each runtime arm (default: 1 with --quick, else "
                          "5 and 3).", min=1, max=50),
    ] = None,
    only: Annotated[
        list[str] | None,
        typer.Option(help="Run only these parts (repeatable): cluster, carbon, congestion, adaptation, reliability."),
    ] = None,
    elastic_json: Annotated[
        Path | None,
        typer.Option(help="bench/bench_elastic.py --json output the simulation takes its per-action costs from "
                          "(default: the one shipped)."),
    ] = None,
    testbed: Annotated[
        bool, typer.Option(help="Run the runtime scenarios on the testbed (network namespaces, shaped links) where "
                                "this machine can build it; loopback otherwise.")
    ] = True,
    uplink_mbit: Annotated[
        float, typer.Option(help="With the testbed: each locality group's uplink rate in Mbit/s.", min=1, max=10_000)
    ] = 50.0,
    seed: Annotated[int, typer.Option(help="The first seed (runs use seed, seed+1, ...).", min=0)] = 0,
) -> None:
    """Measure what cooperation buys: each scenario with the status quo and with HarmonAIze; report, plots, JSON."""
    from harmonaize_cli.evaluation.run import GROUPS, EvalOptions, run_evaluation

    chosen = frozenset(only) if only else frozenset(GROUPS)
    unknown = sorted(chosen - set(GROUPS))
    if unknown:
        fail(f"--only: unknown part(s) {', '.join(unknown)}; parts: {', '.join(GROUPS)}", code=2)
    if elastic_json is not None and not elastic_json.is_file():
        fail(f"--elastic-json: no such file: {elastic_json}", code=2)
    if out.exists() and not out.is_dir():
        fail(f"--out: {out} exists and is not a directory", code=2)
    options = EvalOptions(out=out, quick=quick, seeds=seeds, only=chosen, elastic_json=elastic_json,
                          testbed=testbed, uplink_mbit=uplink_mbit, seed=seed,
                          command="harmonaize eval" + (" --quick" if quick else ""),
                          log=lambda line: typer.echo(line))
    meta = run_evaluation(options)
    typer.echo(f"report: {out / 'report.md'}  results: {out / 'results.json'}  ({meta['duration_s']:.0f} s)")
    if meta["failures"]:
        fail(f"{len(meta['failures'])} part(s) did not finish: {', '.join(meta['failures'])} (see the report)")
