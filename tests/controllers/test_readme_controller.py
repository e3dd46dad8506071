"""The README's "first tenant controller", extracted from README.md as written and run against the real broker and
API: if the README and the SDK drift apart, this fails."""

from __future__ import annotations

import re
from pathlib import Path

from tests.controllers.live_cloud import LiveCloud
from tests.controllers.support import failure
from tests.controllers.test_examples_real import _negotiation_settled, placed, run_script  # noqa: F401
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


async def test_the_readme_controller_runs_as_shown(placed: LiveCloud, tmp_path: Path) -> None:  # noqa: F811
    script = tmp_path / "my_controller.py"
    script.write_text(readme_controller())
    async with run_script(placed, script, tmp_path / "state"):
        await placed.publish(failure())
        await eventually(lambda: _negotiation_settled(placed), timeout=15, what="the README controller negotiated")
    [negotiation] = await placed.negotiations(job="llm-finetune")
    assert (negotiation["kind"], negotiation["state"]) == ("scale", "accepted")
    assert negotiation["terms"]["desired_workers"] == 2
    assert negotiation["terms"]["accept_workers"] == {"min": 1, "max": 2}
