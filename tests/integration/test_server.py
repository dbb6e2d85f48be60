"""The worker's HTTP API with real clients: the official `openai` client works unchanged,
proof routes return signed rollouts, weights load only under a trusted signature, and
bad input on every route gets a clear 4xx while the node keeps serving."""

from __future__ import annotations

import json
import time

import httpx
import msgpack
import pytest
from openai import BadRequestError, OpenAI

from protocol.envelope import open_envelope, seal
from protocol.identity import Identity
from protocol.messages import (
    Rollout,
    RolloutRequest,
    SamplingParams,
    Verdict,
    VerifyRequest,
    WeightReload,
    WeightUpdate,
)
from tests.nodes import start_node

MSGPACK = {"Content-Type": "application/msgpack"}


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    work = tmp_path_factory.mktemp("server")
    trainer = Identity.load_or_create(work / "trainer.key")
    n = start_node(
        work,
        "n",
        "--engine.model",
        "tiny",
        "--trusted-keys",
        f'["{trainer.node_id}"]',
        "--server.max-body-bytes",
        "65536",
        "--engine.max-model-len",
        "512",
    )
    yield n, trainer, work
    n.stop()


@pytest.fixture(scope="module")
def client(node):
    return OpenAI(base_url=f"{node[0].url}/v1", api_key="unused", max_retries=0)


def test_openai_chat_completion_with_logprobs_and_token_ids(node, client):
    n, _, _ = node
    resp = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "reverse: abc"}],
        max_tokens=24,
        temperature=1.0,
        logprobs=True,
        top_logprobs=3,
        seed=7,
        extra_body={"return_token_ids": True},
    )
    choice = resp.choices[0]
    extra = resp.model_extra
    assert choice.finish_reason in ("stop", "length")
    assert len(choice.logprobs.content) == len(choice.model_extra["token_ids"]) <= 24
    first = choice.logprobs.content[0]
    assert first.logprob <= 0 and len(first.top_logprobs) == 3
    assert first.top_logprobs[0].logprob >= first.logprob - 1e-6
    assert extra["prompt_token_ids"] and extra["rollout_id"]
    # Same seed, same answer; the signed rollout with its proof is on the proof route.
    again = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "reverse: abc"}], max_tokens=24, seed=7
    )
    assert again.choices[0].message.content == choice.message.content
    raw = httpx.get(f"{n.url}/v1/rollouts/{extra['rollout_id']}").content
    opened = open_envelope(raw, Rollout, check_expiry=False)
    assert opened.sender_id == n.identity.node_id
    assert opened.message.completion_ids == choice.model_extra["token_ids"]
    assert [round(x, 5) for x in opened.message.logprobs] == [
        round(c.logprob, 5) for c in choice.logprobs.content
    ]
    assert len(opened.message.proof) == -(-len(opened.message.completion_ids) // 32)


def test_openai_completions_models_and_stop_strings(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    resp = client.completions.create(
        model="tiny", prompt="hello", max_tokens=16, logprobs=1, seed=1
    )
    assert len(resp.choices[0].logprobs.token_logprobs) == len(
        resp.choices[0].model_extra["token_ids"]
    )
    # A stop string ends the completion and is cut from the text, as OpenAI does.
    full = client.completions.create(
        model="tiny", prompt="hello", max_tokens=32, seed=3, temperature=1.0
    )
    text = full.choices[0].text
    if len(text) > 4:
        stop = text[3]
        cut = client.completions.create(
            model="tiny", prompt="hello", max_tokens=32, seed=3, stop=[stop]
        )
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].text == text[: text.index(stop)]


def test_tokenize_route_matches_chat_prompt(node, client):
    n, _, _ = node
    msgs = [{"role": "user", "content": "hi"}]
    toks = httpx.post(f"{n.url}/tokenize", json={"messages": msgs}).json()["tokens"]
    resp = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4)
    assert toks == resp.model_extra["prompt_token_ids"]


