"""Which piece to ask a peer for next: rarest first, random tie-breaks, endgame.

Invariants: a peer is only asked for a piece it announced; outside endgame a piece is
requested from one peer at a time; endgame starts once every missing piece is requested,
and then a piece may be asked of several peers (the first copy wins, the others are
cancelled); a piece whose request timed out or whose peer left is requestable again.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from collections.abc import Iterable


class PiecePicker:
    def __init__(self, have: list[bool], rng: random.Random | None = None):
        self.have = list(have)
        self.availability = [0] * len(have)  # connected peers holding each piece
        self.requested: dict[int, dict[str, float]] = defaultdict(dict)  # piece -> peer -> t
        self.rng = rng or random.Random()

    # -- what peers hold -----------------------------------------------------------
    def peer_has(self, indices: Iterable[int], sign: int = 1) -> None:
        """Count (sign 1) or forget (sign -1) a peer's pieces in the availability."""
        for i in indices:
            self.availability[i] += sign

    # -- choosing --------------------------------------------------------------------
    @property
    def missing(self) -> list[int]:
        return [i for i, h in enumerate(self.have) if not h]

    @property
    def endgame(self) -> bool:
        return all(self.requested.get(i) for i in self.missing)

    def pick(self, peer: str, peer_pieces: list[bool]) -> int | None:
        """The next piece to request from `peer`, or None."""
        candidates = [i for i in self.missing if peer_pieces[i] and not self.requested.get(i)]
        if candidates:
            rarest = min(self.availability[i] for i in candidates)
            return self.rng.choice([i for i in candidates if self.availability[i] == rarest])
        # Endgame: every missing piece is out; ask this peer for one it is not serving yet.
        if self.endgame:
            extra = [
                i for i in self.missing if peer_pieces[i] and peer not in self.requested.get(i, {})
            ]
            if extra:
                return self.rng.choice(extra)
        return None

    def is_interesting(self, peer_pieces: list[bool]) -> bool:
        return any(peer_pieces[i] for i in self.missing)

    # -- bookkeeping -----------------------------------------------------------------
    def mark_requested(self, index: int, peer: str) -> None:
        self.requested[index][peer] = time.monotonic()

    def drop_request(self, index: int, peer: str) -> None:
        self.requested.get(index, {}).pop(peer, None)

    def drop_peer(self, peer: str) -> None:
        for peers in self.requested.values():
            peers.pop(peer, None)

    def got(self, index: int) -> list[str]:
        """Mark `index` as held; return the other peers it was requested from (to cancel)."""
        self.have[index] = True
        return list(self.requested.pop(index, {}))

    def expired(self, timeout_s: float) -> list[tuple[int, str]]:
        now = time.monotonic()
        return [
            (i, p)
            for i, peers in self.requested.items()
            for p, t in peers.items()
            if now - t > timeout_s
        ]
