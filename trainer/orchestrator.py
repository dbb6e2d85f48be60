"""The orchestrator (`prime-trainer orchestrate`): environment -> rollouts through the pool
-> verified, scored, filtered batches for the trainer (DESIGN.md section 2, steps 1 and 6).

Per step n it waits until the trainer has written the oldest policy step n may train on
(n - 1 - async_level: `trainer.batch.staleness`), draws a round of prompts (seeded by
(pool, seed, step, round) and, with `[orchestrator.buffer]` on, by each prompt's recent
pass rate: `trainer.difficulty`), runs each group's episodes with the verifiers
environment's client pointed at the scheduler's OpenAI-compatible endpoint (the pool API
key; `min_version`: the newest policy, never older than that, which the pool holds before
the round starts), joins every turn with its result from the scheduler's results stream
(status and the signed rollout that was verified), scores with the environment's rubric,
and writes `rollouts/step_<n>.pt`. Every `[orchestrator.eval]` interval it evaluates the
policy beside training (`trainer.online_eval`).

Groups (`[orchestrator.groups]`): each episode of a group runs as its own task (verifiers'
`run_rollout`, its independent scoring); one the pool lost (a turn rejected, failed or
never released, or a call that failed: `trainer.rollouts.lost_to_pool`; not the policy's
own empty or invalid answer) is generated again for the same prompt, up to
`max_reschedules` per group; at the round's deadline the stragglers are cancelled; a group short of
episodes trains at its smaller size if its advantages still carry signal. An environment
whose rubric scores a whole group at once is scored episode by episode here.

Invariants: an episode is trained on only if every turn was accepted and the trained ids,
logprobs and scored text are those of its signed rollout (trainer/rollouts.py);
no sample older than async_level reaches a batch; no round outlives its deadline; the
orchestrator runs at most async_level steps ahead of the trainer, so the trainer never
waits while inference keeps up; resuming recomputes nothing that already exists: a batch
file on disk is kept, and a round's prompts depend only on (pool, seed, step, round) and
the difficulty state of the checkpoint (the pass rates of steps whose batches were kept
are not observed again).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import statistics
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from protocol.client import RemoteError
from protocol.envelope import open_envelope
from protocol.identity import Identity
from protocol.messages import PoolConfig, Rollout
from protocol.scheduler_client import SchedulerClient
from protocol.tokenizer import ChatTokenizer
from trainer.batch import Batch, TrainingSample, batch_path, oldest_admissible, write_batch
from trainer.checkpoint import step_dir
from trainer.config import OrchestratorConfig, check_pool_async_level, read_pool
from trainer.difficulty import DifficultyBuffer, round_rng
from trainer.envs import (
    load_environment,
    openai_client,
    pool_sampling_args,
    resolved_client,
    tool_context,
)
from trainer.monitor import Monitor
from trainer.online_eval import OnlineEval
from trainer.rollouts import (
    Episode,
    Verdict,
    build_samples,
    episodes_from_outputs,
    lost_to_pool,
    release_status,
)
from trainer.weights import make_transport
from verifier.models import resolve_model

log = logging.getLogger("prime.orchestrator")
POOL_SYNC_TIMEOUT_S = 60.0


class OrchestratorError(RuntimeError):
    """A setup problem the user must fix (wrong key, unreadable pool file)."""


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
        self.difficulty = DifficultyBuffer(cfg.buffer, len(self.dataset), cfg.group_size)
        self.evals = OnlineEval(cfg.eval, self.model, self.tokenizer.decode)
        self.transport = make_transport(cfg.weights, cfg.run_dir)
        self.verdicts: dict[str, Verdict] = {}
        self.waiting: dict[str, asyncio.Future] = {}  # rollout id -> its verdict's arrival
        self.cursor = 0
        self.published = -1
        self.announced_seeders: list = []
        self.spare: list[list[TrainingSample]] = []  # verified groups for the next step
        self.start_step = 1
        if cfg.ckpt.resume and (state := latest_state(cfg.run_dir)):
            self.start_step = state["step"] + 1
            self.cursor = state["cursor"]
            # A checkpoint from before the difficulty buffer named its spare groups "buffer".
            spare = state.get("spare", state.get("buffer", []))
            self.spare = [[TrainingSample(**s) for s in g] for g in spare]
            self.difficulty.restore(state.get("difficulty", {}))
            log.info("resuming after step %d (results cursor %d)", state["step"], self.cursor)

    @property
    def model(self) -> str:
        return self.cfg.model_name or self.pool.model

    # -- background tasks -----------------------------------------------------------
    async def _follow_results(self, client: SchedulerClient) -> None:
        async for r in client.stream(self.cursor, wait_s=5.0):
            if r.source == "openai":
                rollout = None
                if r.status == "accepted" and r.rollout_envelope:
                    rollout = open_envelope(r.rollout_envelope, Rollout, check_expiry=False)
                    rollout = rollout.message
                self.verdicts[r.request_id] = Verdict(r.status, r.weights_version, rollout)
                if (fut := self.waiting.pop(r.request_id, None)) and not fut.done():
                    fut.set_result(None)
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

    async def _wait_verdicts(self, ids: list[str], deadline: float) -> None:
        """Until every one of `ids` has its result, or `deadline` (monotonic) passed."""
        loop = asyncio.get_running_loop()
        futs = [
            self.waiting.setdefault(i, loop.create_future()) for i in ids if i not in self.verdicts
        ]
        if futs:
            await asyncio.wait(futs, timeout=max(0.0, deadline - time.monotonic()))

    # -- one step ---------------------------------------------------------------------
    async def _run_episode(
        self,
        env: Any,
        prompt: dict,
        args: dict,
        prefix: str,
        deadline: float,
        slots: asyncio.Semaphore,
    ) -> Episode:
        """One episode of `env` on `prompt` through the pool (one of `slots` held while it
        generates), its turns' verdicts awaited until `deadline`. A call that raised is lost
        to the pool (verifiers' 'ModelError'). Training's and evaluation's episodes alike."""
        async with slots:
            try:
                out = await env.run_rollout(
                    prompt, self.client, self.model, args, state_columns=["trajectory"]
                )
            except Exception as exc:  # noqa: BLE001 - one episode lost, not the step
                log.warning("an episode of %s failed: %r", prefix, exc)
                group = f"{prefix}/{prompt.get('example_id')}"
                return Episode(group, 0.0, [], repr(exc), "ModelError")
        (ep,) = episodes_from_outputs([out], prefix)
        await self._wait_verdicts([t.rollout_id for t in ep.turns], deadline)
        return ep

    def _episode(self, row: int, prefix: str, version: int, deadline: float):
        """One training episode of dataset row `row` (a coroutine)."""
        args = pool_sampling_args(self.cfg.sampling, version)
        prompt = dict(self.dataset[row])
        return self._run_episode(self.env, prompt, args, prefix, deadline, self.slots)

    async def _group(
        self, row: int, prefix: str, version: int, deadline: float
    ) -> tuple[list[Episode], int, int]:
        """A group of `row`: its episodes (lost ones generated again, up to the limit, while
        the deadline allows), and how many were rescheduled and cut off at the deadline."""
        cfg = self.cfg.groups

        def launch() -> asyncio.Task:
            return asyncio.create_task(self._episode(row, prefix, version, deadline))

        pending = {launch() for _ in range(self.cfg.group_size)}
        episodes: list[Episode] = []
        rescheduled = 0
        try:
            while pending and (left := deadline - time.monotonic()) > 0:
                done, pending = await asyncio.wait(
                    pending, timeout=left, return_when=asyncio.FIRST_COMPLETED
                )
                for task in done:
                    ep = task.result()
                    episodes.append(ep)
                    lost = lost_to_pool(ep, release_status(ep, self.verdicts))
                    if lost and rescheduled < cfg.max_reschedules:
                        rescheduled += 1
                        pending.add(launch())
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        return episodes, rescheduled, len(pending)

    async def _round(self, step: int, rnd: int, groups: int, version: int):
        rng = round_rng(self.pool.pool_id, self.cfg.seed, step, rnd)
        draw = self.difficulty.sample(rng, groups)
        prefix = f"{step}/{rnd}"
        deadline = time.monotonic() + self.cfg.groups.deadline_s
        results = await asyncio.gather(
            *(self._group(row, prefix, version, deadline) for row in draw.rows)
        )
        episodes = [ep for eps, _, _ in results for ep in eps]
        kept, filt = build_samples(
            episodes,
            self.verdicts,
            version,
            self.tokenizer.decode,
            self.tools,
            self.cfg.groups.min_size,
        )
        for row in draw.rows:
            if (rewards := filt.verified.get(f"{prefix}/{row}")) is not None:
                self.difficulty.observe(row, rewards)
        cut = sum(c for _, _, c in results)
        filt.counts["straggler"] += cut
        filt.generated += cut
        stats = Counter(
            rescheduled=sum(r for _, r, _ in results),
            sampled_active=draw.active,
            sampled_revisit=draw.revisited,
            partial_groups=sum(len(g) < self.cfg.group_size for g in kept.values()),
        )
        return kept, filt, stats

    async def produce(self, client: SchedulerClient, step: int) -> dict[str, float]:
        cfg = self.cfg
        min_version = oldest_admissible(step, cfg.async_level)
        waited = 0.0
        t0 = time.monotonic()
        needed = cfg.batch_size // cfg.group_size
        chosen = [g for g in self.spare if min(s.version for s in g) >= min_version][:needed]
        self.spare = []
        rewards: list[float] = []
        tokens = turns = calls = invalid = generated = 0
        counts: Counter[str] = Counter()
        stats: Counter[str] = Counter()
        rounds = 0
        while len(chosen) < needed and rounds < cfg.max_rounds:
            version, dt = await self._sync_policy(client, min_version)
            waited += dt
            if self.evals.due(version):
                self._start_eval(version)
            groups, filt, round_stats = await self._round(
                step, rounds, needed - len(chosen), version
            )
            rounds += 1
            rewards += filt.rewards
            tokens += filt.completion_tokens
            turns, calls = turns + filt.turns, calls + filt.tool_calls
            invalid += filt.invalid_calls
            generated += filt.generated
            counts.update(filt.counts)
            stats.update(round_stats)
            fresh = list(groups.values())
            take = needed - len(chosen)
            chosen += fresh[:take]
            self.spare += fresh[take:]
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
            # Rollouts the pool generated this step, and the share of them this batch trains
            # (spare groups of the step before count where they are trained).
            "rollouts_generated": generated,
            "trained_share": len(samples) / generated if generated else 0.0,
            **stats,
            **self.difficulty.counts(),
            # Versions due for evaluation that were skipped: the one before still ran.
            "evals_skipped": self.evals.skipped,
            **{f"dropped_{k}": v for k, v in counts.items()},
        }
        if not samples:
            log.warning("step %d: no group carried a learning signal (%s)", step, dict(counts))
        write_batch(cfg.run_dir, Batch(step, samples, metrics))
        # Nodes load new weights while the trainer trains: the next round finds them ready.
        await self._announce_latest(client)
        return metrics

    def _start_eval(self, version: int) -> None:
        self.evals.start(version, self._run_episode, self.verdicts, self.eval_monitor.log)

    def _checkpoint(self, step: int) -> None:
        path = step_dir(self.cfg.run_dir, step) / STATE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "step": step,
            "cursor": self.cursor,
            "spare": [[asdict(s) for s in g] for g in self.spare],
            "difficulty": self.difficulty.state(),
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
        quiet = cfg.monitor.model_copy(update={"progress": False, "plot": False})
        self.eval_monitor = Monitor(cfg.run_dir, "eval", quiet, cfg.max_steps)
        base = cfg.scheduler.split(",")[0].rstrip("/")
        self.client = resolved_client(openai_client(f"{base}/v1", cfg.api_key_file))
        self.slots = asyncio.Semaphore(cfg.max_concurrent)
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
                await self._checked(self._final_eval(client), tasks)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                monitor.close()
                self.eval_monitor.close()

    async def _final_eval(self, client: SchedulerClient) -> None:
        """The last version evaluated (`eval.final`) once the trainer published it, and the
        evaluation still running waited for."""
        if self.evals.enabled and self.cfg.eval.final:
            version, _ = await self._sync_policy(client, self.cfg.max_steps)
            await self.evals.drain()
            if version not in self.evals.done:
                self._start_eval(version)
        await self.evals.drain()

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
