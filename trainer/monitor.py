"""What a run shows while it runs and leaves behind: a rich progress display, one JSONL
metrics file per process (`<run_dir>/logs/<process>_metrics.jsonl`), optional Weights &
Biases, and a PNG of reward and loss curves (`<run_dir>/curves.png`) at the end.

Invariants: a metrics line is flushed as soon as it is logged (a killed run keeps what it
measured); appending is resume-safe (a resumed run's lines for a step replace the earlier
ones in the plot); W&B is imported only when a project is configured.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from trainer.config import MonitorConfig

SHOWN = ("reward_mean", "loss", "grad_norm", "entropy", "mismatch_kl", "idle_s", "tokens_per_s")


def make_progress(label: str, console: Console, disable: bool = False) -> Progress:
    """The run progress bar every trusted-side process draws (steps done of the run)."""
    return Progress(
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=console,
        disable=disable,
    )


def metrics_path(run_dir: Path, process: str) -> Path:
    return Path(run_dir) / "logs" / f"{process}_metrics.jsonl"


def read_metrics(run_dir: Path, process: str) -> list[dict]:
    """The last line logged per step (a resumed run overwrites the steps it redid)."""
    path = metrics_path(run_dir, process)
    if not path.exists():
        return []
    by_step: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            by_step[int(row["step"])] = row
    return [by_step[k] for k in sorted(by_step)]


class Monitor:
    def __init__(
        self,
        run_dir: Path,
        process: str,
        cfg: MonitorConfig,
        total_steps: int,
        start_step: int = 0,
        enabled: bool = True,
    ):
        self.enabled = enabled  # False on FSDP ranks other than 0
        self.run_dir = Path(run_dir)
        self.path = metrics_path(run_dir, process)
        self.cfg = cfg
        self.progress: Progress | None = None
        self.wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if cfg.progress:
            self.progress = make_progress(process, Console(stderr=True))
            self.task = self.progress.add_task("", total=total_steps, completed=start_step)
            self.progress.start()
        if cfg.wandb_project:
            import wandb

            self.wandb = wandb.init(
                project=cfg.wandb_project, name=f"{Path(run_dir).name}-{process}"
            )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        row = {"step": step, "time": time.time(), **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.progress is not None:
            shown = " ".join(f"{k}={metrics[k]:.3g}" for k in SHOWN if k in metrics)
            self.progress.update(self.task, completed=step, description=shown)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        if self.enabled and self.cfg.plot:
            plot_run(self.run_dir)
        if self.wandb is not None:
            self.wandb.finish()


def eval_rewards(row: dict) -> dict[str, float]:
    """An online evaluation row's mean reward per environment (`eval/<env>/reward_mean`)."""
    return {k.split("/")[1]: v for k, v in row.items() if k.endswith("/reward_mean")}


def plot_run(run_dir: Path) -> Path | None:
    """Reward (orchestrator, and online evaluation's per evaluated version) and loss
    (trainer) per step into `<run_dir>/curves.png`."""
    orch = read_metrics(run_dir, "orchestrator")
    train = read_metrics(run_dir, "trainer") or read_metrics(run_dir, "sft")
    if not orch and not train:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_l) = plt.subplots(1, 2, figsize=(10, 3.6))
    if orch:
        steps = [r["step"] for r in orch]
        ax_r.plot(
            steps, [r.get("reward_mean", float("nan")) for r in orch], marker=".", label="training"
        )
        ax_r.set(title="mean reward per step", xlabel="step", ylabel="reward")
    if evals := read_metrics(run_dir, "eval"):
        # An evaluation row's step is the version evaluated: the policy after that step.
        for name in sorted(eval_rewards(evals[-1])):
            ax_r.plot(
                [r["step"] for r in evals],
                [eval_rewards(r).get(name, float("nan")) for r in evals],
                marker="o",
                label=f"eval: {name}",
            )
        ax_r.legend(fontsize=8)
    if train:
        steps = [r["step"] for r in train]
        ax_l.plot(steps, [r.get("loss", float("nan")) for r in train], marker=".", color="C1")
        ax_l.set(title="trainer loss", xlabel="step", ylabel="loss")
    fig.tight_layout()
    out = Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
