"""The web console in headless Chromium against the real API: a tenant's page shows its jobs with charts and its
negotiations with their rounds, the feed shows an event published before the page loaded (replayed) and one after,
a tenant never sees another tenant's job, and the admin view shows hosts, ledger utilisation and the outbox. Each
test saves a screenshot into its tmp dir; with `HZ_TEST_CONSOLE_DOCS=1` the tenant's also goes to
docs/console/tenant.png (the README's). `cloud` comes before `browser` in each signature, so the browser closes (its
event streams end) before the API stops."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from tests.console.console_cloud import ADMIN_TOKEN, ConsoleCloud, carbon

WAIT_MS = 30_000
"""Generous: the machine running the suite may be busy; every wait is on a condition, never a fixed time."""
CSP = "Content Security Policy"
"""How Chromium's console reports a violation of the page's policy (counted as a page error)."""
DOCS_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "console" / "tenant.png"


async def _signed_in(
    browser: Any, cloud: ConsoleCloud, token: str, *, fragment: str = "", height: int = 900
) -> Any:
    page = await browser.new_page(viewport={"width": 1280, "height": height})
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("console", lambda message: errors.extend([message.text] if CSP in message.text else []))
    page.errors = errors
    await page.goto(f"{cloud.url}/console/{fragment}")
    await page.fill("#token", token)
    await page.click("#sign-in button[type=submit]")
    return page


async def _wait_text(page: Any, selector: str, text: str) -> None:
    try:
        await page.wait_for_function(
            "([selector, text]) => document.querySelector(selector)?.textContent.includes(text)",
            arg=[selector, text], timeout=WAIT_MS,
        )
    except Exception as exc:  # say what the page showed instead
        shown = await page.locator("body").inner_text()
        raise AssertionError(f"{selector} never showed {text!r}; the page shows:\n{shown}") from exc


async def test_the_tenant_page_shows_its_job_with_charts_and_its_negotiations(
    cloud: ConsoleCloud, browser: Any, screenshots: Path
) -> None:
    await cloud.report_progress("acme", "acme-train", epoch=1, step=10, world_size=2, loss=2.31)
    page = await _signed_in(browser, cloud, cloud.tokens["acme"], height=1000)
    await page.wait_for_selector('#jobs tr[data-job="acme-train"]', timeout=WAIT_MS)
    await _wait_text(page, "#who", "tenant acme")

    shapes = [(1, 40, 2, "ddp", 1.92), (2, 80, 3, "ddp", 1.55), (2, 120, 3, "ddp", 1.31), (3, 160, 2, "hsdp", 1.12),
              (3, 200, 2, "hsdp", 0.98)]
    for epoch, step, world_size, plan, loss in shapes:
        await cloud.report_progress("acme", "acme-train", epoch=epoch, step=step, world_size=world_size, plan=plan,
                                    loss=loss)
        await _wait_text(page, '[data-testid="step"] b', str(step))  # the page sampled this report
    await _wait_text(page, '[data-testid="plan"] b', "hsdp")
    await page.wait_for_selector('[data-testid="world-size-chart"] svg[data-points="3"]', timeout=WAIT_MS)
    kept = await cloud.admin.get("/v1/jobs/acme-train/progress", headers=cloud.headers("acme"))
    assert kept.status_code == 200, kept.text
    losses = [sample["loss"] for sample in kept.json() if sample["loss"] is not None]
    assert len(losses) >= 3, f"the first report and each new shape are kept: {losses}"
    await page.wait_for_function(
        "(n) => +document.querySelector('[data-testid=\"loss-chart\"] svg').dataset.points === n", arg=len(losses),
        timeout=WAIT_MS,
    )  # the chart draws what the API kept, not what this tab happened to see
    plans = await page.locator('[data-testid="world-size-chart"] text.plan').all_text_contents()
    assert plans == ["ddp", "ddp", "hsdp"]  # one point per shape the job ran in: 2 ddp, 3 ddp, 2 hsdp

    opened = await cloud.admin.post(
        "/v1/negotiations", json={"job": "acme-train", "kind": "scale", "terms": {"desired_workers": 3}},
        headers={**cloud.headers("acme"), "Idempotency-Key": "console-1"},
    )
    assert opened.status_code == 201, opened.text
    negotiation = opened.json()["id"]
    accepted = await cloud.admin.post(f"/v1/negotiations/{negotiation}/accept", json={"option": 0},
                                      headers=cloud.headers("acme"))
    assert accepted.status_code == 200, accepted.text
    row = f'#negotiations details[data-id="{negotiation}"]'
    await _wait_text(page, f"{row} summary", "accepted")
    await page.click(f"{row} summary")
    await page.wait_for_function(
        "(row) => document.querySelectorAll(`${row} tr.round`).length >= 2", arg=row, timeout=WAIT_MS
    )
    rounds = await page.locator(f"{row} tr.round").all_inner_texts()
    assert "request" in rounds[0] and any("accept" in text for text in rounds[1:]), rounds
    await cloud.publish("acme", "acme-train", carbon(187.0))
    await page.wait_for_selector('[data-testid="feed"] li[data-kind="carbon"]', timeout=WAIT_MS)

    path = screenshots / "tenant.png"
    await page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000
    if os.environ.get("HZ_TEST_CONSOLE_DOCS"):
        DOCS_SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, DOCS_SCREENSHOT)
    assert page.errors == []


async def test_the_live_feed_shows_an_event_published_after_the_page_loaded(
    cloud: ConsoleCloud, browser: Any, screenshots: Path
) -> None:
    before = await cloud.publish("acme", "acme-train", carbon(55.0))  # replayed when the page opens its feed
    page = await _signed_in(browser, cloud, cloud.tokens["acme"])
    await _wait_text(page, '[data-testid="feed-state"]', "live")
    await page.wait_for_selector(f'[data-testid="feed"] li[data-id="{before}"]', timeout=WAIT_MS)

    others = await cloud.publish("globex", "globex-train", carbon(123.0))
    same_job_id = await cloud.publish("globex", "acme-train", carbon(124.0))
    own = await cloud.publish("acme", "acme-train", carbon(321.0))
    item = f'[data-testid="feed"] li[data-id="{own}"]'
    await page.wait_for_selector(item, timeout=WAIT_MS)
    assert "321" in await page.locator(item).inner_text()
    assert await page.locator('[data-testid="feed"] li[data-kind="carbon"]').count() == 2
    feed = await page.locator('[data-testid="feed"]').inner_text()
    assert others not in feed and same_job_id not in feed and "globex" not in feed

    await page.screenshot(path=str(screenshots / "feed.png"), full_page=True)
    assert page.errors == []


async def test_a_tenant_cannot_see_another_tenants_job(cloud: ConsoleCloud, browser: Any, screenshots: Path) -> None:
    await cloud.report_progress("globex", "globex-train", epoch=1, step=7, world_size=2, loss=4.2)
    page = await _signed_in(browser, cloud, cloud.tokens["acme"], fragment="#job=globex-train")
    await page.wait_for_selector('#jobs tr[data-job="acme-train"]', timeout=WAIT_MS)
    await _wait_text(page, "#job h2", "Job acme-train")  # asked for globex's job, shown its own
    assert await page.locator("#jobs tr[data-job]").count() == 1
    assert "globex" not in await page.locator("main").inner_text()

    statuses = await page.evaluate(
        """async (token) => {
            const get = async (path) => (await fetch(path, {headers: {Authorization: `Bearer ${token}`}})).status;
            return [await get("/v1/jobs/globex-train"), await get("/v1/jobs/globex-train/status"),
                    await get("/v1/jobs/globex-train/timeline"), await get("/v1/hosts"), await get("/v1/outbox")];
        }""",
        cloud.tokens["acme"],
    )
    assert statuses == [404, 404, 404, 403, 403]
    await page.screenshot(path=str(screenshots / "isolation.png"), full_page=True)
    assert page.errors == []


async def test_the_admin_view_shows_hosts_ledger_utilisation_and_outbox(
    cloud: ConsoleCloud, browser: Any, screenshots: Path
) -> None:
    page = await _signed_in(browser, cloud, ADMIN_TOKEN)
    await _wait_text(page, "#who", "provider admin")
    for host in ("h1", "h2", "h3"):
        await page.wait_for_selector(f'#hosts tr[data-host="{host}"]', timeout=WAIT_MS)
    await _wait_text(page, '[data-testid="utilisation"] b', "67 %")  # 2 jobs x 2 workers x 2 GPUs of 12
    await _wait_text(page, '[data-testid="gpus"] b', "8 / 12")
    await page.wait_for_selector("#outbox tr[data-outbox]", timeout=WAIT_MS)
    await _wait_text(page, "#outbox", "desired_state")  # the jobs' placements, written with them
    await _wait_text(page, "#outbox", "tenant_event")  # the sweeper's capacity events: its next pass, a refresh later
    assert await page.locator("#allocations tbody tr").count() >= 2
    await page.screenshot(path=str(screenshots / "admin.png"), full_page=True)
    assert page.errors == []
