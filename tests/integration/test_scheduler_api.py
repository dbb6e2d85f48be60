"""The scheduler daemon's API without any model: admission, rate limits, bad input.

A real `prime-scheduler serve` process on loopback; requests are signed by real keys and
sent over HTTP. Node registrations here point at URLs nobody serves (no work is sent).
"""

from __future__ import annotations

import base64
import time

import httpx
import msgpack
import pytest

from protocol.envelope import seal
from protocol.identity import Identity
from protocol.messages import (
    AdmissionPolicy,
    Deregister,
    Heartbeat,
    Invite,
    RegisterRequest,
    ResultsQuery,
    RolloutSpec,
    SubmitRollouts,
    WeightUpdate,
)
from scheduler.pool import make_api_key, make_invite
from tests.pools import make_pool

MSGPACK = {"Content-Type": "application/msgpack"}


def post(url: str, body: bytes | str, json_ct: bool = False, key: str = "") -> httpx.Response:
    headers = {"Content-Type": "application/json"} if json_ct else MSGPACK
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(url, content=body, headers=headers, timeout=10)


def registration(identity: Identity, pool_id: str = "test", invite: bytes = b"") -> bytes:
    req = RegisterRequest(pool_id=pool_id, model="tiny", invite=invite)
    return seal(identity, req)


def error_of(resp: httpx.Response) -> str:
    return resp.json()["error"]["message"]


@pytest.fixture
def allowlist_pool(tmp_path):
    listed = Identity.generate()
    pool = make_pool(
        tmp_path, admission=AdmissionPolicy(mode="allowlist", allowlist=[listed.node_id])
    )
    pool.start_scheduler(
        "--rate-limits.per-identity-per-s", "5", "--rate-limits.per-identity-burst", "10"
    )
    yield pool, listed
    pool.close()


@pytest.fixture
def invite_pool(tmp_path):
    pool = make_pool(tmp_path, admission=AdmissionPolicy(mode="invite"))
    pool.start_scheduler("--server.max-body-bytes", "65536")
    yield pool
    pool.close()


def test_allowlist_admits_listed_node_and_refuses_unknown(allowlist_pool):
    pool, listed = allowlist_pool
    stranger = Identity.generate()
    resp = post(f"{pool.url}/v1/nodes/register", registration(stranger))
    assert resp.status_code == 403
    assert "not on pool 'test'" in error_of(resp) and stranger.node_id in error_of(resp)
    ok = post(f"{pool.url}/v1/nodes/register", registration(listed))
    assert ok.status_code == 200, ok.text
    # A heartbeat from the unknown node is refused too: it was never admitted.
    hb = post(
        f"{pool.url}/v1/nodes/heartbeat",
        seal(stranger, Heartbeat(node_id=stranger.node_id, weights_version=0)),
    )
    assert hb.status_code == 404 and "not registered" in error_of(hb)
    assert pool.health()["nodes"] == {"registered": 1}


def test_replayed_registration_is_refused(allowlist_pool):
    pool, listed = allowlist_pool
    envelope = registration(listed)
    assert post(f"{pool.url}/v1/nodes/register", envelope).status_code == 200
    again = post(f"{pool.url}/v1/nodes/register", envelope)
    assert again.status_code == 409
    assert "replayed" in error_of(again)


def test_flooding_node_is_rate_limited(allowlist_pool):
    pool, listed = allowlist_pool
    assert post(f"{pool.url}/v1/nodes/register", registration(listed)).status_code == 200
    statuses = [
        post(
            f"{pool.url}/v1/nodes/heartbeat",
            seal(listed, Heartbeat(node_id=listed.node_id, weights_version=0)),
        )
        for _ in range(40)
    ]
    codes = [r.status_code for r in statuses]
    assert codes[0] == 200
    assert 429 in codes, codes
    limited = next(r for r in statuses if r.status_code == 429)
    assert "rate limit" in error_of(limited) and listed.node_id in error_of(limited)
    # Others are not affected by one node's flood.
    assert pool.health()["status"] == "ok"


