"""Online evaluation during an RL run (`[orchestrator.eval]`, DESIGN.md section 2, step 1).

The orchestrator asks `due(version)` when a step's policy is in the pool; when it is, an
evaluation of that version runs beside training: each environment's fixed prompts
(`prompts`) go through the scheduler's OpenAI front like training requests (signed,
generated, verified) at the configured priority, which the scheduler serves only after
every waiting training request. Each episode is scored by the environment's rubric on the
trusted side; the row written to `<run_dir>/logs/eval_metrics.jsonl` (step = the version
asked for) holds per environment the mean reward and pass rate of the scored episodes,
how many were scored of those asked (and why the others were not), and the versions
that generated them.

Invariants: an episode is scored only if every turn was accepted and is exactly its
signed rollout (`trainer.rollouts.episode_verdict`, the training path's own check), or
if the policy itself failed it (an empty or invalid answer, which reached the
environment only through the verified path: reward 0, counted as `dropped_policy_error`);
an episode not verified within `timeout_s` is reported missing, never scored; at most one
evaluation runs at a time (a due version found one running is skipped and counted);
evaluation never blocks a training step: it runs as its own task.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from protocol.openai import Decode
from protocol.tools import ToolContext
from trainer.config import EnvConfig, OnlineEvalConfig
from trainer.envs import load_environment, pool_sampling_args, tool_context
from trainer.rollouts import Episode, Verdict, episode_verdict, lost_to_pool

log = logging.getLogger("prime.orchestrator.eval")

# The orchestrator's one episode through the pool, its verdicts awaited:
# (env, prompt, sampling args, group prefix, deadline, slots) -> the episode.
RunEpisode = Callable[[Any, dict, dict, str, float, asyncio.Semaphore], Awaitable[Episode]]


@dataclass
class EvalEnv:
    name: str
    env: Any
    tools: ToolContext | None
    prompts: list[dict]


def eval_prompts(env: Any, n: int) -> list[dict]:
    """The first `n` prompts of the environment's eval split (its training set when it has
    none): the same ones at every evaluation of a run."""
    data = env.get_eval_dataset(n=n)  # verifiers falls back to the training set itself
    return [dict(data[i]) for i in range(min(n, len(data)))]


def env_name(cfg: EnvConfig, taken: set[str]) -> str:
    """A metric prefix per environment: its id, numbered when the same id comes twice."""
    name = cfg.id.rsplit(":", 1)[-1]
    k, out = 2, name
    while out in taken:
        out, k = f"{name}_{k}", k + 1
    taken.add(out)
    return out


class OnlineEval:
    """Evaluations of one run; `start` launches one, `drain` waits for the one running."""

    def __init__(self, cfg: OnlineEvalConfig, model: str, decode: Decode):
        self.cfg = cfg
        self.model = model
        self.decode = decode
        taken: set[str] = set()
        self.envs: list[EvalEnv] = []
        for env_cfg in cfg.envs:
            env = load_environment(env_cfg)
            self.envs.append(
                EvalEnv(
                    env_name(env_cfg, taken),
                    env,
                    tool_context(env),
                    eval_prompts(env, cfg.num_examples),
                )
            )
        self.task: asyncio.Task | None = None
        self.done: set[int] = set()
        self.skipped = 0

    @property
    def enabled(self) -> bool:
        return bool(self.envs)

    def due(self, version: int) -> bool:
        """Whether `version` is one to evaluate and was not yet."""
        return self.enabled and version % self.cfg.interval == 0 and version not in self.done

    def start(
        self,
        version: int,
        run_episode: RunEpisode,
        verdicts: dict[str, Verdict],
        write: Callable[[int, dict], None],
    ) -> None:
        """Evaluate `version` in the background (skipped while another evaluation runs)."""
        self.done.add(version)
        if self.task is not None and not self.task.done():
            self.skipped += 1
            log.info("version %d not evaluated: an evaluation is still running", version)
            return
        self.task = asyncio.create_task(
            self._evaluate(version, run_episode, verdicts, write), name=f"eval v{version}"
        )

    async def drain(self) -> None:
        """Wait for the evaluation running, if any (its failure is raised here)."""
        if self.task is not None:
            await self.task

    async def _evaluate(self, version, run_episode, verdicts, write) -> None:
        t0 = time.monotonic()
        deadline = t0 + self.cfg.timeout_s
        slots = asyncio.Semaphore(self.cfg.max_concurrent)
        args = pool_sampling_args(self.cfg.sampling, version, self.cfg.priority)
        prefix = f"eval/{version}"

        row: dict[str, float] = {}
        for ev in self.envs:
            work = [
                asyncio.create_task(run_episode(ev.env, p, args, prefix, deadline, slots))
                for p in ev.prompts
                for _ in range(self.cfg.rollouts_per_example)
            ]
            done, pending = await asyncio.wait(work, timeout=max(0.0, deadline - time.monotonic()))
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            row |= self._score(ev, [t.result() for t in done], len(work), version, verdicts)
        row["eval_s"] = time.monotonic() - t0
        write(version, row)
        log.info("evaluated version %d: %s", version, row)

    def _score(
        self,
        ev: EvalEnv,
        episodes: list[Episode],
        asked: int,
        version: int,
        verdicts: dict[str, Verdict],
    ) -> dict[str, float]:
        rewards: list[float] = []
        versions: list[int] = []
        why: Counter[str] = Counter()
        for ep in episodes:
            status, v = episode_verdict(ep, verdicts, version, self.decode, ev.tools)
            if status == "ok":
                rewards.append(ep.reward)
                versions.append(v)
            elif status == "error" and not lost_to_pool(ep, status):
                # The policy's own failure (an empty or invalid answer, which reached the
                # environment only through the verified path): scored as a miss, reward 0.
                rewards.append(0.0)
                why["policy_error"] += 1
            else:
                why[status] += 1
        p = f"eval/{ev.name}/"
        return {
            p + "reward_mean": statistics.fmean(rewards) if rewards else float("nan"),
            p + "pass_rate": (
                sum(r >= self.cfg.pass_threshold for r in rewards) / len(rewards)
                if rewards
                else float("nan")
            ),
            p + "episodes": float(asked),
            p + "scored": float(len(rewards)),
            p + "missing": float(asked - len(episodes)),
            p + "version_min": float(min(versions, default=version)),
            p + "version_max": float(max(versions, default=version)),
            **{p + f"dropped_{k}": float(n) for k, n in why.items()},
        }
