"""The scheduler's operability surface seen from outside: the dashboard in a real headless
browser (Debian's /usr/bin/chromium driven by playwright), /v1/dashboard/state and /metrics.

The browser test talks to a `DashboardTarget`: a served dashboard plus three levers (ban a
node, get results accepted, stop the server). The `dashboard_target` fixture is the only
thing to swap to run it against the real scheduler process; today it is `FakeScheduler`,
an aiohttp app serving `dashboard_routes` over a state dict the test controls.
"""

from __future__ import annotations

import copy
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from protocol.processes import free_port
from scheduler.dashboard import dashboard_routes
from scheduler.metrics import SchedulerMetrics

CHROMIUM = Path("/usr/bin/chromium")
REPO = Path(__file__).resolve().parents[2]
SCREENSHOT = REPO / "runs" / "dashboard.png"
UPDATE_S = 5.0  # the page polls every second; allow for a loaded 2-core box

needs_chromium = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium); "
    "this test never downloads a browser",
)


class DashboardTarget(Protocol):
    """What the browser test needs from a scheduler (fake or real)."""

    url: str
    """Base URL; the page is at {url}/dashboard."""
    node_ids: list[str]
    """Nodes that are healthy when the test starts (at least two)."""

    async def ban(self, node_id: str) -> None:
        """Make the scheduler ban this node."""

    async def accept(self, n: int) -> None:
        """Make n more results get accepted (totals.accepted grows by n)."""

    async def stop(self) -> None:
        """Stop serving (the page must then show it is disconnected)."""


class FakeScheduler:
    """A dashboard served from a state dict; every poll sees fresh time and throughput."""

    def __init__(self) -> None:
        self.node_ids = ["12D3KooWAlphaNodeHonest000001", "12D3KooWBravoNodeCheater00002"]
        self.polls = 0
        self.state: dict[str, Any] = {
            "pool_id": "demo-pool",
            "scheduler_id": "12D3KooWSchedulerIdentity0000",
            "time": time.time(),
            "weights_version": 3,
            "totals": dict.fromkeys(
                [
                    "submitted",
                    "queued",
                    "in_flight",
                    "accepted",
                    "failed",
                    "verifications",
                    "rejections",
                    "disputes",
                    "banned",
                ],
                0,
            ),
            "nodes": [self._node(i, nid) for i, nid in enumerate(self.node_ids)],
            "recent_verdicts": [],
        }
        self.state["totals"].update(submitted=40, queued=6, in_flight=4, accepted=30)
        self.state["totals"].update(verifications=31, rejections=1)
        self.state["recent_verdicts"] = [
            self._verdict("req-0001", accepted=True),
            # Reasons come from untrusted verifiers: the page must show them as text.
            self._verdict("req-0000", accepted=False, reasons=["<b>logprob mismatch</b>"]),
        ]
        self.url = ""
        self._runner: web.AppRunner | None = None

    def _node(self, i: int, node_id: str) -> dict[str, Any]:
        return {
            "node_id": node_id,
            "operator": f"12D3KooWOperator{i}",
            "state": "healthy",
            "weights_version": 3 - i,
            "reputation": 0.95 - 0.5 * i,
            "in_flight": 2,
            "generated": 20 + i,
            "tokens_per_s": 120.0,
            "verified": 15,
            "accepted": 15 - i,
            "rejected": i,
            "last_seen_s": 0.5,
        }

    def _verdict(self, request_id: str, accepted: bool, **kw: Any) -> dict[str, Any]:
        return {
            "time": time.time(),
            "request_id": request_id,
            "generator_id": self.node_ids[1],
            "verifier_id": self.node_ids[0],
            "accepted": accepted,
            "kind": kw.get("kind", "verify"),
            "reasons": kw.get("reasons", []),
        }

    def get_state(self) -> dict[str, Any]:
        self.polls += 1
        snap = copy.deepcopy(self.state)
        snap["time"] = time.time()
        for n in snap["nodes"]:  # values move between polls
            n["tokens_per_s"] += self.polls % 7
        return snap

    async def start(self) -> None:
        app = web.Application()
        app.add_routes(dashboard_routes(self.get_state))
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"

    async def ban(self, node_id: str) -> None:
        node = next(n for n in self.state["nodes"] if n["node_id"] == node_id)
        node.update(state="banned", reputation=0.2)
        self.state["totals"]["banned"] += 1
        self.state["totals"]["disputes"] += 1
        self.state["recent_verdicts"].insert(
            0, self._verdict("req-0002", False, kind="dispute", reasons=["sampling replay"])
        )

    async def accept(self, n: int) -> None:
        self.state["totals"]["accepted"] += n

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


