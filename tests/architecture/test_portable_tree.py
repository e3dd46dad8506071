"""The repository runs wherever it is cloned: nothing tracked names the machine it was written on.

A shebang naming one checkout's interpreter (`#!/somewhere/.venv/bin/python`) passes on that machine only; helper
scripts are started through `sys.executable` or `/usr/bin/env`, and no tracked file contains the absolute path of the
checkout that runs these tests.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PORTABLE_INTERPRETERS = ("#!/usr/bin/env ", "#!/bin/sh", "#!/bin/bash")


def _tracked_text_files() -> list[Path]:
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=30
        ).stdout.split(b"\0")
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"not a git checkout, so there is no tracked tree to check ({exc})")
    files = []
    for name in filter(None, listed):
        path = ROOT / name.decode()
        try:
            head = path.read_bytes()[:8192]
        except OSError:
            continue
        if b"\0" not in head:
            files.append(path)
    return files


def test_every_shebang_finds_its_interpreter_on_the_path() -> None:
    offenders = []
    for path in _tracked_text_files():
        with path.open("rb") as handle:
            first = handle.readline().decode(errors="replace")
        if first.startswith("#!") and not first.startswith(PORTABLE_INTERPRETERS):
            offenders.append(f"{path.relative_to(ROOT)}: {first.strip()}")
    assert not offenders, "shebangs tied to one machine:\n" + "\n".join(offenders)


def test_no_tracked_file_names_this_checkout() -> None:
    here = str(ROOT)
    offenders = [
        str(path.relative_to(ROOT))
        for path in _tracked_text_files()
        if here in path.read_text(errors="replace")
    ]
    assert not offenders, f"files naming the absolute path {here}: {offenders}"



def test_no_tracked_file_points_outside_the_clone() -> None:
    """A user's clone has only the repository: every document the code or docs cite must be in it. Tests and CI may
    use the workplace's shared tools where present (and skip without them), so only they may name that folder."""
    documents = ("DESIGN" + ".md", "NOTES" + ".md")
    shared = "../" + "shared"
    offenders = []
    for path in _tracked_text_files():
        if path.resolve() == Path(__file__).resolve():
            continue
        text = path.read_text(errors="replace")
        relative = path.relative_to(ROOT)
        offenders += [f"{relative} names {name}" for name in documents if name in text]
        if shared in text and relative.parts[0] not in ("tests", ".ci"):
            offenders.append(f"{relative} names {shared}")
    assert not offenders, "\n".join(offenders)
