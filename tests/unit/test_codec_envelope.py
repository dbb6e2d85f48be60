"""Wire codec, message validation and signed envelopes (DESIGN.md sections 3 and 4)."""

from __future__ import annotations

import math
import time

import msgpack
import pytest
from pydantic import ValidationError

from protocol import PROTOCOL_VERSION
from protocol.codec import CodecError, decode, encode, pack, unpack
from protocol.envelope import (
    EnvelopeError,
    ReplayCache,
    ReplayCacheFullError,
    ReplayError,
    UntrustedSenderError,
    open_envelope,
    seal,
    signed_part,
)
from protocol.identity import Identity
from protocol.messages import (
    CheckResult,
    Heartbeat,
    ProofParams,
    Rollout,
    RolloutRequest,
    SamplingParams,
    Verdict,
)

# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def alice() -> Identity:
    return Identity.from_seed(bytes(range(32)))


@pytest.fixture(scope="module")
def bob() -> Identity:
    return Identity.from_seed(bytes(range(1, 33)))


def make_request(**kw) -> RolloutRequest:
    fields = dict(
        request_id="req-1",
        prompt_ids=[1, 2, 3],
        sampling=SamplingParams(
            temperature=0.7, top_p=0.9, top_k=20, max_tokens=64, stop=("\n\n",)
        ),
        seed=2**63 - 1,
        min_version=3,
        proof=ProofParams(chunk_tokens=16, topk=64),
    )
    fields.update(kw)
    return RolloutRequest(**fields)


def rollout_fields(n_tokens: int = 40, chunk_tokens: int = 32, **kw) -> dict:
    fields = dict(
        request_id="req-1",
        node_id=Identity.from_seed(bytes(32)).node_id,
        prompt_ids=[5, 6, 7],
        completion_ids=list(range(10, 10 + n_tokens)),
        logprobs=[-0.5 - i / 100 for i in range(n_tokens)],
        finish_reason="length",
        sampling=SamplingParams(max_tokens=64),
        seed=42,
        weights_version=7,
        weights_hash="ab" * 32,
        proof_params=ProofParams(chunk_tokens=chunk_tokens),
        proof=[bytes([i]) * 258 + b"\x00\xff" for i in range(math.ceil(n_tokens / chunk_tokens))],
    )
    fields.update(kw)
    return fields


def make_verdict() -> Verdict:
    return Verdict(
        request_id="req-1",
        rollout_digest="0" * 64,
        generator_id="gen",
        verifier_id="ver",
        weights_hash="ab" * 32,
        accepted=False,
        checks=[
            CheckResult(name="proof", passed=True, metrics={"exp_mismatch": 3.0}),
            CheckResult(name="logprobs", passed=False, detail="max diff 0.9", metrics={"max": 0.9}),
        ],
    )


# ---------------------------------------------------------------- codec


def test_round_trip_rollout_request():
    req = make_request()
    back = decode(encode(req), RolloutRequest)
    assert back == req
    assert back.sampling.stop == ("\n\n",)
    assert back.seed == 2**63 - 1


def test_round_trip_rollout_with_binary_proof():
    ro = Rollout(**rollout_fields())
    back = decode(encode(ro), Rollout)
    assert back == ro
    assert back.proof == ro.proof
    assert all(isinstance(c, bytes) for c in back.proof)
    assert back.digest() == ro.digest()


def test_round_trip_verdict():
    v = make_verdict()
    back = decode(encode(v), Verdict)
    assert back == v
    assert back.reasons == ["logprobs: max diff 0.9"]


def test_digest_identifies_content():
    a, b = make_request(), make_request()
    assert a.digest() == b.digest()
    assert make_request(seed=1).digest() != a.digest()


def test_body_over_cap_is_refused_before_parsing(monkeypatch):
    data = encode(make_request())
    called = []
    monkeypatch.setattr(msgpack, "unpackb", lambda *a, **k: called.append(1))
    with pytest.raises(CodecError, match="exceeds the cap"):
        decode(data, RolloutRequest, max_bytes=len(data) - 1)
    assert not called
    # Garbage over the cap is also reported as too big, not as malformed.
    monkeypatch.undo()
    with pytest.raises(CodecError, match="exceeds the cap of 10 bytes"):
        decode(b"\xc1" * 11, RolloutRequest, max_bytes=10)


def test_body_at_cap_is_accepted():
    data = encode(make_request())
    assert decode(data, RolloutRequest, max_bytes=len(data)) == make_request()


