"""The contract imports no FastAPI, SQLAlchemy, NATS or torch, so tenants and training scripts can depend on it.

import-linter checks the import graph (`pyproject.toml`, run by CI and by tests/architecture); this checks what
really loads: every module of the package imported in a fresh interpreter, with no exception.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import harmonaize

FORBIDDEN = ("fastapi", "sqlalchemy", "nats", "torch", "starlette", "uvicorn")
_PROBE = """
import importlib, json, sys
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
print(json.dumps(sorted({module.split(".")[0] for module in sys.modules})))
"""


def _contract_modules() -> list[str]:
    modules = ["harmonaize"]
    for info in pkgutil.walk_packages(harmonaize.__path__, prefix="harmonaize."):
        modules.append(info.name)
    return sorted(modules)


def test_discovery_finds_the_contract() -> None:
    modules = _contract_modules()
    for expected in ("harmonaize.events.envelope", "harmonaize.subjects", "harmonaize.timeids", "harmonaize.ids"):
        assert expected in modules


def test_contract_imports_no_provider_stack() -> None:
    modules = _contract_modules()
    completed = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(modules)], capture_output=True, text=True, timeout=60, check=False
    )
    assert completed.returncode == 0, completed.stderr
    top_level = set(json.loads(completed.stdout))
    leaked = sorted(top_level & set(FORBIDDEN))
    assert not leaked, f"contract modules pulled in {leaked}"
