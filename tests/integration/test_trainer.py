"""The trainer as a process: FSDP2 over two ranks, resume after SIGKILL, weights, timeouts.

Every run is a real `python -m trainer.train` (or torchrun) subprocess on the tiny model,
fed synthetic batches written with `trainer.batch.write_batch`.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.nodes import REPO
from trainer.batch import Batch, TrainingSample, write_batch

CONFIG = REPO / "configs" / "trainer" / "tiny-cpu.toml"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
TORCHRUN = Path(sys.executable).parent / "torchrun"


def write_batches(run_dir: Path, steps: range, seed: int = 0) -> None:
    """Random token sequences with random advantages and a fixed mu; one stale sample."""
    for step in steps:
        rng = random.Random(seed * 1000 + step)
        samples = []
        for _ in range(8):
            n, prompt = rng.randint(8, 40), rng.randint(2, 6)
            samples.append(
                TrainingSample(
                    input_ids=[rng.randrange(3, 90) for _ in range(n)],
                    loss_mask=[False] * prompt + [True] * (n - prompt),
                    logprobs=[0.0] * prompt + [-4.0] * (n - prompt),
                    advantage=rng.uniform(-1, 1),
                    version=max(step - 1, 0),
                )
            )
        samples.append(TrainingSample([5, 6, 7], [False, True, True], [0, -1, -1], 1.0, -9))
        write_batch(run_dir, Batch(step, samples, {"reward_mean": step / 10}))


def train(run_dir: Path, *flags: str, nproc: int = 1, wait: bool = True, timeout: float = 240):
    args = ["@", str(CONFIG), "--run-dir", str(run_dir), *flags]
    if nproc > 1:
        cmd = [str(TORCHRUN), "--standalone", f"--nproc-per-node={nproc}", "-m", "trainer.train"]
    else:
        cmd = [sys.executable, "-m", "trainer.train"]
    proc = subprocess.Popen(
        cmd + args, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    if not wait:
        return proc
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "logs" / "trainer_metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "weights" / f"step_{step}" / "model.safetensors")


def test_two_fsdp_ranks_match_one_process(tmp_path, report):
    flags = ("--max-steps", "3", "--weights.keep-last", "10", "--micro-batch-tokens", "64")
    runs = {}
    for nproc in (1, 2):
        run_dir = tmp_path / f"nproc{nproc}"
        write_batches(run_dir, range(1, 4))
        t0 = time.monotonic()
        rc, out = train(run_dir, *flags, nproc=nproc)
        assert rc == 0, out[-3000:]
        runs[nproc] = (metrics(run_dir), run_dir, time.monotonic() - t0)
    (m1, dir1, t1), (m2, dir2, t2) = runs[1], runs[2]
    assert [m["step"] for m in m1] == [m["step"] for m in m2] == [1, 2, 3]
    for a, b in zip(m1, m2, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert a["stale_dropped"] == 1 and a["orch/reward_mean"] == a["step"] / 10
        assert a["micro_batches"] >= 2 and b["micro_batches"] == -(-a["micro_batches"] // 2)
        assert {"idle_s", "entropy", "mismatch_kl", "capped_fraction", "lr", "mfu"} <= set(a)
    w1, w2 = weights(dir1, 3), weights(dir2, 3)
    worst = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    assert worst < 1e-5
    report("trainer_fsdp2_vs_single", {
        "losses_1proc": [m["loss"] for m in m1], "losses_2proc": [m["loss"] for m in m2],
        "max_weight_diff_step3": worst, "wall_s_1proc": round(t1, 1), "wall_s_2proc": round(t2, 1),
    })  # fmt: skip


def test_weights_of_every_step_are_stable_and_load(tmp_path):
    from transformers import AutoModelForCausalLM

    from verifier.models import resolve_model

    run_dir = tmp_path / "run"
    write_batches(run_dir, range(1, 3))
    rc, out = train(run_dir, "--max-steps", "2", "--weights.keep-last", "10")
    assert rc == 0, out[-3000:]
    for step in (0, 1, 2):
        folder = run_dir / "weights" / f"step_{step}"
        assert (folder / "STABLE").exists()
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert model.config.num_hidden_layers == 2
    initial = load_file(resolve_model("tiny") / "model.safetensors")
    w0, w2 = weights(run_dir, 0), weights(run_dir, 2)
    assert all(torch.equal(w0[k], initial[k]) for k in initial)  # version 0 = the start
    assert any(not torch.equal(w2[k], w0[k]) for k in w0)  # and training moved the weights
    assert (run_dir / "configs" / "trainer.toml").exists()


@pytest.mark.parametrize("nproc", [1, 2])
def test_resume_after_sigkill_gives_the_same_weights(tmp_path, report, nproc):
    """Killed after a checkpoint and resumed on as many ranks, a run ends with the weights
    and loss of one never interrupted (FSDP2: each rank restores its own shards), and a
    killed torchrun leaves no rank training on."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    write_batches(straight, range(1, 11))
    rc, out = train(straight, nproc=nproc)
    assert rc == 0, out[-3000:]

    # Only batches 1..6 exist: the run checkpoints at step 5 and then blocks on batch 7
    # (or is still in step 6) when it is killed.
    write_batches(killed, range(1, 7))
    proc = train(killed, wait=False, nproc=nproc)
    marker = killed / "checkpoints" / "step_5" / "trainer" / "COMPLETE"
    deadline = time.monotonic() + 180
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), proc.communicate(timeout=10)[0][-3000:] if proc.poll() else "timeout"
    # kill -9 of the trainer (torchrun's agent for 2 ranks): its ranks must die with it,
    # or they would train on the batches written below and checkpoint past step 5.
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    write_batches(killed, range(7, 11))
    rc, out = train(killed, "--ckpt.resume", nproc=nproc)
    assert rc == 0, out[-3000:]
    assert "resumed from the checkpoint of step 5" in out

    a, b = weights(straight, 10), weights(killed, 10)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= 1e-6
    resumed = [m for m in metrics(killed) if m["step"] == 10][-1]
    assert resumed["loss"] == pytest.approx(metrics(straight)[-1]["loss"], rel=1e-6, abs=1e-9)
    ckpts = sorted(p.name for p in (killed / "checkpoints").iterdir())
    assert ckpts == ["step_10", "step_5"]  # keep_last = 2
    report(f"trainer_resume_max_weight_diff_{nproc}proc", worst)


