"""The pool's swarm tracker: which peers take part in which weights version.

Workers (and the trainer's seeder) announce each manifest they fetch or seed; the answer
is a random sample of the other members, seeds first, so a node that joins late finds
peers that already hold the version instead of the trainer. "Have" news then travels
between the peers themselves.

The tracker also knows how each member is reached (`counts`): directly, or through a
relay when it sits behind NAT.

Invariants: only registered, unbanned nodes and the trainer key may announce (a banned
node is dropped from every swarm at once); an entry silent for `4 x interval_s` is
forgotten; tracker state is soft (memory only): after a restart or a replica takeover it
is rebuilt from the next round of announcements.
"""

from __future__ import annotations

import ipaddress
import random
import time

from protocol.messages import SwarmAnnounce, SwarmPeer, SwarmPeers


class Tracker:
    def __init__(self, interval_s: float = 15.0, max_swarms: int = 64):
        self.interval_s = interval_s
        self.max_swarms = max_swarms
        # manifest hash -> peer id -> (peer, last announce)
        self.swarms: dict[str, dict[str, tuple[SwarmPeer, float]]] = {}

    def _expire(self, now: float) -> None:
        horizon = now - 4 * self.interval_s
        for digest in list(self.swarms):
            members = {k: v for k, v in self.swarms[digest].items() if v[1] >= horizon}
            if members:
                self.swarms[digest] = members
            else:
                del self.swarms[digest]

    def announce(self, peer_id: str, msg: SwarmAnnounce) -> SwarmPeers:
        now = time.time()
        self._expire(now)
        members = self.swarms.setdefault(msg.manifest_hash, {})
        if msg.stopped:
            members.pop(peer_id, None)
        else:
            members[peer_id] = (
                SwarmPeer(peer_id=peer_id, addrs=msg.addrs, complete=msg.complete),
                now,
            )
        while len(self.swarms) > self.max_swarms:  # oldest versions go first
            oldest = min(self.swarms, key=lambda d: max(t for _, t in self.swarms[d].values()))
            del self.swarms[oldest]
        others = [p for pid, (p, _) in members.items() if pid != peer_id and p.addrs]
        random.shuffle(others)
        others.sort(key=lambda p: not p.complete)
        return SwarmPeers(peers=others[: msg.want], interval_s=self.interval_s)

    def forget(self, peer_id: str) -> None:
        """Drop a peer (banned or gone) from every swarm."""
        for members in self.swarms.values():
            members.pop(peer_id, None)

    def counts(self) -> dict[str, dict[str, int]]:
        """Per version: members, seeds, and how they are reached: `relayed` peers hold a
        reservation on a relay (they announce a /p2p-circuit address: behind NAT, or
        playing safe); `unreachable` peers announce neither a relayed nor a public
        address (behind NAT without a relay: only their own network can fetch from them)."""
        return {
            d[:12]: {
                "peers": len(m),
                "seeds": sum(p.complete for p, _ in m.values()),
                "relayed": sum(any(_relayed(a) for a in p.addrs) for p, _ in m.values()),
                "unreachable": sum(
                    not any(_relayed(a) or _public(a) for a in p.addrs) for p, _ in m.values()
                ),
            }
            for d, m in self.swarms.items()
        }


def _relayed(addr: str) -> bool:
    return "/p2p-circuit" in addr


def _public(addr: str) -> bool:
    """A direct multiaddr whose host is a global IP address or a DNS name."""
    parts = addr.split("/")
    if len(parts) < 3:
        return False
    try:
        return ipaddress.ip_address(parts[2]).is_global
    except ValueError:
        return parts[1].startswith("dns")
