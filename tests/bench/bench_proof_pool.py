#!/usr/bin/env python
"""Proofs beside decoding: how much a worker's generation slows while TOPLOC proofs of an
earlier batch are built in a thread of the worker (`--engine.proof-processes 0`) or in child
processes (`node.proof_pool`, N > 0).

toploc's builder holds the GIL, so a proof thread takes turns with the engine thread, whose
Python work per decode step bounds a small model (on a GPU always; here with the tiny model).
Per mode, side by side in one run: `engine.generate` of B rollouts alone, then the same while
proofs are built without pause beside it; reported: generation seconds, slowdown against
alone, proof chunks built per second meanwhile. The engine runs with one torch thread, so
that one core is left for a proof process on a 2-core box.

    python tests/bench/bench_proof_pool.py                  # tiny model on this CPU
    python tests/bench/bench_proof_pool.py --model smollm2-random --device cuda --batch 256

Outputs: a rich table, tests/bench/results/proof_pool_<device>.json (stem: --out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "bench"))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from node.config import EngineConfig  # noqa: E402
from node.engines.base import GenerationRequest  # noqa: E402
from node.engines.torch_engine import TorchEngine  # noqa: E402
from node.proof_pool import ProofPool  # noqa: E402
from protocol.messages import ProofParams, SamplingParams  # noqa: E402

console = Console()


def proofs_beside(
    pool: ProofPool, rows: torch.Tensor, stop: threading.Event
) -> tuple[list[int], threading.Thread]:
    """Build proofs of `rows` until `stop`, 4 at a time: ([chunks built], the thread)."""
    built = [0]
    params = ProofParams()

    async def loop() -> None:
        while not stop.is_set():
            proofs = await asyncio.gather(*(pool.build(rows, params) for _ in range(4)))
            built[0] += sum(len(p) for p in proofs)

    thread = threading.Thread(target=lambda: asyncio.run(loop()), daemon=True)
    thread.start()
    return built, thread


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny | smollm2-random | a model folder")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--processes", default="1", help="comma-separated pool sizes to compare")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = args.model
    if model == "smollm2-random":
        from bench_node import build_random_smollm2

        model = str(build_random_smollm2(Path(tempfile.mkdtemp()) / "m"))
    engine = TorchEngine(EngineConfig(model=model, device=args.device))
    sp = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, min(engine.vocab_size, 90), (args.batch, 16), generator=g).tolist()
    reqs = [GenerationRequest(p, sp, i) for i, p in enumerate(prompts)]
    hidden = engine.generate(reqs[:1])[0].hidden_states
    rows = hidden.repeat(max(1, 512 // hidden.shape[0]), 1)[:512]  # one 512-token rollout

    def timed_generate() -> float:
        t0 = time.perf_counter()
        engine.generate(reqs)
        return time.perf_counter() - t0

    timed_generate()  # warm-up
    results = [{"mode": "alone", "gen_s": min(timed_generate() for _ in range(2))}]
    for n in [0] + [int(x) for x in args.processes.split(",")]:
        pool, stop = ProofPool(n), threading.Event()
        built, thread = proofs_beside(pool, rows, stop)
        deadline = time.monotonic() + 120
        while built[0] == 0 and time.monotonic() < deadline:  # children started (spawn)
            time.sleep(0.1)
        start = built[0]
        t0 = time.perf_counter()
        gen_s = timed_generate()
        chunks = built[0] - start
        wall = time.perf_counter() - t0
        stop.set()
        thread.join()
        pool.close()
        mode = "proofs in a thread" if n == 0 else f"proofs in {n} process(es)"
        results.append({"mode": mode, "gen_s": gen_s, "proof_chunks_per_s": chunks / wall})
    alone = results[0]["gen_s"]
    for r in results:
        r["slowdown"] = r["gen_s"] / alone
    table = Table(
        title=f"generation beside proof building: {args.model} on {args.device}, "
        f"B={args.batch}, {args.max_tokens} tokens"
    )
    for col in ("mode", "generate s", "x alone", "proof chunks/s"):
        table.add_column(col, justify="right")
    for r in results:
        chunks = r.get("proof_chunks_per_s")
        table.add_row(
            r["mode"],
            f"{r['gen_s']:.2f}",
            f"{r['slowdown']:.2f}",
            "-" if chunks is None else f"{chunks:.0f}",
        )
    console.print(table)
    out = Path(args.out or ROOT / "tests/bench/results" / f"proof_pool_{args.device.split(':')[0]}")
    payload = {"bench": "proof_pool", "settings": vars(args), "results": results}
    out.with_suffix(".json").write_text(json.dumps(payload, indent=2))
    console.print(f"wrote {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