def test_wrong_protocol_version_is_refused():
    data = pack(
        {"v": PROTOCOL_VERSION + 1, "t": "RolloutRequest", "b": make_request().model_dump()}
    )
    with pytest.raises(CodecError, match="version"):
        decode(data, RolloutRequest)


def test_wrong_message_type_is_refused():
    with pytest.raises(CodecError, match="expected a Rollout message, got 'RolloutRequest'"):
        decode(encode(make_request()), Rollout)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        b"\x93\x01",  # array of 3 with one element: truncated
        b"\x82\xa1v\x01",  # map of 2 with one pair: truncated
    ],
)
def test_malformed_bytes_raise_codec_error(data):
    with pytest.raises(CodecError, match="malformed"):
        decode(data, RolloutRequest)


def test_truncated_valid_message_raises_codec_error():
    data = encode(make_request())
    with pytest.raises(CodecError):
        decode(data[:-3], RolloutRequest)


@pytest.mark.parametrize("obj", [[1, 2, 3], "text", 5, {"v": 1, "t": "RolloutRequest"}])
def test_body_that_is_not_the_wire_map_is_refused(obj):
    with pytest.raises(CodecError, match="'v', 't' and 'b'"):
        decode(pack(obj), RolloutRequest)


def test_invalid_field_gives_codec_error_naming_the_field():
    body = make_request().model_dump()
    body["seed"] = -5
    with pytest.raises(CodecError, match="seed"):
        decode(pack({"v": PROTOCOL_VERSION, "t": "RolloutRequest", "b": body}), RolloutRequest)
    body = make_request().model_dump()
    body["sampling"]["temperature"] = "hot"
    with pytest.raises(CodecError, match=r"sampling\.temperature"):
        decode(pack({"v": PROTOCOL_VERSION, "t": "RolloutRequest", "b": body}), RolloutRequest)


def test_unknown_field_is_refused():
    body = make_request().model_dump()
    body["sneaky"] = 1
    with pytest.raises(CodecError, match="sneaky"):
        decode(pack({"v": PROTOCOL_VERSION, "t": "RolloutRequest", "b": body}), RolloutRequest)


def test_non_string_map_keys_are_malformed():
    with pytest.raises(CodecError):
        unpack(pack({1: 2}))


# ---------------------------------------------------------------- message validation


def test_valid_rollout_builds():
    ro = Rollout(**rollout_fields(n_tokens=33, chunk_tokens=32))
    assert len(ro.proof) == 2


def test_rollout_logprob_count_mismatch_raises():
    with pytest.raises(ValidationError, match="39 logprobs for 40 completion tokens"):
        Rollout(**rollout_fields(logprobs=[-1.0] * 39))


def test_rollout_too_many_tokens_for_max_tokens_raises():
    with pytest.raises(ValidationError, match="exceed max_tokens=16"):
        Rollout(
            **rollout_fields(n_tokens=17, chunk_tokens=32, sampling=SamplingParams(max_tokens=16))
        )


@pytest.mark.parametrize("n_chunks", [0, 1, 3])
def test_rollout_wrong_number_of_proof_chunks_raises(n_chunks):
    # 40 tokens at 32 per chunk need 2 chunks.
    with pytest.raises(ValidationError, match="proof chunks"):
        Rollout(**rollout_fields(n_tokens=40, chunk_tokens=32, proof=[b"x"] * n_chunks))


@pytest.mark.parametrize("bad", [0.5, float("nan"), float("inf"), float("-inf")])
def test_rollout_positive_or_non_finite_logprob_raises(bad):
    lp = [-1.0] * 40
    lp[7] = bad
    with pytest.raises(ValidationError, match="logprobs must be finite"):
        Rollout(**rollout_fields(logprobs=lp))


def test_rollout_zero_logprob_is_allowed():
    Rollout(**rollout_fields(logprobs=[0.0] * 40))


def test_rollout_negative_token_id_raises():
    with pytest.raises(ValidationError, match="non-negative"):
        Rollout(**rollout_fields(prompt_ids=[1, -2]))


def test_invalid_rollout_on_the_wire_is_a_codec_error():
    body = Rollout(**rollout_fields()).model_dump()
    body["proof"] = body["proof"][:1]
    with pytest.raises(CodecError, match="proof chunks"):
        decode(pack({"v": PROTOCOL_VERSION, "t": "Rollout", "b": body}), Rollout)


