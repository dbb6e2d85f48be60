"""The scheduler's live dashboard: GET /dashboard (one static HTML page) and
GET /v1/dashboard/state (the JSON snapshot the page polls every second).

Owns: the two routes and the page in scheduler/static/dashboard.html. The scheduler owns
the state; it hands in `get_state`, a sync or async callable returning the contract's
dict (pool_id, scheduler_id, time, weights_version, totals, nodes, recent_verdicts).

Invariants:
- The page loads no external assets (no CDN): it works on an air-gapped box.
- Node ids, operators and verdict reasons come from untrusted workers: the page writes
  them with textContent only, never as HTML.
- A failing `get_state` answers a JSON 500 and a log line; the scheduler keeps serving.
- Never imports torch.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from aiohttp import web

log = logging.getLogger("prime.scheduler.dashboard")

StateFn = Callable[[], dict[str, Any] | Awaitable[dict[str, Any]]]


def dashboard_html() -> bytes:
    """The page, shipped as package data (pyproject: [tool.setuptools.package-data])."""
    return resources.files("scheduler").joinpath("static", "dashboard.html").read_bytes()


def dashboard_routes(get_state: StateFn) -> list[web.RouteDef]:
    """Routes for the dashboard page and its state endpoint."""
    page = dashboard_html()

    async def dashboard(_request: web.Request) -> web.Response:
        return web.Response(
            body=page,
            content_type="text/html",
            charset="utf-8",
            headers={"Cache-Control": "no-cache"},
        )

    async def state(_request: web.Request) -> web.Response:
        try:
            result = get_state()
            if inspect.isawaitable(result):
                result = await result
        except Exception as exc:  # the dashboard must never take the scheduler down
            log.exception("dashboard state failed")
            return web.json_response(
                {
                    "error": {
                        "message": f"state unavailable: {exc}",
                        "type": "server_error",
                        "code": 500,
                    }
                },
                status=500,
            )
        return web.json_response(result, headers={"Cache-Control": "no-store"})

    return [
        web.get("/dashboard", dashboard),
        web.get("/v1/dashboard/state", state),
    ]
