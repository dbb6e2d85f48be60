"""Raw honest and cheating verification statistics, per rollout, for a per-node sequential
test and tail-fitted thresholds (first step of "Verification that holds on GPUs in bf16").

Each strategy's rollouts are generated on the pool's torch engine (honest) or on a copy of
it that cheats (cheaper weights, other sampling, one steered token) while claiming the
pool's weights and sampling (temperature 1, top_p 1); the verifier (always the true
weights) prefills them in batches of `--verify-batch` in a shuffled order, so its batch
composition differs from the generator's. Every check runs with
`verifier.calibration.permissive_policy()` (nothing filtered) and the raw figures are kept:
per-token |claimed - verifier logprob|, per-token replay score gaps, tokens outside the
support, per proof chunk exponent mismatches / mantissa error mean / median, plus the
rollout-level check metrics. Rejection by a policy is recomputed from those raw figures
(the shipped tiny-torch-cpu-fp32 thresholds and the default `VerificationPolicy()`).

Strategies:
- honest_a, honest_b: two independent honest sets (different prompt and rollout seeds);
- int8, int4: per-output-channel symmetric weight quantization of every nn.Linear weight
  (127 / 7 levels each side), dequantized back (SmolLM2 ties lm_head to the embedding, so
  the embedding is quantized with it);
- fp8: every nn.Linear weight cast to float8_e4m3fn and back with a per-tensor scale;
- noise_1e-2, noise_3e-3, noise_1e-3: Gaussian noise of that scale x each tensor's std on
  every parameter (as `tests.adversaries.perturbed_engine`, on the engine's device);
- temp_0.8, top_p_0.9: generated with temperature 0.8 / top_p 0.9, signed as 1 / 1 (the
  generator's own logprobs claimed);
- steered: generated honestly, then one token at a random position k < n-1 is replaced by
  the generator's most likely token other than the sampled one (and other than EOS); the
  rest of the completion, the proof and the other logprobs are kept as generated, the
  claimed logprob of token k is the generator's logprob of the new token
  (variant "replace_keep_rest");
- launder_noise_1e-3, launder_int8, launder_int4, launder_fp8: the launder family
  (`tests.adversaries.launder`, issue 27): tokens from that cheaper model, every claim
  (logprobs, proof rows) from one batched prefill of the real one;
- near_tie: the real model's tokens except where its best two seeded scores are within
  `tests.adversaries.NEAR_TIE_MARGIN` (0.5), where it takes the runner-up (`tests.adversaries.NearTie`), claims as launder.

Outputs: rich tables, PREFIX.json (PREFIX.json.gz with `--gzip`; env, args, per-strategy
summaries, every rollout's raw lists) and PREFIX.png (histograms of the per-rollout mean |logprob error|, log-x).

    python tests/bench/bench_trust_stats.py --model tiny --device cpu --rollouts 500 --cheat-rollouts 200
    python tests/bench/bench_trust_stats.py --model tiny --strategies honest_a,honest_b \
        --rollouts 10000 --seed 1 --gzip --out tests/bench/results/trust_stats_cpu_tiny_honest10k
    python tests/bench/bench_trust_stats.py --model smollm2 --device cuda --dtype bfloat16 \
        --gen-batch 64 --verify-batch 8 --max-tokens 192 --rollouts 1000 --cheat-rollouts 64
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402
from rich.table import Table  # noqa: E402
from toploc import verify_proofs_bytes  # noqa: E402

from node.calibrate import calibration_prompts  # noqa: E402
from node.config import EngineConfig  # noqa: E402
from node.engines import GenerationRequest  # noqa: E402
from node.engines.torch_engine import TorchEngine  # noqa: E402
from node.worker import make_rollout  # noqa: E402
from protocol.messages import RolloutRequest, SamplingParams, VerificationPolicy  # noqa: E402
from verifier.calibration import permissive_policy  # noqa: E402
from verifier.checks import check_rollout, replay_rollouts  # noqa: E402

console = Console(width=200)

ALL_STRATEGIES = [
    "honest_a",
    "int8",
    "int4",
    "fp8",
    "noise_1e-2",
    "noise_3e-3",
    "noise_1e-3",
    "temp_0.8",
    "top_p_0.9",
    "steered",
    "launder_noise_1e-3",
    "launder_int8",
    "launder_int4",
    "launder_fp8",
    "near_tie",
    "honest_b",  # last: a run cut short by --deadline-s still has every strategy
]
STEERED_VARIANT = "replace_keep_rest"
SHIPPED_TOML = REPO / "configs" / "verification" / "tiny-torch-cpu-fp32.toml"


# --- cheat engines ---------------------------------------------------------------------
def _copy_engine(engine: TorchEngine) -> TorchEngine:
    bad = copy.copy(engine)
    bad.model = copy.deepcopy(engine.model)
    bad.base = bad.model.get_decoder()
    bad.lm_head = bad.model.get_output_embeddings()
    bad._slots = None  # the real engine's slot decoder runs the real model: one of its own
    return bad


def _linear_weights(model) -> list[torch.nn.Parameter]:
    seen, out = set(), []
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and id(m.weight) not in seen:
            seen.add(id(m.weight))
            out.append(m.weight)
    return out


def quantized_engine(engine: TorchEngine, kind: str) -> TorchEngine:
    bad = _copy_engine(engine)
    with torch.no_grad():
        for w in _linear_weights(bad.model):
            x = w.float()
            if kind in ("int8", "int4"):
                levels = 127 if kind == "int8" else 7
                lo = -127 if kind == "int8" else -8  # int4: 16 levels, -8..7
                scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / levels
                q = (x / scale).round().clamp(lo, levels) * scale
            elif kind == "fp8":
                scale = x.abs().max().clamp(min=1e-12) / 448.0
                q = (x / scale).to(torch.float8_e4m3fn).float() * scale
            else:
                raise ValueError(kind)
            w.copy_(q.to(w.dtype))
    return bad


def noisy_engine(engine: TorchEngine, scale: float, seed: int = 0) -> TorchEngine:
    """`tests.adversaries.perturbed_engine`, with the noise moved to the weights' device."""
    bad = _copy_engine(engine)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in bad.model.parameters():
            std = p.float().std() if p.numel() > 1 else p.abs().float()
            noise = torch.randn(p.shape, generator=gen).to(p.device) * std * scale
            p.add_(noise.to(p.dtype))
    return bad


