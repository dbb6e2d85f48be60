"""One node, assembled from its config: the engine, its worker, the weight-swarm peer and
the HTTP server, built the same way for `prime-node serve` (standalone) and `prime-node
join` (in a pool).

Owns how a node's settings reach its parts. Invariants:
- Every `EngineConfig` setting reaches the engine (`load_engine`) or the worker
  (`Worker.from_config`), whichever command started the node: a flag honoured by `serve`
  is honoured by `join`.
- The swarm peer gets its hooks (load into the worker, read the version held, the
  tracker, what to run after a swap) in its constructor; nothing is wired by assignment
  afterwards.
- What differs between a standalone node and a pool node is said by the caller, in the
  arguments of `assemble`: the verification thresholds, the pool id, the keys that sign
  weights, who may send proof-route work (`callers`) and who may use the OpenAI routes
  (`api_key`), the tracker and what runs after a swap.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from node.config import EngineConfig, NodeWeightsConfig, ServerConfig
from node.engines import InferenceEngine, create_engine
from node.server import NodeServer
from node.swarm_weights import SwarmWeights
from node.worker import Worker
from protocol.identity import Identity, node_id_from_public_key
from protocol.messages import VerificationPolicy
from protocol.swarm.tracker import TrackerClient

log = logging.getLogger("prime.node")


def load_engine(cfg: EngineConfig) -> InferenceEngine:
    """The engine `cfg` names, its model loaded (slow: keep it off an event loop)."""
    log.info("loading %s on the %s engine", cfg.model, cfg.kind)
    return create_engine(cfg)


def assemble(
    engine: InferenceEngine,
    engine_cfg: EngineConfig,
    identity: Identity,
    server_cfg: ServerConfig,
    weights_cfg: NodeWeightsConfig,
    *,
    policy: VerificationPolicy,
    pool_id: str,
    trainer_keys: set[bytes],
    model_name: str,
    callers: set[bytes] | None = None,
    api_key: str | None = "",
    tracker: TrackerClient | None = None,
    on_loaded: Callable[[], None] = lambda: None,
    worker_cls: type[Worker] = Worker,
    swarm_cls: type[SwarmWeights] = SwarmWeights,
) -> NodeServer:
    """The node's server over a worker of `engine` (built from `engine_cfg`) and, unless
    `weights_cfg` switches it off, a swarm peer that loads into that worker. Weights are
    taken only under `trainer_keys`; `model_name` is shown on /v1/models unless
    `server_cfg.served_model_name` says otherwise. Nothing starts until the server's app
    does (`NodeServer.app`: its startup hook starts the worker and the swarm peer)."""
    worker = worker_cls.from_config(engine, identity, policy, engine_cfg, pool_id)
    swarm = swarm_cls.from_config(
        identity,
        weights_cfg,
        trainer_keys,
        load=worker.load_weights,
        current_version=lambda: worker.engine.weights_version,
        tracker=tracker,
        on_loaded=on_loaded,
    )
    return NodeServer(
        worker,
        model_name=server_cfg.served_model_name or model_name,
        trusted_keys=[node_id_from_public_key(k) for k in trainer_keys],
        callers=callers,
        api_key=api_key,
        swarm=swarm,
        max_body_bytes=server_cfg.max_body_bytes,
        max_concurrent=server_cfg.max_concurrent_requests,
        rollout_cache_size=server_cfg.rollout_cache_size,
        body_read_timeout_s=server_cfg.body_read_timeout_s,
    )