def test_missing_batch_times_out_with_a_clear_message(tmp_path):
    rc, out = train(tmp_path / "empty", "--batch-timeout-s", "1", timeout=120)
    assert rc != 0
    assert "no batch for step 1 after 1 s" in out
    assert "Traceback" not in out


def test_sft_lowers_the_nll_and_saves_a_loadable_folder(tmp_path):
    from transformers import AutoModelForCausalLM

    from trainer.config import OptimConfig, SFTConfig
    from trainer.train import train_sft

    rng = random.Random(0)
    examples = []
    for _ in range(6):
        prompt = [rng.randrange(3, 90) for _ in range(5)]
        completion = [rng.randrange(3, 90) for _ in range(8)]
        examples.append(
            TrainingSample(prompt + completion, [False] * 5 + [True] * 8, [0.0] * 13, 0.0)
        )
    cfg = SFTConfig(
        run_dir=tmp_path, max_steps=20, batch_size=4, micro_batch_tokens=32, device="cpu",
        optim=OptimConfig(lr=3e-3),
    )  # fmt: skip
    out = train_sft(cfg, examples)
    assert out == tmp_path / "final"
    rows = [json.loads(line) for line in (tmp_path / "logs" / "sft_metrics.jsonl").open()]
    assert len(rows) == 20 and all(r["loss_tokens"] == 4 * 8 for r in rows)
    assert rows[-1]["loss"] < 0.5 * rows[0]["loss"]
    AutoModelForCausalLM.from_pretrained(out)