# --- generation ------------------------------------------------------------------------
def strategy_seed(name: str) -> int:
    return 1 + ALL_STRATEGIES.index(name)


def generate_strategy(name, engine, cheat, n, args, progress, deadline):
    """Signed rollouts of one strategy (claims: T=1, top_p=1, the pool's weights)."""
    claimed = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.max_tokens)
    used = claimed
    if name == "temp_0.8":
        used = SamplingParams(temperature=0.8, top_p=1.0, max_tokens=args.max_tokens)
    elif name == "top_p_0.9":
        used = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=args.max_tokens)
    seed = args.seed * 1000 + strategy_seed(name)
    prompts = calibration_prompts(engine.tokenizer, n, seed)
    rng = random.Random(seed)
    out, meta = [], []
    task = progress.add_task(f"generate {name}", total=n)
    for start in range(0, n, args.gen_batch):
        if deadline and time.monotonic() > deadline:
            console.print(f"[yellow]{name}: deadline, {len(out)}/{n} rollouts[/yellow]")
            break
        batch = prompts[start : start + args.gen_batch]
        reqs = [
            RolloutRequest(
                request_id=f"{name}-{start + i}",
                prompt_ids=p,
                sampling=claimed,
                seed=seed * 100_003 + start + i,
            )
            for i, p in enumerate(batch)
        ]
        asked = [GenerationRequest(q.prompt_ids, used, q.seed) for q in reqs]
        if name.startswith(("launder_", "near_tie")):
            from tests.adversaries import launder

            results = launder(engine, cheat, asked)
        else:
            results = cheat.generate(asked)
        for q, g in zip(reqs, results, strict=True):
            m = {}
            if name == "steered" and len(g.completion_ids) >= 2:
                g, m = steer(cheat, g, rng)
            out.append(make_rollout(q, g, name, 0, engine.weights_hash))
            meta.append(m)
        progress.advance(task, len(batch))
    progress.remove_task(task)
    return out, meta


@torch.inference_mode()
def steer(engine, g, rng):
    k = rng.randrange(len(g.completion_ids) - 1)
    h = g.hidden_states[k : k + 1].to(engine.device, engine.lm_head.weight.dtype)
    logits = engine.lm_head(h).float()[0]
    logp = torch.log_softmax(logits, dim=-1)
    banned = logits.clone()
    banned[g.completion_ids[k]] = float("-inf")
    for e in engine.eos_token_ids:
        if e < banned.shape[0]:
            banned[e] = float("-inf")
    new = int(banned.argmax())
    ids, lps = list(g.completion_ids), list(g.logprobs)
    meta = {"position": k, "old_token": ids[k], "new_token": new}
    ids[k], lps[k] = new, float(logp[new])
    return type(g)(ids, lps, g.finish_reason, g.hidden_states, g.top_logprobs), meta


