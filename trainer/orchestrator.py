"""The orchestrator (`prime-trainer orchestrate`): environment -> rollouts through the pool
-> verified, scored, filtered batches for the trainer (DESIGN.md section 2, steps 1 and 6).

Per step n it waits until the trainer has written the oldest policy step n may train on
(n - 1 - async_level: `trainer.batch.staleness`), samples prompts with a seed derived from (pool, seed, step,
round), runs the verifiers environment with its client pointed at the scheduler's
OpenAI-compatible endpoint (with the pool API key; `min_version`: the newest policy,
never older than that, which the pool holds before the round starts), joins every turn
with its result from the scheduler's results stream (status and the signed rollout that
was verified), scores with the environment's rubric, and writes `rollouts/step_<n>.pt`.

Invariants: an episode is trained on only if every turn was accepted and the trained ids,
logprobs and scored text are those of its signed rollout (trainer/rollouts.py);
no sample older than async_level reaches a batch; the orchestrator runs at most
async_level steps ahead of the trainer, so the trainer never waits while inference keeps
up; resuming recomputes nothing that already exists: a batch file on disk is kept, and
prompt order depends only on (pool, seed, step, round).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import random
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from protocol.client import RemoteError
from protocol.envelope import open_envelope
from protocol.identity import Identity
from protocol.messages import PoolConfig, Rollout
from protocol.scheduler_client import SchedulerClient
from protocol.tokenizer import ChatTokenizer
from trainer.batch import Batch, TrainingSample, batch_path, oldest_admissible, write_batch
from trainer.checkpoint import step_dir
from trainer.config import OrchestratorConfig, check_pool_async_level, read_pool
from trainer.envs import load_environment, openai_client, tool_context
from trainer.monitor import Monitor
from trainer.rollouts import Verdict, build_samples, episodes_from_outputs
from trainer.weights import make_transport
from verifier.models import resolve_model

log = logging.getLogger("prime.orchestrator")
VERDICT_TIMEOUT_S = 300.0
POOL_SYNC_TIMEOUT_S = 60.0


class OrchestratorError(RuntimeError):
    """A setup problem the user must fix (wrong key, unreadable pool file)."""


def prompt_indices(pool_id: str, seed: int, step: int, rnd: int, k: int, n: int) -> list[int]:
    """k distinct dataset rows for (pool, seed, step, round): nobody picks easy prompts."""
    digest = hashlib.sha256(f"{pool_id}:{seed}:{step}:{rnd}".encode()).digest()
    return random.Random(digest).sample(range(n), min(k, n))


STATE_FILE = "orchestrator.json"  # beside the trainer's part of checkpoints/step_<n>/


def saved_states(run_dir: Path) -> list[Path]:
    """The orchestrator's checkpoint files, oldest step first."""
    found = (Path(run_dir) / "checkpoints").glob(f"step_*/{STATE_FILE}")
    return sorted(found, key=lambda p: int(p.parent.name.removeprefix("step_")))


def latest_state(run_dir: Path) -> dict | None:
    found = saved_states(run_dir)
    return json.loads(found[-1].read_text()) if found else None