def test_signed_rollout_and_verify_routes(node):
    n, _, _ = node
    scheduler = Identity.generate()
    req = RolloutRequest(
        request_id="r1", prompt_ids=[1, 70, 71, 72], seed=5, sampling=SamplingParams(max_tokens=40)
    )
    busy = [httpx.get(f"{n.url}/health").json()["busy_s"]]
    raw = httpx.post(f"{n.url}/v1/rollouts", content=seal(scheduler, req), headers=MSGPACK).content
    rollout = open_envelope(raw, Rollout, check_expiry=False).message
    busy.append(httpx.get(f"{n.url}/health").json()["busy_s"])
    verify = VerifyRequest(rollout_envelope=raw, request=req)
    vraw = httpx.post(
        f"{n.url}/v1/verify", content=seal(scheduler, verify), headers=MSGPACK
    ).content
    verdict = open_envelope(vraw, Verdict).message
    assert verdict.accepted and verdict.rollout_digest == rollout.digest()
    # /health counts the seconds spent on each kind of work: a generation adds to
    # `generate` only, a verification to `verify` only.
    busy.append(httpx.get(f"{n.url}/health").json()["busy_s"])
    assert busy[1]["generate"] > busy[0]["generate"] and busy[1]["verify"] == busy[0]["verify"]
    assert busy[2]["verify"] > busy[1]["verify"] and busy[2]["generate"] == busy[1]["generate"]
    # A rollout that does not answer the request it is checked against is rejected.
    other = req.model_copy(update={"seed": 6})
    vraw = httpx.post(
        f"{n.url}/v1/verify",
        content=seal(scheduler, VerifyRequest(rollout_envelope=raw, request=other)),
        headers=MSGPACK,
    ).content
    verdict = open_envelope(vraw, Verdict).message
    assert not verdict.accepted and any(
        c.name == "request" and not c.passed for c in verdict.checks
    )


def _save_perturbed_weights(model_dir, out_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(str(out_dir))
    return out_dir


def test_weight_update_only_under_trusted_signature(node, tiny_path, client):
    n, trainer, work = node
    before = n.health()
    new = _save_perturbed_weights(tiny_path, work / "weights-1")
    update = WeightUpdate(version=1, path=str(new))
    r = httpx.post(
        f"{n.url}/v1/weights/update", content=seal(Identity.generate(), update), headers=MSGPACK
    )
    assert r.status_code == 403 and "not trusted" in r.json()["error"]["message"]
    assert n.health()["weights_hash"] == before["weights_hash"]
    r = httpx.post(
        f"{n.url}/v1/weights/update",
        content=seal(trainer, update.model_copy(update={"path": "/nope"})),
        headers=MSGPACK,
    )
    assert r.status_code == 400 and "/nope" in r.json()["error"]["message"]
    envelope = seal(trainer, update)
    r = httpx.post(f"{n.url}/v1/weights/update", content=envelope, headers=MSGPACK)
    assert r.status_code == 200, r.text
    after = n.health()
    assert after["weights_version"] == 1 and after["weights_hash"] != before["weights_hash"]
    r = httpx.post(f"{n.url}/v1/weights/update", content=envelope, headers=MSGPACK)
    assert r.status_code == 409
    r = httpx.post(
        f"{n.url}/v1/weights/reload",
        content=seal(trainer, WeightReload(version=3)),
        headers=MSGPACK,
    )
    assert r.status_code == 400
    r = httpx.post(
        f"{n.url}/v1/weights/reload",
        content=seal(trainer, WeightReload(version=1)),
        headers=MSGPACK,
    )
    assert r.status_code == 200 and r.json()["weights_hash"] == after["weights_hash"]
    resp = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4
    )
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_weight_update_refuses_a_version_not_newer_than_the_nodes(node, tiny_path):
    """Only newer weights are swapped in, on every route: a trainer-signed update of the
    version the node holds (other files) or of an older one is refused with a 409 and
    changes nothing, even as a fresh envelope (not a replay)."""
    n, trainer, work = node
    held = n.health()["weights_version"]
    newer = WeightUpdate(version=held + 2, path=str(tiny_path))
    r = httpx.post(f"{n.url}/v1/weights/update", content=seal(trainer, newer), headers=MSGPACK)
    assert r.status_code == 200, r.text
    before = n.health()
    assert before["weights_version"] == held + 2
    other = _save_perturbed_weights(tiny_path, work / "weights-not-newer")
    for version in (held + 2, held + 1):
        update = WeightUpdate(version=version, path=str(other))
        r = httpx.post(f"{n.url}/v1/weights/update", content=seal(trainer, update), headers=MSGPACK)
        assert r.status_code == 409, (version, r.text)
        assert f"holds weights version {held + 2}" in r.json()["error"]["message"]
        after = n.health()
        assert (after["weights_version"], after["weights_hash"]) == (
            before["weights_version"],
            before["weights_hash"],
        )


