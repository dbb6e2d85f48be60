"""Where does a pool's path leave the slot decode's exactness? (issue 27, item 1)

The slot decode matched a verifier's prefill exactly in `bench_trust_stats` (static
batches of 16 to 256), but not in the GPU main job (p99.9 of the per-rollout max logprob
error 0.17). This probe runs one generating engine and one verifying engine (separate
instances, as two nodes are) through the paths a pool takes and a static bench does not,
and says per path how far the verifier's recomputation lands from the generator's claims:

- `static`: one batch of 64 through `generate` (the bench's path; the reference);
- `trickle`: `generate_stream` with one request joining at each readback (joiner
  prefills of one prompt, slot buckets that grow and shrink);
- `single`: requests one at a time (slot bucket 1, no other slot);
- `filter-mix`: every fourth request filters (top-p 0.9), so steps switch between the
  fused and the torch sampling paths under the others;
- `bucket-edge`: prompts whose completions cross a 128-token length bucket;
- `swapped`: `trickle` again after both engines hot-swapped perturbed weights;
- `single, min rows m`: `single` under `EngineConfig.decode_min_rows = m` (a step runs at
  least m rows), for each m of `--min-rows-sweep`.

Each path's rollouts are verified twice: one at a time (a prefill without padding) and
in shuffled batches of 8 (right-padded). Per path and verification: the per-rollout max
|claimed - recomputed logprob|, tokens off the replayed seeded choice (a score gap above
`verifier.checks.OFF_REPLAY_GAP`), the largest difference of a proof row (hidden
state) from the verifier's, and where the first token off by more than 1e-3 sits.

    python3 tests/bench/pool_path_probe.py --model smollm2 --device cuda --out $OUT/pool_path
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from node.config import EngineConfig  # noqa: E402
from node.engines.base import GenerationRequest, GenerationResult  # noqa: E402
from node.engines.torch_engine import TorchEngine  # noqa: E402
from protocol.messages import SamplingParams  # noqa: E402
from verifier.checks import OFF_REPLAY_GAP  # noqa: E402
from verifier.sampling import RowParams, replay  # noqa: E402

WORDS = "the a reverse text of cat dog sky blue red green number four seven apple tree river"


def prompts(eng: TorchEngine, n: int, rng: random.Random, words: tuple[int, int]) -> list:
    vocab = WORDS.split()
    out = []
    for _ in range(n):
        text = "Reverse this text: " + " ".join(
            rng.choice(vocab) for _ in range(rng.randint(*words))
        )
        chat = [{"role": "user", "content": text}]
        text = eng.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        out.append(list(eng.tokenizer(text)["input_ids"]))
    return out


def requests(ps: list[list[int]], max_tokens: int, seed0: int, filter_every: int = 0):
    out = []
    for i, p in enumerate(ps):
        top_p = 0.9 if filter_every and i % filter_every == 0 else 1.0
        sp = SamplingParams(temperature=1.0, top_p=top_p, max_tokens=max_tokens)
        out.append(GenerationRequest(p, sp, seed=seed0 + i))
    return out


def trickle(eng: TorchEngine, reqs: list[GenerationRequest]) -> list[GenerationResult]:
    """One request to start, then one more joins at each readback."""
    queue = list(enumerate(reqs))
    done: dict[int, GenerationResult] = {}
    first = [queue.pop(0)]

    def more(k: int):
        return [queue.pop(0)] if queue and k > 0 else []

    eng.generate_stream([r for _, r in first], more, lambda group: done.update(group))
    return [done[i] for i in range(len(reqs))]


def judge(ver: TorchEngine, reqs, results, batch: int, rng: random.Random) -> dict:
    order = list(range(len(reqs)))
    rng.shuffle(order)
    errs, off, row_err, tokens, first_bad = [], 0, 0.0, 0, []
    for s in range(0, len(order), batch):
        idx = order[s : s + batch]
        pre = ver.prefill([(reqs[i].prompt_ids, results[i].completion_ids) for i in idx])
        for i, p in zip(idx, pre, strict=True):
            r, g = reqs[i], results[i]
            sp = r.sampling
            rep = replay(
                p.logits,
                g.completion_ids,
                RowParams(sp.temperature, sp.top_k, sp.top_p),
                r.seed,
                0.01,
            )
            claimed = torch.tensor(g.logprobs)
            err = (claimed - rep.logprobs.cpu()).abs()
            errs.append(float(err.max()))
            if errs[-1] > 1e-3:
                first_bad.append(int((err > 1e-3).nonzero()[0, 0]))
            off += int((rep.score_gap.cpu() > OFF_REPLAY_GAP).sum())
            tokens += len(g.completion_ids)
            d = (g.hidden_states.cpu().float() - p.hidden_states.cpu().float()).abs().max()
            row_err = max(row_err, float(d))
    errs.sort()
    return {
        "rollouts": len(errs),
        "tokens": tokens,
        "median_max_err": errs[len(errs) // 2],
        "max_err": errs[-1],
        "rollouts_err_over_1e-3": sum(e > 1e-3 for e in errs),
        "tokens_off_replay": off,
        "max_row_err": row_err,
        "first_bad_token": sorted(first_bad)[:12],
    }


def perturbed(eng: TorchEngine, scale: float, folder: Path) -> Path:
    g = torch.Generator().manual_seed(7)
    state = {}
    for k, v in eng.model.state_dict().items():
        w = v.detach().float().cpu()
        if w.is_floating_point() and w.numel() > 1:
            w = w + torch.randn(w.shape, generator=g) * (w.std() * scale)
        state[k] = w.to(v.dtype).contiguous()
    if getattr(eng.model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(folder / "model.safetensors"))
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rollouts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument(
        "--min-rows-sweep",
        default="1,4,8,16,32,64",
        help="`single` again under each `EngineConfig.decode_min_rows` (comma-separated)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, decode="slots", max_batch_size=64
    )
    gen, ver = TorchEngine(cfg), TorchEngine(cfg)
    rng = random.Random(0)
    n = args.rollouts
    short = prompts(gen, n, rng, (3, 12))
    long = prompts(gen, n, rng, (40, 46))  # about 100-128 tokens: completions cross 128
    paths = {
        "static": lambda: (r := requests(short, args.max_tokens, 1000), gen.generate(r)),
        "trickle": lambda: (r := requests(short, args.max_tokens, 2000), trickle(gen, r)),
        "single": lambda: (
            r := requests(short[:16], args.max_tokens, 3000),
            [gen.generate([x])[0] for x in r],
        ),
        "filter-mix": lambda: (r := requests(short, args.max_tokens, 4000, 4), trickle(gen, r)),
        "bucket-edge": lambda: (r := requests(long, args.max_tokens, 5000), trickle(gen, r)),
    }
    rows: dict[str, dict] = {}
    console = Console(width=170)

    def run(name: str, make) -> None:
        reqs, results = make()
        for batch in (1, 8):
            rows[f"{name} / verify x{batch}"] = judge(ver, reqs, results, batch, rng)
            console.print(f"{name} verify x{batch}", rows[f"{name} / verify x{batch}"])

    for name, make in paths.items():
        run(name, make)
    for m in [int(x) for x in args.min_rows_sweep.split(",") if x]:
        alone = TorchEngine(cfg.model_copy(update={"decode_min_rows": m}))
        reqs = requests(short[:16], args.max_tokens, 6000)
        results = [alone.generate([x])[0] for x in reqs]
        rows[f"single, min rows {m} / verify x8"] = judge(ver, reqs, results, 8, rng)
        console.print(f"min rows {m}", rows[f"single, min rows {m} / verify x8"])
        alone.close()
        del alone
    with tempfile.TemporaryDirectory() as tmp:
        folder = perturbed(gen, 0.02, Path(tmp))
        gen.load_weights(folder, 1)
        ver.load_weights(folder, 1)
        run("swapped", paths["trickle"])
    table = Table(
        title=f"pool paths against a verifier's prefill ({args.model} {args.dtype} {args.device})"
    )
    cols = list(next(iter(rows.values())))
    table.add_column("path / verification")
    for c in cols:
        table.add_column(c.replace("_", " "), justify="right")
    for k, v in rows.items():
        table.add_row(k, *[f"{v[c]:.3g}" if isinstance(v[c], float) else str(v[c]) for c in cols])
    console.print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".json").write_text(
            json.dumps({"args": vars(args), "paths": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
