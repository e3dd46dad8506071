"""The public testing kit (`tenant_controllers.testing`), used only as a tenant would use it: the README's first
controller, imported from its own file, tested without a cloud; and the README's testing example, run as written."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from harmonaize.events import Failure, FailureKind, Severity
from harmonaize.ranges import WorkerRange
from tenant_controllers import Controller, InvalidRequestError
from tenant_controllers.testing import ControllerHarness, Faults, decline, offer

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
HOST = "h-0123456789abcdef"


def readme_section(heading: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def python_blocks(section: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", section, re.DOTALL)


@pytest.fixture
def my_controller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The README's first controller as the tenant's own `my_controller.py`, imported afresh for each test."""
    [code] = python_blocks(readme_section("Your first tenant controller"))
    folder = tmp_path / "tenant"
    folder.mkdir()
    (folder / "my_controller.py").write_text(code)
    monkeypatch.syspath_prepend(str(folder))
    sys.modules.pop("my_controller", None)
    yield importlib.import_module("my_controller")
    sys.modules.pop("my_controller", None)


def gpu_error() -> Failure:
    return Failure(kind=FailureKind.GPU_ERROR, host=HOST, detected_at=datetime.now(UTC), severity=Severity.CRITICAL)


async def test_the_readme_controller_asks_on_a_failure_and_accepts_the_providers_offer(my_controller: Any) -> None:
    ctl: Controller = my_controller.ctl
    async with ControllerHarness(ctl, workers=2, max_workers=4) as h:
        sent = await h.publish(gpu_error())
        asked = await h.provider.next_negotiation()
        await h.settle()
    assert sent.subject == "my-job" and sent.source == f"/hz/provider/agent/{HOST}", "enveloped as the provider does"
    assert asked.job == "my-job" and asked.kind == "scale" and asked.state == "offered"
    assert asked.terms.desired_workers == 2
    assert asked.terms.accept_workers == WorkerRange(min=1, max=2)
    assert asked.offer is not None and [o.workers for o in asked.offer.options] == [2]
    settled = h.provider.negotiation(asked.id)
    assert settled.state == "accepted" and [r.action for r in settled.rounds] == ["request", "offer", "accept"]
    assert h.job()["desired_workers"] == 2
    assert [r.status for r in h.records] == ["done"]


async def test_scripted_offers_and_declines_are_what_the_controller_sees(my_controller: Any) -> None:
    async with ControllerHarness(my_controller.ctl, workers=3) as h:
        h.provider.answer(offer({"workers": 2, "reason": "one host is gone"}), decline("nothing free"))
        await h.publish(gpu_error())
        first = await h.provider.next_negotiation()
        await h.settle()
        assert h.job()["desired_workers"] == 2
        await h.publish(gpu_error())
        second = await h.provider.next_negotiation()
        await h.settle()
    assert first.offer is not None and first.offer.options[0].reason == "one host is gone"
    assert second.state == "declined" and second.rounds[-1].note == "nothing free"
    assert h.job()["desired_workers"] == 2, "a decline changes nothing"
    assert [r.status for r in h.records] == ["done", "gave_up"], "Declined is permanent: the handler gives up"


async def test_a_duplicate_delivery_is_handled_once(my_controller: Any) -> None:
    async with ControllerHarness(my_controller.ctl) as h:
        await h.publish(gpu_error(), duplicate=True)
        await h.settle()
        assert h.stats.received == 2 and h.stats.duplicates == 1
    assert len(h.provider.negotiations) == 1 and len(h.records) == 1


async def test_a_stream_that_stores_everything_twice_and_loses_acks_still_gets_one_negotiation_per_event(
    my_controller: Any,
) -> None:
    faults = Faults(duplicate=1.0, lose_ack=0.5, seed=7)
    async with ControllerHarness(my_controller.ctl, faults=faults, ack_wait=0.2, capacity=4) as h:
        await h.publish(gpu_error())
        await h.settle()
        await h.publish(gpu_error())
        await h.settle()
        assert h.stats.duplicates >= 2
    assert [n["state"] for n in h.provider.negotiations.values()] == ["accepted", "accepted"]
    assert [r.status for r in h.records] == ["done", "done"]


async def test_an_event_redelivered_after_a_crash_replays_the_negotiation_instead_of_opening_another(
    my_controller: Any,
) -> None:
    async with ControllerHarness(my_controller.ctl, ack_wait=0.3) as h:
        h.provider.slow_next(5.0, path_contains="/accept")  # the crash comes while the accept is in flight
        await h.publish(gpu_error())
        asked = await h.provider.next_negotiation()
        await h.restart(crash=True)
        await h.settle()
    assert len(h.provider.posts()) == 2, "the handler ran again from the top"
    assert list(h.provider.negotiations) == [asked.id], "its request was replayed (same idempotency key)"
    assert h.provider.negotiation(asked.id).state == "accepted"


async def test_transient_api_errors_are_retried_by_the_sdk(my_controller: Any) -> None:
    async with ControllerHarness(my_controller.ctl) as h:
        h.provider.fail_next(2, status=503, path_contains="/v1/negotiations")
        await h.publish(gpu_error())
        await h.settle()
    assert len(h.provider.posts()) == 3 and len(h.provider.negotiations) == 1
    assert [r.status for r in h.records] == ["done"]


async def test_a_lost_reply_is_replayed_not_duplicated(my_controller: Any) -> None:
    async with ControllerHarness(my_controller.ctl) as h:
        h.provider.fail_next(status=0, lose_reply=True, path_contains="/v1/negotiations")
        await h.publish(gpu_error())
        await h.settle()
    assert len(h.provider.posts()) == 2 and len(h.provider.negotiations) == 1
    assert [n["state"] for n in h.provider.negotiations.values()] == ["accepted"]


async def test_a_refused_request_surfaces_as_the_handlers_permanent_error(my_controller: Any) -> None:
    async with ControllerHarness(my_controller.ctl) as h:
        h.provider.fail_next(status=422, path_contains="/v1/negotiations")
        await h.publish(gpu_error())
        await h.settle()
        assert h.stats.gave_up == 1
    [record] = h.records
    assert record.status == "gave_up"
    assert record.outcome.startswith(f"{InvalidRequestError.__name__}: HTTP 422: scripted fault: request refused")
    assert h.job()["desired_workers"] == 2 and len(h.provider.posts()) == 1, "a 422 is never resent"


async def test_events_published_while_disconnected_arrive_after_the_reconnect(my_controller: Any) -> None:
    async with ControllerHarness(my_controller.ctl) as h:
        async with h.disconnected():
            await h.publish(gpu_error())
            await asyncio.sleep(0.2)
            assert h.stats.received == 0 and not h.provider.negotiations
        await h.settle()
    assert [n["state"] for n in h.provider.negotiations.values()] == ["accepted"]


def test_the_kit_imports_nothing_of_the_providers_stack() -> None:
    probe = "import sys, tenant_controllers.testing; print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    loaded = set(subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True,
                                cwd=ROOT).stdout.split())
    assert not loaded & {"fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic", "torch", "api", "provider_agents"}


async def test_the_readme_testing_example_runs_as_written(my_controller: Any) -> None:
    [code] = python_blocks(readme_section("Testing a controller without a cloud"))
    namespace: dict[str, Any] = {"__name__": "test_my_controller"}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - the README's own example
    tests = [fn for name, fn in namespace.items() if name.startswith("test_") and inspect.iscoroutinefunction(fn)]
    assert tests, "the README's testing example defines a test"
    for test in tests:
        await test()
