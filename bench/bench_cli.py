#!/usr/bin/env python
"""CLI start-up benchmark: wall time of `harmonaize` commands as a shell user runs them, beside `python -c pass`.

Each sample is one fresh process, timed from spawn to exit by this script (output to a pipe, read and dropped):

* `python -c pass`             the interpreter's own start-up: the floor every command stands on. The baseline.
* `harmonaize --help`          the root help (typer + rich rendering)
* `harmonaize version`
* `harmonaize jobs show J`     a tenant's daily read: four GET requests to the API and a few lines printed
* `harmonaize negotiations list`

The commands run through the console script installed beside this interpreter (`harmonaize`; `python -m
harmonaize_cli.main` where there is none), in an empty working directory (no `.env` read) with a tenant's environment
(HZ_API_URL, HZ_TENANT, HZ_TENANT_TOKEN). The API they talk to is bench_api.py's "ours" server (`--serve ours`:
`api.app.create_app` with the in-memory broker port, uvicorn in its own process, on a fresh migrated SQLite database
and a free loopback port) holding tenant acme with one job and one negotiation.

Every round runs every command once, rotating their order; a command's figure is the median over rounds (min and max
beside it) and `- pass` is the median of its per-round difference to `python -c pass`, so slow drift of the machine's
load cancels. `--baseline-tree DIR` also times the same commands from another source tree put first on PYTHONPATH
(e.g. `git archive <commit> | tar -x -C <dir named after the commit>`; rows are labelled with the directory's name),
in the same rounds, to show a change's effect on the same machine.

Run from the repository root: `python bench/bench_cli.py` (~25 s; ~45-70 s with `--baseline-tree`), `--quick`
(~7-20 s), `--json PATH` for every sample. No timed assertions: it prints figures. Every loop is bounded in count
and in time; only loopback addresses.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _benchutil import (
    clean_nan,
    ensure_repo_on_path,
    git_state,
    loadavg,
    machine_line,
    median,
    package_version,
    table,
    write_json,
)

ensure_repo_on_path()

import httpx  # noqa: E402
from bench_api import ADMIN_TOKEN, ServerProcess, ours_settings  # noqa: E402

JOB = "bench-job"
TARGETS_S = {"--help": 0.3, "version": 0.3, "jobs show": 0.6, "negotiations list": 0.6}
"""Issue 14's targets on the development machine (2 cores), printed beside the figures; not asserted."""
COMMAND_TIMEOUT_S = 60.0


def cli_module(tree: Path) -> str:
    """The module that runs the `harmonaize` command in a source tree, before and after the CLI's own package."""
    return "harmonaize_cli" if (tree / "harmonaize_cli" / "__main__.py").is_file() else "harmonaize.cli"


def harmonaize_command() -> list[str]:
    script = Path(sys.executable).parent / "harmonaize"
    return [str(script)] if script.exists() else [sys.executable, "-m", "harmonaize_cli"]


def commands(harmonaize: list[str]) -> dict[str, list[str]]:
    return {
        "python -c pass": [sys.executable, "-c", "pass"],
        "--help": [*harmonaize, "--help"],
        "version": [*harmonaize, "version"],
        "jobs show": [*harmonaize, "jobs", "show", JOB],
        "negotiations list": [*harmonaize, "negotiations", "list"],
    }


def time_once(argv: list[str], env: dict[str, str], cwd: Path) -> float:
    """Seconds from spawn to exit of one process; raises if it fails (a failing command measures nothing)."""
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, timeout=COMMAND_TIMEOUT_S)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.decode(errors='replace')[-500:]}")
    return elapsed


