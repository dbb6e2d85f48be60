"""Online difficulty filtering: which prompts a round of the orchestrator samples
(`[orchestrator.buffer]`, DESIGN.md section 2, step 1). Plain bookkeeping, no I/O: the
orchestrator feeds it the rewards of verified episodes (`observe`), asks it for a round's
prompts (`sample`) and keeps its `state()` in its checkpoint.

A prompt's pass rate is the share of its last `window` verified rollouts whose reward
reached `pass_threshold`. Once it has `min_seen` of them, a prompt at or above
`easy_threshold` is easy, one at or below `hard_threshold` hard, and one whose next group
would come back all-equal with a chance of at least `flat` flat, that chance estimated as
q ** group_size, q the share of its most common reward among its recent ones: all three
are set aside, because their groups would most likely be dropped as all-equal after the
pool paid for them. (With a 0/1 reward, a flat prompt is one (almost) always or never
solved; with a graded one it is the policy (almost) always giving the same answer, what
sets the tiny reverse-text run's groups all-equal.) The others (unseen prompts among
them) are active. A round draws its
prompts from the active ones and, each with probability `revisit`, from the set-aside
ones, whose fresh rollouts update their pass rate (a prompt the policy forgot comes back).

Invariants: the draw depends only on (pool, seed, step, round) and the buffer's state,
never on a worker, so nobody picks easy prompts; a round never holds a prompt twice and
asks for at most as many as the dataset has; when no active prompt is left the round
draws set-aside ones (a step never starves); with filtering off the draw is the uniform
one (`uniform_rows`), the same as before filtering existed, and pass rates are still
tracked and reported; only rewards of verified episodes reach `observe`.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter, deque
from dataclasses import dataclass, field

from trainer.config import BufferConfig


def round_rng(pool_id: str, seed: int, step: int, rnd: int) -> random.Random:
    """The randomness of one round's draw: (pool, seed, step, round), nothing else."""
    return random.Random(hashlib.sha256(f"{pool_id}:{seed}:{step}:{rnd}".encode()).digest())


def uniform_rows(rng: random.Random, k: int, n: int) -> list[int]:
    """k distinct dataset rows of n, uniformly."""
    return rng.sample(range(n), min(k, n))


@dataclass
class Draw:
    """One round's prompts and why each was drawn."""

    rows: list[int]
    active: int = 0
    """Drawn from the prompts with signal (or never seen)."""
    revisited: int = 0
    """Drawn from the set-aside ones (the revisit rate, or no active prompt left)."""


@dataclass
class DifficultyBuffer:
    cfg: BufferConfig
    size: int
    """Rows of the dataset."""
    group_size: int = 8
    """Episodes per group (what a flat prompt's chance of an all-equal group is over)."""
    rewards: dict[int, deque[float]] = field(default_factory=dict)
    """Per seen row: the rewards of its last `window` verified rollouts."""

    def observe(self, row: int, rewards: list[float]) -> None:
        """Verified rewards of `row`'s episodes (never an unverified one)."""
        self.rewards.setdefault(row, deque(maxlen=self.cfg.window)).extend(rewards)

    def _recent(self, row: int) -> deque[float] | None:
        seen = self.rewards.get(row)
        enough = seen is not None and len(seen) >= min(self.cfg.min_seen, self.cfg.window)
        return seen if enough else None

    def pass_rate(self, row: int) -> float | None:
        """None until `min_seen` verified rollouts of `row` were observed."""
        if (seen := self._recent(row)) is None:
            return None
        return sum(r >= self.cfg.pass_threshold for r in seen) / len(seen)

    def kind(self, row: int) -> str:
        """'easy', 'hard', 'flat' or 'active'."""
        if (rate := self.pass_rate(row)) is None:
            return "active"
        if rate >= self.cfg.easy_threshold:
            return "easy"
        hard = self.cfg.hard_threshold
        if hard is not None and rate <= hard:
            return "hard"
        if self.cfg.flat is None:
            return "active"
        seen = self.rewards[row]
        q = Counter(seen).most_common(1)[0][1] / len(seen)
        return "flat" if q**self.group_size >= self.cfg.flat else "active"

    def sample(self, rng: random.Random, k: int) -> Draw:
        """k distinct rows for one round (uniform when filtering is off)."""
        if not self.cfg.enabled:
            rows = uniform_rows(rng, k, self.size)
            return Draw(rows, active=len(rows))
        aside = [r for r in sorted(self.rewards) if self.kind(r) != "active"]
        set_aside = set(aside)
        active = [r for r in range(self.size) if r not in set_aside]
        rng.shuffle(active)
        rng.shuffle(aside)
        draw = Draw([])
        for _ in range(min(k, self.size)):
            if aside and (not active or rng.random() < self.cfg.revisit):
                draw.rows.append(aside.pop())
                draw.revisited += 1
            else:
                draw.rows.append(active.pop())
                draw.active += 1
        return draw

    def counts(self) -> dict[str, int]:
        """Prompts seen, and of those easy, hard and flat now (the per-step metrics)."""
        kinds = [self.kind(r) for r in self.rewards]
        return {
            "prompts_seen": len(kinds),
            **{f"prompts_{k}": kinds.count(k) for k in ("easy", "hard", "flat")},
        }

    def state(self) -> dict:
        """What the orchestrator's checkpoint keeps (JSON)."""
        return {str(r): list(seen) for r, seen in self.rewards.items()}

    def restore(self, state: dict) -> None:
        self.rewards = {
            int(r): deque(map(float, seen), maxlen=self.cfg.window) for r, seen in state.items()
        }
