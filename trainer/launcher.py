"""`prime-trainer rl`: start the processes of one run, watch them, stop them together.

A run is a trainer child and an orchestrator child on an existing pool; with
`local_swarm.enabled` it is the whole network on this machine: an optional SFT warm-up,
a scheduler and N workers first (trainer/local_swarm.py), then the trainer and the
orchestrator on that pool. Each child gets its resolved config in `<run_dir>/configs/`
(trainer, orchestrator) or its flags on the command line (pool processes) and logs to
`<run_dir>/logs/<name>.log`. The parent draws one live view (trainer/live_view.py).

Invariants: one process-management path for every child (`Launch` over
`ManagedProcess`, which also kills children if the parent dies); the run ends when the
trainer and then the orchestrator finished (it may still evaluate the last version),
and fails as soon as any child fails (a non-zero exit, or a pool
service exiting at all), naming the child and showing its log tail; on success, failure,
Ctrl-C or SIGTERM every child is stopped, the curves PNG and `summary.json` are written.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.live import Live

from protocol.config import write_resolved
from protocol.processes import ManagedProcess
from trainer.config import RLConfig
from trainer.live_view import RunView, summary_table
from trainer.local_swarm import Child, LaunchError, LocalPool
from trainer.monitor import plot_run, read_metrics


class Interrupted(Exception):
    """Ctrl-C or SIGTERM: stop everything, keep what was written."""


class Launch:
    """The children of one run, in start order."""

    def __init__(self, run_dir: Path):
        self.logs = Path(run_dir) / "logs"
        self.children: dict[str, tuple[Child, ManagedProcess]] = {}

    def start(self, child: Child) -> ManagedProcess:
        proc = ManagedProcess.start(
            child.name, child.cmd, child.health_url, self.logs / f"{child.name}.log",
            env=child.env, wait=False,
        )  # fmt: skip
        self.children[child.name] = (child, proc)
        return proc

    def failure(self) -> str | None:
        """The first child that failed, or None."""
        for child, proc in self.children.values():
            code = proc.proc.poll()
            if code is not None and (code != 0 or child.service):
                return child.name
        return None

    def wait_exit(self, name: str, tick: Callable[[], None], poll_s: float = 0.5) -> None:
        """Until `name` exits, calling `tick` (refresh the view) meanwhile; raises
        ChildFailed if it, or any other child, fails."""
        proc = self.children[name][1]
        while proc.alive():
            self.check()
            tick()
            time.sleep(poll_s)
        self.check()

    def check(self) -> None:
        if (failed := self.failure()) is not None:
            raise ChildFailed(failed)

    def wait_healthy(self, names: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for name in names:
            try:
                self.children[name][1].wait_healthy(max(1.0, deadline - time.monotonic()))
            except (RuntimeError, TimeoutError) as exc:
                raise ChildFailed(name) from exc

    def stop_all(self, grace_s: float = 15) -> None:
        """Last started first; everyone is asked at once, then waited for within one shared
        `grace_s` (not `grace_s` each: five slow children would take five times as long),
        and whoever is left is killed."""
        procs = [p for _, p in reversed(self.children.values())]
        for p in procs:
            if p.alive():
                p.proc.terminate()
        deadline = time.monotonic() + grace_s
        for p in procs:
            p.stop(grace_s=max(0.1, deadline - time.monotonic()))


class ChildFailed(Exception):
    """A child of the run exited (or did not come up); the argument is its name."""


def _trainer_children(cfg: RLConfig) -> list[Child]:
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
    return [Child("trainer", trainer), Child("orchestrator", orchestrator)]


def _start_pool(local: LocalPool, launch: Launch, view: RunView) -> RLConfig:
    """Warm-up, pool file, scheduler, workers; returns the run's config on that pool."""
    if (sft := local.sft()) is not None:
        view.phase = "SFT warm-up"
        launch.start(sft)

        def sft_progress() -> None:
            done = read_metrics(local.sft_model.parent, "sft")
            view.phase = f"SFT warm-up, step {done[-1]['step'] if done else 0}"

        launch.wait_exit("sft", sft_progress)
    view.phase = "starting the pool"
    local.create_pool()
    launch.start(local.scheduler())
    launch.wait_healthy(["scheduler"], 60)
    for name in local.workers:
        launch.start(local.worker(name))
    view.phase = f"starting {len(local.workers)} workers"
    launch.wait_healthy(local.workers, local.ls.startup_timeout_s)
    deadline = time.monotonic() + local.ls.startup_timeout_s
    while True:  # registered and healthy in the scheduler's eyes, not only serving
        launch.check()
        view.poll()
        healthy = [n for n in (view.pool or {}).get("nodes", []) if n["state"] == "healthy"]
        if len(healthy) >= len(local.workers):
            break
        if time.monotonic() > deadline:
            raise LaunchError(f"only {len(healthy)} of {len(local.workers)} workers joined")
        time.sleep(0.5)
    cfg = local.rl_config()
    write_resolved(cfg, Path(cfg.run_dir) / "configs" / "rl.toml")
    return cfg


def _raise_interrupted(*_: object) -> None:
    raise Interrupted()


def run_rl(cfg: RLConfig, console: Console) -> int:
    if not cfg.ckpt.resume and (Path(cfg.run_dir) / "rollouts").exists():
        console.print(
            f"[red]{cfg.run_dir} already holds a run[/red]: pass --ckpt.resume to continue "
            "it, or another --run-dir"
        )
        return 2
    write_resolved(cfg, Path(cfg.run_dir) / "configs" / "rl.toml")
    launch = Launch(cfg.run_dir)
    local = LocalPool(cfg) if cfg.local_swarm.enabled else None
    view = RunView(
        cfg.run_dir,
        cfg.max_steps,
        local.url if local else None,
        local.names() if local else None,
        local.worker_health_urls() if local else None,
    )
    live = (
        Live(view, console=console, refresh_per_second=2)
        if cfg.monitor.progress
        else contextlib.nullcontext()
    )
    # Both installed here: a process started in the background inherits SIGINT ignored
    # (POSIX shells do that to `cmd &`), and Ctrl-C or `kill -INT` must still stop the run.
    previous = {
        sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    outcome, message = "failed", ""
    try:
        with live:
            if local is not None:
                cfg = _start_pool(local, launch, view)
            for child in _trainer_children(cfg):
                launch.start(child)
            view.phase = "training"
            launch.wait_exit("trainer", view.poll)
            # The orchestrator is done by now, unless it evaluates the last version.
            view.phase = "evaluating"
            launch.wait_exit("orchestrator", view.poll)
            outcome = "finished"
    except ChildFailed as exc:
        name = str(exc)
        tail = launch.children[name][1].log_tail() if name in launch.children else ""
        message = f"[red]{name} failed[/red]; its log ends with:\n{tail}"
    except LaunchError as exc:
        message = f"[red]{exc}[/red]"
    except (KeyboardInterrupt, Interrupted):
        outcome, message = "interrupted", "[yellow]interrupted: stopping every process[/yellow]"
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        view.phase = "stopping"
        view.poll()  # the pool's final counts, before it goes
        view.poll_workers()
        launch.stop_all()
        if cfg.monitor.plot:
            plot_run(cfg.run_dir)
    summary = view.summary(outcome)
    console.print()
    if message:
        console.print(message)
    console.print(summary_table(summary))
    console.print(f"run {outcome}: {cfg.run_dir} (curves.png, summary.json, logs/)")
    return 0 if outcome == "finished" else 1
