"""Which optional install (extra) a command needs, and the one line that says so when it is missing.

Why: `pip install harmonaize` is a tenant's install (the contract, the tenant SDK, the tenant commands); the provider's
stack (`[provider]`) and the training runtime (`[workloads]`) are extras, and the local cloud needs both (`[all]`).
Without this, a provider command run from a tenant's install ends in a traceback about a module its user never asked
for. Only the standard library here, and little of it: `harmonaize_cli.main.main` imports this module on every
invocation.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["missing_extra"]

PROVIDER_MODULES = frozenset(
    {"fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic", "aiosqlite", "asyncpg", "yaml", "prometheus_client"}
)
"""Top-level modules of the `[provider]` extra's packages (the control plane, host agents, fleet monitor)."""

WORKLOADS_MODULES = frozenset({"torch", "numpy"})
"""Top-level modules of the `[workloads]` extra's packages (the training runtime)."""

LOCAL_CLOUD_COMMANDS = frozenset({"up", "demo"})
"""Commands that run the whole local cloud, training jobs included: they need `[all]`. Checked before they start,
because the cloud itself would come up without torch and only its jobs' nodes would fail, later and in a log."""

_STACKS = {
    "all": "the provider stack and the training runtime",
    "provider": "the provider stack",
    "workloads": "the training runtime",
}


def _command(argv: Sequence[str]) -> list[str]:
    """The command's words: the leading arguments before the first option, at most a group and its command."""
    words: list[str] = []
    for arg in argv:
        if arg.startswith("-") or len(words) == 2:
            break
        words.append(arg)
    return words


_PACKAGES = {"yaml": "pyyaml", "prometheus_client": "prometheus-client"}
"""Modules whose package has another name: the line names what pip would install."""


def _line(words: list[str], extra: str, module: str) -> str:
    command = " ".join(words) or "this command"
    package = _PACKAGES.get(module, module)
    return f"'{command}' needs {_STACKS[extra]} ({package} is not installed): pip install 'harmonaize[{extra}]'"


def missing_extra(argv: Sequence[str], error: ModuleNotFoundError | None = None) -> str | None:
    """The line naming the extra to install, or None.

    With `error` (raised while the command ran): None when the missing module belongs to no extra, i.e. a real bug to
    show with its traceback. Without: the check made before a local-cloud command starts (help always passes)."""
    words = _command(argv)
    local_cloud = bool(words) and words[0] in LOCAL_CLOUD_COMMANDS
    if error is None:
        if not local_cloud or "--help" in argv:
            return None
        import importlib.util

        for module in sorted(PROVIDER_MODULES) + sorted(WORKLOADS_MODULES):
            if importlib.util.find_spec(module) is None:
                return _line(words[:1], "all", module)
        return None
    module = (error.name or "").partition(".")[0]
    if module not in PROVIDER_MODULES | WORKLOADS_MODULES:
        return None
    if local_cloud:
        return _line(words[:1], "all", module)
    return _line(words, "workloads" if module in WORKLOADS_MODULES else "provider", module)
