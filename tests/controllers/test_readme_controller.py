"""The README's "first tenant controller", extracted from README.md as written and run against the real broker and
API: if the README and the SDK drift apart, this fails."""

from __future__ import annotations

import re
from pathlib import Path

from tests.controllers.live_cloud import LiveCloud
from tests.controllers.support import failure
from tests.controllers.test_examples_real import placed, run_script  # noqa: F401
from tests.support import eventually

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_controller() -> str:
    text = README.read_text()
    section = text[text.index("Your first tenant controller"):]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, "the README's first-controller section has no python block"
    code = match.group(1)
    assert len(code.strip().splitlines()) <= 20, "the first controller must stay within 20 lines"
    return code


def readme_job(code: str) -> str:
    match = re.search(r'Controller\(job="([^"]+)"\)', code)
    assert match, "the README controller names its job"
    return match.group(1)


async def test_the_readme_controller_runs_as_shown(placed: LiveCloud, tmp_path: Path) -> None:  # noqa: F811
    code = readme_controller()
    job = readme_job(code)
    await placed.create_job(job, min_workers=1, max_workers=4, initial_workers=2)
    script = tmp_path / "my_controller.py"
    script.write_text(code)

    async def settled() -> bool:
        items = await placed.negotiations(job=job)
        return bool(items) and all(n["state"] != "offered" for n in items)

    async with run_script(placed, script, tmp_path / "state"):
        await placed.publish(failure(job=job))
        await eventually(settled, timeout=15, what="the README controller negotiated")
    [negotiation] = await placed.negotiations(job=job)
    assert (negotiation["kind"], negotiation["state"]) == ("scale", "accepted")
    assert negotiation["terms"]["desired_workers"] == 2
    assert negotiation["terms"]["accept_workers"] == {"min": 1, "max": 2}