async def setup_api(url: str) -> str:
    """Tenant acme with job JOB and one negotiation on it; returns the tenant's token."""
    async with httpx.AsyncClient(base_url=url, timeout=30.0) as client:
        created = await client.post("/v1/tenants", json={"id": "acme", "display_name": "Acme"},
                                    headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        if created.status_code != 201:
            raise RuntimeError(f"creating the tenant: {created.status_code} {created.text[:300]}")
        tenant = {"Authorization": f"Bearer {created.json()['api_token']}"}
        job = await client.post("/v1/jobs", json={"id": JOB, "min_workers": 1, "max_workers": 4}, headers=tenant)
        if job.status_code != 201:
            raise RuntimeError(f"creating the job: {job.status_code} {job.text[:300]}")
        opened = await client.post(
            "/v1/negotiations", headers={**tenant, "Idempotency-Key": "bench-cli"},
            json={"job": JOB, "kind": "scale", "terms": {"desired_workers": 2}},
        )
        if opened.status_code != 201:
            raise RuntimeError(f"opening a negotiation: {opened.status_code} {opened.text[:300]}")
        return str(created.json()["api_token"])


async def start_api(data_dir: Path) -> tuple[ServerProcess, str]:
    from api.migrate import upgrade_async

    server = ServerProcess("ours", data_dir, "")
    await upgrade_async(ours_settings(data_dir, ""))
    server.start()
    try:
        await server.wait_ready("/v1/healthz")
        return server, await setup_api(server.url)
    except BaseException:
        server.stop()
        raise


def measure(args: argparse.Namespace, env: dict[str, str], cwd: Path) -> dict[str, dict[str, list[float]]]:
    """{tree: {command: [seconds per round]}}; every round runs every (tree, command) once, order rotated."""
    trees = {"this tree": env}
    tree_argvs = {"this tree": commands(harmonaize_command())}
    if args.baseline_tree:
        tree = args.baseline_tree.resolve()
        name = f"baseline {tree.name}"
        trees[name] = {**env, "PYTHONPATH": str(tree)}
        # the installed entry point imports this tree's module; the baseline runs its own CLI module
        tree_argvs[name] = commands([sys.executable, "-m", cli_module(tree)])
    argvs = tree_argvs["this tree"]
    cells = [(tree, name) for tree in trees for name in argvs if not (tree != "this tree" and name == "python -c pass")]
    samples: dict[str, dict[str, list[float]]] = {tree: {} for tree in trees}
    for tree, name in cells:  # warm-up, not recorded: page cache, .pyc files, the API's first requests
        time_once(tree_argvs[tree][name], trees[tree], cwd)
    deadline = time.monotonic() + args.cap
    for r in range(args.rounds):
        if time.monotonic() >= deadline:
            print(f"  stopped after {r} rounds: --cap {args.cap:.0f} s reached", file=sys.stderr)
            break
        for tree, name in cells[r % len(cells):] + cells[: r % len(cells)]:
            samples[tree].setdefault(name, []).append(time_once(tree_argvs[tree][name], trees[tree], cwd))
        if not args.json_only:
            print(f"  round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    return samples


def summarise(samples: dict[str, dict[str, list[float]]]) -> list[dict[str, Any]]:
    floor = samples["this tree"]["python -c pass"]
    rows = []
    for tree, by_command in samples.items():
        for name, values in by_command.items():
            rows.append({
                "tree": tree,
                "command": name,
                "median_s": median(values),
                "min_s": min(values),
                "max_s": max(values),
                "over_pass_s": (median(v - p for v, p in zip(values, floor, strict=True))
                                if name != "python -c pass" else None),
                "target_s": TARGETS_S.get(name),
                "rounds": len(values),
            })
    return rows


def render(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    def s(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    lines = [
        f"CLI start-up  {meta['date']}  git {meta['git']}  load {meta['loadavg']}",
        f"{meta['machine']}; typer {meta['typer']}, rich {meta['rich']}; commands via {meta['harmonaize']}",
        "",
        table(
            ["command", "tree", "median s", "min s", "max s", "- pass s", "target s"],
            [[r["command"], r["tree"], s(r["median_s"]), s(r["min_s"]), s(r["max_s"]), s(r["over_pass_s"]),
              s(r["target_s"])] for r in rows],
        ),
        "",
        "- pass: the median of each round's difference to `python -c pass` (what the command adds to a bare "
        "interpreter).",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5 rounds, ~10 s")
    ap.add_argument("--rounds", type=int, help="rounds; each runs every command once (default 15, quick 5)")
    ap.add_argument("--cap", type=float, default=300.0, help="seconds cap on the rounds (default 300)")
    ap.add_argument("--baseline-tree", type=Path, metavar="DIR",
                    help="also time the commands from this source tree (first on PYTHONPATH), e.g. a git worktree "
                         "of an older commit")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (database, server log)")
    ap.add_argument("--json", metavar="PATH", help="also write every sample as JSON to PATH ('-': stdout, no table)")
    args = ap.parse_args(argv)
    if args.rounds is None:
        args.rounds = 5 if args.quick else 15
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.baseline_tree is not None and not any(
        (args.baseline_tree / path).is_file() for path in ("harmonaize_cli/__main__.py", "harmonaize/cli.py")
    ):
        ap.error(f"--baseline-tree {args.baseline_tree}: neither harmonaize_cli/ nor harmonaize/cli.py there")
    args.json_only = args.json == "-"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="hz-bench-cli-"))
    cwd = workdir / "cwd"
    cwd.mkdir()
    meta: dict[str, Any] = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_line(),
        "git": git_state(),
        "loadavg": loadavg(),
        "typer": package_version("typer"),
        "rich": package_version("rich"),
        "harmonaize": " ".join(Path(part).name for part in harmonaize_command()),
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
    }
    started = time.monotonic()
    server: ServerProcess | None = None
    try:
        server, token = asyncio.run(asyncio.wait_for(start_api(workdir), timeout=120))
        base = {k: v for k, v in os.environ.items() if not k.startswith("HZ_") and k != "PYTHONPATH"}
        env = {**base, "HZ_API_URL": server.url, "HZ_TENANT": "acme", "HZ_TENANT_TOKEN": token,
               "COLUMNS": "120", "TERM": "dumb"}
        samples = measure(args, env, cwd)
    finally:
        if server is not None:
            server.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    meta["seconds"] = round(time.monotonic() - started, 1)
    rows = summarise(samples)
    if not args.json_only:
        print(render(rows, meta))
        print(f"\n(total {meta['seconds']} s)")
    if args.json:
        payload = {"meta": meta, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                   "results": rows, "samples": samples}
        write_json(args.json, clean_nan(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