# --- verification ----------------------------------------------------------------------
def r5(xs) -> list[float]:
    return [round(float(x), 5) for x in xs]


def verify_all(rollouts, metas, engine, args, progress, name):
    policy = permissive_policy()
    order = list(range(len(rollouts)))
    random.Random(args.seed * 7919 + strategy_seed(name)).shuffle(order)
    records: list[dict | None] = [None] * len(rollouts)
    task = progress.add_task(f"verify {name}", total=len(order))
    for start in range(0, len(order), args.verify_batch):
        idx = order[start : start + args.verify_batch]
        batch = [rollouts[i] for i in idx]
        pre = engine.prefill([(r.prompt_ids, r.completion_ids) for r in batch])
        reps = replay_rollouts(batch, [p.logits for p in pre], policy.support_tolerance)
        for i, r, p, rep in zip(idx, batch, pre, reps, strict=True):
            checks = check_rollout(
                r,
                rep,
                p.hidden_states,
                policy,
                weights_hash=engine.weights_hash,
                eos_ids=engine.eos_token_ids,
                decode=engine.tokenizer.decode,
            )
            rows = p.hidden_states.to(torch.bfloat16).cpu().contiguous()
            pp = r.proof_params
            chunks = verify_proofs_bytes(rows, r.proof, pp.chunk_tokens, pp.topk, skip_prefill=True)
            rec = {
                "tokens": len(r.completion_ids),
                "finish_reason": r.finish_reason,
                "verify_batch": start // args.verify_batch,
                "logprob_err": r5(
                    (torch.tensor(r.logprobs, dtype=torch.float32) - rep.logprobs).abs()
                )
                if rep is not None
                else None,
                "score_gap": r5(rep.score_gap) if rep is not None else None,
                "tokens_outside": int((~rep.in_support).sum()) if rep is not None else None,
                "chunks": {
                    "exp_mismatches": [int(c.exp_mismatches) for c in chunks],
                    "mant_err_mean": r5(c.mant_err_mean for c in chunks),
                    "mant_err_median": r5(c.mant_err_median for c in chunks),
                },
                "checks": {
                    c.name: {"passed": c.passed, **{k: round(v, 6) for k, v in c.metrics.items()}}
                    for c in checks
                },
            }
            if metas[i]:
                rec["steer"] = metas[i]
            records[i] = rec
        progress.advance(task, len(idx))
    progress.remove_task(task)
    return records


def rejected_by(rec: dict, policy: VerificationPolicy) -> list[str]:
    """Checks failed under `policy`, recomputed from the raw figures."""
    bad = [
        k
        for k in ("request", "weights", "termination")
        if k in rec["checks"] and not rec["checks"][k]["passed"]
    ]
    if rec["logprob_err"] is None:
        return bad + ["support"]
    if rec["tokens_outside"]:
        bad.append("support")
    n = rec["tokens"]
    mism = sum(g > policy.sampling_tolerance for g in rec["score_gap"])
    if mism / n > policy.max_sampling_mismatch_fraction:
        bad.append("sampling")
    err = rec["logprob_err"]
    if max(err) > policy.max_logprob_abs_diff or sum(err) / n > policy.logprob_mean_limit(n):
        bad.append("logprobs")
    c = rec["chunks"]
    if any(
        e > policy.max_exp_mismatches
        or m > policy.max_mant_err_mean
        or md > policy.max_mant_err_median
        for e, m, md in zip(
            c["exp_mismatches"], c["mant_err_mean"], c["mant_err_median"], strict=True
        )
    ):
        bad.append("proof")
    return bad


def _q(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))] if s else None


