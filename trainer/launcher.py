"""`prime-trainer rl`: start a trainer and an orchestrator for one run and watch them.

Each child gets its resolved config as a TOML file in `<run_dir>/configs/` and logs to
`<run_dir>/logs/<name>.log`. The parent shows one progress display fed by the children's
metrics files.

Invariants: one process-management path for every child (`ManagedProcess`, which also
kills children if the parent dies); if either child fails the other is stopped and the
run exits non-zero with the failing child's log tail; the curves PNG is written whether
the run succeeded or not.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from rich.console import Console

from protocol.config import write_resolved
from protocol.processes import ManagedProcess
from trainer.config import RLConfig
from trainer.monitor import make_progress, plot_run, read_metrics


def _commands(cfg: RLConfig) -> dict[str, list[str]]:
    configs = Path(cfg.run_dir) / "configs"
    trainer_toml = write_resolved(cfg.trainer_config(), configs / "trainer.toml")
    orch_toml = write_resolved(cfg.orchestrator_config(), configs / "orchestrator.toml")
    py = sys.executable
    if cfg.trainer.nproc > 1:
        trainer = [py, "-m", "torch.distributed.run", "--standalone"]
        trainer += [f"--nproc-per-node={cfg.trainer.nproc}"]
        trainer += ["-m", "trainer.train", "@", str(trainer_toml)]
    else:
        trainer = [py, "-m", "trainer.train", "@", str(trainer_toml)]
    orchestrator = [py, "-m", "trainer.cli", "orchestrate", "@", str(orch_toml)]
    return {"trainer": trainer, "orchestrator": orchestrator}


def run_rl(cfg: RLConfig, console: Console) -> int:
    write_resolved(cfg, Path(cfg.run_dir) / "configs" / "rl.toml")
    logs = Path(cfg.run_dir) / "logs"
    children = {
        name: ManagedProcess.start(name, cmd, "", logs / f"{name}.log", wait=False)
        for name, cmd in _commands(cfg).items()
    }
    progress = make_progress("rl", console, disable=not cfg.monitor.progress)
    task = progress.add_task("", total=cfg.max_steps)
    failed = ""
    try:
        with progress:
            while children["trainer"].alive():
                if (
                    not children["orchestrator"].alive()
                    and children["orchestrator"].proc.returncode
                ):
                    failed = "orchestrator"
                    break
                trained = read_metrics(cfg.run_dir, "trainer")
                made = read_metrics(cfg.run_dir, "orchestrator")
                if trained:
                    t = trained[-1]
                    o = made[-1] if made else {}
                    progress.update(
                        task,
                        completed=t["step"],
                        description=f"reward={o.get('reward_mean', float('nan')):.3f} "
                        f"loss={t.get('loss', float('nan')):.4f} idle={t.get('idle_s', 0):.1f}s",
                    )
                time.sleep(0.5)
            if not failed and children["trainer"].proc.returncode:
                failed = "trainer"
    finally:
        for child in children.values():
            child.stop()
        if cfg.monitor.plot:
            plot_run(cfg.run_dir)
    if failed:
        console.print(
            f"[red]{failed} failed[/red]; its log ends with:\n{children[failed].log_tail()}"
        )
        return 1
    console.print(f"run finished: {cfg.run_dir} (curves.png, logs/*_metrics.jsonl)")
    return 0
