"""`prime-node calibrate`: measure honest verification errors on a generator/verifier
engine pair and propose pool thresholds.

Generates honest rollouts at temperature 1 on the generator engine, verifies each on the
verifier engine with no numeric thresholds (`verifier.calibration.permissive_policy`),
prints the distribution of every metric and writes the proposed `[verification]` table
as TOML (it loads into a node or pool config with ``@ file.toml``).

When the verifier's engine config differs from the generator's, the two engines stand for
the two kinds of node of a mixed pool, where each kind generates and verifies for the
other: the rollouts are split between the two directions (the first half generated on the
generator and verified on the verifier, the second half the other way round), the
thresholds and the evidence model are fitted on the pooled verdicts of both, and
`engine_mixes` lists both engines' mixes. With one engine config (the default) there is
one direction and `engine_mixes` is the generator's mix.

Invariants: the same prompts, seeds and sampling parameters are used for every run of
the same config, so two engine mixes are compared on identical work (rollout i has the
same prompt and seed whichever direction makes it); rollouts are generated in batches of
varying size (1 to `batch_size`) and verified in other batches (shuffled,
`verify_batch_size` each), because a pool's batches vary and its verifier never sees the
generator's batch; a rollout is never verified by the engine that generated it unless the
two configs are the same.
"""

from __future__ import annotations

import random

import tomli_w
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from node.config import CalibrateConfig
from node.engines import GenerationRequest, InferenceEngine, create_engine, engine_mix
from node.worker import make_rollout
from protocol.messages import CheckResult, RolloutRequest, SamplingParams
from verifier.calibration import (
    collect,
    exactness,
    honest_rate,
    permissive_policy,
    propose,
    propose_evidence,
    propose_exact,
    summarize,
    threshold,
)
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


# Below this the fitted tails are too noisy to trust at a 1e-4 target (48 honest bf16
# rollouts proposed a mean-logprob threshold that an honest pool rollout then exceeded).
MIN_ROLLOUTS_FOR_TAIL = 500


def measure(
    generator: InferenceEngine,
    verifier: InferenceEngine,
    prompts: list[list[int]],
    first: int,
    cfg: CalibrateConfig,
    sizes: random.Random,
    shuffle: random.Random,
    progress: Progress,
    label: str,
) -> list[list[CheckResult]]:
    """Honest rollouts of `prompts` (rollout `first + i` for prompt i: its request id and
    seed) generated on `generator`, checked on `verifier` with the permissive policy."""
    policy = permissive_policy()
    sampling = SamplingParams(
        temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens
    )
    rollouts = []
    checks: list[list[CheckResult]] = []
    task = progress.add_task(f"generate {label}", total=len(prompts))
    # bf16 errors depend on the batch a request is generated in: vary its size.
    start = 0
    while start < len(prompts):
        batch = prompts[start : start + sizes.randint(1, cfg.batch_size)]
        reqs = [
            RolloutRequest(
                request_id=f"cal-{first + start + i}",
                prompt_ids=p,
                sampling=sampling,
                seed=cfg.seed * 100_003 + first + start + i,
            )
            for i, p in enumerate(batch)
        ]
        results = generator.generate(
            [GenerationRequest(q.prompt_ids, q.sampling, q.seed) for q in reqs]
        )
        for r, g in zip(reqs, results, strict=True):
            rollouts.append(make_rollout(r, g, "calibration", 0, verifier.weights_hash))
        progress.advance(task, len(batch))
        start += len(batch)
    # Verified in other batches than they were generated in, as in a pool.
    shuffle.shuffle(rollouts)
    task = progress.add_task(f"verify {label}", total=len(rollouts))
    for start in range(0, len(rollouts), cfg.verify_batch_size):
        part = rollouts[start : start + cfg.verify_batch_size]
        pre = verifier.prefill([(r.prompt_ids, r.completion_ids) for r in part])
        for rollout, v in zip(part, pre, strict=True):
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
        progress.advance(task, len(part))
    return checks


def run_calibration(cfg: CalibrateConfig, console: Console) -> None:
    vcfg = cfg.verifier or cfg.generator
    generator = create_engine(cfg.generator)
    try:
        verifier = generator if vcfg == cfg.generator else create_engine(vcfg)
        try:
            _calibrate(cfg, vcfg, generator, verifier, console)
        finally:
            if verifier is not generator:
                verifier.close()
    finally:
        generator.close()


