"""Settings of a swarm peer (the trainer's seeder, a worker, the `swarm` CLI).

Every field is documented where it is declared; validators fail with a message naming
the field. Rates are bytes per second and model the node's link: tests and benchmarks cap
them to act out slow home uplinks.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from protocol.config import PrimeSettings, Section

MiB = 1024 * 1024


class SwarmConfig(Section):
    """A libp2p peer that seeds and fetches weight versions piece by piece."""

    listen: list[str] = ["/ip4/127.0.0.1/tcp/0"]
    """libp2p multiaddrs to listen on (tcp/0: any free port). Use /ip4/0.0.0.0/... to be
    reachable from other machines."""
    announce_addrs: list[str] = []
    """Addresses to tell others instead of the listen addresses (a public IP behind NAT
    with a forwarded port); empty: the listen addresses."""
    piece_size: int = Field(4 * MiB, ge=16 * 1024, le=64 * MiB)
    """Bytes per piece when publishing (a few MiB: big enough to keep per-piece overhead
    small, small enough that many peers can trade pieces early)."""
    upload_rate: float = Field(0.0, ge=0.0)
    """Upload cap of this node in bytes/s, over all peers together (0: unlimited)."""
    download_rate: float = Field(0.0, ge=0.0)
    """Download cap of this node in bytes/s (0: unlimited)."""
    upload_slots: int = Field(4, ge=1, le=64)
    """Peers uploaded to at once per version (the rest are choked until a re-choke)."""
    optimistic_slots: int = Field(1, ge=0, le=8)
    """Of those, slots given to random choked peers, so newcomers get their first pieces."""
    rechoke_interval_s: float = Field(2.0, gt=0.0)
    """How often upload slots are handed out again (to the peers that upload to us the
    fastest; a seed favours the peers it has sent the least)."""
    max_peers: int = Field(30, ge=1, le=1000)
    """Peers connected per version (dials stop beyond it)."""
    pipeline: int = Field(2, ge=1, le=64)
    """Piece requests outstanding per peer."""
    request_timeout_s: float = Field(60.0, gt=0.0)
    """A requested piece that has not arrived by then is asked of another peer."""
    connect_timeout_s: float = Field(10.0, gt=0.0)
    """Dialing a peer gives up after this long."""
    share: bool = True
    """Serve pieces to other downloaders. False makes a pure leecher (a star topology: only
    seeds upload; for comparisons)."""
    relay_service: bool = False
    """Act as a circuit relay (libp2p circuit relay v2, hop) for peers nobody can dial:
    they reserve a slot here and are reached through it. The trainer's seed turns it on
    (it is public by necessity); a worker with a public address may too."""
    relay_max_reservations: int = Field(1024, ge=1, le=100_000)
    """Peers that may hold a reservation on this relay at once."""
    relay_max_circuits: int = Field(64, ge=1, le=10_000)
    """Relayed connections through this relay per reserving peer."""
    use_relay: bool = True
    """Reserve a slot on the trainer's seed (a relay) and announce the relayed address, so
    peers that cannot dial this one directly (it sits behind NAT) still reach it; direct
    addresses are always tried first."""
    relays: list[str] = []
    """Relays to reserve a slot on at start (full multiaddrs ending in /p2p/<relay id>);
    a pool node also reserves on the trainer's seed named by each weights update."""
    hole_punch: bool = True
    """Over a relayed connection, try to upgrade to a direct one (DCUtR hole punching);
    where the NATs allow it, pieces then stop going through the relay."""
    max_connections: int = Field(10_000, ge=16)
    """libp2p connection limit (py-libp2p counts every inbound connection it ever accepted
    against a limit derived from this)."""

    @field_validator("listen", "announce_addrs", "relays")
    @classmethod
    def check_multiaddrs(cls, v: list[str]) -> list[str]:
        for a in v:
            if not a.startswith("/"):
                raise ValueError(f"{a!r} is not a multiaddr (like /ip4/127.0.0.1/tcp/4001)")
        return v


class SwarmToolSettings(PrimeSettings):
    """Fields shared by the operators' swarm commands (`prime-trainer publish`,
    `prime-node fetch`)."""

    swarm: SwarmConfig = SwarmConfig()
    """This peer: listen address, upload and download caps, upload slots, piece size."""
    status_file: Path | None = None
    """Rewrite this JSON file with the torrent's counters every half second."""
    progress: bool = True
    """Show a progress bar."""
