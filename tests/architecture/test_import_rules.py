"""The layout is the architecture: these rules keep the parts from growing into each other.

* `api`, `provider_agents` and `tenant_controllers` never import each other: they talk over NATS and HTTP only.
* `workloads` (runs inside a tenant's training job) imports none of them either.
* The shared contract is checked separately (tests/contract): it imports no FastAPI, SQLAlchemy, NATS or torch.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("api", "provider_agents", "tenant_controllers", "workloads")
FORBIDDEN: dict[str, set[str]] = {part: set(PARTS) - {part} for part in PARTS}
FORBIDDEN["broker_config"] = set(PARTS)


def imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_part_does_not_import_its_peers(part: str) -> None:
    offenders = {
        f"{path.relative_to(ROOT)} imports {sorted(imported_top_levels(path) & FORBIDDEN[part])}"
        for path in (ROOT / part).rglob("*.py")
        if imported_top_levels(path) & FORBIDDEN[part]
    }
    assert not offenders, "\n".join(sorted(offenders))


def test_the_rule_detects_a_violation(tmp_path: Path) -> None:
    sample = tmp_path / "x.py"
    sample.write_text("from tenant_controllers.sdk import Controller\nimport api.app\n")
    assert imported_top_levels(sample) == {"tenant_controllers", "api"}
