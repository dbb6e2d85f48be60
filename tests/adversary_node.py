"""A dishonest node process, for tests only: `python -m tests.adversary_node KIND <join flags>`.

It is the real `prime-node join` (server, registration, heartbeats, weight swarm, leave)
with the worker replaced by one of `tests.adversaries.DISHONEST_WORKERS` (and, for a kind
whose worker class names a `swarm_cls`, the weight-swarm peer replaced too).
"""

from __future__ import annotations

import asyncio
import sys

from node.config import JoinConfig
from node.join import JoinError, PoolNode, run
from protocol.config import load_config
from protocol.logs import setup_logging
from tests.adversaries import DISHONEST_WORKERS


def main(argv: list[str]) -> None:
    kind, args = argv[0], argv[1:]
    worker_cls = DISHONEST_WORKERS[kind]
    hooks: dict = {"worker_cls": worker_cls}
    if hasattr(worker_cls, "swarm_cls"):
        hooks["swarm_cls"] = worker_cls.swarm_cls()
    node_cls = type(f"Dishonest[{kind}]", (PoolNode,), hooks)
    setup_logging()
    try:
        asyncio.run(run(load_config(JoinConfig, args), node_cls=node_cls))
    except JoinError as exc:  # same exit codes as `prime-node join` (3: banned)
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main(sys.argv[1:])