class Orchestrator:
    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg
        try:
            self.pool: PoolConfig = read_pool(cfg.pool)
            check_pool_async_level(cfg.async_level, self.pool, cfg.pool)
        except ValueError as exc:
            raise OrchestratorError(str(exc)) from exc
        if not Path(cfg.trainer_key).exists():
            raise OrchestratorError(f"trainer key {cfg.trainer_key} not found")
        self.identity = Identity.load_or_create(cfg.trainer_key)
        if self.identity.public_key != self.pool.trainer_public_key:
            raise OrchestratorError(
                f"{cfg.trainer_key} is not the trainer key of pool {self.pool.pool_id!r}: "
                "workers would refuse its weights"
            )
        # The trusted decoding the rubric's text is checked against (the scheduler's too).
        self.tokenizer = ChatTokenizer(cfg.tokenizer or resolve_model(self.pool.model))
        self.env = load_environment(cfg.env)
        self.tools = tool_context(self.env)  # how the trusted side reads this env's calls
        self.dataset = self.env.get_dataset()
        self.transport = make_transport(cfg.weights, cfg.run_dir)
        self.verdicts: dict[str, Verdict] = {}
        self.verdict_event = asyncio.Event()
        self.cursor = 0
        self.published = -1
        self.announced_seeders: list = []
        self.buffer: list[list[TrainingSample]] = []  # spare groups for the next step
        self.start_step = 1
        if cfg.ckpt.resume and (state := latest_state(cfg.run_dir)):
            self.start_step = state["step"] + 1
            self.cursor = state["cursor"]
            self.buffer = [[TrainingSample(**s) for s in g] for g in state["buffer"]]
            log.info("resuming after step %d (results cursor %d)", state["step"], self.cursor)

    # -- background tasks -----------------------------------------------------------
    async def _follow_results(self, client: SchedulerClient) -> None:
        async for r in client.stream(self.cursor, wait_s=5.0):
            if r.source == "openai":
                rollout = None
                if r.status == "accepted" and r.rollout_envelope:
                    rollout = open_envelope(r.rollout_envelope, Rollout, check_expiry=False)
                    rollout = rollout.message
                self.verdicts[r.request_id] = Verdict(r.status, r.weights_version, rollout)
                self.verdict_event.set()
            self.cursor = r.seq

    async def _sync_policy(self, client: SchedulerClient, min_version: int) -> tuple[int, float]:
        """Announce the newest weights (>= min_version, waiting for the trainer if need be)
        and wait until the pool's healthy nodes hold them; returns (version, seconds waited).

        Weights change only between rounds, and a round asks for that version only, so a
        rollout's verifier always holds the weights that generated it."""
        t0 = time.monotonic()
        while (latest := self.transport.latest()) is None or latest < min_version:
            await asyncio.sleep(0.05)
        await self._announce_latest(client)
        latest = self.published
        deadline = time.monotonic() + POOL_SYNC_TIMEOUT_S
        while True:
            versions = (await client.health())["healthy_versions"]
            holding = sum(c for v, c in versions.items() if int(v) >= latest)
            if holding and holding == sum(versions.values()):
                break
            if time.monotonic() > deadline:
                log.warning("pool nodes still load weights v%d (%s); going ahead", latest, versions)
                break
            await asyncio.sleep(0.1)
        return latest, time.monotonic() - t0

    async def _announce_latest(self, client: SchedulerClient) -> None:
        """Tell the pool about the trainer's newest weights (only between rounds), and again
        when the trainer's seed moved (a restarted trainer listens on new addresses)."""
        latest = self.transport.latest()
        if latest is None or latest < self.published:
            return
        update = self.transport.update(latest)
        if latest == self.published and update.seeders == self.announced_seeders:
            return
        try:
            await client.publish_weights(update)
            log.info("announced weights v%d to the pool", latest)
        except RemoteError as exc:
            if exc.status != 409:
                raise
            # The pool already holds a newer version: a resumed trainer is rewriting
            # that step (its folder is gone until the new one is complete).
            log.info("not announcing v%d: %s", latest, exc.message)
        self.published, self.announced_seeders = latest, update.seeders

    async def _wait_verdicts(self, ids: list[str]) -> None:
        deadline = time.monotonic() + VERDICT_TIMEOUT_S
        while any(i not in self.verdicts for i in ids) and time.monotonic() < deadline:
            self.verdict_event.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.verdict_event.wait(), 1.0)

    # -- one step ---------------------------------------------------------------------
    def _sampling_args(self, min_version: int) -> dict:
        s = self.cfg.sampling
        return {
            "temperature": s.temperature,
            "top_p": s.top_p,
            "max_tokens": s.max_tokens,
            "logprobs": True,
            "extra_body": {"return_token_ids": True, "min_version": min_version},
        }

    async def _round(self, step: int, rnd: int, groups: int, min_version: int):
        rows = prompt_indices(
            self.pool.pool_id, self.cfg.seed, step, rnd, groups, len(self.dataset)
        )
        inputs = [dict(self.dataset[i]) for i in rows for _ in range(self.cfg.group_size)]
        base = self.cfg.scheduler.split(",")[0].rstrip("/")
        out = await self.env.generate(
            inputs,
            client=openai_client(f"{base}/v1", self.cfg.api_key_file),
            model=self.cfg.model_name or self.pool.model,
            sampling_args=self._sampling_args(min_version),
            max_concurrent=self.cfg.max_concurrent,
            state_columns=["trajectory"],
            on_progress=lambda *a, **k: None,
        )
        episodes = episodes_from_outputs(out["outputs"], f"{step}/{rnd}")
        await self._wait_verdicts([t.rollout_id for ep in episodes for t in ep.turns])
        return build_samples(
            episodes, self.verdicts, min_version, self.tokenizer.decode, self.tools
        )

    async def produce(self, client: SchedulerClient, step: int) -> dict[str, float]:
        cfg = self.cfg
        min_version = oldest_admissible(step, cfg.async_level)
        waited = 0.0
        t0 = time.monotonic()
        needed = cfg.batch_size // cfg.group_size
        chosen = [g for g in self.buffer if min(s.version for s in g) >= min_version][:needed]
        self.buffer = []
        rewards: list[float] = []
        tokens = turns = calls = invalid = 0
        counts: dict[str, int] = {}
        rounds = 0
        while len(chosen) < needed and rounds < cfg.max_rounds:
            version, dt = await self._sync_policy(client, min_version)
            waited += dt
            groups, filt = await self._round(step, rounds, needed - len(chosen), version)
            rounds += 1
            rewards += filt.rewards
            tokens += filt.completion_tokens
            turns, calls = turns + filt.turns, calls + filt.tool_calls
            invalid += filt.invalid_calls
            for k, v in filt.counts.items():
                counts[k] = counts.get(k, 0) + v
            fresh = list(groups.values())
            take = needed - len(chosen)
            chosen += fresh[:take]
            self.buffer += fresh[take:]
        samples = [s for g in chosen for s in g]
        generate_s = time.monotonic() - t0 - waited
        metrics = {
            "reward_mean": statistics.fmean(rewards) if rewards else 0.0,
            "reward_std": statistics.stdev(rewards) if len(rewards) > 1 else 0.0,
            "episodes": len(rewards),
            "groups": len(chosen),
            "samples": len(samples),
            "rounds": rounds,
            "wait_policy_s": waited,
            "generate_s": generate_s,
            # Completion tokens of this step's episodes over the time spent getting them.
            "completion_tokens": tokens,
            "pool_tokens_per_s": tokens / generate_s if generate_s > 0 else 0.0,
            "min_version": min_version,
            "turns_per_episode": turns / len(rewards) if rewards else 0.0,
            "tool_calls_per_episode": calls / len(rewards) if rewards else 0.0,
            # Turns that opened a call block which did not parse, per call block written.
            "tool_calls_invalid_share": invalid / (invalid + calls) if invalid + calls else 0.0,
            **{f"dropped_{k}": v for k, v in counts.items()},
        }
        if not samples:
            log.warning("step %d: no group carried a learning signal (%s)", step, counts)
        write_batch(cfg.run_dir, Batch(step, samples, metrics))
        # Nodes load new weights while the trainer trains: the next round finds them ready.
        await self._announce_latest(client)
        return metrics

    def _checkpoint(self, step: int) -> None:
        path = step_dir(self.cfg.run_dir, step) / STATE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "step": step,
            "cursor": self.cursor,
            "buffer": [[asdict(s) for s in g] for g in self.buffer],
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, path)
        for old in saved_states(self.cfg.run_dir)[: -self.cfg.ckpt.keep_last]:
            old.unlink()
            with contextlib.suppress(OSError):  # the trainer's part may still be there
                old.parent.rmdir()

    async def run(self) -> None:
        cfg = self.cfg
        monitor = Monitor(
            cfg.run_dir, "orchestrator", cfg.monitor, cfg.max_steps, self.start_step - 1
        )
        async with SchedulerClient(cfg.scheduler, self.identity, self.pool.pool_id) as client:
            tasks = [asyncio.create_task(self._follow_results(client), name="results")]
            try:
                for step in range(self.start_step, cfg.max_steps + 1):
                    if batch_path(cfg.run_dir, step).exists():
                        continue  # written before a restart: same data, keep it
                    metrics = await self._checked(self.produce(client, step), tasks)
                    monitor.log(step, metrics)
                    if step % cfg.ckpt.interval == 0 or step == cfg.max_steps:
                        self._checkpoint(step)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                monitor.close()

    @staticmethod
    async def _checked(work, tasks: list[asyncio.Task]):
        """Run `work`, but fail at once if a background task died (the pool is gone)."""
        main = asyncio.ensure_future(work)
        done, _ = await asyncio.wait([main, *tasks], return_when=asyncio.FIRST_COMPLETED)
        if main not in done:
            main.cancel()
            dead = next(iter(done))
            raise OrchestratorError(f"{dead.get_name()} stopped: {dead.exception()!r}")
        return main.result()