def test_messages_are_frozen():
    req = make_request()
    with pytest.raises(ValidationError):
        req.seed = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "kw",
    [
        {"prompt_ids": []},
        {"prompt_ids": [1, -1]},
        {"seed": -1},
        {"seed": 2**63},
        {"request_id": ""},
        {"sampling": {"temperature": -0.1}},
        {"sampling": {"top_p": 0.0}},
        {"sampling": {"stop": ("",)}},
    ],
)
def test_rollout_request_rejects_bad_values(kw):
    with pytest.raises(ValidationError):
        make_request(**kw)


# ---------------------------------------------------------------- envelopes


def _env(data: bytes) -> dict:
    return msgpack.unpackb(data, raw=False)


def test_sealed_envelope_opens(alice):
    req = make_request()
    opened = open_envelope(seal(alice, req), RolloutRequest)
    assert opened.message == req
    assert opened.sender == alice.public_key
    assert opened.sender_id == alice.node_id
    assert len(opened.nonce) >= 8
    assert time.time() < opened.expires <= time.time() + 61


def test_two_seals_of_one_message_use_different_nonces(alice):
    a = open_envelope(seal(alice, make_request()), RolloutRequest)
    b = open_envelope(seal(alice, make_request()), RolloutRequest)
    assert a.nonce != b.nonce


def test_tampered_body_is_refused(alice):
    env = _env(seal(alice, make_request(seed=1)))
    env["body"] = encode(make_request(seed=2))
    with pytest.raises(EnvelopeError, match="bad signature") as info:
        open_envelope(pack(env), RolloutRequest)
    assert info.value.status == 401


@pytest.mark.parametrize("field", ["sig", "nonce", "expires", "sender"])
def test_tampered_signed_field_is_refused(alice, bob, field):
    env = _env(seal(alice, make_request()))
    if field == "sig":
        env["sig"] = bytes([env["sig"][0] ^ 0x01]) + env["sig"][1:]
    elif field == "nonce":
        env["nonce"] = b"\x00" * len(env["nonce"])
    elif field == "expires":
        env["expires"] = env["expires"] + 10
    else:  # claim someone else sent it
        env["sender"] = bob.public_key
    with pytest.raises(EnvelopeError, match="bad signature"):
        open_envelope(pack(env), RolloutRequest)


def test_expired_envelope_is_refused(alice):
    data = seal(alice, make_request(), ttl_s=5)
    with pytest.raises(EnvelopeError, match="expired"):
        open_envelope(data, RolloutRequest, clock=lambda: time.time() + 10)
    # ... unless re-checking authorship later, without expiry.
    opened = open_envelope(data, RolloutRequest, check_expiry=False, clock=lambda: time.time() + 10)
    assert opened.message == make_request()


def test_negative_ttl_envelope_is_refused(alice):
    with pytest.raises(EnvelopeError, match="expired"):
        open_envelope(seal(alice, make_request(), ttl_s=-1), RolloutRequest)


def test_expiry_too_far_ahead_is_refused(alice):
    data = seal(alice, make_request(), ttl_s=7200)
    with pytest.raises(EnvelopeError, match="ahead"):
        open_envelope(data, RolloutRequest)
    with pytest.raises(EnvelopeError, match="ahead"):
        open_envelope(seal(alice, make_request(), ttl_s=120), RolloutRequest, max_ttl_s=60)
    assert open_envelope(data, RolloutRequest, max_ttl_s=8000).message == make_request()


def test_envelope_with_nan_expiry_is_refused(alice):
    req = make_request()
    body, nonce, expires = encode(req), b"n" * 16, float("nan")
    sig = alice.sign(
        signed_part(PROTOCOL_VERSION, alice.public_key, nonce, expires, "RolloutRequest", body)
    )
    data = pack(
        {
            "v": PROTOCOL_VERSION,
            "sender": alice.public_key,
            "nonce": nonce,
            "expires": expires,
            "kind": "RolloutRequest",
            "body": body,
            "sig": sig,
        }
    )
    with pytest.raises((EnvelopeError, CodecError)):
        open_envelope(data, RolloutRequest, clock=lambda: time.time() + 10 * 365 * 86400)