def test_invites_admit_once_and_forgeries_are_refused(invite_pool):
    pool = invite_pool
    url = f"{pool.url}/v1/nodes/register"
    a, b, c = Identity.generate(), Identity.generate(), Identity.generate()
    no_invite = post(url, registration(a))
    assert no_invite.status_code == 403 and "invite-only" in error_of(no_invite)

    forger = Identity.generate()
    forged = seal(forger, Invite(pool_id="test", invite_id="f" * 16), ttl_s=3600)
    refused = post(url, registration(a, invite=forged))
    assert refused.status_code == 403
    assert "invite refused" in error_of(refused) and "not trusted" in error_of(refused)

    token = base64.urlsafe_b64decode(make_invite(pool.owner, "test", ttl_s=3600))
    assert post(url, registration(a, invite=token)).status_code == 200
    reused = post(url, registration(b, invite=token))
    assert reused.status_code == 403 and "already used" in error_of(reused)

    bound = base64.urlsafe_b64decode(make_invite(pool.owner, "test", 3600, node_id=a.node_id))
    wrong_node = post(url, registration(c, invite=bound))
    assert wrong_node.status_code == 403 and "bound to another node" in error_of(wrong_node)
    other_pool = base64.urlsafe_b64decode(make_invite(pool.owner, "elsewhere", 3600))
    wrong_pool = post(url, registration(c, invite=other_pool))
    assert wrong_pool.status_code == 403 and "'elsewhere'" in error_of(wrong_pool)