def _calibrate(cfg, vcfg, generator, verifier, console: Console) -> None:
    if verifier.weights_hash != generator.weights_hash:
        raise ValueError(
            f"the generator ({cfg.generator.model}) and the verifier ({vcfg.model}) load "
            "different weights: calibrate one model on both engines"
        )
    if cfg.rollouts < MIN_ROLLOUTS_FOR_TAIL:
        console.print(
            f"[yellow]{cfg.rollouts} rollouts fit the tail at {cfg.target_rate:g} poorly; "
            f"use --rollouts {MIN_ROLLOUTS_FOR_TAIL} or more for thresholds a pool ships[/yellow]"
        )
    # A fit to the loop decode's noise holds for the slot decode too (its errors are
    # smaller): such a mix covers either decode. A fit to the slot decode's may be exact,
    # and then holds for it alone.
    gen_mix, ver_mix = (
        m if m.decode == "slots" else m.model_copy(update={"decode": None})
        for m in (engine_mix(generator, cfg.generator.kind), engine_mix(verifier, vcfg.kind))
    )
    both_ways = verifier is not generator
    prompts = calibration_prompts(generator.tokenizer, cfg.rollouts, cfg.seed)
    # (generating engine, verifying engine, first rollout, last rollout + 1, label)
    half = (len(prompts) + 1) // 2 if both_ways else len(prompts)
    label = f"{gen_mix.label()} -> {ver_mix.label()}"
    directions = [(generator, verifier, 0, half, label)]
    if both_ways:
        back = f"{ver_mix.label()} -> {gen_mix.label()}"
        directions.append((verifier, generator, half, len(prompts), back))
    sizes = random.Random(cfg.seed + 1)
    per_direction: list[tuple[str, list[list[CheckResult]]]] = []
    with Progress(console=console, transient=True) as progress:
        for d, (gen, ver, lo, hi, name) in enumerate(directions):
            shuffle = random.Random(cfg.seed + d)
            got = measure(gen, ver, prompts[lo:hi], lo, cfg, sizes, shuffle, progress, name)
            per_direction.append((name, got))
    checks = [c for _, got in per_direction for c in got]
    stats = summarize(collect(checks))
    proposed = propose(stats, target_rate=cfg.target_rate)
    mixes = [gen_mix] if not both_ways or ver_mix == gen_mix else [gen_mix, ver_mix]
    proposed = proposed.model_copy(
        update={"evidence": propose_evidence(checks), "engine_mixes": mixes}
    )
    exact = exactness(checks)
    if exact.exact:  # one token off the seeded choice rejects a rollout
        proposed = propose_exact(stats, proposed)
    title = " and ".join(name for name, _ in per_direction)
    table = Table(title=f"honest errors over {len(checks)} rollouts ({title})")
    for col in ("metric", "median", "p99", "max", "threshold", "honest rejected (fit)"):
        table.add_column(col)
    for s in stats:
        limit = threshold(s, proposed)
        table.add_row(
            s.name,
            f"{s.median:.4g}",
            f"{s.p99:.4g}",
            f"{s.maximum:.4g}",
            f"{limit:.4g}",
            f"{honest_rate(s, proposed):.2g}",
        )
    console.print(table)
    console.print(f"the engine mix is {exact.describe()}")
    if both_ways:
        lines = [
            f"# prime-node calibrate: both directions of a mixed pool, model {cfg.generator.model}: "
            f"{len(per_direction[0][1])} rollouts generated on {gen_mix.label()} and verified "
            f"on {ver_mix.label()}, {len(per_direction[1][1])} generated on {ver_mix.label()} "
            f"and verified on {gen_mix.label()}; thresholds fitted on the pooled verdicts, "
            "engine_mixes lists both."
        ]
    else:
        lines = [
            f"# prime-node calibrate: generated on {gen_mix.label()}, verified on "
            f"{ver_mix.label()}, model {cfg.generator.model}"
        ]
    header = [
        *lines,
        f"# {len(checks)} honest rollouts of up to {cfg.max_tokens} tokens at temperature "
        f"{cfg.temperature}, generated in batches of 1 to {cfg.batch_size}, verified in shuffled "
        f"batches of {cfg.verify_batch_size}; target false rejections {cfg.target_rate:g} "
        "per rollout, split between the thresholds (fitted exponential tail).",
        f"# The mix is {exact.describe()}"
        + ("; the exact tier's thresholds." if exact.exact else "."),
        "# The honest distribution: metric, median, p99, max, threshold, honest share rejected.",
        *(
            f"#   {s.name}: {s.median:.4g} {s.p99:.4g} {s.maximum:.4g} "
            f"{threshold(s, proposed):.4g} {honest_rate(s, proposed):.2g}"
            for s in stats
        ),
    ]
    if both_ways:
        header.append("# Per direction: metric, median, p99, max.")
        for name, got in per_direction:
            header.append(f"#   {name}:")
            header += [
                f"#     {s.name}: {s.median:.4g} {s.p99:.4g} {s.maximum:.4g}"
                for s in summarize(collect(got))
            ]
    toml = (
        "\n".join(header)
        + "\n"
        + tomli_w.dumps({"verification": proposed.model_dump(mode="json", exclude_none=True)})
    )
    console.print("[bold]proposed thresholds[/bold]")
    console.print(toml, markup=False, highlight=False)
    if cfg.out:
        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        cfg.out.write_text(toml)
        console.print(f"written to {cfg.out}")
