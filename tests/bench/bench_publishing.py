#!/usr/bin/env python
"""Publishing off the trainer's critical path (issue 28, item 1), side by side in one run.

The real `Trainer.run` loop (trainer/train.py) on SmolLM2-135M-Instruct (real weights) with
the batches of every step written ahead of time, so the trainer never waits for an
orchestrator: its wall clock per step is the optimizer step plus what it spends on
weights (gather, write, hash, delta-code, seed) and checkpoints. Two variants, each in a
fresh run directory, one after the other in this process:

- `foreground`: `weights.background = false`, `ckpt.background = false`: the trainer
  publishes every version and writes every checkpoint before its next step (the state of
  the main job before issue 28);
- `background`: the defaults: versions are published by `trainer.publisher` on a thread
  and checkpoints written by DCP's async save while the next step trains.

Per variant: median wall clock per step (between consecutive steps' metrics; the first two
steps excluded), the median optimizer step, and the share of the wall clock the trainer
itself spent on weights and checkpoints (`weights_s`: the hand-off, any wait for the
version before, the checkpoint's copy). The ratio of the two walls is what counts here;
absolute times only on the GPU.

    python tests/bench/bench_publishing.py --device cpu --steps 12 \\
        --out tests/bench/results/publishing_cpu
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from trainer.batch import Batch, TrainingSample, write_batch  # noqa: E402
from trainer.config import TrainerConfig  # noqa: E402
from trainer.monitor import read_metrics  # noqa: E402
from trainer.train import Trainer  # noqa: E402


def write_batches(run_dir: Path, steps: int, samples: int, seq: int, vocab: int) -> None:
    """Every step's batch, ahead of time: random completions with random advantages."""
    rng = random.Random(0)
    prompt = seq // 2
    for n in range(1, steps + 1):
        batch = []
        for _ in range(samples):
            ids = [rng.randrange(vocab) for _ in range(seq)]
            mask = [False] * prompt + [True] * (seq - prompt)
            mu = [0.0] * prompt + [-rng.uniform(0.5, 3.0) for _ in range(seq - prompt)]
            batch.append(TrainingSample(ids, mask, mu, rng.uniform(-1, 1), version=n - 1))
        write_batch(run_dir, Batch(n, batch))


def run_variant(name: str, background: bool, args: argparse.Namespace, vocab: int) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"publishing-{name}-"))
    write_batches(run_dir, args.steps, args.samples, args.seq, vocab)
    cfg = TrainerConfig.model_validate(
        {
            "run_dir": run_dir,
            "max_steps": args.steps,
            "async_level": 2,
            "device": args.device,
            "model": {"name": args.model},
            "micro_batch_tokens": args.samples * args.seq,
            "monitor": {"progress": False, "plot": False},
            "ckpt": {"interval": args.ckpt_interval, "background": background},
            "weights": {
                "transport": args.transport,
                "dtype": "bfloat16",
                "background": background,
                "trainer_key": run_dir / "trainer.key",
            },
        }
    )
    trainer = Trainer(cfg)
    trainer.run()
    trainer.monitor.close()
    rows = read_metrics(run_dir, "trainer")
    walls = [b["time"] - a["time"] for a, b in zip(rows, rows[1:], strict=False)][1:]
    later = rows[2:]
    wall = sum(walls)
    return {
        "variant": name,
        "steps": len(rows),
        "wall_s_per_step": statistics.median(walls),
        "step_s": statistics.median(r["step_time_s"] for r in later),
        "weights_s": statistics.median(r["weights_s"] for r in later),
        "weights_share": sum(r["weights_s"] for r in later) / wall,
        "publish_s_total": rows[-1]["publish_s_total"],
        "run_dir": str(run_dir),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--ckpt-interval", type=int, default=5)
    ap.add_argument("--transport", choices=["filesystem", "swarm"], default="swarm")
    ap.add_argument("--out", type=Path, default=Path("tests/bench/results/publishing_cpu"))
    args = ap.parse_args(argv)
    from verifier.models import load_tokenizer, resolve_model

    vocab = len(load_tokenizer(resolve_model(args.model)))
    rows = [
        run_variant("foreground", False, args, vocab),
        run_variant("background", True, args, vocab),
    ]
    fg, bg = rows
    report = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
        "wall_ratio_background_over_foreground": bg["wall_s_per_step"] / fg["wall_s_per_step"],
    }
    t = Table(title=f"trainer wall clock per step, publishing and checkpoints ({args.device})")
    for col in ("variant", "wall s/step", "optimizer step s", "weights+ckpt s", "share"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            r["variant"],
            f"{r['wall_s_per_step']:.3f}",
            f"{r['step_s']:.3f}",
            f"{r['weights_s']:.3f}",
            f"{r['weights_share']:.1%}",
        )
    console = Console()
    console.print(t)
    console.print(
        f"background / foreground wall per step: "
        f"{report['wall_ratio_background_over_foreground']:.2f}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    console.print(f"wrote {args.out}.json")


if __name__ == "__main__":
    main()
