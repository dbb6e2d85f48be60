"""The slot decode (`node.engines.slot_decode`) on a CPU: what a user of the engine sees is
what the loop decode gives, request for request, while requests join and leave slots.

On a CPU in fp32 both decodes compute the same logits to rounding, so every sampler choice
(top-k, top-p, temperature, greedy), every stop (EOS, stop string, max_tokens) and every
claimed logprob must agree; the rollouts must pass the engine's own verification. The GPU
half (CUDA graphs, the fused kernel) is in test_gpu_paths.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from node.config import EngineConfig
from node.engines.base import GenerationRequest
from node.engines.common import StopWatcher
from node.engines.slot_decode import SlotDecoder
from node.engines.torch_engine import TorchEngine
from protocol.messages import SamplingParams


@pytest.fixture(scope="module")
def engines():
    loop = TorchEngine(EngineConfig(model="tiny", decode="loop"))
    slots = TorchEngine(
        EngineConfig(
            model="tiny", decode="slots", max_batch_size=6, max_model_len=256, decode_window=3
        )
    )
    return loop, slots


def _requests(n: int, vocab: int, seed: int = 0) -> list[GenerationRequest]:
    rng = random.Random(seed)
    kinds = [
        {},
        {"top_k": 5},
        {"top_p": 0.8, "temperature": 0.7},
        {"temperature": 0.0},
        {"stop": ["e"]},
        {"ignore_eos": True, "top_k": 40, "top_p": 0.95},
    ]
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 30))]
        sp = SamplingParams(max_tokens=rng.randrange(1, 60), **kinds[i % len(kinds)])
        out.append(GenerationRequest(prompt, sp, seed=rng.randrange(2**40)))
    return out


def test_slot_decode_gives_the_loop_decodes_completions(engines):
    loop, slots = engines
    reqs = _requests(30, loop.vocab_size)  # 30 requests through 6 slots: they join as others end
    expected = [loop.generate([r])[0] for r in reqs]
    got = slots.generate(reqs)
    assert slots.decode_steps["slots"] > 0
    for r, x, y in zip(reqs, expected, got, strict=True):
        assert y.completion_ids == x.completion_ids, r.sampling
        assert y.finish_reason == x.finish_reason
        assert len(y.logprobs) == len(y.completion_ids) == y.hidden_states.shape[0]
        assert torch.allclose(torch.tensor(y.logprobs), torch.tensor(x.logprobs), atol=1e-4)
        assert torch.allclose(y.hidden_states, x.hidden_states, atol=1e-4)
    # The stop-string requests stopped at "e" or ran to their length.
    for r, y in zip(reqs, got, strict=True):
        if r.sampling.stop and y.finish_reason == "stop":
            assert "e" in slots.tokenizer.decode(y.completion_ids)


def test_a_slot_freed_early_takes_the_next_request(engines):
    """Short and long requests mixed: the decoder runs fewer steps than batches of its
    slot count, each waiting for its longest, would have."""
    _, slots = engines
    sp_long = SamplingParams(max_tokens=48, ignore_eos=True)
    sp_short = SamplingParams(max_tokens=4, ignore_eos=True)
    reqs = [
        GenerationRequest([5, 6, 7], sp_long if i % 6 == 0 else sp_short, seed=i) for i in range(24)
    ]
    before = slots.decode_steps["slots"]
    got = slots.generate(reqs)
    steps = slots.decode_steps["slots"] - before
    assert [len(g.completion_ids) for g in got] == [r.sampling.max_tokens for r in reqs]
    # Four batches of six, each as long as its 48-token request: 4 x 48 steps.
    assert steps < 4 * 48 / 2, steps


def test_a_worker_answers_short_requests_while_a_long_one_runs(engines):
    """Requests reaching a worker while its engine generates join the running batch
    (`Batcher` streaming mode): a short request sent after a long one is answered first,
    and a weight swap waits only for the requests already taken."""
    import asyncio

    from node.worker import Worker
    from protocol.identity import Identity
    from protocol.messages import RolloutRequest, VerificationPolicy

    _, slots = engines
    worker = Worker(
        slots,
        Identity.generate(),
        VerificationPolicy(),
        max_batch_size=6,
        batch_wait_s=0.0,
        max_model_len=256,
    )

    def req(i: int, n: int) -> RolloutRequest:
        sp = SamplingParams(max_tokens=n, ignore_eos=True)
        return RolloutRequest(request_id=f"r{i}", prompt_ids=[5, 6, 7], sampling=sp, seed=i)

    async def main() -> list[str]:
        worker.start()
        order: list[str] = []

        async def one(r: RolloutRequest) -> None:
            signed = await worker.generate(r)
            assert len(signed.rollout.completion_ids) == r.sampling.max_tokens
            order.append(r.request_id)

        before = slots.decode_steps["slots"]
        long = asyncio.create_task(one(req(0, 240)))
        # The short requests arrive once the long one is decoding: not after a wall-clock
        # sleep, which a loaded machine can outlast. Twelve 3-token requests through five
        # free slots take about 30 steps; the long request takes 240.
        while slots.decode_steps["slots"] == before:
            await asyncio.sleep(0.001)
        await asyncio.gather(long, *(one(req(i, 3)) for i in range(1, 13)))
        await worker.stop()
        return order

    order = asyncio.run(main())
    assert order[-1] == "r0", order
    assert len(order) == 13


def test_idle_slots_riding_along_change_nothing(engines):
    """On a GPU a step runs at least `decode_min_rows` rows, idle slots riding along (with
    fewer, cuBLAS sums in another order than a verifier's prefill): a request decoded
    beside five idle slots gets what it gets in a step of its own."""
    _, slots = engines
    reqs = _requests(6, slots.vocab_size, seed=3)

    def decode(min_rows: int):
        dec = SlotDecoder(
            slots.model,
            slots=6,
            max_len=256,
            max_new=256,
            eos_ids=slots.eos_token_ids,
            window=3,
            min_rows=min_rows,
        )
        stop = lambda r: StopWatcher(slots.tokenizer, r.sampling.stop).hit  # noqa: E731
        out = [dict(x for g in dec.run(iter([(0, r)]), stop) for x in g)[0] for r in reqs]
        return dec, out

    alone, expected = decode(1)
    riding, got = decode(6)
    assert (alone.slot_buckets[0], riding.slot_buckets) == (1, [6])
    for x, y in zip(expected, got, strict=True):
        assert y.completion_ids == x.completion_ids
        assert torch.allclose(torch.tensor(y.logprobs), torch.tensor(x.logprobs), atol=1e-5)
