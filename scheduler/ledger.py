"""The published-weights ledger: every weights version the trainer published through this
scheduler, with its manifest hashes, and the current trainer-signed `WeightUpdate` (the
one registrations and heartbeats relay to nodes).

The map and its checks are pure (`note`, `check`, `adopt`); `load` and `publish` are the
only I/O: the kv table holds key "weights" (the current signed update) and keys
"weights/<version>" (that version's hashes, comma-separated), so a restarted scheduler
checks rollouts exactly as before.

Invariants:
- Every published (version, hash) is kept, in memory and durably: a version republished
  under another manifest keeps both hashes, and rollouts of older versions stay checked.
- `check` is what a rollout's claimed (weights_version, weights_hash) must pass: version 0
  (the pool's base model, which a swarm trainer announces under its manifest hash while
  nodes hash its folder) and versions published without a hash are not checked here (the
  verifier, who holds the weights of the claimed hash, checks what was generated); a
  version published with hashes must claim one of them; a version newer than any
  published is refused (nobody can hold it yet).
- The current version never goes backwards: an update older than it is refused
  (`StaleUpdate`) before anything is written, and it becomes current only once stored.
"""

from __future__ import annotations

import asyncio

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from protocol.envelope import open_envelope
from protocol.messages import WeightUpdate
from scheduler import db

CURRENT_KEY = "weights"
# kv keys "weights/<version>" hold the manifest hashes (comma-separated) the trainer
# published for a version.
PUBLISHED_PREFIX = "weights/"


class StaleUpdate(Exception):
    """A weights update older than the pool's current version."""


class WeightsLedger:
    def __init__(self) -> None:
        # Weights version -> manifest hashes ('' when published without one) of every
        # trainer-signed `WeightUpdate` the scheduler relayed.
        self.published: dict[int, set[str]] = {}
        self.envelope = b""
        """The current signed `WeightUpdate` (b"" before any)."""
        self.version = 0

    # -- pure ----------------------------------------------------------------------
    def note(self, version: int, weights_hash: str) -> set[str]:
        """The trainer published `version` with this manifest hash; returns every hash
        known for that version."""
        known = self.published.setdefault(version, set())
        known.add(weights_hash)
        return known

    def check(self, version: int, weights_hash: str) -> bool:
        """Whether (version, hash) can be what the trainer published (see the module doc)."""
        if version == 0:  # the base model: nodes hash its folder, a trainer its manifest
            return True
        known = self.published.get(version)
        if known is None:
            return version <= max(self.published, default=0)
        return "" in known or weights_hash in known

    def adopt(self, envelope: bytes) -> None:
        """Make this trainer-signed update the current one (and note it)."""
        update = open_envelope(envelope, WeightUpdate, check_expiry=False).message
        self.envelope = envelope
        self.version = update.version
        self.note(update.version, update.weights_hash)

    # -- I/O -----------------------------------------------------------------------
    async def load(self, engine: AsyncEngine) -> None:
        """Rebuild the ledger from the kv table (after a restart or a takeover)."""
        async with engine.connect() as conn:
            current = (
                await conn.execute(select(db.kv.c.value).where(db.kv.c.key == CURRENT_KEY))
            ).scalar()
            rows = (
                await conn.execute(
                    select(db.kv.c.key, db.kv.c.value).where(
                        db.kv.c.key.startswith(PUBLISHED_PREFIX)
                    )
                )
            ).all()
        for key, value in rows:
            for weights_hash in value.decode().split(","):
                self.note(int(key.removeprefix(PUBLISHED_PREFIX)), weights_hash)
        if current:
            self.adopt(current)

    async def publish(
        self, envelope: bytes, update: WeightUpdate, engine: AsyncEngine, writer: db.Writer
    ) -> None:
        """Record a newly published update (`envelope` is its signed form, already opened
        and checked as `update`), store it, then make it current."""
        if update.version < self.version:
            raise StaleUpdate(f"version {update.version} is older than the pool's {self.version}")
        hashes = self.note(update.version, update.weights_hash)
        upsert = db.upsert_stmt(engine, db.kv)
        await asyncio.gather(
            writer.write(upsert, {"key": CURRENT_KEY, "value": envelope}),
            writer.write(
                upsert,
                {
                    "key": f"{PUBLISHED_PREFIX}{update.version}",
                    "value": ",".join(sorted(hashes)).encode(),
                },
            ),
        )
        self.adopt(envelope)