def test_bad_input_on_every_route_gets_4xx_and_daemon_keeps_serving(invite_pool):
    pool = invite_pool
    u = pool.url
    stranger = Identity.generate()
    key = pool.api_key()
    foreign_key = make_api_key(stranger, pool.pool_id, "stranger", 60, 1, 1)
    spec = RolloutSpec(request_id="x", prompt_ids=[1, 2])
    cases: list[tuple[str, httpx.Response, int]] = [
        ("register garbage", post(f"{u}/v1/nodes/register", b"\x00\x01garbage"), 400),
        ("register empty", post(f"{u}/v1/nodes/register", b""), 400),
        ("register json", post(f"{u}/v1/nodes/register", '{"pool_id": "test"}', True), 400),
        (
            "register wrong kind",
            post(f"{u}/v1/nodes/register", seal(stranger, Deregister(node_id="x"))),
            400,
        ),
        (
            "register bad capacity",
            post(
                f"{u}/v1/nodes/register",
                _raw_envelope(stranger, "RegisterRequest", {"pool_id": "test", "capacity": 0}),
            ),
            400,
        ),
        (
            "register wrong pool",
            post(f"{u}/v1/nodes/register", registration(stranger, pool_id="nope")),
            404,
        ),
        ("heartbeat garbage", post(f"{u}/v1/nodes/heartbeat", msgpack.packb([1, 2, 3])), 400),
        (
            "heartbeat unknown node",
            post(
                f"{u}/v1/nodes/heartbeat", seal(stranger, Heartbeat(node_id="n", weights_version=0))
            ),
            404,
        ),
        ("deregister garbage", post(f"{u}/v1/nodes/deregister", b"{}"), 400),
        (
            "submit by a non-trainer",
            post(
                f"{u}/v1/rollouts/submit",
                seal(stranger, SubmitRollouts(pool_id="test", requests=[spec])),
            ),
            403,
        ),
        (
            "submit wrong pool",
            post(
                f"{u}/v1/rollouts/submit",
                seal(pool.trainer, SubmitRollouts(pool_id="nope", requests=[spec])),
            ),
            404,
        ),
        (
            "submit duplicate ids",
            post(
                f"{u}/v1/rollouts/submit",
                seal(pool.trainer, SubmitRollouts(pool_id="test", requests=[spec, spec])),
            ),
            400,
        ),
        (
            "submit negative tokens",
            post(
                f"{u}/v1/rollouts/submit",
                _raw_envelope(
                    pool.trainer,
                    "SubmitRollouts",
                    {"pool_id": "test", "requests": [{"request_id": "y", "prompt_ids": [-1]}]},
                ),
            ),
            400,
        ),
        (
            "results by a non-trainer",
            post(f"{u}/v1/rollouts/results", seal(stranger, ResultsQuery())),
            403,
        ),
        (
            "results bad cursor",
            post(
                f"{u}/v1/rollouts/results",
                _raw_envelope(pool.trainer, "ResultsQuery", {"after": -5}),
            ),
            400,
        ),
        (
            "weights by a non-trainer",
            post(f"{u}/v1/weights", seal(stranger, WeightUpdate(version=1, path="/tmp/x"))),
            403,
        ),
        ("oversized body", post(f"{u}/v1/nodes/register", b"\x00" * 100_000), 413),
        ("chat without a key", post(f"{u}/v1/chat/completions", "{}", True), 401),
        ("chat with a made-up key", post(f"{u}/v1/chat/completions", "{}", True, "sk-x"), 401),
        (
            "chat with another pool's key",
            post(f"{u}/v1/chat/completions", "{}", True, foreign_key),
            401,
        ),
        ("chat malformed json", post(f"{u}/v1/chat/completions", "{not json", True, key), 400),
        ("chat not an object", post(f"{u}/v1/chat/completions", "[1, 2]", True, key), 400),
        (
            "chat bad min_version",
            post(f"{u}/v1/chat/completions", '{"messages": [], "min_version": "x"}', True, key),
            400,
        ),
        (
            "chat with tools",
            post(
                f"{u}/v1/chat/completions",
                '{"messages": [{"role": "user", "content": "hi"}], "tools": [{}]}',
                True,
                key,
            ),
            400,
        ),
        (
            "chat top_p out of range",
            post(
                f"{u}/v1/chat/completions",
                '{"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}',
                True,
                key,
            ),
            400,
        ),
        ("completions no node", post(f"{u}/v1/completions", '{"prompt": "hi"}', True, key), 503),
        ("tokenize malformed", post(f"{u}/tokenize", "nope", True, key), 400),
        ("tokenize no messages", post(f"{u}/tokenize", '{"messages": []}', True, key), 400),
        ("unknown route", httpx.get(f"{u}/v1/nothing-here", timeout=10), 404),
    ]
    for name, resp, status in cases:
        assert resp.status_code == status, f"{name}: {resp.status_code} {resp.text}"
        body = resp.json()
        if status != 404 or name != "unknown route":
            assert body["error"]["message"], name
    # Expired and tampered envelopes.
    expired = seal(pool.trainer, ResultsQuery(), ttl_s=-1)
    resp = post(f"{u}/v1/rollouts/results", expired)
    assert resp.status_code == 401 and "expired" in error_of(resp)
    env = msgpack.unpackb(seal(pool.trainer, ResultsQuery()))
    env["body"] = env["body"][:-1] + b"\x01"
    resp = post(f"{u}/v1/rollouts/results", msgpack.packb(env))
    assert resp.status_code == 401 and "signature" in error_of(resp)
    assert pool.health()["status"] == "ok"
    metrics = httpx.get(f"{u}/metrics", timeout=10).text
    assert 'prime_scheduler_http_errors_total{route="/v1/nodes/register",status="400"}' in metrics


def _raw_envelope(identity: Identity, kind: str, body: dict) -> bytes:
    """A correctly signed envelope around a body that is not a valid message."""
    from protocol import PROTOCOL_VERSION
    from protocol.codec import pack
    from protocol.envelope import seal_body

    return seal_body(identity, kind, pack({"v": PROTOCOL_VERSION, "t": kind, "b": body}))


def test_saturated_pool_answers_503_with_retry_after(tmp_path):
    pool = make_pool(tmp_path)
    pool.start_scheduler("--dispatch.max-queued", "5")
    try:
        batch = [RolloutSpec(request_id=f"q{i}", prompt_ids=[1, 2]) for i in range(4)]
        first = post(
            f"{pool.url}/v1/rollouts/submit",
            seal(pool.trainer, SubmitRollouts(pool_id="test", requests=batch)),
        )
        assert first.status_code == 200  # no node yet: they wait in the queue
        more = [RolloutSpec(request_id=f"m{i}", prompt_ids=[1, 2]) for i in range(4)]
        refused = post(
            f"{pool.url}/v1/rollouts/submit",
            seal(pool.trainer, SubmitRollouts(pool_id="test", requests=more)),
        )
        assert refused.status_code == 503
        assert refused.headers["Retry-After"] == "1"
        assert "saturated" in error_of(refused) and "4 requests queued" in error_of(refused)
        assert pool.health()["queued"] == 4
    finally:
        pool.close()