def test_replayed_envelope_is_refused_with_409_fresh_nonce_passes(alice):
    cache = ReplayCache()
    data = seal(alice, make_request())
    open_envelope(data, RolloutRequest, replay_cache=cache)
    with pytest.raises(ReplayError) as info:
        open_envelope(data, RolloutRequest, replay_cache=cache)
    assert info.value.status == 409
    assert isinstance(info.value, EnvelopeError)
    # The same message sealed again carries a fresh nonce and is accepted.
    assert (
        open_envelope(seal(alice, make_request()), RolloutRequest, replay_cache=cache).message
        == make_request()
    )


def test_same_nonce_from_different_senders_is_not_a_replay():
    cache = ReplayCache(clock=lambda: 0.0)
    cache.check_and_add(b"a" * 32, b"n" * 16, 100.0)
    cache.check_and_add(b"b" * 32, b"n" * 16, 100.0)
    assert len(cache) == 2


def test_untrusted_sender_is_refused_with_403(alice, bob):
    data = seal(alice, make_request())
    with pytest.raises(UntrustedSenderError, match=alice.node_id) as info:
        open_envelope(data, RolloutRequest, trusted_senders={bob.public_key})
    assert info.value.status == 403
    assert (
        open_envelope(
            data, RolloutRequest, trusted_senders={bob.public_key, alice.public_key}
        ).sender
        == alice.public_key
    )


def test_refused_untrusted_envelope_does_not_consume_the_nonce(alice, bob):
    cache = ReplayCache()
    data = seal(alice, make_request())
    with pytest.raises(UntrustedSenderError):
        open_envelope(data, RolloutRequest, replay_cache=cache, trusted_senders={bob.public_key})
    assert len(cache) == 0


def test_wrong_kind_is_codec_error(alice):
    data = seal(alice, make_request())
    with pytest.raises(CodecError, match="expected a signed Rollout, got 'RolloutRequest'"):
        open_envelope(data, Rollout)


def test_envelope_missing_field_or_not_a_map_is_codec_error(alice):
    env = _env(seal(alice, make_request()))
    del env["sig"]
    with pytest.raises(CodecError, match="sig"):
        open_envelope(pack(env), RolloutRequest)
    with pytest.raises(CodecError, match="map"):
        open_envelope(pack([1, 2]), RolloutRequest)
    with pytest.raises(CodecError):
        open_envelope(b"\xc1garbage", RolloutRequest)


def test_envelope_with_wrong_field_types_is_codec_error(alice):
    env = _env(seal(alice, make_request()))
    env["sender"] = env["sender"][:31]
    with pytest.raises(CodecError, match="wrong types"):
        open_envelope(pack(env), RolloutRequest)
    env = _env(seal(alice, make_request()))
    env["nonce"] = b"short"
    with pytest.raises(CodecError, match="wrong types"):
        open_envelope(pack(env), RolloutRequest)


def test_envelope_wrong_version_is_codec_error(alice):
    env = _env(seal(alice, make_request()))
    env["v"] = PROTOCOL_VERSION + 1
    with pytest.raises(CodecError, match="version"):
        open_envelope(pack(env), RolloutRequest)


def test_envelope_over_cap_is_refused(alice):
    data = seal(alice, make_request())
    with pytest.raises(CodecError, match="exceeds the cap"):
        open_envelope(data, RolloutRequest, max_bytes=len(data) - 1)


def test_envelope_carries_rollout_with_proof(alice):
    ro = Rollout(**rollout_fields(node_id=alice.node_id))
    opened = open_envelope(seal(alice, ro), Rollout)
    assert opened.message == ro
    assert opened.message.node_id == opened.sender_id


def test_heartbeat_kind_distinct_from_other_messages(alice):
    hb = Heartbeat(node_id=alice.node_id, weights_version=1)
    assert open_envelope(seal(alice, hb), Heartbeat).message == hb
    with pytest.raises(CodecError):
        open_envelope(seal(alice, hb), Verdict)


# ---------------------------------------------------------------- replay cache