def _expired(identity, message):
    return seal(identity, message, ttl_s=-1)


def _bad_sig(identity, message):
    env = msgpack.unpackb(seal(identity, message))
    env["sig"] = bytes(64)
    return msgpack.packb(env)


def _json_cases():
    return [
        ("malformed json", b"{not json", 400),
        ("json array", b"[1, 2]", 400),
        ("wrong types", json.dumps({"messages": "hi", "temperature": "hot"}).encode(), 400),
        (
            "n too large",
            json.dumps({"messages": [{"role": "user", "content": "a"}], "n": 17}).encode(),
            400,
        ),
        (
            "tools (malformed)",
            json.dumps({"messages": [{"role": "user", "content": "a"}], "tools": [{}]}).encode(),
            400,
        ),
        (
            "response_format (not supported)",
            json.dumps(
                {"messages": [{"role": "user", "content": "a"}], "response_format": {}}
            ).encode(),
            400,
        ),
        (
            "top_p out of range",
            json.dumps({"messages": [{"role": "user", "content": "a"}], "top_p": 0}).encode(),
            400,
        ),
        (
            "top_k over 2**64",
            json.dumps({"messages": [{"role": "user", "content": "a"}], "top_k": 2**65}).encode(),
            400,
        ),
        (
            "no messages",
            json.dumps({"messages": []}).encode(),
            400,
        ),
        (
            "too long",
            json.dumps(
                {"messages": [{"role": "user", "content": "a"}], "max_tokens": 100000}
            ).encode(),
            400,
        ),
        ("oversized", b'{"messages": "' + b"a" * 70000 + b'"}', 413),
    ]


def test_bad_input_on_every_route_gets_clear_4xx_and_node_keeps_serving(node, client):
    n, trainer, _ = node
    sender = Identity.generate()
    req = RolloutRequest(
        request_id="bad", prompt_ids=[1, 2, 3], seed=1, sampling=SamplingParams(max_tokens=4)
    )
    replayed = seal(sender, req)
    assert httpx.post(f"{n.url}/v1/rollouts", content=replayed, headers=MSGPACK).status_code == 200
    cases = []
    for route in ("/v1/chat/completions", "/v1/completions"):
        for name, body, status in _json_cases():
            cases.append((route, name, body, status))
    cases += [
        (
            "/v1/completions",
            "token id outside vocab",
            json.dumps({"prompt": [1, 10**6]}).encode(),
            400,
        ),
        ("/v1/completions", "empty prompt", json.dumps({"prompt": []}).encode(), 400),
        ("/tokenize", "neither prompt nor messages", b"{}", 400),
        ("/tokenize", "malformed json", b"{", 400),
    ]
    for route in ("/v1/rollouts", "/v1/verify", "/v1/weights/update", "/v1/weights/reload"):
        cases += [
            (route, "malformed msgpack", b"\xc1\xc1garbage", 400),
            (route, "msgpack of wrong shape", msgpack.packb([1, 2, 3]), 400),
            (route, "oversized", b"\x00" * 70000, 413),
            (
                route,
                "wrong message kind",
                seal(sender, WeightReload(version=0))
                if route != "/v1/weights/reload"
                else seal(trainer, req),
                400,
            ),
        ]
    signed = {
        "/v1/rollouts": req,
        "/v1/verify": VerifyRequest(rollout_envelope=b"junk"),
        "/v1/weights/update": WeightUpdate(version=1, path="/x"),
        "/v1/weights/reload": WeightReload(version=0),
    }
    for route, msg in signed.items():
        who = trainer if "weights" in route else sender
        cases += [
            (route, "bad signature", _bad_sig(who, msg), 401),
            (route, "expired", _expired(who, msg), 401),
        ]
    cases += [
        ("/v1/rollouts", "replayed", replayed, 409),
        ("/v1/verify", "rollout envelope is junk", seal(sender, signed["/v1/verify"]), 400),
        (
            "/v1/rollouts",
            "prompt too long for the model",
            seal(sender, req.model_copy(update={"prompt_ids": [5] * 600})),
            400,
        ),
    ]
    failures = []
    for route, name, body, status in cases:
        r = httpx.post(
            f"{n.url}{route}",
            content=body,
            headers=MSGPACK
            if "json" not in name and route.startswith("/v1/") and "completions" not in route
            else {"Content-Type": "application/json"},
        )
        ok = r.status_code == status and r.json()["error"]["message"]
        if not ok:
            failures.append((route, name, r.status_code, r.text[:200]))
    assert httpx.get(f"{n.url}/v1/rollouts/no-such-id").status_code == 404
    assert not failures, failures
    # Still serving, and the OpenAI client sees a proper error object.
    assert n.alive() and n.health()["status"] == "ok"
    with pytest.raises(BadRequestError, match="'response_format' is not supported"):
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "a"}],
            response_format={"type": "json_object"},
        )
    resp = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a"}], max_tokens=3
    )
    assert resp.usage.completion_tokens <= 3
    time.sleep(0.1)
    assert "-> 4" in n.log_path.read_text()  # every refusal left a log line


