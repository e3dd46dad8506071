"""How every HarmonAIze command reports what stops it: one line on stderr, `<program>: <message>`, and an exit code.

The `harmonaize` command and the parts' own entry points (host agents, fleet monitor, controller runner) answer shell
users the same way: exit code 2 for bad input or configuration (the variable or field named), 1 for a failure at run
time. It lives in the contract so each of them imports it without importing another part.

`fail` raises SystemExit rather than typer's Exit because the contract may not import typer; click lets SystemExit
through unchanged, so a process (or a CliRunner) sees the same code either way. Only the stdlib is imported at module
level, because `harmonaize` imports this on every invocation and keeps its start-up short; pydantic and the settings
are imported inside `settings_or_fail`.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from pydantic import ValidationError

    from harmonaize.settings import Settings

__all__ = ["EXIT_BAD_INPUT", "EXIT_FAILURE", "PROGRAM", "describe_settings_error", "fail", "report", "settings_or_fail"]

PROGRAM = "harmonaize"
EXIT_FAILURE = 1
"""The command ran and something failed (the cloud refused, a step did not complete)."""
EXIT_BAD_INPUT = 2
"""Bad input or configuration: nothing was attempted."""


def report(message: str, *, program: str = PROGRAM) -> None:
    """Write `<program>: <message>` to stderr (flushed: a CliRunner reads its buffer right after the command)."""
    print(f"{program}: {message}", file=sys.stderr, flush=True)


def fail(message: str, code: int = EXIT_FAILURE, *, program: str = PROGRAM) -> NoReturn:
    """Report `message` and exit with `code`."""
    report(message, program=program)
    raise SystemExit(code)


def describe_settings_error(exc: ValidationError) -> str:
    """The first problem of a settings error as the variable a user sets: `bad configuration: HZ_FIELD: msg`."""
    first = exc.errors()[0]
    field = ".".join(str(part) for part in first["loc"]) or "settings"
    return f"bad configuration: HZ_{field.upper()}: {first['msg']}"


def settings_or_fail(**overrides: object) -> Settings:
    """Settings from the environment with command-line overrides (None: not given); a bad value exits 2 naming it."""
    from pydantic import ValidationError

    from harmonaize.settings import Settings

    try:
        settings = Settings()
        values = {key: value for key, value in overrides.items() if value is not None}
        return Settings.model_validate({**settings.model_dump(), **values}) if values else settings
    except ValidationError as exc:
        fail(describe_settings_error(exc), EXIT_BAD_INPUT)
