"""The layout is the architecture, and import-linter holds it to that (contracts in `pyproject.toml`): the command and
local cloud on top; api, provider_agents, tenant_controllers and workloads independent of each other; then
broker_config; the contract (`harmonaize`) at the bottom, free of the provider's and the training stack.

CI runs `lint-imports` before the suite; these tests run it too, so `./scripts/test` alone catches a broken rule, and
prove that the checker really reads this tree (a planted violation in a copy of it is refused, by name).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "harmonaize", "harmonaize_cli", "broker_config", "api", "provider_agents", "tenant_controllers", "workloads",
)


def _lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    executable = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if executable is None:
        pytest.fail("lint-imports is not installed (import-linter is a test dependency)")
    return subprocess.run(
        [executable, "--config", str(tree / "pyproject.toml"), "--no-cache"],
        cwd=tree, capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
    )


def test_every_import_contract_is_kept() -> None:
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "planted", "broken"),
    [
        ("harmonaize/ids.py", "import api.app\n", "Layers"),
        ("harmonaize/ids.py", "import sqlalchemy\n", "contract pulls in no provider"),
        ("provider_agents/clock.py", "import tenant_controllers\n", "Layers"),
        ("api/services/ledger.py", "import fastapi\n", "Domain services"),
    ],
)
def test_a_planted_violation_is_refused(tmp_path: Path, module: str, planted: str, broken: str) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    shutil.copy(ROOT / "pyproject.toml", tree)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tree / package, ignore=shutil.ignore_patterns("__pycache__"))
    target = tree / module
    target.write_text(target.read_text() + "\n" + planted)
    result = _lint_imports(tree)
    assert result.returncode != 0, result.stdout[-4000:]
    assert f"{broken}" in result.stdout and "BROKEN" in result.stdout, result.stdout[-4000:]
