"""Client side of the pool's swarm tracker (`POST /v1/swarm/announce` on the scheduler).

Invariants: every announce is signed by the peer's own identity (the tracker only lists
registered nodes and the trainer); a tracker that is down is not fatal: peers keep
trading with whom they know, and the next announce tries again.
"""

from __future__ import annotations

from collections.abc import Callable

import aiohttp

from protocol.client import call
from protocol.identity import Identity
from protocol.messages import SwarmAnnounce, SwarmPeer, SwarmPeers


class TrackerClient:
    def __init__(
        self, session: aiohttp.ClientSession, base_url: Callable[[], str], identity: Identity
    ):
        self.session = session
        self.base_url = base_url  # follows the node's current scheduler replica
        self.identity = identity

    async def announce(self, msg: SwarmAnnounce) -> SwarmPeers:
        url = self.base_url().rstrip("/") + "/v1/swarm/announce"
        opened, _ = await call(self.session, url, self.identity, msg, SwarmPeers)
        return opened.message


def dial_addrs(peer: SwarmPeer) -> list[str]:
    """Dialable multiaddrs (ending in /p2p/<id>) of a peer in a tracker answer."""
    return [a if "/p2p/" in a else f"{a}/p2p/{peer.peer_id}" for a in peer.addrs]