class Clock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_replay_cache_remembers_until_expiry_then_forgets():
    clock = Clock(0.0)
    cache = ReplayCache(clock=clock, max_entries=2)
    s = b"s" * 32
    cache.check_and_add(s, b"n1" * 8, 100.0)
    cache.check_and_add(s, b"n2" * 8, 200.0)
    # Full, and nothing has expired yet: refused rather than forgetting a live nonce.
    clock.now = 100.0  # n1 expires at 100: still accepted by open_envelope, so kept
    with pytest.raises(ReplayCacheFullError, match="full"):
        cache.check_and_add(s, b"n3" * 8, 300.0)
    with pytest.raises(ReplayError):
        cache.check_and_add(s, b"n1" * 8, 100.0)
    # After n1 expired it is forgotten, making room; n2 is still remembered.
    clock.now = 150.0
    cache.check_and_add(s, b"n3" * 8, 300.0)
    assert len(cache) == 2
    with pytest.raises(ReplayError):
        cache.check_and_add(s, b"n2" * 8, 200.0)
    with pytest.raises(ReplayError):
        cache.check_and_add(s, b"n3" * 8, 300.0)
    clock.now = 250.0  # n2 expired: forgotten on the next add
    cache.check_and_add(s, b"n4" * 8, 400.0)
    assert len(cache) == 2


def test_replay_cache_reports_replay_while_not_full():
    cache = ReplayCache(clock=Clock(0.0))
    cache.check_and_add(b"s" * 32, b"n" * 16, 100.0)
    with pytest.raises(ReplayError, match="already used"):
        cache.check_and_add(b"s" * 32, b"n" * 16, 100.0)


def test_replay_cache_prunes_expired_entries_periodically():
    clock = Clock(0.0)
    cache = ReplayCache(clock=clock)
    s = b"s" * 32
    for i in range(1024):
        cache.check_and_add(s, i.to_bytes(16, "big"), 10.0)
    live = b"live" * 4
    cache.check_and_add(s, live, 1000.0)  # at len 1024: prunes, nothing expired yet
    assert len(cache) == 1025
    clock.now = 20.0
    for i in range(1025, 2048):
        cache.check_and_add(s, i.to_bytes(16, "big"), 1000.0)
    assert len(cache) == 2048
    cache.check_and_add(s, b"x" * 16, 1000.0)  # prunes the 1024 expired ones
    assert len(cache) == 1025
    with pytest.raises(ReplayError):
        cache.check_and_add(s, live, 1000.0)


def test_open_envelope_uses_cache_across_clock(alice):
    clock = Clock(time.time())
    cache = ReplayCache(clock=clock)
    data = seal(alice, make_request(), ttl_s=30)
    open_envelope(data, RolloutRequest, replay_cache=cache, clock=clock)
    clock.now += 20  # still valid: replay refused
    with pytest.raises(ReplayError):
        open_envelope(data, RolloutRequest, replay_cache=cache, clock=clock)
    clock.now += 20  # expired: refused as expired
    with pytest.raises(EnvelopeError, match="expired"):
        open_envelope(data, RolloutRequest, replay_cache=cache, clock=clock)


# -- node channel frames (protocol.channel) ------------------------------------------------
def test_channel_frames_round_trip_and_refuse_what_is_not_one():
    from protocol.channel import (
        answer_frame,
        call_frame,
        challenge_frame,
        read_answer,
        read_call,
        read_challenge,
        ws_url,
    )

    assert read_call(call_frame(7, "/v1/verify", b"x"), 1024) == (7, "/v1/verify", b"x")
    assert read_answer(answer_frame(7, 200, b"ok"), 1024) == (7, 200, b"ok")
    assert read_challenge(challenge_frame(b"c" * 32), 1024) == b"c" * 32
    assert ws_url("https://s.example:7000/") == "wss://s.example:7000/v1/nodes/connect"
    assert ws_url("http://127.0.0.1:7000") == "ws://127.0.0.1:7000/v1/nodes/connect"
    bad_calls = [
        call_frame(1, "http://elsewhere/v1/verify", b""),  # not a path of the node's API
        call_frame(1, "//elsewhere/x", b""),
        call_frame(1, "/v1/../admin", b""),
        call_frame(1, "/v1/verify?x=1", b""),
        pack({"id": True, "route": "/v1/verify", "body": b""}),  # a bool is no id
        pack({"id": 1, "route": "/v1/verify"}),  # a key missing
        pack(
            {
                "id": 1,
                "route": "/v1/verify",
                "body": "text",
            }
        ),
        b"\xc1",  # not msgpack
    ]
    for frame in bad_calls:
        with pytest.raises(CodecError):
            read_call(frame, 1024)
    with pytest.raises(CodecError):
        read_challenge(challenge_frame(b"short"), 1024)
    with pytest.raises(CodecError, match="exceeds the cap"):
        read_answer(answer_frame(1, 200, b"x" * 2048), 1024)
