"""Commands of the `harmonaize` CLI whose code is imported only when they run.

Why: typer builds the click object of every registered command on every invocation, and building one means importing
the module that defines it. The host agent's and the controller runner's command modules import their whole part
(telemetry models, the tenant SDK, httpx, ...), which made `harmonaize version` pay for all of them. A lazy entry is
listed under the name and help text given at registration (a test checks that text against the real command's) and
hands everything else to the real command, imported on first use: parsing, `--help`, errors, completion, invocation.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, ClassVar, cast

import typer
from typer.core import TyperCommand, TyperGroup

if TYPE_CHECKING:
    from typer import _click as click  # typer's own copy of click, whose classes TyperCommand/TyperGroup extend

__all__ = ["lazy_command", "lazy_group", "lazy_entries", "real_command"]


def real_command(target: str, name: str) -> click.Command:
    """The click command `target` ('module:attribute', a command function or a `typer.Typer`) builds under `name`,
    exactly as registering it eagerly would have (no completion options: those belong to the root)."""
    module, _, attribute = target.partition(":")
    value = getattr(importlib.import_module(module), attribute)
    if isinstance(value, typer.Typer):
        return typer.main.get_group(value)
    single = typer.Typer(add_completion=False)
    single.command(name)(value)
    return typer.main.get_command(single)


class _Lazy:
    """Mixin: the real command is built on the first `make_context`, which every use of a command goes through, or
    when its parameters, callback or sub-commands are looked at (tools that walk the command tree). What the parent's
    listing reads (name, help, hidden, deprecated) is the registration's and loads nothing."""

    target: ClassVar[str]
    name: str | None
    _real: click.Command | None = None

    def real(self) -> click.Command:
        if self._real is None:
            self._real = real_command(self.target, self.name or "")
        return self._real

    def make_context(
        self, info_name: str | None, args: list[str], parent: click.Context | None = None, **extra: Any
    ) -> click.Context:
        return self.real().make_context(info_name, args, parent=parent, **extra)

    # click's __init__ assigns these from the placeholder registration; reads go to the real command.
    @property
    def params(self) -> list[click.Parameter]:
        return self.real().params

    @params.setter
    def params(self, _placeholder: list[click.Parameter]) -> None:
        pass

    @property
    def callback(self) -> Any:
        return self.real().callback

    @callback.setter
    def callback(self, _placeholder: Any) -> None:
        pass


class LazyCommand(_Lazy, TyperCommand):
    """A listed command; its options are the real command's."""


class LazyGroup(_Lazy, TyperGroup):
    """A listed group; its sub-commands are the real group's."""

    @property
    def commands(self) -> Any:
        return cast(TyperGroup, self.real()).commands  # a Typer sub-app is built by get_group, a TyperGroup

    @commands.setter
    def commands(self, _placeholder: Any) -> None:
        pass


def _not_loaded() -> None:  # the callback typer needs to register a command; never invoked (make_context delegates)
    raise RuntimeError("a lazy command ran without its real command")


def lazy_command(app: typer.Typer, name: str, target: str, *, help: str) -> None:
    """Register command `name` on `app`, listed with `help`; `target` is 'module:function', imported when it runs."""
    proxy = type(f"LazyCommand_{name}", (LazyCommand,), {"target": target})
    app.command(name, cls=proxy, help=help)(_not_loaded)


def lazy_group(app: typer.Typer, name: str, target: str, *, help: str) -> None:
    """Register group `name` on `app`, listed with `help`; `target` is 'module:typer_app', imported when it runs."""
    proxy = type(f"LazyGroup_{name}", (LazyGroup,), {"target": target})
    app.add_typer(typer.Typer(cls=proxy, help=help), name=name)


def lazy_entries(app: typer.Typer) -> dict[str, _Lazy]:
    """The lazy commands and groups of `app`, by name (for the test that their help matches the real commands')."""
    group = typer.main.get_group(app)
    return {name: command for name, command in group.commands.items() if isinstance(command, _Lazy)}
