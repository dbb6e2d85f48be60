"""The local swarm: the whole network on this machine, for `prime-trainer rl` with
`local_swarm.enabled` (the README's main job).

Owns everything of the local pool under `<run_dir>/swarm/`: the keys (owner, trainer,
scheduler, one per worker, and the orchestrator's API key to the scheduler's OpenAI
endpoint), the owner-signed pool file, the scheduler's SQLite database
and the workers' folders (logs, downloaded weights); and the command lines of the
processes that make the pool: an optional SFT warm-up, `prime-scheduler serve` and
`prime-node join` per worker. The launcher (trainer/launcher.py) runs them.

Invariants: every process is a real CLI on loopback (no in-process shortcut), so the
local swarm is the network a real pool runs, only smaller; the pool's trainer key is the
run's trainer key, so workers accept the run's weights and nobody else's; everything is
derived from the run directory, so `--ckpt.resume` on the same directory reuses the keys,
the database and the warm-up model (nodes re-register on new ports).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from protocol.identity import Identity
from protocol.processes import free_port
from trainer.config import RLConfig, read_pool
from verifier.models import resolve_model


class LaunchError(RuntimeError):
    """The local pool could not be set up (message says what to fix)."""


@dataclass
class Child:
    """One process of a run, as the launcher starts it."""

    name: str
    cmd: list[str]
    health_url: str = ""
    """Answers 200 once the process serves ('' : nothing to wait for)."""
    env: dict[str, str] = field(default_factory=dict)
    service: bool = False
    """A service never exits on its own: its exit, whatever the code, fails the run."""


def _py(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


class LocalPool:
    """The files and command lines of one run's local pool."""

    def __init__(self, cfg: RLConfig):
        self.cfg = cfg
        self.ls = cfg.local_swarm
        self.root = Path(cfg.run_dir) / "swarm"
        self.keys = self.root / "keys"
        self.port = self.ls.scheduler_port or free_port()
        self.workers = [f"w{i}" for i in range(self.ls.workers)]
        self.worker_ports = {w: free_port() for w in self.workers}
        self.keys.mkdir(parents=True, exist_ok=True)
        for name in ("owner", "trainer", "scheduler", *self.workers):
            Identity.load_or_create(self.keys / f"{name}.key")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pool_file(self) -> Path:
        return self.cfg.local_pool_file

    @property
    def api_key_file(self) -> Path:
        return self.keys / "orchestrator.apikey"

    @property
    def sft_model(self) -> Path:
        return Path(self.cfg.run_dir) / "sft" / "final"

    def names(self) -> dict[str, str]:
        """Node id -> worker name, for the live view."""
        return {Identity.load_or_create(self.keys / f"{w}.key").node_id: w for w in self.workers}

    # -- steps before the pool starts -----------------------------------------------------
    def sft(self) -> Child | None:
        """The warm-up run, or None when not configured or already done (resume)."""
        if self.ls.sft is None or (self.sft_model / "config.json").is_file():
            return None
        args = ["sft", "@", str(self.ls.sft), "--run-dir", str(self.sft_model.parent)]
        args += ["--model.name", self.cfg.model.name, "--monitor.progress", "false"]
        return Child("sft", _py("trainer.cli", *args))

    def policy(self) -> str:
        """What the pool serves at version 0 and the trainer starts from."""
        return str(self.sft_model) if self.ls.sft is not None else self.cfg.model.name

    def create_pool(self) -> Path:
        """Sign the pool file with the owner key (the scheduler and the workers check it)."""
        cmd = _py(
            "scheduler.cli", "pool", "create", "@", str(self.ls.verification),
            "--pool-id", self.ls.pool_id, "--model", self.policy(),
            "--trainer", str(self.keys / "trainer.key"),
            "--owner-key", str(self.keys / "owner.key"),
            "--async-level", str(self.cfg.async_level),
            "--out", str(self.pool_file), *self.ls.pool_args,
        )  # fmt: skip
        self._run(cmd, "pool create")
        if not self.api_key_file.is_file():
            key = self._run(
                _py(
                    "scheduler.cli",
                    "pool",
                    "api-key",
                    "--pool-file",
                    str(self.pool_file),
                    "--owner-key",
                    str(self.keys / "owner.key"),
                    "--name",
                    "orchestrator",
                    "--rate",
                    "1000",
                    "--burst",
                    "1000",
                ),  # fmt: skip
                "pool api-key",
            )
            self.api_key_file.touch(mode=0o600)
            self.api_key_file.write_text(key.strip())
        return self.pool_file

    @staticmethod
    def _run(cmd: list[str], what: str) -> str:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if out.returncode:
            raise LaunchError(f"prime-scheduler {what} failed:\n{out.stderr[-2000:]}")
        return out.stdout

    # -- the pool's processes ---------------------------------------------------------
    def scheduler(self) -> Child:
        hb = self.ls.heartbeat_interval_s
        cmd = _py(
            "scheduler.cli", "serve", "--pool-file", str(self.pool_file),
            "--key-file", str(self.keys / "scheduler.key"),
            "--database.url", f"sqlite+aiosqlite:///{(self.root / 'scheduler.db').resolve()}",
            "--server.port", str(self.port), "--log-dir", str(self.root / "scheduler"),
            "--lifecycle.heartbeat-interval-s", str(hb),
            "--lifecycle.unhealthy-after-s", str(5 * hb),
            "--lifecycle.dead-after-s", str(15 * hb),
            "--openai.tokenizer", str(resolve_model(self.policy())),
        )  # fmt: skip
        return Child("scheduler", cmd, f"{self.url}/health", service=True)

    def worker_health_urls(self) -> dict[str, str]:
        return {w: f"http://127.0.0.1:{p}/health" for w, p in self.worker_ports.items()}

    def worker(self, name: str) -> Child:
        port = self.worker_ports[name]
        cmd = _py(
            "node.cli", "join", "--pool", self.ls.pool_id, "--scheduler", self.url,
            "--key-file", str(self.keys / f"{name}.key"), "--operator", name,
            "--server.port", str(port), "--log-dir", str(self.root / name),
            "--weights.folder", str(self.root / name / "weights"),
            "--weights.peer.upload-rate", str(self.ls.worker_upload_rate),
            "--drain-timeout-s", "5", *self.engine_flags(), *self.ls.worker_args,
        )  # fmt: skip
        # Two cores shared by every process: one thread each keeps them from fighting.
        env = {"OMP_NUM_THREADS": "1"}
        return Child(name, cmd, self.worker_health_urls()[name], env, service=True)

    def engine_flags(self) -> list[str]:
        """`--engine.*` flags for the pool's one engine mix, so a worker generates with what
        the thresholds were calibrated for (a CPU pool on a GPU machine stays on the CPU);
        none when the pool admits several mixes (the worker's own defaults pick one)."""
        mixes = read_pool(self.pool_file).verification.engine_mixes
        if len(mixes) != 1:
            return []
        mix = mixes[0]
        return [
            "--engine.kind",
            mix.engine,
            "--engine.dtype",
            mix.dtype,
            "--engine.device",
            mix.device,
        ]

    def rl_config(self) -> RLConfig:
        """The run's config pointed at this pool (the children get it resolved), validated
        again: the pool it now names must be signed with the run's async_level."""
        changes = {
            "orchestrator": {
                "pool": self.pool_file,
                "scheduler": self.url,
                "trainer_key": self.keys / "trainer.key",
                "api_key_file": self.api_key_file,
            },
            "model": {"name": self.policy()},
        }
        try:
            return self.cfg.with_changes(changes)
        except ValueError as exc:
            raise LaunchError(f"the run does not fit its local pool: {exc}") from exc
