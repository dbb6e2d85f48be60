"""The main job (`make demo`): two real workers on loopback serving SmolLM2.

Worker A answers the official `openai` client; each answer's signed rollout (tokens,
logprobs, TOPLOC proof) is fetched from A and verified by worker B, which returns a
signed verdict; finally a tampered copy (one token edited) is shown being rejected.
Everything runs locally; nothing is downloaded from a model hub.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
from openai import OpenAI
from rich.console import Console
from rich.table import Table

from protocol.envelope import open_envelope, seal
from protocol.identity import Identity
from protocol.messages import Rollout, Verdict, VerifyRequest
from protocol.processes import ManagedProcess, free_port
from verifier.models import resolve_model

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write a haiku about the sea.",
]
MSGPACK = {"Content-Type": "application/msgpack"}


def start_worker(name: str, run_dir: Path, model: str) -> tuple[ManagedProcess, str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "node.cli",
        "serve",
        "--engine.model",
        model,
        "--server.port",
        str(port),
        "--key-file",
        str(run_dir / f"{name}.key"),
        "--log-dir",
        str(run_dir / name),
        "@",
        str(
            Path(__file__).resolve().parent.parent
            / "configs"
            / "verification"
            / "smollm2-torch-cpu-fp32.toml"
        ),
    ]
    url = f"http://127.0.0.1:{port}"
    return ManagedProcess.start(name, cmd, f"{url}/health", run_dir / f"{name}.log"), url


def verify(url: str, scheduler: Identity, rollout_envelope: bytes) -> Verdict:
    body = seal(scheduler, VerifyRequest(rollout_envelope=rollout_envelope))
    return open_envelope(
        httpx.post(f"{url}/v1/verify", content=body, headers=MSGPACK, timeout=120).content, Verdict
    ).message


def main(model: str = "smollm2", run_dir: Path = Path("runs/demo")) -> None:
    console = Console()
    run_dir.mkdir(parents=True, exist_ok=True)
    with console.status("preparing SmolLM2-135M-Instruct (dequantized once, then cached)"):
        resolve_model(model)
    with console.status("starting worker A and worker B"):
        a, a_url = start_worker("worker-a", run_dir, model)
        b, b_url = start_worker("worker-b", run_dir, model)
    try:
        client = OpenAI(base_url=f"{a_url}/v1", api_key="unused")
        scheduler = Identity.load_or_create(run_dir / "scheduler.key")
        table = Table(title="worker A answers the openai client; worker B verifies each answer")
        for col in ("question", "answer", "tokens", "gen s", "proof bytes", "verdict (B)"):
            table.add_column(col)
        last_envelope = None
        for q in QUESTIONS:
            t0 = time.time()
            resp = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": q}],
                max_tokens=48,
                temperature=1.0,
                seed=len(q),
                logprobs=True,
            )
            gen_s = time.time() - t0
            envelope = httpx.get(f"{a_url}/v1/rollouts/{resp.model_extra['rollout_id']}").content
            rollout = open_envelope(envelope, Rollout, check_expiry=False).message
            verdict = verify(b_url, scheduler, envelope)
            last_envelope = (envelope, rollout)
            table.add_row(
                q,
                resp.choices[0].message.content.strip(),
                str(resp.usage.completion_tokens),
                f"{gen_s:.1f}",
                str(sum(len(p) for p in rollout.proof)),
                "[green]accepted[/green]" if verdict.accepted else f"[red]{verdict.reasons}[/red]",
            )
        console.print(table)
        # A cheater edits one token of the last answer and re-signs it as its own.
        _, rollout = last_envelope
        cheater = Identity.generate()
        ids = list(rollout.completion_ids)
        ids[len(ids) // 2] = (ids[len(ids) // 2] + 1) % 49152
        forged = rollout.model_copy(update={"completion_ids": ids, "node_id": cheater.node_id})
        verdict = verify(b_url, scheduler, seal(cheater, forged))
        console.print(
            f"tampered copy (one token edited): "
            f"{'[green]accepted[/green]' if verdict.accepted else '[red]rejected[/red]'} -> "
            f"{'; '.join(verdict.reasons)}"
        )
        console.print(f"logs and keys in {run_dir}/")
    finally:
        a.stop()
        b.stop()


if __name__ == "__main__":
    main(*sys.argv[1:2])