def summarize(records: list[dict], policies: dict[str, VerificationPolicy]) -> dict:
    ok = [r for r in records if r["logprob_err"]]
    means = [sum(r["logprob_err"]) / r["tokens"] for r in ok]
    maxes = [max(r["logprob_err"]) for r in ok]
    exp = [max(r["chunks"]["exp_mismatches"]) for r in ok if r["chunks"]["exp_mismatches"]]
    mant = [max(r["chunks"]["mant_err_mean"]) for r in ok if r["chunks"]["mant_err_mean"]]
    gaps = [max(r["score_gap"]) for r in ok]
    out = {
        "rollouts": len(records),
        "tokens": sum(r["tokens"] for r in records),
        "mean_err": {
            "mean": statistics.fmean(means) if means else None,
            "median": _q(means, 0.5),
            "p99": _q(means, 0.99),
            "max": max(means, default=None),
        },
        "max_err": {
            "median": _q(maxes, 0.5),
            "p99": _q(maxes, 0.99),
            "max": max(maxes, default=None),
        },
        "worst_chunk_exp_mismatches": {"median": _q(exp, 0.5), "max": max(exp, default=None)},
        "worst_chunk_mant_err_mean": {"median": _q(mant, 0.5), "max": max(mant, default=None)},
        "max_score_gap": {"median": _q(gaps, 0.5), "max": max(gaps, default=None)},
        "rejected": {},
        "rejected_by_check": {},
    }
    for pname, pol in policies.items():
        fails = [rejected_by(r, pol) for r in records]
        out["rejected"][pname] = sum(bool(f) for f in fails) / max(1, len(records))
        counts: dict[str, int] = {}
        for f in fails:
            for k in f:
                counts[k] = counts.get(k, 0) + 1
        out["rejected_by_check"][pname] = counts
    return out


# --- output ----------------------------------------------------------------------------
def env_info(engine: TorchEngine) -> dict:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except Exception:  # noqa: BLE001 - no git on the box
        commit = ""
    dev = engine.device
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": str(engine.dtype),
        "threads": torch.get_num_threads(),
        "git": commit,
    }


