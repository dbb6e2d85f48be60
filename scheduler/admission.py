"""Admission: who may register with the pool, under its owner-signed policy.

Policies: `open` (anyone), `allowlist` (listed node ids), `invite` (an owner-signed,
single-use invite token). Every registration is a signed `RegisterRequest` whose
(sender, nonce) is stored in the database until the envelope expires, so a replayed
registration is refused even by a scheduler restarted in between.

Invariants: a refusal raises `Refused` with the HTTP status and a message that tells the
node operator what is wrong; nothing is written for a refused node; a banned node can
never register again (its id is its key).
"""

from __future__ import annotations

import time

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from protocol.envelope import Opened
from protocol.messages import EngineMix, RegisterRequest
from scheduler import db
from scheduler.pool import PoolError, SignedPool, check_invite
from scheduler.registry import NodeRecord


class Refused(Exception):
    """A registration that is not admitted; `status` is the HTTP status to answer."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


async def admit(
    engine: AsyncEngine,
    pool: SignedPool,
    opened: Opened[RegisterRequest],
    existing: NodeRecord | None,
) -> str:
    """Check a registration against the pool's policy; return the invite id it consumed ('')."""
    req = opened.message
    node_id = opened.sender_id
    cfg = pool.config
    if req.pool_id != cfg.pool_id:
        raise Refused(404, f"this scheduler runs pool {cfg.pool_id!r}, not {req.pool_id!r}")
    if req.model and req.model != cfg.model:
        raise Refused(400, f"pool {cfg.pool_id!r} trains model {cfg.model!r}, not {req.model!r}")
    mix = EngineMix(engine=req.engine, dtype=req.dtype, device=req.device, decode=req.decode)
    covered = cfg.verification.engine_mixes
    if not mix.covered_by(covered):
        raise Refused(
            403,
            f"pool {cfg.pool_id!r}'s verification thresholds were calibrated for "
            f"{', '.join(m.label() for m in covered) or 'no engine mix'}, not {mix.label()}: "
            "run the node with a covered engine, dtype and device, or ask the pool owner to "
            "calibrate this mix (prime-node calibrate) and add it",
        )
    if existing is not None and existing.state == "banned":
        raise Refused(403, f"node {node_id} is banned from this pool: {existing.reason}")
    invite_id = ""
    policy = cfg.admission
    if policy.mode == "allowlist" and node_id not in policy.allowlist:
        raise Refused(403, f"node {node_id} is not on pool {cfg.pool_id!r}'s allowlist")
    if policy.mode == "invite" and existing is None:
        if not req.invite:
            raise Refused(403, f"pool {cfg.pool_id!r} is invite-only: join with --invite TOKEN")
        try:
            invite_id = check_invite(req.invite, pool, node_id).invite_id
        except PoolError as exc:
            raise Refused(403, str(exc)) from exc
    await _consume(engine, opened, invite_id, node_id)
    return invite_id


async def _consume(
    engine: AsyncEngine, opened: Opened[RegisterRequest], invite_id: str, node_id: str
) -> None:
    """Record the registration nonce (and the invite) once, or refuse a replay / a reuse."""
    now = time.time()
    key = (opened.sender + opened.nonce).hex()
    async with engine.begin() as conn:
        await conn.execute(delete(db.nonces).where(db.nonces.c.expires < now))
        try:
            await conn.execute(db.nonces.insert().values(key=key, expires=opened.expires))
        except IntegrityError as exc:
            raise Refused(
                409, "replayed registration: this signed request was already used"
            ) from exc
        if invite_id:
            used = (
                await conn.execute(
                    select(db.invites.c.node_id).where(db.invites.c.invite_id == invite_id)
                )
            ).scalar()
            if used is not None:
                raise Refused(403, f"invite already used (by {used})")
            await conn.execute(
                db.invites.insert().values(invite_id=invite_id, node_id=node_id, used_at=now)
            )
