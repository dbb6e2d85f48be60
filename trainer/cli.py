"""`prime-trainer`: the trusted side's commands.

- `rl`: one RL run; starts a trainer (under torchrun when trainer.nproc > 1) and an
  orchestrator as child processes, shows their progress, stops both if either fails,
  and plots the run at the end. Its config contains both processes' configs
  (`--trainer.<any train flag>`, `--orchestrator.<any orchestrate flag>`) and sets what
  they share once, at the top level (`--async-level`, `--max-steps`, `--model.name`, ...).
- `train` / `orchestrate`: each half alone (multi-node deployments).
- `sft`: supervised warm-up on an environment's bundled data.
- `eval`: mean reward of whatever serves an OpenAI-compatible endpoint.
- `publish`: sign and seed a file or weights folder over the swarm by hand (link tests;
  `prime-node fetch` is the other end).

Every command takes `@ file.toml` and `--section.key value` flags (protocol.config) and
writes its resolved config into `<run_dir>/configs/`.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import typer
from rich.console import Console

from protocol.config import load_config_or_exit, write_resolved
from protocol.logs import setup_logging

app = typer.Typer(
    help="prime-swarm trainer and orchestrator.", no_args_is_help=True, add_completion=False
)
console = Console(stderr=True)
EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}


@app.command(context_settings=EXTRA)
def rl(ctx: typer.Context) -> None:
    """Run RL: trainer + orchestrator on one pool (`@ configs/rl/local-swarm-tiny.toml`)."""
    from trainer.config import RLConfig
    from trainer.launcher import run_rl

    cfg = load_config_or_exit(RLConfig, ctx.args)
    raise typer.Exit(run_rl(cfg, console))


@app.command(context_settings=EXTRA)
def train(ctx: typer.Context) -> None:
    """The trainer alone: waits for the orchestrator's batches in the run directory."""
    from trainer.config import TrainerConfig
    from trainer.train import main

    load_config_or_exit(
        TrainerConfig, ctx.args
    )  # fail fast with a clear message before torch starts
    main(ctx.args)


@app.command(context_settings=EXTRA)
def orchestrate(ctx: typer.Context) -> None:
    """The orchestrator alone: environment -> pool -> batches in the run directory."""
    import asyncio

    from trainer.config import OrchestratorConfig
    from trainer.orchestrator import Orchestrator, OrchestratorError

    setup_logging()
    cfg = load_config_or_exit(OrchestratorConfig, ctx.args)
    write_resolved(cfg, Path(cfg.run_dir) / "configs" / "orchestrator.toml")
    try:
        asyncio.run(Orchestrator(cfg).run())
    except OrchestratorError as exc:
        console.print(f"[red]orchestrator:[/red] {exc}")
        raise typer.Exit(1) from exc


@app.command(context_settings=EXTRA)
def sft(ctx: typer.Context) -> None:
    """Supervised warm-up on an environment's SFT data; writes a model folder."""
    from trainer.config import SFTConfig
    from trainer.envs import sft_examples
    from trainer.sft_data import tokenize_examples
    from trainer.train import train_sft
    from verifier.models import load_tokenizer, resolve_model

    cfg = load_config_or_exit(SFTConfig, ctx.args)
    write_resolved(cfg, Path(cfg.run_dir) / "configs" / "sft.toml")
    tokenizer = load_tokenizer(resolve_model(cfg.model.name))
    samples = tokenize_examples(tokenizer, sft_examples(cfg.env, cfg.num_examples, cfg.seed))
    out = train_sft(cfg, samples)
    console.print(f"SFT model written to {out}")


@app.command(name="eval", context_settings=EXTRA)
def evaluate(ctx: typer.Context) -> None:
    """Mean reward on an environment through an OpenAI-compatible endpoint."""
    import asyncio

    from trainer.config import EvalConfig
    from trainer.envs import load_environment, openai_client

    cfg = load_config_or_exit(EvalConfig, ctx.args)
    write_resolved(cfg, Path(cfg.run_dir) / "configs" / "eval.toml")
    env = load_environment(cfg.env)
    out = asyncio.run(
        env.evaluate(
            client=openai_client(cfg.base_url, cfg.api_key_file),
            model=cfg.model_name,
            sampling_args={
                "temperature": cfg.sampling.temperature,
                "top_p": cfg.sampling.top_p,
                "max_tokens": cfg.sampling.max_tokens,
            },
            num_examples=cfg.num_examples,
            rollouts_per_example=cfg.rollouts_per_example,
        )
    )
    rewards = [float(o["reward"]) for o in out["outputs"]]
    result = {
        "env": cfg.env.id,
        "episodes": len(rewards),
        "reward_mean": sum(rewards) / len(rewards),
    }
    path = Path(cfg.run_dir) / "eval.json"
    path.write_text(json.dumps(result, indent=2))
    console.print(
        f"{cfg.env.id}: mean reward {result['reward_mean']:.3f} over {len(rewards)} episodes"
    )


@app.command(context_settings=EXTRA)
def publish(ctx: typer.Context) -> None:
    """Sign and seed a file or folder: prime-trainer publish --source weights/step_3"""
    import time

    from protocol.identity import Identity
    from protocol.swarm.follow import follow
    from protocol.swarm.host import SwarmHost
    from protocol.swarm.manifest import MANIFEST_FILE, build_manifest, sign_manifest
    from trainer.config import PublishConfig

    cfg = load_config_or_exit(PublishConfig, ctx.args)
    setup_logging()
    identity = Identity.load_or_create(cfg.trainer_key)
    source = cfg.source.resolve()
    with console.status(f"hashing {source}"):
        manifest = build_manifest(source, cfg.step, cfg.swarm.piece_size)
    envelope = sign_manifest(identity, manifest)
    out = cfg.manifest_out or (
        source.with_name(source.name + ".manifest") if source.is_file() else source / MANIFEST_FILE
    )
    out.write_bytes(envelope)
    folder = source.parent if source.is_file() else source
    with SwarmHost(identity, cfg.swarm, {identity.public_key}) as host:
        digest = host.seed(envelope, folder)
        console.print(
            f"seeding step {cfg.step}: {manifest.total_size / 2**20:.1f} MiB in "
            f"{manifest.num_pieces} pieces, manifest {digest[:16]} written to {out}\n"
            f"fetch with: prime-node fetch --manifest {out} --trusted_key {identity.node_id} "
            f"--peers '{json.dumps(host.addrs)}'"
        )
        stop_at = time.time() + cfg.seed_for_s if cfg.seed_for_s else float("inf")
        with contextlib.suppress(KeyboardInterrupt):
            follow(
                host,
                digest,
                until=lambda _: time.time() > stop_at,
                status_file=cfg.status_file,
                show_progress=cfg.progress,
            )


@app.command()
def version() -> None:
    """Print the protocol version this trainer speaks."""
    from protocol import PROTOCOL_VERSION

    print(f"prime-swarm protocol v{PROTOCOL_VERSION}")


if __name__ == "__main__":
    app()
