"""Honest claims from the decode against claims from a prefill, measured.

Generates rollouts in batches (`--gen-batch`), takes each rollout's claims two ways, the
decode's logprobs (what the torch engine reports) and those of a prefill of prompt +
completion in the generation batch, and compares both with a verifier's prefill in other,
shuffled batches (`--verify-batch`): the per-rollout max |logprob error| (median, p90, p99,
max). The second column is what honest noise would be if the engine took its claims from
a prefill (tests/bench/README.md, "The main job on the H200").

    .venv/bin/python tests/bench/claims_probe.py --model smollm2 --rollouts 128 --max-tokens 32
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from node.config import EngineConfig  # noqa: E402
from node.engines.base import GenerationRequest  # noqa: E402
from node.engines.torch_engine import TorchEngine  # noqa: E402
from protocol.messages import SamplingParams  # noqa: E402
from verifier.sampling import token_logprobs  # noqa: E402

WORDS = "the a reverse text of cat dog sky blue red green number four seven apple tree river"


def logprobs_of(logits: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    return token_logprobs(logits.float(), torch.tensor(tokens)[:, None])


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rollouts", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--gen-batch", type=int, default=16)
    ap.add_argument("--verify-batch", type=int, default=8)
    args = ap.parse_args()
    eng = TorchEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype))
    rng = random.Random(0)
    words = WORDS.split()
    prompts = []
    for _ in range(args.rollouts):
        text = "Reverse this text: " + " ".join(
            rng.choice(words) for _ in range(rng.randint(3, 12))
        )
        chat = [{"role": "user", "content": text}]
        templated = eng.tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=False
        )
        prompts.append(eng.tokenizer(templated)["input_ids"])
    sampling = SamplingParams(temperature=1.0, max_tokens=args.max_tokens)
    gens = []  # (prompt, completion, decode claims, prefill claims)
    for s in range(0, args.rollouts, args.gen_batch):
        reqs = [
            GenerationRequest(p, sampling, seed=1000 + s + i)
            for i, p in enumerate(prompts[s : s + args.gen_batch])
        ]
        outs = eng.generate(reqs)
        pre = eng.prefill(
            [(r.prompt_ids, g.completion_ids) for r, g in zip(reqs, outs, strict=True)]
        )
        for r, g, p in zip(reqs, outs, pre, strict=True):
            prefill_claims = logprobs_of(p.logits, g.completion_ids)
            gens.append((r.prompt_ids, g.completion_ids, torch.tensor(g.logprobs), prefill_claims))
    order = list(range(args.rollouts))
    rng.shuffle(order)
    errors: dict[str, list[float]] = {"decode claims": [], "prefill claims": []}
    for s in range(0, args.rollouts, args.verify_batch):
        idx = order[s : s + args.verify_batch]
        for i, p in zip(idx, eng.prefill([gens[i][:2] for i in idx]), strict=True):
            ours = logprobs_of(p.logits, gens[i][1])
            errors["decode claims"].append(float((gens[i][2] - ours).abs().max()))
            errors["prefill claims"].append(float((gens[i][3] - ours).abs().max()))
    for name, xs in errors.items():
        print(
            f"{name:15s} per-rollout max |logprob error|: median {quantile(xs, 0.5):.4f} "
            f"p90 {quantile(xs, 0.9):.4f} p99 {quantile(xs, 0.99):.4f} max {max(xs):.4f}"
        )
    print(f"{args.rollouts} rollouts of up to {args.max_tokens} tokens, {args.model} {args.dtype}")


if __name__ == "__main__":
    main()
