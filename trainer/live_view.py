"""What `prime-trainer rl` shows while a run goes and what it leaves at the end: a live view
built from the children's metrics files (and, for a local swarm, the scheduler's
dashboard state), and the end-of-run summary (`<run_dir>/summary.json` plus a table).

Invariants: the view only reads (metrics files, one GET of the scheduler's state per
refresh) and never fails the run: a scheduler that does not answer shows as such; the
summary is computed from the same files a user can read afterwards.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import httpx
from rich.console import Group, RenderableType
from rich.table import Table

from trainer.monitor import eval_rewards, read_metrics


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


class RunView:
    """A rich renderable of a running `rl` run; call `poll` before each refresh."""

    def __init__(
        self,
        run_dir: Path,
        max_steps: int,
        scheduler_url: str | None = None,
        names: dict[str, str] | None = None,
        worker_urls: dict[str, str] | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.max_steps = max_steps
        self.scheduler_url = scheduler_url
        self.names = names or {}
        self.started = time.monotonic()
        self.trained: list[dict] = []
        self.made: list[dict] = []
        self.evals: list[dict] = []
        """Online evaluation rows, one per evaluated version (`[orchestrator.eval]`)."""
        self.pool: dict | None = None
        self.worker_urls = worker_urls or {}
        """Worker name -> its /health URL (a local swarm's workers, on loopback)."""
        self.workers_busy: dict[str, dict[str, float]] = {}
        self.phase = "starting"

    def poll(self) -> None:
        self.trained = read_metrics(self.run_dir, "trainer")
        self.made = read_metrics(self.run_dir, "orchestrator")
        self.evals = read_metrics(self.run_dir, "eval")
        if self.scheduler_url:
            try:
                r = httpx.get(f"{self.scheduler_url}/v1/dashboard/state", timeout=1.0)
                self.pool = r.json() if r.status_code == 200 else None
            except httpx.HTTPError:
                self.pool = None

    def poll_workers(self) -> None:
        """Each local worker's seconds spent generating and verifying (its /health `busy_s`),
        read once at the end: the share of worker time that verification costs."""
        for name, url in self.worker_urls.items():
            try:
                r = httpx.get(url, timeout=2.0)
                if r.status_code == 200:
                    self.workers_busy[name] = r.json()["busy_s"]
            except (httpx.HTTPError, ValueError, KeyError):
                pass

    # -- pieces -------------------------------------------------------------------------
    def _rollouts(self) -> dict[str, int]:
        if not self.pool:
            return {}
        t = self.pool["totals"]
        return {
            "generated": sum(n["generated"] for n in self.pool["nodes"]),
            "verified": t.get("verifications", 0),
            "accepted": t.get("accepted", 0),
            "rejected": t.get("rejections", 0),
            "disputes": t.get("disputes", 0),
        }

    def _run_table(self) -> Table:
        t = self.trained[-1] if self.trained else {}
        o = self.made[-1] if self.made else {}
        step = t.get("step", 0)
        table = Table(show_header=False, box=None, pad_edge=False)
        table.add_column(style="bold")
        table.add_column()
        elapsed = time.monotonic() - self.started
        table.add_row("run", f"{self.run_dir}  ({self.phase}, {elapsed:.0f} s)")
        table.add_row("step", f"{step} / {self.max_steps}")
        first = self.made[0]["reward_mean"] if self.made else None
        table.add_row(
            "reward",
            f"{_fmt(o.get('reward_mean'))} (step 1: {_fmt(first)}, batch of "
            f"{o.get('episodes', 0)} episodes)",
        )
        if self.evals:
            e = self.evals[-1]
            scores = "  ".join(f"{name} {_fmt(v)}" for name, v in eval_rewards(e).items())
            table.add_row("eval", f"v{e['step']}: {scores} (every evaluated version: eval_metrics)")
        if "trained_share" in o:
            table.add_row(
                "buffer",
                f"trained {o['trained_share']:.0%} of {o.get('rollouts_generated', 0)} rollouts; "
                f"prompts easy {o.get('prompts_easy', 0)} hard {o.get('prompts_hard', 0)} "
                f"of {o.get('prompts_seen', 0)} seen",
            )
        table.add_row(
            "trainer",
            f"loss {_fmt(t.get('loss'), '.4f')}  {_fmt(t.get('tokens_per_s'), '.0f')} tok/s  "
            f"idle {_fmt(t.get('idle_s'), '.1f')} s/step",
        )
        if rollouts := self._rollouts():
            gen_tps = sum(n["tokens_per_s"] for n in self.pool["nodes"] if n["state"] == "healthy")
            banned = sum(n["state"] == "banned" for n in self.pool["nodes"])
            table.add_row(
                "rollouts",
                "  ".join(f"{k} {v}" for k, v in rollouts.items())
                + f"  ({gen_tps:.0f} tok/s; nodes banned {banned})",
            )
        elif self.scheduler_url:
            table.add_row("rollouts", "[yellow]scheduler not answering[/yellow]")
        return table

    def _last_eval(self) -> dict:
        """The last evaluation's mean rewards (`eval_<env>_reward`) and its version."""
        if not self.evals:
            return {}
        e = self.evals[-1]
        rewards = {f"eval_{name}_reward": v for name, v in eval_rewards(e).items()}
        return {"eval_version": e["step"], **rewards}

    def _nodes_table(self) -> Table | None:
        if not self.pool:
            return None
        table = Table(title=f"pool {self.pool['pool_id']}: policy v{self.pool['weights_version']}")
        for col in ("node", "state", "weights", "reputation", "generated", "verified", "tok/s"):
            table.add_column(col, justify="left" if col in ("node", "state") else "right")
        for n in self.pool["nodes"]:
            state = n["state"]
            style = {"healthy": "green", "banned": "red"}.get(state, "yellow")
            table.add_row(
                self.names.get(n["node_id"], n["node_id"][:12]),
                f"[{style}]{state}[/{style}]",
                f"v{n['weights_version']}",
                f"{n['reputation']:.2f}",
                str(n["generated"]),
                str(n["verified"]),
                f"{n['tokens_per_s']:.0f}",
            )
        return table

    def __rich__(self) -> RenderableType:
        parts: list[RenderableType] = [self._run_table()]
        if (nodes := self._nodes_table()) is not None:
            parts.append(nodes)
        return Group(*parts)

    # -- the end ----------------------------------------------------------------------
    def summary(self, outcome: str) -> dict:
        """What the run did, also written to `<run_dir>/summary.json`."""
        rewards = [r["reward_mean"] for r in self.made]
        fifth = max(1, len(rewards) // 5)
        idle = [r.get("idle_s", 0.0) for r in self.trained[1:]]
        busy = [r.get("step_time_s", 0.0) for r in self.trained[1:]]
        mfu = [r["mfu"] for r in self.trained[1:] if "mfu" in r]
        out: dict = {
            "outcome": outcome,
            "wall_s": round(time.monotonic() - self.started, 1),
            "steps": len(self.trained),
            "reward_first_fifth": statistics.fmean(rewards[:fifth]) if rewards else None,
            "reward_last_fifth": statistics.fmean(rewards[-fifth:]) if rewards else None,
            "trainer_idle_fraction": sum(idle) / (sum(idle) + sum(busy)) if busy else None,
            "stale_samples": sum(r.get("stale_dropped", 0) for r in self.trained),
            "pool_tokens_per_s": _ratio(
                sum(r.get("completion_tokens", 0) for r in self.made),
                sum(r.get("generate_s", 0.0) for r in self.made),
            ),
            "trainer_mfu": statistics.fmean(mfu) if mfu else None,
            # Rollouts the trainer got over those the pool generated for the run.
            "trained_share": _ratio(
                sum(r.get("samples", 0) for r in self.made),
                sum(r.get("rollouts_generated", 0) for r in self.made),
            ),
            **self._last_eval(),
            **{f"rollouts_{k}": v for k, v in self._rollouts().items()},
        }
        if self.workers_busy:
            gen = sum(b.get("generate", 0.0) for b in self.workers_busy.values())
            ver = sum(b.get("verify", 0.0) for b in self.workers_busy.values())
            out.update(worker_generate_s=gen, worker_verify_s=ver)
            out["worker_verify_share"] = _ratio(ver, gen + ver)
        if self.pool:
            out["nodes_banned"] = sum(n["state"] == "banned" for n in self.pool["nodes"])
        if self.pool:
            out["nodes"] = {
                self.names.get(n["node_id"], n["node_id"]): {
                    "state": n["state"],
                    "weights_version": n["weights_version"],
                }
                for n in self.pool["nodes"]
            }
        (self.run_dir / "summary.json").write_text(json.dumps(out, indent=2))
        return out


def summary_table(summary: dict) -> Table:
    table = Table(title="run summary", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for k, v in summary.items():
        if k == "nodes":
            v = ", ".join(f"{n} {s['state']} v{s['weights_version']}" for n, s in v.items())
        elif isinstance(v, float):
            v = f"{v:.3f}"
        table.add_row(k.replace("_", " "), str(v))
    return table