@pytest.fixture
async def fake_scheduler() -> AsyncIterator[FakeScheduler]:
    fake = FakeScheduler()
    await fake.start()
    yield fake
    await fake.stop()


class RealScheduler:
    """A real pool on loopback: `prime-scheduler serve` and three `prime-node join` processes
    on the tiny model, one of them a verifier that rejects everything (tests/adversaries.py).
    A ban is earned for real: it loses disputes until its reputation is under the threshold."""

    def __init__(self, workdir: Path) -> None:
        from tests.pools import make_pool

        self.pool = make_pool(workdir)
        self.pool.start_scheduler()
        self.pool.join_many(["h0", "h1", "rejecter"], rejecter="reject-all")
        self.url = self.pool.url
        self.node_ids = [self.pool.node_id(n) for n in ("h0", "h1", "rejecter")]
        self.client = self.pool.client()
        self.submitted = 0
        self.seen = 0

    async def _run(self, n: int) -> None:
        from protocol.messages import RolloutSpec, SamplingParams
        from tests.pools import collect

        specs = [
            RolloutSpec(
                request_id=f"d{self.submitted + i}",
                prompt_ids=[5 + i % 30, 9, 11],
                sampling=SamplingParams(max_tokens=8),
            )
            for i in range(n)
        ]
        self.submitted += n
        await self.client.submit(specs)
        results = await collect(self.client, n, 120, after=self.seen)
        self.seen = results[-1].seq

    async def ban(self, node_id: str) -> None:
        assert node_id == self.node_ids[-1], "only the dishonest verifier can be banned for real"
        for _ in range(20):
            if self.pool.node_state(node_id) == "banned":
                return
            await self._run(6)
        raise AssertionError(f"{node_id} was never banned: {self.pool.state()}")

    async def accept(self, n: int) -> None:
        await self._run(n)

    async def stop(self) -> None:
        await self.client.close()
        self.pool.close()


@pytest.fixture(params=["fake", pytest.param("real", marks=pytest.mark.slow)])
async def dashboard_target(request, tmp_path) -> AsyncIterator[DashboardTarget]:
    """The fake (state under the test's control) and the real scheduler process."""
    if request.param == "fake":
        fake = FakeScheduler()
        await fake.start()
        yield fake
        await fake.stop()
    else:
        real = RealScheduler(tmp_path)
        try:
            yield real
        finally:
            await real.stop()


@pytest.fixture
async def page():
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        try:
            yield await browser.new_page(viewport={"width": 1280, "height": 640})
        finally:
            await browser.close()


@needs_chromium
@pytest.mark.timeout(120)
async def test_dashboard_live_updates_in_browser(dashboard_target: DashboardTarget, page, report):
    from playwright.async_api import expect

    target = dashboard_target
    t0 = time.monotonic()
    js_errors: list[str] = []
    page.on("pageerror", lambda exc: js_errors.append(str(exc)))
    page.on("console", lambda m: js_errors.append(m.text) if m.type == "error" else None)
    await page.goto(f"{target.url}/dashboard")
    await page.evaluate("window.__notReloaded = true")
    ms = UPDATE_S * 1000

    def cell(node_id: str, field: str):
        return page.locator(f'tr[data-node-id="{node_id}"] td[data-field="{field}"]')

    # Node rows appear with their state.
    for node_id in target.node_ids:
        await expect(cell(node_id, "state")).to_have_text("healthy", timeout=ms)
    await expect(page.locator("#disconnected")).to_be_hidden()
    banned = int(await page.locator("#total-banned").inner_text())

    # A ban and new accepted results show up without a reload.
    victim = target.node_ids[-1]
    await target.ban(victim)
    t_ban = time.monotonic()
    await expect(cell(victim, "state")).to_have_text("banned", timeout=ms)
    ban_seen_s = time.monotonic() - t_ban
    await page.wait_for_timeout(1500)  # let the page catch up with results released meanwhile
    accepted = int(await page.locator("#total-accepted").inner_text())
    await target.accept(3)
    await expect(page.locator(f'tr[data-node-id="{victim}"]')).to_have_attribute(
        "data-state", "banned"
    )
    await expect(cell(target.node_ids[0], "state")).to_have_text("healthy")
    await expect(page.locator("#total-accepted")).to_have_text(str(accepted + 3), timeout=ms)
    await expect(page.locator("#total-banned")).to_have_text(str(banned + 1), timeout=ms)
    assert await page.evaluate("window.__notReloaded === true"), "the page reloaded"
    assert not js_errors, js_errors

    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    await page.screenshot(path=str(SCREENSHOT), full_page=True)

    # Server gone: a visible banner, without losing the last data shown.
    await target.stop()
    await expect(page.locator("#disconnected")).to_be_visible(timeout=ms)
    await expect(page.locator("body")).to_have_attribute("data-connected", "false")
    await expect(cell(victim, "state")).to_have_text("banned")
    await page.screenshot(path=str(SCREENSHOT.with_name("dashboard-disconnected.png")))
    report(
        "dashboard",
        {"ban_visible_after_s": round(ban_seen_s, 2), "test_s": round(time.monotonic() - t0, 2)},
    )


