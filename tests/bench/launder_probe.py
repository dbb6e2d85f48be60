"""A laundering cheat, measured: tokens from a cheaper model (weight noise), claims
(logprobs, proof rows) from one prefill of the real model, the cheapest liar there is
once proofs and logprobs only attest "a prefill of these tokens". Prints, per strategy, the
mean |logprob error| the per-node evidence sees (an honest node claims its decode's
logprobs, the liar a prefill's), the share of tokens whose seeded choice
the replay does not reproduce, and the share of rollouts over the replay tolerance.

    .venv/bin/python tests/bench/launder_probe.py tiny 96 32   # model, rollouts, max tokens
"""

import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from adversaries import perturbed_engine  # noqa: E402

from node.config import EngineConfig  # noqa: E402
from node.engines.base import GenerationRequest  # noqa: E402
from node.engines.torch_engine import TorchEngine  # noqa: E402
from protocol.messages import SamplingParams  # noqa: E402
from verifier.sampling import RowParams, replay_rows, token_logprobs  # noqa: E402

model, n, max_tok = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
eng = TorchEngine(EngineConfig(model=model, device="cpu", dtype="bfloat16"))
rng = random.Random(0)
prompts = [[rng.randrange(3, eng.vocab_size) for _ in range(rng.randint(4, 16))] for _ in range(n)]
sp = SamplingParams(temperature=1.0, max_tokens=max_tok)
for name, gen in (
    ("honest", eng),
    ("launder_noise_1e-2", perturbed_engine(eng, 1e-2)),
    ("launder_noise_3e-3", perturbed_engine(eng, 3e-3)),
):
    reqs = [GenerationRequest(p, sp, seed=7000 + i) for i, p in enumerate(prompts)]
    outs = []
    for s in range(0, n, 16):
        outs += gen.generate(reqs[s : s + 16])
    # the claims: the real model's prefill (the engine's own claims path for honest)
    claims = [
        eng.prefill([(r.prompt_ids, o.completion_ids)])[0] for r, o in zip(reqs, outs, strict=True)
    ]
    lp_err, gaps_max, frac = [], [], []
    for s in range(0, n, 8):
        idx = list(range(s, min(n, s + 8)))
        pre = eng.prefill([(reqs[i].prompt_ids, outs[i].completion_ids) for i in idx])
        for i, pr in zip(idx, pre, strict=True):
            toks = outs[i].completion_ids
            if name == "honest":  # what an honest torch engine claims: its decode's logprobs
                cl = torch.tensor(outs[i].logprobs)
            else:
                cl = token_logprobs(claims[i].logits, torch.tensor(toks)[:, None])
            v = token_logprobs(pr.logits, torch.tensor(toks)[:, None])
            lp_err.append(float((cl - v).abs().mean()))
            rep = replay_rows(
                pr.logits,
                toks,
                [RowParams(1.0, 0, 1.0)] * len(toks),
                [reqs[i].seed] * len(toks),
                list(range(len(toks))),
                0.0,
            )
            g = rep.score_gap
            gaps_max.append(float(g.max()))
            frac.append(float((g > 1e-6).float().mean()))
    srt = sorted(gaps_max)
    print(
        f"{name:20s} mean|lp err| {sum(lp_err) / n:.4f}  tokens with a replay gap {sum(frac) / n:.3f}  rollouts with max gap > 0.098 (tiny bf16 tolerance): {sum(x > 0.098 for x in gaps_max) / n:.2f}  median max gap {srt[n // 2]:.3f}"
    )
