"""An honest node is never punished for a request's parameters.

Owns that property, at two levels. Worker level: for every `SamplingParams` that
validates and any short prompt, the rollout an honest node generates (in one batch with
up to two other requests of other parameters) passes its own verification and another
node's (its own identity, its prefill batched with other rollouts): in-process
`node.worker.Worker`s over the real tiny model (character tokenizer, 100 ids) with the
thresholds of configs/verification/tiny-torch-cpu-fp32.toml. Sampler level: the sampler
and the replay agree on logits full of exact ties and near-ties. And the other half: the
values that cannot be treated consistently are refused by `SamplingParams`, with a
message naming them.
"""

from __future__ import annotations

import asyncio
import itertools
import tomllib
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from node.worker import SignedRollout, Worker
from protocol.identity import Identity
from protocol.messages import (
    MAX_SEED,
    MAX_TOP_K,
    MIN_TEMPERATURE,
    RolloutRequest,
    SamplingParams,
    Verdict,
    VerificationPolicy,
    VerifyRequest,
)
from tests.conftest import random_chat_prompts
from tests.nodes import REPO
from verifier.sampling import RowParams, param_tensors, replay_rows, sample, support_mask

POLICY = VerificationPolicy(
    **tomllib.loads((REPO / "configs/verification/tiny-torch-cpu-fp32.toml").read_text())[
        "verification"
    ]
)
TINY_VOCAB = 100
GENERATOR, OTHER = Identity.generate(), Identity.generate()
_IDS = itertools.count()


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The tensors here are tiny: one intra-op thread is faster than two, and a hundred
    times faster when other processes keep the cores busy (threads wait on each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- strategies

temperatures = st.one_of(
    st.just(0.0),
    st.sampled_from([MIN_TEMPERATURE, 0.05, 1.0, 10.0]),
    st.floats(MIN_TEMPERATURE, 10.0),
)
# Values that vanish or turn subnormal in float32 are drawn often: they are the issue's.
top_ps = st.one_of(
    st.sampled_from([1.0, 1e-300, 5e-324, 1e-46, 1e-45, 1e-38, 1e-7, 0.5, 1 - 1e-9]),
    st.floats(0.0, 1.0, exclude_min=True),
)
top_ks = st.one_of(
    st.sampled_from([0, 1, 2, TINY_VOCAB - 1, TINY_VOCAB, TINY_VOCAB + 1, MAX_TOP_K]),
    st.integers(0, 2 * TINY_VOCAB),
    st.integers(0, MAX_TOP_K),
)
# Characters the tokenizer has ("a", "e", " ", "\n", "\t", "."), ones it has not
# ("é", "€", a no-break space), multi-byte ones (2 to 4 UTF-8 bytes) and the replacement
# character a partial decode produces; plus the special tokens' own text.
STOP_ALPHABET = "ae .\n\t" + "é€😀\ufffd\u00a0"
SPECIAL_STOPS = ["<|im_end|>", "<|im_start|>", "<|pad|>", "  ", " \n", "\n\n", "\t \t"]
stop_strings = st.one_of(
    st.text(alphabet=STOP_ALPHABET, min_size=1, max_size=3), st.sampled_from(SPECIAL_STOPS)
)
sampling_params = st.builds(
    SamplingParams,
    temperature=temperatures,
    top_p=top_ps,
    top_k=top_ks,
    max_tokens=st.integers(1, 24),
    stop=st.lists(stop_strings, max_size=3).map(tuple),
    ignore_eos=st.booleans(),
)


@dataclass(frozen=True)
class Job:
    sampling: SamplingParams
    prompt_seed: int
    prompt_len: int
    seed: int
    # (where, length): add a stop string cut from the text this job generates without it,
    # so stop strings do end completions (a drawn one rarely appears in random text).
    stop_cut: tuple[float, int] | None = None


jobs = st.builds(
    Job,
    sampling=sampling_params,
    prompt_seed=st.integers(0, 2**32 - 1),
    prompt_len=st.integers(1, 20),
    seed=st.one_of(st.sampled_from([0, MAX_SEED]), st.integers(0, MAX_SEED)),
    stop_cut=st.none() | st.tuples(st.floats(0.0, 1.0), st.integers(1, 12)),
)
# The first job is the one under test; the others share its generation batch.
batches = st.lists(jobs, min_size=1, max_size=3)

# ---------------------------------------------------------------- harness


def make_request(tokenizer, job: Job) -> RolloutRequest:
    prompt = random_chat_prompts(tokenizer, 1, job.prompt_seed, 1, job.prompt_len)[0]
    return RolloutRequest(
        request_id=f"honest-{next(_IDS)}", prompt_ids=prompt, sampling=job.sampling, seed=job.seed
    )


def _worker(engine, identity: Identity) -> Worker:
    # batch_wait_s > 0: requests submitted together form one engine batch.
    return Worker(engine, identity, POLICY, max_batch_size=8, batch_wait_s=0.01, max_model_len=512)


Checked = list[tuple[str, RolloutRequest, Verdict]]


async def generate_and_verify(
    engine, requests: list[RolloutRequest], fillers: list[SignedRollout]
) -> tuple[list[SignedRollout], Checked]:
    """Generate `requests` in one batch on the generator, then verify each rollout on the
    generator alone and on the other node in one prefill batch with `fillers` (other
    rollouts of other lengths). Returns the rollouts and every (verifier, request, verdict)."""
    gen, other = _worker(engine, GENERATOR), _worker(engine, OTHER)
    gen.start()
    other.start()
    try:
        signed = await asyncio.gather(*(gen.generate(r) for r in requests))
        out = []
        for r, s in zip(requests, signed, strict=True):
            verdict, _ = await gen.verify(VerifyRequest(rollout_envelope=s.envelope, request=r))
            out.append(("own", r, verdict))
        mixed = list(zip(requests, signed, strict=True)) + [(None, f) for f in fillers]
        verdicts = await asyncio.gather(
            *(other.verify(VerifyRequest(rollout_envelope=s.envelope, request=r)) for r, s in mixed)
        )
        out += [("other", r, v) for (r, _), (v, _) in zip(mixed, verdicts, strict=True) if r]
        return list(signed), out
    finally:
        await gen.stop()
        await other.stop()


def assert_all_accepted(results: Checked) -> None:
    bad = [
        f"{who} verifier rejected {r.sampling!r} seed={r.seed}: {v.reasons}"
        for who, r, v in results
        if not v.accepted
    ]
    assert not bad, "\n".join(bad)


class Fillers(list):
    """Rollouts to batch the other node's prefill with (short repr in failure reports)."""

    def __repr__(self) -> str:
        return f"<{len(self)} filler rollouts>"


@pytest.fixture(scope="module")
def fillers(tiny_engine) -> Fillers:
    """Two rollouts of other lengths (24 and 5 tokens) and other prompts."""
    reqs = [
        make_request(
            tiny_engine.tokenizer, Job(SamplingParams(max_tokens=n, ignore_eos=True), s, 30, s)
        )
        for n, s in ((24, 1), (5, 2))
    ]

    async def run() -> Fillers:
        gen = _worker(tiny_engine, GENERATOR)
        gen.start()
        try:
            return Fillers(await asyncio.gather(*(gen.generate(r) for r in reqs)))
        finally:
            await gen.stop()

    return asyncio.run(run())


def with_cut_stops(engine, requests: list[RolloutRequest], batch: list[Job]):
    """`requests` with each job's `stop_cut` stop string added, cut from what the same batch
    generates without it (the same batch: the same numerics, so the cut is reached)."""
    if all(j.stop_cut is None for j in batch):
        return requests

    async def probe() -> list[SignedRollout]:
        gen = _worker(engine, GENERATOR)
        gen.start()
        try:
            return list(await asyncio.gather(*(gen.generate(r) for r in requests)))
        finally:
            await gen.stop()

    out = []
    for req, job, s in zip(requests, batch, asyncio.run(probe()), strict=True):
        text = engine.tokenizer.decode(s.rollout.completion_ids, skip_special_tokens=False)
        if job.stop_cut is not None:
            where, length = job.stop_cut
            start = min(int(where * len(text)), len(text) - 1)
            cut = text[start : start + length]
            sampling = req.sampling.model_copy(update={"stop": (*req.sampling.stop, cut)})
            req = req.model_copy(update={"sampling": SamplingParams(**sampling.model_dump())})
        out.append(req)
    return out


def check_batch(engine, fillers: list[SignedRollout], batch: list[Job]) -> None:
    requests = [make_request(engine.tokenizer, j) for j in batch]
    requests = with_cut_stops(engine, requests, batch)
    signed, results = asyncio.run(generate_and_verify(engine, requests, fillers))
    # What the examples exercised (pytest --hypothesis-show-statistics).
    r = signed[0].rollout
    ended_by_eos = r.completion_ids[-1] in engine.eos_token_ids and not r.sampling.ignore_eos
    event(f"finish_reason={r.finish_reason}" + (" (EOS)" if ended_by_eos else ""))
    if r.finish_reason == "stop" and not ended_by_eos:
        event(
            "a stop string ended it"
            + (" (special-token text)" if "|" in r.sampling.stop[-1] else "")
        )
    event(f"top_p is 0 in float32: {float(torch.tensor(r.sampling.top_p)) == 0.0}")
    if r.sampling.ignore_eos and set(r.completion_ids) & engine.eos_token_ids:
        event("EOS inside an ignore_eos completion")
    assert_all_accepted(results)


# ---------------------------------------------------------------- the property

_SETTINGS = dict(
    deadline=None,
    database=None,  # nothing written into the repository
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@settings(max_examples=100, **_SETTINGS)
@given(batch=batches)
def test_honest_rollout_passes_both_verifiers(tiny_engine, fillers, batch):
    check_batch(tiny_engine, fillers, batch)


@pytest.mark.slow
@settings(max_examples=300, **_SETTINGS)
@given(batch=batches)
def test_honest_rollout_passes_both_verifiers_many(tiny_engine, fillers, batch):
    check_batch(tiny_engine, fillers, batch)


# ---------------------------------------------------------------- the sampler and the masks
# The same property one level down, where near-ties are easy to make: logits on a coarse
# grid (exact ties everywhere), the verifier's copy off by up to 1e-6 (a batch-composition
# difference in fp32), top_p sometimes exactly a cumulative mass of the row.

LOGIT_ERROR = 1e-6


@st.composite
def sampled_batches(draw) -> tuple[torch.Tensor, list[RowParams], list[int]]:
    vocab = draw(st.integers(2, 48))
    rows = draw(st.integers(1, 6))
    scale = draw(st.sampled_from([0.05, 0.5, 2.0]))
    grid = st.lists(st.integers(-6, 6), min_size=vocab, max_size=vocab)
    logits = torch.tensor([draw(grid) for _ in range(rows)], dtype=torch.float32) * scale
    params = []
    for row in logits:
        s = draw(sampling_params)
        top_p = s.top_p
        if draw(st.booleans()):  # the nucleus boundary falls exactly on a token
            scaled = row.double() / (s.temperature or 1.0)
            mass = torch.softmax(scaled, -1).sort(descending=True).values.cumsum(-1)
            top_p = min(1.0, float(mass[draw(st.integers(0, vocab - 1))]))
        params.append(RowParams(s.temperature, s.top_k, top_p))
    seeds = draw(st.lists(st.integers(0, MAX_SEED), min_size=rows, max_size=rows))
    return logits, params, seeds


def _check_sampler_and_replay(batch, noise_seed: int) -> None:
    logits, params, seeds = batch
    n = len(params)
    positions = list(range(n))
    out = sample(logits, params, seeds, positions)
    t, k, p = param_tensors(params, logits.shape[-1], logits.device)
    scaled = logits / t[:, None]
    strict = support_mask(scaled, k, p)
    for i in range(n):
        # Each row is sampled as if alone: its neighbours' parameters do not matter.
        alone = sample(logits[i : i + 1], params[i : i + 1], seeds[i : i + 1], [i])
        assert alone.tokens[0] == out.tokens[i], f"row {i} depends on its batch"
        if strict is not None:
            kept = strict[i]
            # Never empty, always holds a most likely token, holds the sampled one.
            assert scaled[i][kept].max() == scaled[i].max(), f"{params[i]} lost the top token"
            assert kept[out.tokens[i]], f"{params[i]} sampled outside its support"
    g = torch.Generator().manual_seed(noise_seed)
    theirs = logits + (torch.rand(logits.shape, generator=g) * 2 - 1) * LOGIT_ERROR
    for verifier_logits in (logits, theirs):
        rep = replay_rows(
            verifier_logits, out.tokens.tolist(), params, seeds, positions, POLICY.support_tolerance
        )
        assert rep.in_support.all(), f"support: {params} {rep.in_support.tolist()}"
        assert (rep.score_gap <= POLICY.sampling_tolerance).all(), (
            f"sampling: {params} {rep.score_gap.tolist()}"
        )
        diff = (rep.logprobs - out.logprobs).abs()
        assert (diff <= POLICY.max_logprob_abs_diff).all(), f"logprobs: {params} {diff.tolist()}"


@settings(max_examples=300, **_SETTINGS)
@given(batch=sampled_batches(), noise_seed=st.integers(0, 2**32 - 1))
def test_sampler_and_replay_agree_on_every_valid_parameter(batch, noise_seed):
    _check_sampler_and_replay(batch, noise_seed)


@pytest.mark.slow
@settings(max_examples=1000, **_SETTINGS)
@given(batch=sampled_batches(), noise_seed=st.integers(0, 2**32 - 1))
def test_sampler_and_replay_agree_on_every_valid_parameter_many(batch, noise_seed):
    _check_sampler_and_replay(batch, noise_seed)


@pytest.mark.parametrize(
    "param", [RowParams(1.0, 1, 1.0), RowParams(0.0, 1, 1.0), RowParams(1.0, 0, 1e-300)]
)
def test_near_tie_at_the_most_likely_token_is_not_punished(param):
    """The generator's top token leads by 1e-6; on the verifier the runner-up leads by
    1e-6. With one token in the support, either is an honest choice."""
    n = 64
    g = torch.Generator().manual_seed(0)
    ours = torch.randn(n, 50, generator=g)
    top2 = ours.topk(2).indices
    rows = torch.arange(n)
    first = ours[rows, top2[:, 0]]
    ours[rows, top2[:, 1]] = first - LOGIT_ERROR
    theirs = ours.clone()
    theirs[rows, top2[:, 1]] = first + LOGIT_ERROR
    seeds, positions = [3] * n, list(range(n))
    out = sample(ours, [param] * n, seeds, positions)
    assert torch.equal(out.tokens, top2[:, 0])
    rep = replay_rows(
        theirs, out.tokens.tolist(), [param] * n, seeds, positions, POLICY.support_tolerance
    )
    assert rep.in_support.all()
    assert (rep.score_gap <= POLICY.sampling_tolerance).all()
    # The slack does not open the support to tokens that are not near-ties.
    third = ours.topk(3).indices[:, 2].tolist()
    assert not replay_rows(
        theirs, third, [param] * n, seeds, positions, POLICY.support_tolerance
    ).in_support.any()


# ---------------------------------------------------------------- the request


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-46])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_vanishing_top_p_is_greedy_and_accepted(tiny_engine, fillers, top_p, temperature):
    """top_p = 1e-300 is 0 in float32; the nucleus is still the most likely token, so the
    rollout is the greedy one and both verifiers accept it (generated beside a greedy and
    a top_p = 1 neighbour, the batch mixing filtered and unfiltered rows)."""
    tok = tiny_engine.tokenizer
    tiny = Job(SamplingParams(temperature=temperature, top_p=top_p, max_tokens=16), 7, 20, 11)
    greedy = Job(SamplingParams(temperature=0.0, max_tokens=16), 7, 20, 11)
    neighbour = Job(SamplingParams(max_tokens=16), 8, 20, 12)
    requests = [make_request(tok, j) for j in (tiny, greedy, neighbour)]
    signed, results = asyncio.run(generate_and_verify(tiny_engine, requests, fillers))
    assert_all_accepted(results)
    assert len(results) == 6
    assert signed[0].rollout.prompt_ids == signed[1].rollout.prompt_ids
    assert signed[0].rollout.completion_ids == signed[1].rollout.completion_ids