def test_the_openai_client_streams_and_gets_several_choices(node, client):
    """`stream=True` gives OpenAI's server-sent chunks, which add up to the same answer as
    the unstreamed call with that seed; `n` gives n rollouts, each signed and fetchable."""
    n, _, _ = node
    ask = dict(
        model="tiny",
        messages=[{"role": "user", "content": "stream me"}],
        max_tokens=12,
        seed=7,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**ask)
    chunks = list(
        client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    assert ids == whole.choices[0].model_extra["token_ids"]
    lps = [e.logprob for c in chunks if c.choices for e in c.choices[0].logprobs.content]
    assert lps == [e.logprob for e in whole.choices[0].logprobs.content]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12
    several = client.chat.completions.create(**(ask | {"seed": 9}), n=3)
    assert [c.index for c in several.choices] == [0, 1, 2]
    rids = [c.model_extra["rollout_id"] for c in several.choices]
    assert len(set(rids)) == 3
    for c, rid in zip(several.choices, rids, strict=True):
        raw = httpx.get(f"{n.url}/v1/rollouts/{rid}").content
        signed = open_envelope(raw, Rollout, check_expiry=False).message
        assert signed.completion_ids == c.model_extra["token_ids"]
    # A request id this node already holds a signed rollout for is refused, not replaced.
    r = httpx.post(
        f"{n.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "request_id": rids[0]},
    )
    assert r.status_code == 409 and "used before" in r.json()["error"]["message"]


def test_the_openai_client_calls_tools_against_a_node(node, client):
    """A standalone node renders a request's tools and reads calls out of its own signed
    rollout as the scheduler does (`protocol.tools`): 'required' starts the turn with the
    call's opening, which is in the signed prompt; the answer, whole or streamed, is the
    parse of the signed completion (the tiny model's random weights rarely write JSON, so
    mostly the text as written with `tool_call_error` beside it); a tool message that answers no
    call and a named choice outside the tools are 400s."""
    from protocol.openai import ChatCompletionRequest
    from protocol.tools import INVALID, parse

    n, _, _ = node
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {}}}
    ask = dict(
        model="tiny",
        messages=[{"role": "user", "content": "find x"}],
        max_tokens=10,
        seed=3,
        tools=[tool],
        tool_choice="required",
    )
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True))
    (c,) = whole.choices
    raw = httpx.get(f"{n.url}/v1/rollouts/{c.model_extra['rollout_id']}").content
    signed = open_envelope(raw, Rollout, check_expiry=False).message
    body = ChatCompletionRequest.model_validate(ask)
    ctx = body.tool_context()
    tok = n_tokenizer()
    assert signed.prompt_ids[-len(tok.encode(ctx.prefill)) :] == tok.encode(ctx.prefill)
    text = tok.decode(signed.completion_ids)
    content, calls, finish = parse(text, ctx, signed.request_id)
    assert c.finish_reason == ("tool_calls" if calls else signed.finish_reason)
    assert ("tool_call_error" in c.model_extra) == (finish == INVALID)
    assert c.message.content == content
    assert [tc.model_dump() for tc in c.message.tool_calls or []] == calls
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == (content or "")  # same seed, same rollout
    for bad, said in (
        ({"messages": [{"role": "tool", "tool_call_id": "z", "content": "1"}]}, "matches none"),
        ({"tool_choice": {"type": "function", "function": {"name": "other"}}}, "not in tools"),
    ):
        with pytest.raises(BadRequestError, match=said):
            client.chat.completions.create(**(ask | bad))


def n_tokenizer():
    from protocol.tokenizer import ChatTokenizer
    from verifier.models import resolve_model

    return ChatTokenizer(resolve_model("tiny"))
