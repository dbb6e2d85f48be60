"""`prime-node calibrate`: measure honest verification errors on a generator/verifier
engine pair and propose pool thresholds.

Generates honest rollouts at temperature 1 on the generator engine, verifies each on the
verifier engine with no numeric thresholds (`verifier.calibration.permissive_policy`),
prints the distribution of every metric and writes the proposed `[verification]` table
as TOML (it loads into a node or pool config with ``@ file.toml``).

Invariant: the same prompts, seeds and sampling parameters are used for every run of
the same config, so two engine mixes are compared on identical work.
"""

from __future__ import annotations

import random

import tomli_w
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from node.config import CalibrateConfig
from node.engines import GenerationRequest, create_engine
from node.worker import make_rollout
from protocol.messages import RolloutRequest, SamplingParams
from verifier.calibration import collect, permissive_policy, propose, summarize
from verifier.checks import verify_rollout

PROMPT_TOPICS = [
    "Write a short poem about the sea.",
    "Explain what a prime number is.",
    "List three uses of copper.",
    "Describe a sunrise in two sentences.",
    "What is the capital of France?",
    "Give me a recipe for tea.",
    "Summarize the plot of a heist movie.",
    "Why is the sky blue?",
    "Count from one to ten in words.",
    "Reverse the word 'swarm'.",
    "Tell a joke about computers.",
    "How do bees make honey?",
]


def calibration_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        msg = [{"role": "user", "content": rng.choice(PROMPT_TOPICS)}]
        if tokenizer.chat_template:
            ids = tokenizer.apply_chat_template(msg, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        else:
            ids = tokenizer.encode(msg[0]["content"])
        prompts.append(ids)
    return prompts


def run_calibration(cfg: CalibrateConfig, console: Console) -> None:
    generator = create_engine(cfg.generator)
    verifier = (
        generator
        if cfg.verifier is None or cfg.verifier == cfg.generator
        else create_engine(cfg.verifier)
    )
    policy = permissive_policy()
    sampling = SamplingParams(
        temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens
    )
    prompts = calibration_prompts(generator.tokenizer, cfg.rollouts, cfg.seed)
    checks = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("generate + verify", total=len(prompts))
        for start in range(0, len(prompts), cfg.batch_size):
            batch = prompts[start : start + cfg.batch_size]
            reqs = [
                RolloutRequest(
                    request_id=f"cal-{start + i}",
                    prompt_ids=p,
                    sampling=sampling,
                    seed=cfg.seed * 100_003 + start + i,
                )
                for i, p in enumerate(batch)
            ]
            results = generator.generate(
                [GenerationRequest(q.prompt_ids, q.sampling, q.seed) for q in reqs]
            )
            pre = verifier.prefill(
                [(r.prompt_ids, g.completion_ids) for r, g in zip(reqs, results, strict=True)]
            )
            for r, g, v in zip(reqs, results, pre, strict=True):
                rollout = make_rollout(r, g, "calibration", 0, verifier.weights_hash)
                checks.append(
                    verify_rollout(
                        rollout,
                        v.logits,
                        v.hidden_states,
                        policy,
                        weights_hash=verifier.weights_hash,
                        eos_ids=verifier.eos_token_ids,
                        decode=verifier.tokenizer.decode,
                    )
                )
            progress.advance(task, len(batch))
    stats = summarize(collect(checks))
    proposed = propose(stats)
    table = Table(
        title=f"honest errors over {len(checks)} rollouts "
        f"({cfg.generator.kind}/{cfg.generator.dtype} -> {(cfg.verifier or cfg.generator).kind})"
    )
    for col in ("metric", "median", "p99", "max"):
        table.add_column(col)
    for s in stats:
        table.add_row(s.name, f"{s.median:.4g}", f"{s.p99:.4g}", f"{s.maximum:.4g}")
    console.print(table)
    toml = tomli_w.dumps({"verification": proposed.model_dump(mode="json")})
    console.print("[bold]proposed thresholds[/bold]")
    console.print(toml, markup=False, highlight=False)
    if cfg.out:
        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        cfg.out.write_text(toml)
        console.print(f"written to {cfg.out}")
