"""Test harness of tests/swarm: a real RL run on a real pool, with handles to break it, and
the audit of DESIGN.md section 3's invariants afterwards.

`FaultRun` is a scheduler and worker processes (tests.pools: honest `prime-node join`
or a dishonest kind from tests.adversaries) plus `prime-trainer rl` on the swarm weight
transport, in the background, so that a test can kill -9 workers, the scheduler or the
trainer while it trains. `audit` then reads only what a run leaves behind: the
scheduler's SQLite database (requests, results with the signed rollouts it released,
verdicts with the rollouts they judged, nodes) and the trainer's records (the batch files
it trained on, its metrics), so an invariant holds or fails independently of anything a
process said while running; every trained sample is compared with its signed rollout
(ids, mu logprobs, and the scored text decoded with the model's tokenizer).
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from protocol.envelope import open_envelope
from protocol.messages import Rollout
from protocol.tokenizer import ChatTokenizer
from tests.pools import Pool, make_pool, processes_with
from tests.rl_runs import ENV, FAST_HEARTBEATS, REPO, rl_args
from trainer.batch import batch_path, staleness
from trainer.monitor import read_metrics
from trainer.rollouts import trusted_reading

ASYNC_LEVEL = 2


@dataclass
class FaultRun:
    pool: Pool
    model: Path
    steps: int
    extra: tuple[str, ...] = ()
    proc: subprocess.Popen | None = None
    kinds: dict[str, str | None] = field(default_factory=dict)
    """Worker name -> dishonest kind (None: honest)."""

    @property
    def run(self) -> Path:
        return self.pool.workdir / "run"

    @classmethod
    def create(cls, workdir: Path, model: Path, steps: int, *extra: str, **pool_kw) -> FaultRun:
        return cls(make_pool(workdir, model=str(model), **pool_kw), model, steps, extra)

    # -- processes ----------------------------------------------------------------------
    def start_pool(self, workers: dict[str, str | None], *scheduler_args: str) -> None:
        self.pool.start_scheduler(*FAST_HEARTBEATS, *scheduler_args)
        self.join(workers)

    def join(self, workers: dict[str, str | None], wait: bool = True) -> None:
        self.kinds.update(workers)
        for name, kind in workers.items():
            self.pool.join(name, dishonest=kind, wait=False)
        if wait:
            for name in workers:
                self.pool.wait_joined(name)

    def start_training(self, *more: str) -> None:
        args = rl_args(
            self.pool, self.model, self.run, "--max-steps", str(self.steps),
            "--async-level", str(ASYNC_LEVEL), "--weights.transport", "swarm",
            "--weights.swarm.piece-size", str(64 * 1024), *self.extra, *more,
        )  # fmt: skip
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainer.cli", *args],
            cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def trained_steps(self) -> int:
        trained = read_metrics(self.run, "trainer")
        return trained[-1]["step"] if trained else 0

    def wait_step(self, step: int, timeout_s: float = 300) -> None:
        """Until the trainer has finished `step` (fails if the run died first)."""
        deadline = time.monotonic() + timeout_s
        while self.trained_steps() < step:
            assert self.proc is not None and self.proc.poll() is None, self.logs()
            assert time.monotonic() < deadline, f"step {step} not reached\n{self.logs()}"
            time.sleep(0.2)

    def wait_finished(self, timeout_s: float = 600) -> None:
        assert self.proc is not None
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(
                f"the run did not finish in {timeout_s} s\n{self.logs()}"
            ) from None
        assert code == 0, f"rl exited with {code}\n{self.logs()}"
        self.drain()

    def drain(self, timeout_s: float = 90) -> None:
        """Until the scheduler holds no open request (late verdicts land in the DB)."""
        deadline = time.monotonic() + timeout_s
        while self.pool.health()["open_requests"] and time.monotonic() < deadline:
            time.sleep(0.5)

    def trainer_pid(self) -> int:
        """The trainer child of `rl` (found by its command line)."""
        (pid,) = processes_with("trainer.train", str(self.run / "configs" / "trainer.toml"))
        return pid

    def kill_trainer(self) -> None:
        """kill -9 of the trainer process; `rl` sees its child fail and stops the rest."""
        os.kill(self.trainer_pid(), signal.SIGKILL)
        assert self.proc is not None
        assert self.proc.wait(60) != 0

    def logs(self) -> str:
        tails = []
        for name in ("trainer", "orchestrator"):
            log = self.run / "logs" / f"{name}.log"
            if log.exists():
                tails.append(f"--- {name}\n{log.read_text()[-2500:]}")
        return "\n".join(tails)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.pool.close()

    # -- afterwards -----------------------------------------------------------------
    def node_ids(self, names) -> set[str]:
        return {self.pool.node_id(n) for n in names}

    def audit(
        self,
        cheat_generators: dict[str, int] | set[str] = frozenset(),
        cheat_verifiers: set[str] = frozenset(),
        exempt: set[str] = frozenset(),
        statistical: set[str] = frozenset(),
    ) -> dict:
        """`audit` with worker names; every worker not named is honest (never banned).
        `cheat_generators` maps a name to the first policy version it lies about (a set:
        from version 0); `statistical` names those of them whose single rollouts may pass
        every check (see `audit`)."""
        if not isinstance(cheat_generators, dict):
            cheat_generators = dict.fromkeys(cheat_generators, 0)
        named = set(cheat_generators) | set(cheat_verifiers) | set(exempt)
        return audit(
            self.run,
            Path(self.pool.db_url.split(":///", 1)[1]),
            self.steps,
            self.model,
            cheat_generators={self.pool.node_id(n): v for n, v in cheat_generators.items()},
            cheat_verifiers=self.node_ids(cheat_verifiers),
            honest=self.node_ids(n for n in self.kinds if n not in named),
            statistical=self.node_ids(statistical),
        )


def check_signed(sample: dict, rollout: Rollout, decode, tools=None) -> None:
    """A trained sample is exactly its signed rollout: input ids are its prompt and
    completion ids, the loss mask covers the completion, mu on those positions is its
    logprobs, and the text the rubric scored is its ids decoded on the trusted side (with
    `tools`, a `protocol.tools.ToolContext`: the content the trusted side parses out)."""
    rid = sample["rollout_id"]
    n_prompt = len(rollout.prompt_ids)
    assert sample["input_ids"] == rollout.prompt_ids + rollout.completion_ids, f"{rid}: ids"
    mask = sample["loss_mask"]
    assert mask == [False] * n_prompt + [True] * len(rollout.completion_ids), f"{rid}: mask"
    mu = [lp for lp, m in zip(sample["logprobs"], mask, strict=True) if m]
    assert mu == rollout.logprobs, f"{rid}: trained mu differs from the signed logprobs"
    assert sample["text"] == trusted_reading(rollout, decode, tools)[0], f"{rid}: scored text"


def audit(
    run: Path,
    db: Path,
    steps: int,
    model: Path,
    cheat_generators: dict[str, int],
    cheat_verifiers: set[str],
    honest: set[str],
    statistical: set[str] = frozenset(),
    tools=None,
) -> dict:
    """Assert DESIGN.md section 3 on what the run left behind; returns the counts.
    (`tools`: the environment's tool context, for `check_signed`.)

    `statistical` cheats (a subset of `cheat_generators`) deviate by less than honest noise
    on some rollouts (lower precision on a short completion: the tiny model's bf16 error on
    7 tokens was 0.00997 against the fp32 threshold 0.01), so one of their rollouts can pass
    every check before the per-node evidence bans them: their trained samples are counted
    (`statistical_cheat_samples`, at most 2% of all) instead of refused; they must be banned.

    Training went on (every step trained); every request got exactly one result; every
    trained sample was accepted, not generated by a cheat (`cheat_generators`: node id ->
    the first version it lies about; before it, its rollouts are honest), at the version the
    scheduler recorded, no staler than async_level, and trained once; it is exactly the
    signed rollout the scheduler released for its id (`check_signed`: ids, mu, scored text
    decoded with `model`'s tokenizer), and that rollout is one an accepting verdict judged
    (the `verdicts` table keeps the rollout each verdict was about); every cheat (as a
    generator or as a verifier) is banned and no honest node is."""
    trained = read_metrics(run, "trainer")
    assert [r["step"] for r in trained] == list(range(1, steps + 1)), "training stopped"
    with sqlite3.connect(db) as conn:
        requests = [r for (r,) in conn.execute("SELECT request_id FROM requests")]
        results = {
            rid: (status, gen, version)
            for rid, status, gen, version in conn.execute(
                "SELECT request_id, status, generator_id, weights_version FROM results"
            )
        }
        released = {
            rid: (envelope, detail.startswith("unverified"))
            for rid, envelope, detail in conn.execute(
                "SELECT request_id, rollout_envelope, detail FROM results WHERE status = 'accepted'"
            )
        }
        vouched: dict[str, set[bytes]] = {}
        for rid, envelope in conn.execute(
            "SELECT request_id, rollout_envelope FROM verdicts WHERE accepted"
        ):
            vouched.setdefault(rid, set()).add(envelope)
        nodes = dict(conn.execute("SELECT node_id, state FROM nodes"))
    # Exactly once: every request has its one result (the table's unique key refuses a
    # second), none is missing.
    assert len(set(requests)) == len(requests)
    lost = set(requests) - set(results)
    assert not lost, f"{len(lost)} requests never got a result: {sorted(lost)[:5]}"
    # The trainer's records: every sample it trained on, joined with the scheduler's.
    seen: Counter[str] = Counter()
    samples = 0
    checked: Counter[str] = Counter()
    decode = ChatTokenizer(model).decode
    for n in range(1, steps + 1):
        batch = torch.load(batch_path(run, n), weights_only=True)
        # Turns the orchestrator dropped because the environment saw other ids or text
        # than the signed rollout (its own check of the same invariant).
        checked["dropped_mismatch"] += int(batch.get("metrics", {}).get("dropped_mismatch", 0))
        for s in batch["samples"]:
            samples += 1
            rid = s["rollout_id"]
            seen[rid] += 1
            assert rid in results, f"step {n} trained on {rid}, unknown to the scheduler"
            status, gen, version = results[rid]
            assert status == "accepted", f"step {n} trained on a {status} rollout {rid}"
            lies_from = cheat_generators.get(gen)
            if gen in statistical and version >= lies_from:
                checked["statistical_cheat_samples"] += 1
            else:
                assert lies_from is None or version < lies_from, f"{rid} of cheat {gen} trained"
            assert s["version"] == version, (rid, s["version"], version)
            assert staleness(n, version) <= ASYNC_LEVEL, f"step {n}: {rid} is v{version}"
            envelope, unverified = released[rid]
            opened = open_envelope(envelope, Rollout, check_expiry=False)
            assert opened.sender_id == gen, f"{rid}: released rollout not signed by {gen}"
            check_signed(s, opened.message, decode, tools)
            checked["signed_samples"] += 1
            checked["signed_tokens"] += len(opened.message.completion_ids)
            if not unverified:  # released by the pool's spot-check rate: no verdict
                assert envelope in vouched.get(rid, ()), f"{rid}: no accepting verdict judged it"
                checked["vouched_samples"] += 1
    twice = [rid for rid, c in seen.items() if c > 1]
    assert not twice, f"trained twice: {twice[:5]}"
    assert samples, "nothing was trained on"
    assert checked["statistical_cheat_samples"] <= 0.02 * samples, checked
    banned = {nid for nid, state in nodes.items() if state == "banned"}
    cheats = set(cheat_generators) | cheat_verifiers
    assert cheats <= banned, f"not banned: {cheats - banned}"
    assert not banned & honest, f"honest nodes banned: {banned & honest}"
    statuses = Counter(status for status, _, _ in results.values())
    return {
        "requests": len(requests),
        "trained_samples": samples,
        "banned": len(banned),
        **checked,
        **{f"results_{k}": v for k, v in statuses.items()},
    }


def pool_state(url: str) -> dict:
    return httpx.get(f"{url}/v1/dashboard/state", timeout=10).json()