def test_a_node_whose_url_never_answers_gets_no_work_however_it_heartbeats(tmp_path):
    """Open admission takes anyone, but a node is healthy only once the scheduler reached
    the URL it registered: heartbeats prove it can call out, not that it can be called."""
    pool = make_pool(tmp_path)
    try:
        pool.start_scheduler("--lifecycle.heartbeat-interval-s", "0.5")
        ghost = Identity.generate()
        assert post(f"{pool.url}/v1/nodes/register", registration(ghost)).status_code == 200
        for _ in range(8):
            hb = post(
                f"{pool.url}/v1/nodes/heartbeat",
                seal(ghost, Heartbeat(node_id=ghost.node_id, weights_version=0)),
            )
            assert hb.status_code == 200
            time.sleep(0.3)
        assert pool.health()["nodes"] == {"registered": 1}
        pool.join("w0")  # a real node at a real URL turns healthy
        assert pool.health()["nodes"] == {"registered": 1, "healthy": 1}
    finally:
        pool.close()


def test_a_node_of_an_engine_mix_the_thresholds_do_not_cover_is_refused(tmp_path):
    """The pool's thresholds were calibrated for torch/float32/cpu: a registration that
    says it generates in bf16 is refused, with what to do; a covered one is admitted."""
    pool = make_pool(tmp_path)
    try:
        pool.start_scheduler()
        node = Identity.generate()
        req = RegisterRequest(pool_id="test", model="tiny", dtype="bfloat16")
        resp = post(f"{pool.url}/v1/nodes/register", seal(node, req))
        assert resp.status_code == 403
        assert "calibrated for torch/float32/cpu, not torch/bfloat16/cpu" in error_of(resp)
        assert "prime-node calibrate" in error_of(resp)
        ok = post(f"{pool.url}/v1/nodes/register", registration(node))
        assert ok.status_code == 200
    finally:
        pool.close()


def test_an_exact_tier_pool_admits_only_the_decode_its_thresholds_hold_for(tmp_path):
    """An exact tier's thresholds (no honest token off the replay) name the slot decode:
    a node that says it decodes with the loop (whose honest noise they would reject) is
    refused with what to do, a slot-decode node is admitted. A pool whose mix names no
    decode admits both (the test above)."""
    from protocol.messages import EngineMix
    from tests.pools import tiny_verification

    exact = EngineMix(engine="torch", dtype="float32", device="cpu", decode="slots")
    policy = tiny_verification().model_copy(update={"engine_mixes": [exact]})
    pool = make_pool(tmp_path, verification=policy)
    try:
        pool.start_scheduler()
        url = f"{pool.url}/v1/nodes/register"
        loop = RegisterRequest(pool_id="test", model="tiny", decode="loop")
        resp = post(url, seal(Identity.generate(), loop))
        assert resp.status_code == 403
        assert "calibrated for torch/float32/cpu/slots, not torch/float32/cpu/loop" in error_of(
            resp
        )
        slots = loop.model_copy(update={"decode": "slots"})
        assert post(url, seal(Identity.generate(), slots)).status_code == 200
    finally:
        pool.close()


def test_new_node_keys_from_one_address_are_capped_per_minute(tmp_path):
    """Identities are free: one address registers at most
    `rate_limits.new_nodes_per_address_per_min` keys the scheduler does not know (429 with
    a clear message after that); a known key registering again (a restarted node) still
    gets in."""
    pool = make_pool(tmp_path)
    pool.start_scheduler("--rate-limits.new-nodes-per-address-per-min", "3")
    try:
        url = f"{pool.url}/v1/nodes/register"
        keys = [Identity.generate() for _ in range(4)]
        codes = [post(url, registration(k)).status_code for k in keys]
        assert codes == [200, 200, 200, 429], codes
        refused = post(url, registration(Identity.generate()))
        assert refused.status_code == 429 and "new node keys" in error_of(refused)
        assert post(url, registration(keys[0])).status_code == 200  # known: a restart
        assert pool.health()["nodes"] == {"registered": 3}
    finally:
        pool.close()
