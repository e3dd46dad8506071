"""`harmonaize asyncapi`: write the tenant event interface (AsyncAPI 3.0 + one JSON Schema per type), or check it.

The document is generated from the code (`harmonaize.asyncapi`); a committed copy is what tenants read and what CI
compares. `--check` writes nothing and exits 1 naming every file that differs (changed, missing or stale), so a model
changed without regenerating fails the build with the command that fixes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from harmonaize.asyncapi import SCHEMAS_DIR, generated_files
from harmonaize.cli_errors import EXIT_BAD_INPUT, EXIT_FAILURE, fail

__all__ = ["DEFAULT_OUT", "asyncapi_command", "stale_files", "write_files"]

DEFAULT_OUT = Path("docs/asyncapi")


def asyncapi_command(
    out: Annotated[
        Path, typer.Option("--out", help="Directory of asyncapi.json and schemas/ (created).")
    ] = DEFAULT_OUT,
    check: Annotated[
        bool, typer.Option("--check", help="Write nothing; exit 1 naming the files that differ from the code's.")
    ] = False,
) -> None:
    """Write the tenant event interface as an AsyncAPI 3.0 document and JSON Schemas; --check compares instead."""
    if out.exists() and not out.is_dir():
        fail(f"--out: {out} exists and is not a directory", code=EXIT_BAD_INPUT)
    files = generated_files()
    if check:
        differing = stale_files(out, files)
        if differing:
            again = "harmonaize asyncapi" + ("" if out == DEFAULT_OUT else f" --out {out}")
            fail(f"{out}: out of date, differs from the code: {', '.join(differing)}; run `{again}`", code=EXIT_FAILURE)
        typer.echo(f"{out}: up to date ({len(files)} files)")
        return
    written = write_files(out, files)
    typer.echo(f"{out}: wrote {len(written)} of {len(files)} files" + (f" ({', '.join(written)})" if written else ""))


def stale_files(out: Path, files: dict[str, str]) -> list[str]:
    """Paths (relative to `out`) whose content differs from `files`, that are missing, or that no longer belong."""
    differing = [name for name, text in files.items() if _read(out / name) != text]
    return sorted(differing + _leftovers(out, files))


def write_files(out: Path, files: dict[str, str]) -> list[str]:
    """Write the files that changed and remove schemas of types that are gone; returns the paths touched."""
    touched = []
    for name, text in files.items():
        path = out / name
        if _read(path) != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(text.encode("utf-8"))  # bytes: no newline translation, the same file on every platform
            touched.append(name)
    for name in _leftovers(out, files):
        (out / name).unlink()
        touched.append(name)
    return sorted(touched)


def _leftovers(out: Path, files: dict[str, str]) -> list[str]:
    """Schema files in `out` that the code no longer generates (a type removed or renamed)."""
    folder = out / SCHEMAS_DIR
    if not folder.is_dir():
        return []
    return sorted(f"{SCHEMAS_DIR}/{path.name}" for path in folder.glob("*.json") if f"{SCHEMAS_DIR}/{path.name}"
                  not in files)


def _read(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