def print_table(summaries: dict, title: str) -> None:
    t = Table(title=title)
    for col in (
        "strategy",
        "rollouts",
        "tokens",
        "mean|e| mean",
        "median",
        "p99",
        "max",
        "max|e| med",
        "max|e| max",
        "exp mism max",
        "mant mean max",
        "rej shipped",
        "rej default",
    ):
        t.add_column(col, justify="right")

    def f(x):
        return "-" if x is None else f"{x:.4g}"

    for name, s in summaries.items():
        t.add_row(
            name,
            str(s["rollouts"]),
            str(s["tokens"]),
            f(s["mean_err"]["mean"]),
            f(s["mean_err"]["median"]),
            f(s["mean_err"]["p99"]),
            f(s["mean_err"]["max"]),
            f(s["max_err"]["median"]),
            f(s["max_err"]["max"]),
            f(s["worst_chunk_exp_mismatches"]["max"]),
            f(s["worst_chunk_mant_err_mean"]["max"]),
            f"{s['rejected']['shipped_tiny_cpu_fp32']:.3f}",
            f"{s['rejected']['default']:.3f}",
        )
    console.print(t)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(result["strategies"])
    means = {
        n: [
            max(sum(r["logprob_err"]) / r["tokens"], 1e-7)
            for r in result["strategies"][n]["rollouts"]
            if r["logprob_err"]
        ]
        for n in names
    }
    allv = [v for vs in means.values() for v in vs]
    if not allv:
        return
    bins = np.logspace(math.log10(min(allv)), math.log10(max(allv)) + 1e-9, 50)
    fig, axes = plt.subplots(len(names), 1, figsize=(9, 1.5 * len(names) + 1), sharex=True)
    axes = np.atleast_1d(axes)
    for ax, n in zip(axes, names, strict=True):
        ax.hist(means[n], bins=bins, color="tab:green" if n.startswith("honest") else "tab:red")
        ax.set_xscale("log")
        ax.set_ylabel(n, rotation=0, ha="right", fontsize=8)
    axes[-1].set_xlabel("per-rollout mean |claimed - verifier logprob|")
    fig.suptitle(result["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write(result: dict, prefix: Path, compress: bool = False) -> None:
    """PREFIX.json, or PREFIX.json.gz for big runs (10,000s of rollouts); atomically."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    final = prefix.with_suffix(".json.gz" if compress else ".json")
    tmp = final.with_name(final.name + ".part")
    text = json.dumps(result, separators=(",", ":")).encode()
    tmp.write_bytes(gzip.compress(text, mtime=0) if compress else text)
    tmp.rename(final)


# --- main ------------------------------------------------------------------------------
def load_engine(args, tmp: Path) -> TorchEngine:
    model = args.model
    if model == "smollm2-random":
        from tests.bench.bench_node import build_random_smollm2

        model = str(build_random_smollm2(tmp / "smollm2-random", args.seed))
    cfg = EngineConfig(
        model=model,
        device=args.device,
        dtype=args.dtype,
        decode=args.decode,
        max_batch_size=max(args.gen_batch or 16, 16),
        max_model_len=1024,
    )
    return TorchEngine(cfg)


def make_cheat(name: str, engine: TorchEngine) -> TorchEngine:
    if name == "near_tie":
        from tests.adversaries import NEAR_TIE_MARGIN, NearTie

        return NearTie(engine, NEAR_TIE_MARGIN)
    name = name.removeprefix("launder_")
    if name in ("int8", "int4", "fp8"):
        return quantized_engine(engine, name)
    if name.startswith("noise_"):
        return noisy_engine(engine, float(name.split("_", 1)[1]), seed=strategy_seed(name))
    return engine


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = ap.add_argument
    add("--model", default="tiny", help="tiny | smollm2 | smollm2-random | a model folder")
    add("--device", default="cpu")
    add("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    add("--rollouts", type=int, default=500, help="honest rollouts per honest set")
    add("--cheat-rollouts", type=int, default=200, help="rollouts per cheating strategy")
    add("--max-tokens", type=int)
    add("--gen-batch", type=int)
    add("--verify-batch", type=int, default=8)
    add("--strategies", default=",".join(ALL_STRATEGIES))
    add("--seed", type=int, default=0)
    add("--judge", default=str(SHIPPED_TOML), help="the thresholds of 'rej shipped'")
    add("--decode", default="auto", choices=["auto", "slots", "loop"], help="EngineConfig.decode")
    add("--deadline-s", type=float, default=0, help="stop generating after this many seconds")
    add("--out", help="output prefix (default tests/bench/results/trust_stats_<device>_<model>)")
    add("--quick", action="store_true", help="smoke mode: a handful of short rollouts")
    add("--gzip", action="store_true", help="write PREFIX.json.gz (for 10,000s of rollouts)")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if args.max_tokens is None:
        args.max_tokens = 192 if cuda else 48
    if args.gen_batch is None:
        args.gen_batch = 64 if cuda else 16
    if args.quick:
        args.rollouts, args.cheat_rollouts = 6, 3
        args.max_tokens = min(args.max_tokens, 12)
        args.gen_batch = min(args.gen_batch, 6)
        args.verify_batch = min(args.verify_batch, 4)
    strategies = [s for s in args.strategies.split(",") if s]
    unknown = set(strategies) - set(ALL_STRATEGIES)
    if unknown:
        ap.error(f"unknown strategies {sorted(unknown)}")
    prefix = Path(
        args.out or REPO / "tests" / "bench" / "results" / f"trust_stats_{args.device}_{args.model}"
    )
    shipped = VerificationPolicy(**tomllib.loads(Path(args.judge).read_text())["verification"])
    policies = {"shipped_tiny_cpu_fp32": shipped, "default": VerificationPolicy()}
    t0 = time.monotonic()
    deadline = t0 + args.deadline_s if args.deadline_s else 0
    with tempfile.TemporaryDirectory() as tmp:
        engine = load_engine(args, Path(tmp))
        console.print(
            f"engine loaded in {time.monotonic() - t0:.1f} s ({engine.device}, {engine.dtype})"
        )
        result = {
            "title": f"trust stats: {args.model} {args.dtype} on {args.device}",
            "args": vars(args),
            "env": env_info(engine),
            "steered_variant": STEERED_VARIANT,
            "policies": {k: p.model_dump(mode="json") for k, p in policies.items()},
            "strategies": {},
        }
        summaries = {}
        with Progress(console=console, transient=True) as progress:
            for name in strategies:
                n = args.rollouts if name.startswith("honest") else args.cheat_rollouts
                ts = time.monotonic()
                cheat = make_cheat(name, engine)
                rollouts, metas = generate_strategy(
                    name, engine, cheat, n, args, progress, deadline
                )
                if cheat is not engine:
                    del cheat
                    if cuda:
                        torch.cuda.empty_cache()
                tg = time.monotonic()
                records = verify_all(rollouts, metas, engine, args, progress, name)
                tv = time.monotonic()
                s = summarize(records, policies)
                s["generate_s"], s["verify_s"] = round(tg - ts, 2), round(tv - tg, 2)
                summaries[name] = s
                result["strategies"][name] = {"summary": s, "rollouts": records}
                result["elapsed_s"] = round(time.monotonic() - t0, 1)
                write(result, prefix, args.gzip)
                console.print(
                    f"{name}: {len(records)} rollouts, {s['tokens']} tokens, "
                    f"gen {s['generate_s']} s, verify {s['verify_s']} s"
                )
    print_table(summaries, result["title"])
    plot(result, prefix.with_suffix(".png"))
    console.print(
        f"written {prefix.with_suffix('.json.gz' if args.gzip else '.json')} and .png in {time.monotonic() - t0:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
