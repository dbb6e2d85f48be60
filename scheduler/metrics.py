"""The scheduler's Prometheus metrics and its GET /metrics route.

Owns: every metric the scheduler exports, all named `prime_scheduler_*`, registered on a
per-instance `CollectorRegistry` (several schedulers may live in one process, e.g. in
tests, and must not share or clash on the global registry).

Invariants:
- Label values come from small fixed sets (outcomes, node states, route *templates*,
  status codes), never from request ids, node ids or raw paths, so cardinality stays bounded.
- Counters only go up; gauges are set from the scheduler's own view (the DB is the truth;
  `set_node_states` replaces the whole `nodes{state}` family each time).
- Never imports torch.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

PREFIX = "prime_scheduler_"

NODE_STATES = ("registered", "healthy", "unhealthy", "dead", "draining", "left", "banned")
"""protocol.messages.NodeState; pre-created so every state shows up at 0."""
RESULT_STATUSES = ("accepted", "rejected", "failed")
"""protocol.messages.RolloutResult.status."""

# Queue wait + send to a generator: 1 ms .. 5 s.
DISPATCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# Submit -> released: generation + verification (+ dispute), seconds to minutes.
END_TO_END_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

Refresh = Callable[[], object | Awaitable[object]]


class SchedulerMetrics:
    """All scheduler metrics on their own registry. Update the attributes directly
    (`m.bans_total.inc()`, `m.verifications_total.labels(outcome="accepted").inc()`)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry

        # prometheus_client appends `_total` to counters itself.
        self.requests_submitted_total = Counter(
            PREFIX + "requests_submitted", "Rollout requests accepted from the trainer.", registry=r
        )
        self.results_released_total = Counter(
            PREFIX + "results_released",
            "Results released into the results stream, by final status.",
            ["status"],
            registry=r,
        )
        self.verifications_total = Counter(
            PREFIX + "verifications",
            "Verdicts received from verifiers, by outcome.",
            ["outcome"],
            registry=r,
        )
        self.disputes_total = Counter(
            PREFIX + "disputes",
            "Settled disputes, by which side the judge found wrong.",
            ["wrong"],
            registry=r,
        )
        self.bans_total = Counter(PREFIX + "bans", "Nodes banned.", registry=r)
        self.heartbeats_total = Counter(
            PREFIX + "heartbeats", "Heartbeats accepted from nodes.", registry=r
        )
        self.dispatch_retries_total = Counter(
            PREFIX + "dispatch_retries",
            "Requests re-dispatched (node failed, timed out, was banned or left).",
            registry=r,
        )
        self.http_errors_total = Counter(
            PREFIX + "http_errors",
            "HTTP responses with status >= 400, by route template and status.",
            ["route", "status"],
            registry=r,
        )
        self.dispatch_latency_seconds = Histogram(
            PREFIX + "dispatch_latency_seconds",
            "Time from submit (or re-queue) until the request was sent to a generator.",
            buckets=DISPATCH_BUCKETS,
            registry=r,
        )
        self.end_to_end_seconds = Histogram(
            PREFIX + "end_to_end_seconds",
            "Time from submit until the result was released.",
            buckets=END_TO_END_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            PREFIX + "queue_depth", "Requests waiting for a generator.", registry=r
        )
        self.in_flight = Gauge(
            PREFIX + "in_flight", "Requests sent to a node and not yet released.", registry=r
        )
        self.nodes = Gauge(PREFIX + "nodes", "Known nodes, by state.", ["state"], registry=r)

        # Pre-create the fixed label sets so dashboards and alerts see zeros, not gaps.
        for status in RESULT_STATUSES:
            self.results_released_total.labels(status=status)
        for outcome in ("accepted", "rejected"):
            self.verifications_total.labels(outcome=outcome)
        for wrong in ("generator", "verifier"):
            self.disputes_total.labels(wrong=wrong)
        self._node_states: set[str] = set(NODE_STATES)
        for state in NODE_STATES:
            self.nodes.labels(state=state).set(0)

    # -- helpers for the common updates -------------------------------------------------

    def observe_verdict(self, accepted: bool) -> None:
        self.verifications_total.labels(outcome="accepted" if accepted else "rejected").inc()

    def observe_dispute(self, wrong: str) -> None:
        """`wrong` is "generator" or "verifier"."""
        self.disputes_total.labels(wrong=wrong).inc()

    def observe_release(self, status: str, submitted_at: float, now: float | None = None) -> None:
        """A result was released; `submitted_at` is the request's submit time (unix)."""
        self.results_released_total.labels(status=status).inc()
        end = time.time() if now is None else now
        self.end_to_end_seconds.observe(max(0.0, end - submitted_at))

    def set_node_states(self, counts: Mapping[str, int]) -> None:
        """Replace `nodes{state}`: states missing from `counts` drop to 0."""
        self._node_states.update(counts)
        for state in self._node_states:
            self.nodes.labels(state=state).set(counts.get(state, 0))

    # -- exposition ---------------------------------------------------------------------

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The registry in Prometheus text format (or OpenMetrics if `accept` asks for it):
        (body, content type)."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type

    def handler(self, refresh: Refresh | None = None) -> Callable[[web.Request], Awaitable]:
        """aiohttp handler for GET /metrics. `refresh` (sync or async) runs first, to set
        gauges from current state (queue depth, node counts) at scrape time."""

        async def metrics(request: web.Request) -> web.Response:
            if refresh is not None:
                result = refresh()
                if inspect.isawaitable(result):
                    await result
            body, content_type = self.render(request.headers.get("Accept"))
            # content_type carries parameters (version, charset): set the header verbatim.
            return web.Response(body=body, headers={"Content-Type": content_type})

        return metrics

    def routes(self, refresh: Refresh | None = None) -> list[web.RouteDef]:
        return [web.get("/metrics", self.handler(refresh))]

    def error_middleware(self) -> Callable:
        """aiohttp middleware counting responses >= 400 into `http_errors_total`, labelled
        by the matched route's template (e.g. /v1/rollouts/{id}), "unmatched" otherwise.
        Put it outermost (first in `middlewares`) so it sees the final status."""

        @web.middleware
        async def count_errors(request: web.Request, handler):
            try:
                response = await handler(request)
            except web.HTTPException as exc:
                if exc.status >= 400:
                    self._count_error(request, exc.status)
                raise
            except Exception:
                self._count_error(request, 500)
                raise
            if response.status >= 400:
                self._count_error(request, response.status)
            return response

        return count_errors

    def _count_error(self, request: web.Request, status: int) -> None:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        self.http_errors_total.labels(route=route, status=str(status)).inc()
