"""The trainer: one optimizer step on a list of samples, and the `prime-trainer train` loop.

`Trainer.step` packs samples into rows, shares them over the ranks (FSDP2 when there
are several; one process trains unsharded under bf16 autocast on GPU), groups up to
`micro_batch_rows` rows per [rows, width] micro-batch, runs forward/backward with the
AIPO (or SFT) loss and takes one AdamW step. `Trainer.run` waits
for the orchestrator's batch of each step, trains on it, and hands the new weights to the
publisher (`trainer.publisher`: written and seeded on a thread while the next step trains)
and, every `ckpt.interval` steps, the state to a checkpoint written in the background. `train_sft` is the supervised warm-up on the same step.

Invariants: weights version n is the policy after n optimizer steps (version 0, the
initial weights, is published before step 1); a step's loss is normalised by the loss
tokens of the whole step on all ranks, so it does not depend on how samples are packed
or how many ranks share them; every rank runs the same collectives in the same order;
only rank 0 writes weights and metrics; a run resumed from its step-k checkpoint ends
with the same weights as one that never stopped, and publishes version k if the stop came
before its publication.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.optim.lr_scheduler import LambdaLR

from protocol.config import load_config_or_exit, write_resolved
from trainer.batch import TrainingSample, oldest_admissible, wait_batch
from trainer.checkpoint import CheckpointWriter, latest_checkpoint, load_checkpoint
from trainer.config import OptimConfig, SFTConfig, TrainerConfig
from trainer.loss import aipo_loss, sft_loss
from trainer.model import PolicyModel, compute_dtype, load_model, pick_device
from trainer.monitor import Monitor
from trainer.packing import pack_samples, split_for_rank
from trainer.parallel import (
    all_reduce_sum,
    apply_activation_checkpointing,
    apply_compile,
    apply_fsdp,
    destroy_distributed,
    end_rank,
    gather_full_state_dict,
    init_distributed,
    is_distributed,
)
from trainer.publisher import Publisher
from trainer.weights import make_transport, save_hf_folder

log = logging.getLogger("prime.trainer")
H100_BF16_PEAK = 989e12
StepHook = Callable[[int, dict[str, float]], None]


def lr_factor(cfg: OptimConfig, max_steps: int) -> Callable[[int], float]:
    """LambdaLR factor for the s-th step (0-based): warm-up, then decay to min_lr_ratio."""

    def factor(s: int) -> float:
        if s < cfg.warmup_steps:
            return (s + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        peak = max(cfg.warmup_steps - 1, 0)  # the last warm-up step (or the first) is at lr
        span = max_steps - 1 - peak
        progress = min(1.0, (s - peak) / span) if span > 0 else 1.0
        if cfg.schedule == "linear":
            return 1.0 - (1.0 - cfg.min_lr_ratio) * progress
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (
            1 + math.cos(math.pi * progress)
        )

    return factor


class Trainer:
    """The policy, its optimizer and schedule, on this rank; built from a TrainerConfig."""

    def __init__(self, cfg: TrainerConfig, process: str = "trainer"):
        self.cfg = cfg
        self.rank, self.world = init_distributed(cfg.device)
        self.device = pick_device(cfg.device)
        self.dtype = compute_dtype(cfg.model, self.device)
        if self.device.type == "cuda":
            # Any float32 matmul left (e.g. under fp32 compute) runs on TF32 tensor cores:
            # several times faster, and AdamW on fp32 master weights absorbs the rounding.
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        torch.manual_seed(cfg.seed)
        hf, self.tokenizer = load_model(cfg.model, self.device)
        self.hf_config = hf.config
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.flops_params = _matmul_params(hf)
        self.layers, self.hidden = hf.config.num_hidden_layers, hf.config.hidden_size
        self.policy = PolicyModel(hf, cfg.loss.temperature, cfg.loss.logprob_chunk)
        if cfg.model.activation_checkpointing:
            apply_activation_checkpointing(self.policy)
        if cfg.model.compile:
            apply_compile(self.policy)
        self.fsdp = apply_fsdp(self.policy, self.device, self.dtype)
        self.optimizer = torch.optim.AdamW(
            self.policy.parameters(),
            lr=cfg.optim.lr,
            betas=cfg.optim.betas,
            weight_decay=cfg.optim.weight_decay,
            fused=self.device.type == "cuda",
        )
        self.scheduler = LambdaLR(self.optimizer, lr_factor(cfg.optim, cfg.max_steps))
        self.checkpoints = CheckpointWriter(cfg.run_dir, cfg.ckpt.keep_last, cfg.ckpt.background)
        self.step_count = 0
        # JSONL metrics, progress display and W&B (rank 0 only); callers may add hooks.
        self.monitor = Monitor(
            cfg.run_dir, process, cfg.monitor, cfg.max_steps, enabled=self.rank == 0
        )
        self.step_hooks: list[StepHook] = [self.monitor.log]

    # ---- one optimizer step -------------------------------------------------------------

    def _autocast(self):
        # Without FSDP's mixed precision (one process), bf16 compute comes from autocast.
        if not self.fsdp and self.dtype != torch.float32:
            return torch.autocast(self.device.type, dtype=self.dtype)
        return contextlib.nullcontext()

    def step(self, samples: list[TrainingSample], loss_kind: str = "rl") -> dict[str, float]:
        """One optimizer step on `samples` (every rank passes the same list)."""
        if loss_kind not in ("rl", "sft"):
            raise ValueError(f"loss_kind must be 'rl' or 'sft', got {loss_kind!r}")
        t0 = time.perf_counter()
        self.policy.train()
        bins = pack_samples(samples, self.cfg.micro_batch_tokens)
        micro = [
            mb.to(self.device)
            for mb in split_for_rank(
                bins, self.rank, self.world, self.pad_id, self.cfg.micro_batch_rows
            )
        ]
        counts = torch.tensor(
            [sum(mb.num_loss_tokens for mb in micro), sum(mb.num_tokens for mb in micro)],
            dtype=torch.float64,
            device=self.device,
        )
        n_loss, n_tokens = (int(x) for x in all_reduce_sum(counts).tolist())
        denom = max(n_loss, 1)
        lc = self.cfg.loss
        sums: dict[str, torch.Tensor] = {}
        loss_sum = torch.zeros((), device=self.device)
        for mb in micro:
            with self._autocast():
                logp, ent = self.policy(mb.input_ids, mb.position_ids, mb.targets)
            if loss_kind == "rl":
                loss, part = aipo_loss(
                    logp, ent, mb.mu, mb.advantages, mb.loss_mask, denom,
                    lc.delta, lc.kl_coef, lc.entropy_coef,
                )  # fmt: skip
            else:
                loss, part = sft_loss(logp, ent, mb.loss_mask, denom)
            # FSDP averages gradients over ranks; the loss is a global sum, so undo the mean.
            (loss * self.world).backward()
            loss_sum += loss.detach()
            for k, v in part.items():
                sums[k] = sums.get(k, 0) + v
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.policy.parameters(), self.cfg.optim.max_norm
        )
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        lr = self.scheduler.get_last_lr()[0]
        if n_loss > 0:  # nothing to learn from: leave weights (and Adam moments) alone
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step_count += 1

        keys = sorted(sums)
        reduced = all_reduce_sum(torch.stack([loss_sum.float()] + [sums[k].float() for k in keys]))
        totals = dict(zip(keys, reduced[1:].tolist(), strict=True))
        dt = time.perf_counter() - t0
        metrics = {
            "loss": reduced[0].item(),
            "grad_norm": grad_norm.item(),
            "entropy": totals["entropy"] / denom,
            "lr": lr,
            "tokens": n_tokens,
            "loss_tokens": n_loss,
            "samples": len(samples),
            "micro_batches": len(micro),
            "step_time_s": dt,
            "tokens_per_s": n_tokens / dt,
            "mfu": self._mfu(samples, n_tokens, dt),
            "ranks": self.world,  # FSDP2 ranks the step ran on (1: one unsharded process)
        }
        if loss_kind == "rl":
            metrics["mismatch_kl"] = totals["mismatch_kl"] / denom
            metrics["capped_fraction"] = totals["capped"] / denom
            metrics["mean_ratio"] = totals["ratio"] / denom
        return metrics

    def _mfu(self, samples: list[TrainingSample], tokens: int, dt: float) -> float:
        peak = self.cfg.peak_flops
        if peak is None and self.device.type == "cuda":
            name = torch.cuda.get_device_name(self.device)
            peak = H100_BF16_PEAK if ("H100" in name or "H200" in name) else None
        if not peak or not samples:
            return 0.0
        seq = tokens / len(samples)  # attention cost grows with each sample's own length
        per_token = 6 * self.flops_params + 12 * self.layers * self.hidden * seq
        return per_token * tokens / dt / (peak * self.world)

    # ---- weights, checkpoints, metrics ---------------------------------------------------

    def full_state_dict(self, dtype: str | None = None) -> dict[str, torch.Tensor]:
        """The HF model's full state dict on rank 0, a CPU copy in `dtype` (None: as
        trained) (collective; other ranks get {})."""
        return gather_full_state_dict(self.policy, getattr(torch, dtype) if dtype else None)

    def save_checkpoint(self, step: int) -> None:
        """Checkpoint the state after `step` (in the background where `ckpt.background`:
        `checkpoints.wait()` returns once it is complete)."""
        self.checkpoints.save(step, self.policy, self.optimizer, self.scheduler)

    def load_checkpoint(self, step: int) -> None:
        self.step_count = load_checkpoint(
            self.cfg.run_dir, step, self.policy, self.optimizer, self.scheduler
        )

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        """Hand a step's metrics to every hook (rank 0 only); a monitor appends its own."""
        if self.rank == 0:
            for hook in self.step_hooks:
                hook(step, metrics)

    # ---- the `prime-trainer train` loop -------------------------------------------------

    def run(self) -> None:
        cfg = self.cfg
        transport = make_transport(cfg.weights, cfg.run_dir)
        if cfg.ckpt.resume and (last := latest_checkpoint(cfg.run_dir)) is not None:
            self.load_checkpoint(last)
            if self.rank == 0:
                log.info("resumed from the checkpoint of step %d", last)
                transport.reopen()
        if self.rank == 0:
            write_resolved(cfg, cfg.run_dir / "configs" / "trainer.toml")
        dtype = getattr(transport, "dtype", None)  # what the pool serves: cast before the copy

        def save(n: int, state: dict[str, torch.Tensor]) -> None:
            transport.save(n, state, self.hf_config, self.tokenizer)
            transport.cleanup(keep_from=oldest_admissible(n + 1, cfg.async_level))

        publisher = Publisher(save, background=cfg.weights.background and self.rank == 0)
        try:
            # The version the run starts from (0, or the checkpoint's after a crash that
            # came before its publication): the orchestrator needs it to make batches.
            state = self.full_state_dict(dtype)
            if self.rank == 0 and self.step_count not in transport.versions():
                publisher.submit(self.step_count, state)
            del state
            for n in range(self.step_count + 1, cfg.max_steps + 1):
                batch, stale, idle = wait_batch(
                    cfg.run_dir, n, cfg.async_level, cfg.batch_timeout_s
                )
                metrics = self.step(batch.samples, "rl")
                t0 = time.perf_counter()
                state = self.full_state_dict(dtype)
                waited = publisher.submit(n, state) if self.rank == 0 else 0.0
                del state
                ckpt_s = 0.0
                if n % cfg.ckpt.interval == 0 or n == cfg.max_steps:
                    t1 = time.perf_counter()
                    self.save_checkpoint(n)
                    ckpt_s = time.perf_counter() - t1
                metrics.update(idle_s=idle, stale_dropped=stale)
                # The trainer's own time on weights and checkpoints this step (its wall clock
                # beyond waiting for batches and the optimizer step).
                metrics.update(
                    publish_wait_s=waited,
                    ckpt_s=ckpt_s,
                    weights_s=time.perf_counter() - t0,
                    publish_s_total=publisher.publish_s,
                )
                metrics.update({f"orch/{k}": v for k, v in batch.metrics.items()})
                if self.rank == 0:
                    log.info("step %d loss %.4g grad_norm %.3g idle %.1fs", n, metrics["loss"],
                             metrics["grad_norm"], idle)  # fmt: skip
                self.on_step(n, metrics)
        finally:
            publisher.close()
            self.checkpoints.wait()