@pytest.mark.parametrize("stop", [(), ("<|im_end|>",), ("im_e",), ("d|>",)])
def test_ignore_eos_and_special_token_stop_strings(tiny_engine, fillers, stop):
    """ignore_eos generates past EOS; a stop string matching the EOS token's text (all or
    part of it) still ends the completion there, in the engine and in the checks alike."""
    tok = tiny_engine.tokenizer
    sampling = SamplingParams(max_tokens=24, ignore_eos=True, stop=stop)
    requests = [make_request(tok, Job(sampling, i, 10, i)) for i in range(6)]
    signed, results = asyncio.run(generate_and_verify(tiny_engine, requests, fillers))
    assert_all_accepted(results)
    eos = tiny_engine.eos_token_ids
    with_eos = [s.rollout for s in signed if set(s.rollout.completion_ids) & eos]
    assert with_eos, "no completion met an EOS token: pick other seeds"
    for r in with_eos:
        if stop:
            assert r.finish_reason == "stop" and r.completion_ids[-1] in eos
        else:
            assert r.finish_reason == "length" and len(r.completion_ids) == 24


# ---------------------------------------------------------------- refused values


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", 1e-3, "temperature must be 0 (greedy) or at least 0.01"),
        ("temperature", 5e-324, "temperature must be 0 (greedy) or at least 0.01"),
        ("temperature", -0.5, "greater than or equal to 0"),
        ("temperature", 10.5, "less than or equal to 10"),
        ("temperature", float("nan"), "finite number"),
        ("temperature", float("inf"), "finite number"),
        ("top_p", 0.0, "greater than 0"),
        ("top_p", 1.5, "less than or equal to 1"),
        ("top_p", float("nan"), "finite number"),
        ("top_k", -1, "greater than or equal to 0"),
        ("top_k", 2**31, "less than or equal to 2147483647"),
        ("top_k", 2**64, "less than or equal to 2147483647"),
        ("max_tokens", 0, "greater than or equal to 1"),
        ("max_tokens", 65537, "less than or equal to 65536"),
        ("stop", ("",), "stop strings must not be empty"),
        ("stop", tuple("abcdefghi"), "at most 8 stop strings, got 9"),
        ("stop", ("x" * 65,), "at most 64 characters"),
        ("stop", ("\ud800",), "not valid Unicode"),
        ("stop", ("ok", "a\udfffb"), "not valid Unicode"),
    ],
)
def test_unverifiable_values_are_refused_with_a_message(field, value, message):
    with pytest.raises(ValidationError) as err:
        SamplingParams(**{field: value})
    assert err.value.errors()[0]["loc"] == (field,)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"temperature": MIN_TEMPERATURE},
        {"temperature": 10.0},
        {"top_p": 5e-324},
        {"top_k": MAX_TOP_K},
        {"max_tokens": 1},
        {"max_tokens": 65536},
        {"stop": ("x" * 64,) * 8},
        {"stop": ("😀", "\ufffd", "<|im_end|>", " ")},
    ],
)
def test_bounds_are_accepted(kwargs):
    assert SamplingParams(**kwargs).digest()  # validates and encodes (msgpack) for signing
