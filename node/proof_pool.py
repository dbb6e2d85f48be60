"""Where a worker builds its TOPLOC proofs: in the caller's thread, or in a pool of processes.

toploc's C++ polynomial builder holds the GIL: two threads building proofs take twice as
long as one, and a thread building proofs competes with the engine thread, whose Python
work per decode step is what bounds a small model on a GPU. A pool of processes builds
them on other cores, in parallel, while the engine decodes the next batch; the rollout is
answered when its proof is ready.

Invariants: a proof is the bytes `verifier.proofs.build_proof` makes in-process (the same
function runs in the child, on the same bf16 rows, carried as raw bytes); children are
started with `spawn` (a forked child of a process holding CUDA is unusable), on first use,
with one torch thread each; with 0 processes proofs are built in the calling thread.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import torch

from protocol.messages import ProofParams
from verifier.proofs import build_proof


def _init_child() -> None:
    torch.set_num_threads(1)  # one core per child; the pool's size says how many


def _build_from_bytes(raw: bytes, shape: tuple[int, int], params: ProofParams) -> list[bytes]:
    rows = torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).view(shape)
    return build_proof(rows, params)


class ProofPool:
    def __init__(self, processes: int):
        self.processes = processes
        self._pool: ProcessPoolExecutor | None = None

    def build_here(self, hidden_states: torch.Tensor, params: ProofParams) -> list[bytes]:
        """Build in the calling thread (what a pool of 0 processes does)."""
        return build_proof(hidden_states, params)

    async def build(self, hidden_states: torch.Tensor, params: ProofParams) -> list[bytes]:
        """The proof of rows [N, H], built in a child process (or in the default executor's
        thread when the pool has no processes)."""
        loop = asyncio.get_running_loop()
        if self.processes == 0:
            return await loop.run_in_executor(None, build_proof, hidden_states, params)
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                self.processes, multiprocessing.get_context("spawn"), initializer=_init_child
            )
        rows = hidden_states.to(torch.bfloat16).cpu().contiguous()
        raw = rows.view(torch.int16).numpy().tobytes()
        return await loop.run_in_executor(
            self._pool, _build_from_bytes, raw, tuple(rows.shape), params
        )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
