"""The API's import rules, checked on the source so they cannot erode quietly."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import api

API_DIR = Path(api.__file__).resolve().parent
FORBIDDEN_FOR_API = ("provider_agents", "tenant_controllers")
FORBIDDEN_FOR_SERVICES = ("fastapi", "starlette")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def _offenders(paths: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{path.relative_to(API_DIR.parent)} imports {module}"
        for path in paths
        for module in sorted(_imports(path))
        if module.split(".")[0] in forbidden
    ]


def test_api_imports_neither_agents_nor_controllers() -> None:
    files = sorted(API_DIR.rglob("*.py"))
    assert len(files) > 10
    assert _offenders(files, FORBIDDEN_FOR_API) == []


def test_services_import_no_web_framework() -> None:
    files = sorted((API_DIR / "services").rglob("*.py"))
    assert files
    assert _offenders(files, FORBIDDEN_FOR_SERVICES) == []


def test_modules_stay_small() -> None:
    too_long = {
        str(path.relative_to(API_DIR.parent)): lines
        for path in API_DIR.rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > 400
    }
    assert too_long == {}


def test_the_negotiation_policy_is_a_pure_function_module() -> None:
    """The policy and its forecast import no database or web framework, even indirectly."""
    probe = (
        "import sys, api.services.negotiation_policy, api.services.carbon_forecast;"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'sqlalchemy', 'fastapi', 'starlette', 'nats'}))"
    )
    completed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert completed.stdout.strip() == "[]"