def _matmul_params(hf) -> int:
    """Parameters that take part in matmuls per token: all but the input embedding."""
    params = {id(p): p.numel() for p in hf.parameters()}
    embed = hf.get_input_embeddings().weight
    tied = embed is hf.get_output_embeddings().weight
    return sum(params.values()) - (0 if tied else embed.numel())


def train_sft(cfg: SFTConfig, examples: list[TrainingSample]) -> Path:
    """Supervised fine-tuning on `examples` (advantages ignored); returns the saved folder."""
    if not examples:
        raise ValueError("train_sft needs at least one example")
    tcfg = TrainerConfig(
        run_dir=cfg.run_dir, seed=cfg.seed, monitor=cfg.monitor, model=cfg.model,
        optim=cfg.optim, max_steps=cfg.max_steps, micro_batch_tokens=cfg.micro_batch_tokens,
        device=cfg.device,
    )  # fmt: skip
    trainer = Trainer(tcfg, process="sft")
    rng = random.Random(cfg.seed)  # same seed on every rank: the same batches everywhere
    order: list[int] = []
    for step in range(1, cfg.max_steps + 1):
        batch = []
        while len(batch) < min(cfg.batch_size, len(examples)):
            if not order:
                order = list(range(len(examples)))
                rng.shuffle(order)
            batch.append(examples[order.pop()])
        trainer.on_step(step, trainer.step(batch, "sft"))
    trainer.monitor.close()
    out = cfg.output if cfg.output not in (None, Path(""), Path(".")) else cfg.run_dir / "final"
    state = trainer.full_state_dict()
    if trainer.rank == 0:
        save_hf_folder(Path(out), state, trainer.hf_config, trainer.tokenizer)
    return Path(out)


def main(argv: list[str]) -> None:
    """`prime-trainer train @ config.toml --key value ...` (also under torchrun)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = load_config_or_exit(TrainerConfig, argv)  # a bad config: message, exit 2
    trainer, done = None, False
    try:
        trainer = Trainer(cfg)
        trainer.run()
        done = True
    except TimeoutError as exc:
        raise SystemExit(f"prime-trainer train: {exc}") from None
    finally:
        if trainer is not None:
            trainer.monitor.close()
        if not done:
            destroy_distributed()
    if is_distributed():
        end_rank(0)  # a finished rank: no interpreter finalization for gloo to abort in


if __name__ == "__main__":
    main(sys.argv[1:])