@needs_chromium
@pytest.mark.timeout(120)
async def test_dashboard_shows_untrusted_strings_as_text(fake_scheduler: FakeScheduler, page):
    from playwright.async_api import expect

    await page.goto(f"{fake_scheduler.url}/dashboard")
    rejected = page.locator('li[data-request-id="req-0000"]')
    await expect(rejected).to_contain_text("<b>logprob mismatch</b>", timeout=UPDATE_S * 1000)
    await expect(rejected).to_have_attribute("data-accepted", "false")
    assert await rejected.locator("b").count() == 0, "a worker's reason was parsed as HTML"


async def test_dashboard_routes_serve_page_and_state() -> None:
    fake = FakeScheduler()
    calls = {"n": 0}

    async def flaky_state() -> dict[str, Any]:  # async state functions work too
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("db is down")
        return fake.get_state()

    app = web.Application()
    app.add_routes(dashboard_routes(flaky_state))
    async with TestClient(TestServer(app)) as client:
        page = await client.get("/dashboard")
        assert page.status == 200 and page.content_type == "text/html"
        html = await page.text()
        assert "v1/dashboard/state" in html
        assert "http://" not in html and "https://" not in html, "no external assets"

        ok = await client.get("/v1/dashboard/state")
        assert ok.status == 200
        body = await ok.json()
        assert body["pool_id"] == "demo-pool" and len(body["nodes"]) == 2

        broken = await client.get("/v1/dashboard/state")
        assert broken.status == 500
        assert "db is down" in (await broken.json())["error"]["message"]
        assert (await client.get("/v1/dashboard/state")).status == 200  # still serving


async def test_metrics_endpoint_exposes_scheduler_metrics() -> None:
    # Two instances in one process must not clash (separate registries).
    m, other = SchedulerMetrics(), SchedulerMetrics()
    m.requests_submitted_total.inc(5)
    m.observe_verdict(accepted=True)
    m.observe_verdict(accepted=False)
    m.observe_dispute("generator")
    m.bans_total.inc()
    m.dispatch_latency_seconds.observe(0.004)
    m.observe_release("accepted", submitted_at=time.time() - 2.0)
    m.queue_depth.set(7)
    m.set_node_states({"healthy": 3, "banned": 1})
    m.set_node_states({"healthy": 2})
    other.bans_total.inc(9)

    async def refresh() -> None:
        m.in_flight.set(4)

    app = web.Application(middlewares=[m.error_middleware()])
    app.add_routes(m.routes(refresh))

    async def boom(_request: web.Request) -> web.Response:
        raise web.HTTPBadRequest(text="bad")

    app.add_routes([web.get("/v1/items/{item_id}", boom)])
    async with TestClient(TestServer(app)) as client:
        assert (await client.get("/v1/items/42")).status == 400
        assert (await client.get("/nowhere")).status == 404
        resp = await client.get("/metrics")
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()

    expected = [
        "prime_scheduler_requests_submitted_total 5.0",
        'prime_scheduler_verifications_total{outcome="accepted"} 1.0',
        'prime_scheduler_verifications_total{outcome="rejected"} 1.0',
        'prime_scheduler_disputes_total{wrong="generator"} 1.0',
        'prime_scheduler_disputes_total{wrong="verifier"} 0.0',
        "prime_scheduler_bans_total 1.0",
        'prime_scheduler_results_released_total{status="accepted"} 1.0',
        'prime_scheduler_dispatch_latency_seconds_bucket{le="0.005"} 1.0',
        'prime_scheduler_end_to_end_seconds_bucket{le="2.5"} 1.0',
        "prime_scheduler_queue_depth 7.0",
        "prime_scheduler_in_flight 4.0",
        'prime_scheduler_nodes{state="healthy"} 2.0',
        'prime_scheduler_nodes{state="banned"} 0.0',
        'prime_scheduler_http_errors_total{route="/v1/items/{item_id}",status="400"} 1.0',
        'prime_scheduler_http_errors_total{route="unmatched",status="404"} 1.0',
        "prime_scheduler_heartbeats_total 0.0",
        "prime_scheduler_dispatch_retries_total 0.0",
    ]
    for line in expected:
        assert line in text, f"missing: {line}"
    body, content_type = other.render()
    assert b"prime_scheduler_bans_total 9.0" in body and content_type.startswith("text/plain")
