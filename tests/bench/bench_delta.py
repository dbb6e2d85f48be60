#!/usr/bin/env python
"""Delta weight versions: bytes shipped per RL step, and how fast 8 capped peers hold one.

What runs (one process, CPU; only loopback traffic):

1. Per learning rate (default 1e-6, 1e-5 and 5e-4, the last being
   configs/rl/reverse-text-tiny.toml's), in a fresh run directory: the project's real
   `trainer.train.Trainer` (SmolLM2-135M-Instruct, `resolve_model("smollm2")`, fp32
   master weights on CPU, AdamW as `OptimConfig` configures it: betas 0.9/0.999, no weight
   decay, clipping at 1.0, constant lr, no warm-up) takes `--steps` optimizer steps with
   `Trainer.step(samples, "rl")` (the AIPO loss). After version 0 and after every step,
   `transport.save(n, trainer.full_state_dict(), ...)` goes through a real `SwarmTransport`
   made by `make_transport` (as `Trainer.run` does) with `deltas=True`,
   `dtype="bfloat16"`: it writes weights/step_n (bf16 safetensors), signs the full
   manifest, writes step_n/.delta when it pays, seeds both on loopback and appends a line
   to weights/published.jsonl, which is where `delta_bytes`, `changed` and `publish_s`
   come from. `cleanup` keeps what async_level 2 needs, as the trainer does.

   Two settings differ from a production run, both so that every step is measured:
   `keyframe_interval` is set past the last step (production: every 10th version is full
   only; the JSON's `amortised_with_keyframes` gives the bytes shipped per step had
   keyframes been on, from the measured deltas), and when the transport publishes no
   delta (it would exceed `delta_max_fraction`, 0.5 of the full version, as configured)
   the bench measures it anyway with `make_delta` into a scratch folder: those steps ship
   the full version (`shipped` = 1.0) and `delta_over_full` is what the delta would have
   been.

   Synthetic rollouts: each step `--prompts` prompts of `--prompt-len` tokens drawn
   uniformly from the vocabulary (special tokens excluded), each with `--group`
   completions of `--completion-len` tokens, also drawn uniformly (`--rollouts random`,
   the default); mu is the current policy's own logprob of each completion token (one
   no-grad forward, temperature 1), so the importance ratio starts at 1 as for on-policy
   samples and AIPO's cap does not distort the gradient. `--rollouts sampled` samples the
   completions from the policy token by token instead (KV cache): text the model would
   write, but 48 decode steps of fp32 SmolLM2 took 10-50 s a step on the shared 2-core
   box (memory-bound), more than the training step. The reward is the fraction of
   completion tokens whose id is below vocab/2, the advantage reward minus the group's
   mean. Why not random advantages: Adam normalises every element's step, so the weight
   change per step is set by the lr and by how consistent the gradient's sign is from
   step to step; pure-noise advantages make Adam's m/sqrt(v) shrink after the first steps
   and would understate the change of a real run, whose reward pushes the policy the same
   way step after step. A fixed learnable reward is the conservative (larger-delta)
   choice. Batch: 2 prompts x 2 completions x (16 + 48)
   tokens, 256 tokens a step, so that the 60 SmolLM2 steps take about 26 minutes on the
   shared 2-core box; the batch size changes the gradient's noise, hardly the size of
   Adam's steps.

2. Side by side, in the same run: for one representative step (`--sbs-lr`,
   `--sbs-step`; default 1e-6, step 10), `--fetchers` `prime-node fetch` processes, each
   capped at `--rate-mib` MiB/s upload (the seed too), fetch (a) the full version (seed:
   `prime-trainer publish` of step_n's files, the run's trainer key) and then (b) the
   delta folder step_n/.delta (seeded the same way; the fetchers hold step_{n-1} and need
   only the delta). Each fetched delta is applied (`protocol.swarm.delta.apply_delta`)
   onto step_{n-1}, the result compared byte for byte with step_n and hashed into pieces
   (`protocol.swarm.manifest.build_manifest`) against the trainer's signed full manifest
   of step_n, as a node does before loading it.

How to read the outputs (rich tables, <out>.json, <out>.png):

- delta/full: the delta file's bytes over the full version's bytes (bf16 safetensors,
  config and tokenizer); shipped: what a worker holding step_{n-1} downloads for step n,
  over full (the delta when the transport published one, else 1.0). Target (issue): at
  most 5% at lr 1e-6, judged on the worst step (`targets`), the median is shown too.
- changed: elements whose bf16 bytes differ from the step before, over all elements;
  `groups` in the JSON splits it by tensor kind (embedding, attention, MLP, norms).
- publish s: `publish_s` from published.jsonl (hash + sign the full manifest, seed,
  make and sign the delta); save s: the whole `transport.save` (also writing the bf16
  folder); step s: `Trainer.step`; gen s: sampling the rollouts.
- side by side: last done s, as bench_swarm.py: the last fetcher's `finished` minus the
  first one's `started` (status files, one clock); hold s adds, for the delta, each
  fetcher's own apply + verify time (measured one after the other after the fetches, as
  if each peer were its own machine); x S/B is last done over size / cap; trainer up is
  what the seed uploaded, in units of the version's size.

    .venv/bin/python tests/bench/bench_delta.py --out tests/bench/results/delta_cpu   # ~30 min here
    .venv/bin/python tests/bench/bench_delta.py --quick --out /tmp/delta_quick          # ~1 min
    .venv/bin/python tests/bench/bench_delta.py --replot tests/bench/results/delta_cpu.json

`--quick` (tests/integration/test_bench_delta_smoke.py): the tiny model, 3 steps per lr,
the side by side at step 2 with 2 fetchers, 1 MiB/s caps, 64 KiB pieces. Only that it runs
and that the rebuilt version is byte-identical mean anything there.
"""

from __future__ import annotations

import argparse
import filecmp
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (str(REPO), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import bench_swarm as bs  # noqa: E402  (status files, CPU use, machine info)
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from protocol.envelope import open_envelope  # noqa: E402
from protocol.identity import Identity  # noqa: E402
from protocol.messages import Manifest  # noqa: E402
from protocol.processes import ManagedProcess  # noqa: E402
from protocol.swarm.delta import DELTA_FILE, apply_delta, make_delta  # noqa: E402
from protocol.swarm.manifest import MANIFEST_FILE, build_manifest, version_files  # noqa: E402

MiB = 2**20
LRS = (1e-6, 1e-5, 5e-4)  # 5e-4: configs/rl/reverse-text-tiny.toml's trainer.optim.lr
TARGET_LR, TARGET_FRACTION = 1e-6, 0.05
MARKER = "STABLE"  # trainer.weights.MARKER (not imported: that pulls in torch at import)

console = Console(width=None if sys.stdout.isatty() else 160)


# -- synthetic on-policy rollouts -----------------------------------------------------
def special_ids(tokenizer) -> set[int]:
    return set(tokenizer.all_special_ids)


def reward_of(completions, vocab: int):
    """A fixed, learnable preference: the fraction of completion ids below vocab/2."""
    return (completions < vocab // 2).float().mean(1)


def equal_groups(rewards, group: int):
    """Per sample: whether its group's rewards are all equal (no advantage: no signal)."""
    r = rewards.view(-1, group)
    return (r.max(1).values == r.min(1).values).repeat_interleave(group)


def sample_batch(trainer, step: int, args: argparse.Namespace, vocab: int, banned: set[int]):
    """`args.prompts` x `args.group` samples with mu from the policy itself: completions
    drawn uniformly from the vocabulary and scored by one forward of the current policy
    (`--rollouts random`), or sampled from it token by token (`--rollouts sampled`)."""
    import torch

    from trainer.batch import TrainingSample

    gen = torch.Generator().manual_seed(args.seed * 100_003 + step)  # same data at every lr
    allowed = torch.tensor([i for i in range(vocab) if i not in banned])
    pick = torch.randint(len(allowed), (args.prompts, args.prompt_len), generator=gen)
    prompts = allowed[pick].repeat_interleave(args.group, dim=0)  # [B, P], groups adjacent
    b, temp = prompts.shape[0], trainer.cfg.loss.temperature
    lm = trainer.policy.lm
    was = lm.training
    lm.eval()
    with torch.no_grad():
        if args.rollouts == "random":
            pick = torch.randint(len(allowed), (b, args.completion_len), generator=gen)
            completions = allowed[pick]
            for _ in range(1000):  # as the orchestrator drops all-equal groups: redraw them
                flat = equal_groups(reward_of(completions, vocab), args.group)
                if not flat.any():
                    break
                pick = torch.randint(
                    len(allowed), (int(flat.sum()), args.completion_len), generator=gen
                )
                completions[flat] = allowed[pick]
            ids = torch.cat([prompts, completions], 1)
            logits = lm(input_ids=ids, use_cache=False).logits[:, args.prompt_len - 1 : -1]
            mu = torch.log_softmax(logits.float() / temp, -1).gather(-1, completions[..., None])
            mu = mu.squeeze(-1)
        else:
            for _ in range(8):  # resample the batch while a group's rewards are all equal
                toks, mus = [], []
                out = lm(input_ids=prompts, use_cache=True)
                for t in range(args.completion_len):
                    logp = torch.log_softmax(out.logits[:, -1].float() / temp, -1)
                    tok = torch.multinomial(logp.exp(), 1, generator=gen)
                    toks.append(tok)
                    mus.append(logp.gather(-1, tok))
                    if t + 1 < args.completion_len:
                        out = lm(input_ids=tok, past_key_values=out.past_key_values, use_cache=True)
                completions, mu = torch.cat(toks, 1), torch.cat(mus, 1)
                if not equal_groups(reward_of(completions, vocab), args.group).any():
                    break
    lm.train(was)
    rewards = reward_of(completions, vocab)
    group_mean = rewards.view(args.prompts, args.group).mean(1).repeat_interleave(args.group)
    samples = []
    p, c = args.prompt_len, args.completion_len
    for i in range(prompts.shape[0]):
        samples.append(
            TrainingSample(
                input_ids=prompts[i].tolist() + completions[i].tolist(),
                loss_mask=[False] * p + [True] * c,
                logprobs=[0.0] * p + mu[i].tolist(),
                advantage=float(rewards[i] - group_mean[i]),
                version=step - 1,
                reward=float(rewards[i]),
            )
        )
    return samples, float(rewards.mean())


def tensor_group(name: str) -> str:
    if "embed" in name or "lm_head" in name:
        return "embedding"
    if "norm" in name:
        return "norms"
    if "self_attn" in name:
        return "attention"
    if "mlp" in name:
        return "mlp"
    return "other"


def bf16_bits(state: dict) -> dict:
    """Each floating tensor as the int16 bits of its bf16 rounding (what is published)."""
    import torch

    return {
        k: v.detach().to(torch.bfloat16).view(torch.int16)
        for k, v in state.items()
        if v.is_floating_point() and k != "lm_head.weight"
    }


def changed_by_group(prev: dict, cur: dict) -> dict[str, dict[str, float]]:
    out: dict[str, list[int]] = {}
    for k, v in cur.items():
        g = out.setdefault(tensor_group(k), [0, 0])
        g[0] += int((v != prev[k]).sum())
        g[1] += v.numel()
    return {g: {"changed": c / n, "elements": n} for g, (c, n) in sorted(out.items())}


def link_files(src: list[Path], dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for p in src:
        try:
            os.link(p, dst / p.name)
        except OSError:
            shutil.copyfile(p, dst / p.name)


# -- 1. train and publish at one learning rate ----------------------------------------
def run_lr(
    args: argparse.Namespace, lr: float, work: Path, keep_sbs: Path | None, show: Callable
) -> dict[str, Any]:
    from protocol.swarm.config import SwarmConfig
    from trainer.batch import oldest_admissible
    from trainer.config import (
        LossConfig,
        ModelConfig,
        MonitorConfig,
        OptimConfig,
        TrainerConfig,
        WeightsConfig,
    )
    from trainer.train import Trainer
    from trainer.weights import DELTA_DIR, make_transport

    run_dir = work / f"lr_{lr:g}"
    weights = WeightsConfig(
        transport="swarm",
        deltas=True,
        dtype="bfloat16",
        keyframe_interval=args.steps + 1,  # every step measured (see the docstring)
        trainer_key=run_dir / "keys" / "trainer.key",
        swarm=SwarmConfig(
            relay_service=True,
            use_relay=False,
            listen=["/ip4/127.0.0.1/tcp/0"],
            piece_size=args.piece_kib * 1024,
        ),
    )
    cfg = TrainerConfig(
        run_dir=run_dir,
        seed=args.seed,
        monitor=MonitorConfig(progress=False, plot=False),
        model=ModelConfig(name=args.model),
        optim=OptimConfig(lr=lr),  # the rest as configured (configs/rl/reverse-text-tiny.toml)
        loss=LossConfig(),
        weights=weights,
        max_steps=args.steps,
        device="cpu",
    )
    t_lr, cpu0, self0 = time.perf_counter(), bs.cpu_times(), os.times()
    trainer = Trainer(cfg)
    vocab = trainer.hf_config.vocab_size
    banned = special_ids(trainer.tokenizer)
    transport = make_transport(cfg.weights, run_dir)
    log_path = run_dir / "weights" / "published.jsonl"
    state = trainer.full_state_dict()
    t0 = time.perf_counter()
    transport.save(0, state, trainer.hf_config, trainer.tokenizer)
    save0_s = time.perf_counter() - t0
    prev_bits = bf16_bits(state)
    del state
    rows: list[dict[str, Any]] = []
    sbs: dict[str, Any] | None = None
    try:
        for n in range(1, args.steps + 1):
            show(f"lr {lr:g}: step {n}/{args.steps} (sampling)")
            t0 = time.perf_counter()
            samples, reward = sample_batch(trainer, n, args, vocab, banned)
            gen_s = time.perf_counter() - t0
            show(f"lr {lr:g}: step {n}/{args.steps} (training)")
            metrics = trainer.step(samples, "rl")
            state = trainer.full_state_dict()
            show(f"lr {lr:g}: step {n}/{args.steps} (publishing)")
            t0 = time.perf_counter()
            transport.save(n, state, trainer.hf_config, trainer.tokenizer)
            save_s = time.perf_counter() - t0
            rec = json.loads(log_path.read_text().splitlines()[-1])
            assert rec["step"] == n, rec
            bits = bf16_bits(state)
            groups = changed_by_group(prev_bits, bits)
            prev_bits = bits
            del state
            folder = transport.folder(n)
            published = rec["delta_bytes"] is not None
            if published:
                delta_bytes, changed, elements = rec["delta_bytes"], rec["changed"], rec["elements"]
            else:  # the transport shipped it full: measure what the delta would have been
                scratch = work / "scratch_delta"
                stats = make_delta(
                    transport.folder(n - 1), folder, scratch, 1e9, frozenset({MARKER})
                )
                shutil.rmtree(scratch, ignore_errors=True)
                assert stats is not None, f"step {n}: no delta possible (files differ?)"
                delta_bytes, changed, elements = stats.delta_bytes, stats.changed, stats.elements
            full = rec["full_bytes"]
            row = {
                "step": n,
                "full_bytes": full,
                "delta_bytes": delta_bytes,
                "delta_published": published,
                "delta_over_full": delta_bytes / full,
                "shipped_over_full": delta_bytes / full if published else 1.0,
                "changed": changed,
                "elements": elements,
                "changed_fraction": changed / elements,
                "groups": groups,
                "publish_s": rec["publish_s"],
                "save_s": save_s,
                "gen_s": gen_s,
                "step_s": metrics["step_time_s"],
                "loss": metrics["loss"],
                "grad_norm": metrics["grad_norm"],
                "mismatch_kl": metrics.get("mismatch_kl"),
                "reward_mean": reward,
                "tokens": metrics["tokens"],
            }
            rows.append(row)
            console.print(
                f"lr {lr:g} step {n:>2}: delta/full {100 * row['delta_over_full']:6.3f}%"
                f" changed {100 * row['changed_fraction']:6.3f}% publish {row['publish_s']:.2f} s"
                f" save {save_s:.2f} s step {row['step_s']:.1f} s gen {gen_s:.1f} s"
                f" reward {reward:.3f} grad_norm {row['grad_norm']:.3g}"
            )
            if keep_sbs is not None and n == args.sbs_step:
                if not published:
                    raise RuntimeError(f"step {n} at lr {lr:g} has no delta to broadcast")
                link_files(
                    [p for p in version_files(transport.folder(n - 1)) if p.name != MARKER],
                    keep_sbs / "base",
                )
                link_files(
                    [p for p in version_files(folder) if p.name != MARKER], keep_sbs / "full"
                )
                link_files([folder / DELTA_DIR / DELTA_FILE], keep_sbs / "delta")
                shutil.copyfile(folder / MANIFEST_FILE, keep_sbs / "step.manifest")
                shutil.copyfile(weights.trainer_key, keep_sbs / "trainer.key")
                os.chmod(keep_sbs / "trainer.key", 0o600)  # Identity refuses a readable key
                sbs = {"lr": lr, "step": n, "row": row}
            transport.cleanup(keep_from=oldest_admissible(n + 1, 2))
    finally:
        transport.close()
        trainer.monitor.close()
        del trainer
        gc.collect()
    summary = summarise(rows)
    wall, self1 = time.perf_counter() - t_lr, os.times()
    own = (self1.user + self1.system - self0.user - self0.system) / (wall * (os.cpu_count() or 1))
    busy = bs.cpu_busy(cpu0, bs.cpu_times())
    summary.update(
        save0_s=save0_s,
        wall_s=wall,
        machine_busy=busy,  # the whole box, /proc/stat
        others_cpu_share=None if busy is None else max(busy - own, 0.0),  # other tenants
    )
    return {"lr": lr, "steps": rows, "summary": summary, "sbs": sbs}


def summarise(rows: list[dict[str, Any]], keyframe_interval: int = 10) -> dict[str, Any]:
    def med(k):
        return statistics.median(r[k] for r in rows)

    ratios = [r["delta_over_full"] for r in rows]
    # Had keyframes been on (every `keyframe_interval`-th version full only): per step shipped.
    amort = [1.0 if r["step"] % keyframe_interval == 0 else r["shipped_over_full"] for r in rows]
    return {
        "median_delta_over_full": statistics.median(ratios),
        "max_delta_over_full": max(ratios),
        "min_delta_over_full": min(ratios),
        "mean_shipped_over_full": statistics.fmean(r["shipped_over_full"] for r in rows),
        "amortised_with_keyframes": {
            "keyframe_interval": keyframe_interval,
            "mean_shipped_over_full": statistics.fmean(amort),
        },
        "steps_published_full": sum(not r["delta_published"] for r in rows),
        "median_changed_fraction": med("changed_fraction"),
        "max_changed_fraction": max(r["changed_fraction"] for r in rows),
        "median_publish_s": med("publish_s"),
        "max_publish_s": max(r["publish_s"] for r in rows),
        "median_save_s": med("save_s"),
        "median_step_s": med("step_s"),
        "median_gen_s": med("gen_s"),
        "full_bytes": rows[-1]["full_bytes"],
        "median_delta_bytes": statistics.median(r["delta_bytes"] for r in rows),
        "reward_first": rows[0]["reward_mean"],
        "reward_last": rows[-1]["reward_mean"],
    }


# -- 2. N capped fetchers of one folder -------------------------------------------------
def broadcast(
    args: argparse.Namespace,
    label: str,
    folder: Path,
    step: int,
    key: Path,
    work: Path,
    show: Callable,
) -> dict[str, Any]:
    """One `prime-trainer publish` seed of `folder` and `args.fetchers` `prime-node fetch`
    processes, all capped at `args.rate_mib`; the row, and the fetched folders in `work`."""
    n, rate = args.fetchers, args.rate_mib * MiB
    size = sum(p.stat().st_size for p in version_files(folder))
    run_dir = work / label
    run_dir.mkdir(parents=True)
    env = bs.child_env()
    trainer_id = Identity.load_or_create(key).node_id
    procs: list[ManagedProcess] = []
    row: dict[str, Any] = {"what": label, "size_bytes": size, "ok": False, "reason": None}
    t0, own0 = time.time(), bs.children_cpu_s()
    try:
        show(f"{label}: starting the seed")
        seed, seed_addr = bs.start_seed(
            folder, key, run_dir, args.piece_kib * 1024, rate, env, procs, step
        )
        seed_status = run_dir / "seed.json"  # written by the seed (start_seed)
        manifest = folder / MANIFEST_FILE
        status = [run_dir / f"d{i}.json" for i in range(n)]
        cpu0, launched = bs.cpu_times(), time.time()
        for i in range(n):
            procs.append(
                ManagedProcess.start(
                    f"d{i}",
                    [
                        sys.executable, "-m", "node.cli", "fetch",
                        "--manifest", str(manifest),
                        "--trusted_key", trainer_id,
                        "--peers", json.dumps([seed_addr]),
                        "--dest", str(run_dir / f"d{i}"),
                        "--key_file", str(run_dir / "keys" / f"d{i}.key"),
                        "--swarm.upload_rate", str(rate),
                        "--status_file", str(status[i]),
                        "--progress", "false",
                        "--seed_after_s", str(args.timeout_s + 600),
                    ],
                    "",
                    run_dir / f"d{i}.log",
                    cwd=REPO,
                    env=env,
                    wait=False,
                )
            )  # fmt: skip
        fetchers = procs[1:]
        deadline = launched + args.timeout_s
        while True:
            st = [bs.read_status(p) for p in status]
            done = sum(bool(s and s["complete"]) for s in st)
            have = sum((s["total"] - s["left"]) if s else 0 for s in st)
            show(
                f"{label}: {done}/{n} done, {have / MiB:.1f}/{n * size / MiB:.1f} MiB,"
                f" {time.time() - launched:.1f} s (S/B = {size / rate:.1f} s)"
            )
            if done == n:
                break
            if not seed.alive():
                raise bs.RunFailed(f"seed exited {seed.proc.returncode}:\n{seed.log_tail(1500)}")
            for p, path in zip(fetchers, status, strict=True):
                s = bs.read_status(path)
                if not p.alive() and not (s and s["complete"]):
                    raise bs.RunFailed(f"{p.name} exited {p.proc.returncode}:\n{p.log_tail(1500)}")
            if time.time() > deadline:
                raise bs.RunFailed(f"timeout after {args.timeout_s} s, {done}/{n} done")
            time.sleep(bs.POLL_S)
        cpu1, all_done = bs.cpu_times(), time.time()
        time.sleep(2.5 * bs.POLL_S)  # final counters
        seed_s = bs.read_status(seed_status)
        st = [bs.read_status(p) for p in status]
        bs.stop_all(procs)
        assert seed_s is not None and all(st)
        t_start = min(s["started"] for s in st)
        done_s = [s["finished"] - t_start for s in st]
        row.update(
            ok=True,
            last_done_s=max(done_s),
            first_done_s=min(done_s),
            done_s=done_s,
            from_launch_s=all_done - launched,
            ideal_s=size / rate,
            ratio_to_ideal=max(done_s) / (size / rate),
            trainer_upload_S=seed_s["uploaded"] / size,
            mean_fetcher_upload_S=statistics.fmean(s["uploaded"] for s in st) / size,
            bad_pieces=seed_s["bad_pieces"] + sum(s["bad_pieces"] for s in st),
            errors=[e for s in [seed_s, *st] for e in s["errors"]],
            pieces=seed_s.get("pieces"),
            cpu_busy=bs.cpu_busy(cpu0, cpu1),
            dests=[str(run_dir / f"d{i}") for i in range(n)],
        )
    except bs.RunFailed as exc:
        row["reason"] = str(exc)
    except Exception as exc:  # a bench bug or a malformed status file: record it
        row["reason"] = f"{type(exc).__name__}: {exc}"
    finally:
        bs.stop_all(procs)
        row["run_wall_s"] = time.time() - t0
        own1 = bs.children_cpu_s()
        row["children_cpu_s"] = None if own0 is None or own1 is None else own1 - own0
    return row


def same_files(a: Path, b: Path) -> bool:
    fa, fb = version_files(a), version_files(b)
    return [p.name for p in fa] == [p.name for p in fb] and all(
        filecmp.cmp(x, y, shallow=False) for x, y in zip(fa, fb, strict=True)
    )


def side_by_side(args: argparse.Namespace, sbs_dir: Path, info: dict, show) -> dict[str, Any]:
    step = info["step"]
    key = sbs_dir / "trainer.key"
    signed = open_envelope((sbs_dir / "step.manifest").read_bytes(), Manifest, check_expiry=False)
    full_manifest = signed.message
    seed_pieces_match = build_manifest(sbs_dir / "full", step, args.piece_kib * 1024).pieces == (
        full_manifest.pieces
    )
    out: dict[str, Any] = {
        "lr": info["lr"],
        "step": step,
        "fetchers": args.fetchers,
        "rate_mib": args.rate_mib,
        "piece_kib": args.piece_kib,
        "delta_over_full": info["row"]["delta_over_full"],
        "seeded_full_matches_trainer_manifest": seed_pieces_match,
    }
    work = sbs_dir / "runs"
    full = broadcast(args, "full", sbs_dir / "full", step, key, work, show)
    if full["ok"]:
        full["identical"] = [same_files(Path(d), sbs_dir / "full") for d in full["dests"]]
        full["all_identical"] = all(full["identical"])
        for d in full["dests"]:
            shutil.rmtree(d, ignore_errors=True)
    out["full"] = full
    _print_broadcast(full)
    delta = broadcast(args, "delta", sbs_dir / "delta", step, key, work, show)
    if delta["ok"]:
        apply_s, identical, manifest_ok = [], [], []
        for i, d in enumerate(delta["dests"]):
            show(f"delta: applying fetcher {i}'s delta onto step {step - 1}")
            rebuilt = work / f"rebuilt{i}"
            t0 = time.perf_counter()
            apply_delta(sbs_dir / "base", Path(d), rebuilt)
            m = build_manifest(rebuilt, step, full_manifest.piece_size, full_manifest.parent_step)
            apply_s.append(time.perf_counter() - t0)
            manifest_ok.append(m.pieces == full_manifest.pieces and m.files == full_manifest.files)
            identical.append(same_files(rebuilt, sbs_dir / "full"))
            shutil.rmtree(rebuilt, ignore_errors=True)
        hold = [f + a for f, a in zip(delta["done_s"], apply_s, strict=True)]
        delta.update(
            apply_verify_s=apply_s,
            median_apply_verify_s=statistics.median(apply_s),
            hold_s=max(hold),
            rebuilt_identical=identical,
            all_rebuilt_identical=all(identical),
            rebuilt_manifest_matches=manifest_ok,
            all_rebuilt_manifest_match=all(manifest_ok),
        )
    out["delta"] = delta
    _print_broadcast(delta)
    if full["ok"]:
        full["hold_s"] = full["last_done_s"]  # a fetched full version is checked piece by piece
    if full["ok"] and delta["ok"]:
        out["speedup_last_done"] = full["last_done_s"] / delta["last_done_s"]
        out["speedup_hold"] = full["hold_s"] / delta["hold_s"]
    return out


def _print_broadcast(r: dict[str, Any]) -> None:
    if not r["ok"]:
        console.print(f"[red]{r['what']} broadcast failed:[/red] {r['reason']}")
        return
    extra = ""
    if "hold_s" in r:
        extra = (
            f", hold {r['hold_s']:.1f} s (apply+verify median {r['median_apply_verify_s']:.2f} s)"
        )
    console.print(
        f"{r['what']}: {r['size_bytes'] / MiB:.2f} MiB to all fetchers in {r['last_done_s']:.1f} s"
        f" ({r['ratio_to_ideal']:.2f} x S/B), trainer up {r['trainer_upload_S']:.2f} S,"
        f" bad pieces {r['bad_pieces']}{extra}"
    )


# -- 3. report ------------------------------------------------------------------------
def targets(result: dict[str, Any]) -> dict[str, Any]:
    runs = {r["lr"]: r for r in result["runs"]}
    out: dict[str, Any] = {}
    if TARGET_LR in runs:
        s = runs[TARGET_LR]["summary"]
        out["delta_over_full_at_1e-6"] = {
            "what": "worst step's delta bytes over full version bytes at lr 1e-6",
            "measured": s["max_delta_over_full"],
            "median": s["median_delta_over_full"],
            "limit": TARGET_FRACTION,
            "met": s["max_delta_over_full"] <= TARGET_FRACTION,
            "median_met": s["median_delta_over_full"] <= TARGET_FRACTION,
        }
    return out


def checks(result: dict[str, Any]) -> dict[str, bool]:
    sbs = result.get("side_by_side") or {}
    full, delta = sbs.get("full") or {}, sbs.get("delta") or {}
    return {
        "full_complete": bool(full.get("ok")),
        "delta_complete": bool(delta.get("ok")),
        "full_fetched_identical": bool(full.get("all_identical")),
        "rebuilt_identical": bool(delta.get("all_rebuilt_identical")),
        "rebuilt_manifest_matches": bool(delta.get("all_rebuilt_manifest_match")),
        "seeded_full_matches_trainer_manifest": bool(
            sbs.get("seeded_full_matches_trainer_manifest")
        ),
        "no_bad_pieces": full.get("bad_pieces") == 0 and delta.get("bad_pieces") == 0,
    }


def pct(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{100 * v:.{digits}f}%"


def print_tables(result: dict[str, Any]) -> None:
    t = Table(title=f"Delta versions per RL step ({result['settings']['model']}, bf16 published)")
    for col in ("lr", "steps", "median delta/full", "max delta/full", "mean shipped/full"):
        t.add_column(col, justify="right")
    for col in ("w/ keyframes", "median changed", "median publish s", "median save s"):
        t.add_column(col, justify="right")
    t.add_column("median step s", justify="right")
    for run in result["runs"]:
        s = run["summary"]
        t.add_row(
            f"{run['lr']:g}",
            str(len(run["steps"])),
            pct(s["median_delta_over_full"], 3),
            pct(s["max_delta_over_full"], 3),
            pct(s["mean_shipped_over_full"], 2),
            pct(s["amortised_with_keyframes"]["mean_shipped_over_full"], 2),
            pct(s["median_changed_fraction"], 3),
            f"{s['median_publish_s']:.2f}",
            f"{s['median_save_s']:.2f}",
            f"{s['median_step_s']:.1f}",
        )
    console.print(t)
    per = Table(title="delta/full per step (changed fraction)")
    per.add_column("step", justify="right")
    for run in result["runs"]:
        per.add_column(f"lr {run['lr']:g}", justify="right")
    for i in range(max(len(r["steps"]) for r in result["runs"])):
        cells = []
        for run in result["runs"]:
            r = run["steps"][i] if i < len(run["steps"]) else None
            cells.append(
                "-"
                if r is None
                else f"{pct(r['delta_over_full'], 3)} ({pct(r['changed_fraction'], 3)})"
                + ("" if r["delta_published"] else " full")
            )
        per.add_row(str(i + 1), *cells)
    console.print(per)
    sbs = result.get("side_by_side")
    if sbs:
        b = Table(
            title=f"Time until {sbs['fetchers']} peers hold step {sbs['step']} (lr {sbs['lr']:g}),"
            f" every node capped at {sbs['rate_mib']:g} MiB/s, {sbs['piece_kib']} KiB pieces"
        )
        for col in ("what", "MiB", "pieces", "last done s", "x S/B", "hold s", "trainer up/S"):
            b.add_column(col, justify="right")
        for col in ("mean peer up/S", "identical", "bad", "CPU busy"):
            b.add_column(col, justify="right")
        for r in (sbs["full"], sbs["delta"]):
            if not r["ok"]:
                b.add_row(r["what"], f"[red]FAILED: {(r['reason'] or '')[:60]}[/red]")
                continue
            ident = r.get("all_rebuilt_identical", r.get("all_identical"))
            b.add_row(
                r["what"],
                f"{r['size_bytes'] / MiB:.2f}",
                str(r.get("pieces")),
                f"{r['last_done_s']:.1f}",
                f"{r['ratio_to_ideal']:.2f}",
                f"{r.get('hold_s', r['last_done_s']):.1f}",
                f"{r['trainer_upload_S']:.2f}",
                f"{r['mean_fetcher_upload_S']:.2f}",
                "yes" if ident else "[red]NO[/red]",
                str(r["bad_pieces"]),
                pct(r["cpu_busy"], 0),
            )
        console.print(b)
        if "speedup_hold" in sbs:
            console.print(
                f"delta over full: {pct(sbs['delta_over_full'], 3)} of the bytes; all peers hold"
                f" it {sbs['speedup_hold']:.1f}x sooner ({sbs['speedup_last_done']:.1f}x by last done)"
            )
    for name, tg in result["targets"].items():
        mark = "[green]met[/green]" if tg["met"] else "[red]NOT met[/red]"
        console.print(
            f"target {name}: {tg['what']} = {pct(tg['measured'], 3)} (median"
            f" {pct(tg['median'], 3)}, limit {pct(tg['limit'], 0)}) {mark}"
        )
    console.print(f"checks: {result['checks']}")


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw={"width_ratios": [1.6, 1]})
    for run in result["runs"]:
        steps = [r["step"] for r in run["steps"]]
        (line,) = ax.plot(
            steps, [r["delta_over_full"] for r in run["steps"]], marker="o", ms=3,
            label=f"lr {run['lr']:g} (median {pct(run['summary']['median_delta_over_full'], 2)})",
        )  # fmt: skip
        full = [r["step"] for r in run["steps"] if not r["delta_published"]]
        if full:
            ax.scatter(full, [1.0] * len(full), marker="x", color=line.get_color())
    ax.axhline(TARGET_FRACTION, color="red", ls="--", lw=1, label="5% target (lr 1e-6)")
    ax.axhline(0.5, color="grey", ls=":", lw=1, label="delta_max_fraction 0.5 (above: full)")
    ax.set_yscale("log")
    ax.set(
        xlabel="RL step",
        ylabel="delta bytes / full version bytes",
        title=f"bytes per step over full ({result['settings']['model']}, bf16; x: shipped full)",
    )
    ax.grid(alpha=0.3, which="both")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize=8, loc="best")
    sbs = result.get("side_by_side")
    if sbs and sbs["full"]["ok"] and sbs["delta"]["ok"]:
        f, d = sbs["full"], sbs["delta"]
        names = ["full", "delta (fetch)", "delta (+apply, verify)"]
        vals = [f["last_done_s"], d["last_done_s"], d["hold_s"]]
        bars = bx.bar(names, vals, color=["tab:blue", "tab:orange", "tab:red"])
        for bar, v in zip(bars, vals, strict=True):
            bx.annotate(f"{v:.1f} s", (bar.get_x() + bar.get_width() / 2, v), ha="center",
                        va="bottom", fontsize=9)  # fmt: skip
        bx.set(
            ylabel="s until all peers hold it",
            title=f"{sbs['fetchers']} peers, step {sbs['step']} at lr {sbs['lr']:g},"
            f" {sbs['rate_mib']:g} MiB/s caps\nfull {f['size_bytes'] / MiB:.1f} MiB,"
            f" delta {d['size_bytes'] / MiB:.2f} MiB",
        )
        bx.grid(alpha=0.3, axis="y")
    else:
        bx.text(0.5, 0.5, "side by side failed (see JSON)", ha="center", va="center")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    plt.close(fig)


# -- main -----------------------------------------------------------------------------
def parse_lrs(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke: tiny model, 3 steps, 2 fetchers")
    ap.add_argument("--model", default=None, help="smollm2 (default) or tiny or a folder")
    ap.add_argument("--lrs", type=parse_lrs, default=list(LRS))
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per lr (20)")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step")
    ap.add_argument("--group", type=int, default=2, help="completions per prompt")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--completion-len", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--rollouts",
        choices=("random", "sampled"),
        default="random",
        help="completions: uniform tokens scored by the policy (mu), or sampled from it",
    )
    ap.add_argument("--sbs-lr", type=float, default=TARGET_LR, help="lr of the side by side")
    ap.add_argument("--sbs-step", type=int, default=None, help="its step (10)")
    ap.add_argument("--fetchers", type=int, default=None, help="peers fetching (8)")
    ap.add_argument("--rate-mib", type=float, default=None, help="every node's upload cap (2)")
    ap.add_argument("--piece-kib", type=int, default=None, help="piece size (4096: the default)")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per broadcast")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "delta_cpu")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--replot", type=Path, default=None, help="redraw table and PNG from a JSON")
    args = ap.parse_args()
    if args.replot is not None:
        result = json.loads(args.replot.read_text())
        print_tables(result)
        plot(result, args.replot.with_suffix(""))
        return
    quick = dict(model="tiny", steps=3, sbs_step=2, fetchers=2, rate_mib=1.0, piece_kib=64)
    full = dict(model="smollm2", steps=20, sbs_step=10, fetchers=8, rate_mib=2.0, piece_kib=4096)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.sbs_lr not in args.lrs or not 1 <= args.sbs_step <= args.steps:
        ap.error("--sbs-lr must be one of --lrs and --sbs-step within --steps")

    import torch

    info = bs.machine_info()
    settings = {
        "model": args.model,
        "quick": args.quick,
        "lrs": args.lrs,
        "steps": args.steps,
        "optimizer": "AdamW betas (0.9, 0.999), weight_decay 0, max_norm 1, constant lr, no warm-up",
        "loss": "AIPO (LossConfig defaults: delta 8, no KL, no entropy bonus)",
        "batch": {
            "prompts": args.prompts,
            "group": args.group,
            "prompt_len": args.prompt_len,
            "completion_len": args.completion_len,
            "tokens_per_step": args.prompts * args.group * (args.prompt_len + args.completion_len),
            "rollouts": args.rollouts,
            "rollouts_are": (
                "completions drawn uniformly from the vocabulary (special tokens excluded), mu"
                " = the current policy's logprobs of them (one forward, temperature 1)"
                if args.rollouts == "random"
                else "completions sampled from the current policy (temperature 1, full"
                " softmax), mu = their logprobs"
            )
            + "; reward = fraction of completion ids below vocab/2; advantage = reward -"
            " group mean; prompts uniform from the vocabulary",
        },
        "weights": {
            "transport": "swarm",
            "deltas": True,
            "dtype": "bfloat16",
            "keyframe_interval": args.steps + 1,
            "delta_max_fraction": 0.5,
            "piece_kib": args.piece_kib,
        },
        "side_by_side": {
            "lr": args.sbs_lr,
            "step": args.sbs_step,
            "fetchers": args.fetchers,
            "rate_mib": args.rate_mib,
            "piece_kib": args.piece_kib,
        },
        "torch_threads": torch.get_num_threads(),
        "seed": args.seed,
    }
    console.print(
        f"{args.model}: lrs {args.lrs}, {args.steps} steps each, "
        f"{settings['batch']['tokens_per_step']} tokens/step; side by side at lr {args.sbs_lr:g}"
        f" step {args.sbs_step}: {args.fetchers} fetchers, {args.rate_mib:g} MiB/s caps;"
        f" {info['cpu_count']} CPUs, load {info.get('loadavg_at_start')}"
    )
    work = Path(tempfile.mkdtemp(prefix="bench-delta-"))
    t0 = time.time()
    result: dict[str, Any] = {"settings": settings, "machine": info, "git": bs.git_state()}
    runs: list[dict[str, Any]] = []
    sbs_info = None
    try:
        with console.status("training") as status:
            for lr in args.lrs:
                sbs_dir = work / "side_by_side" if lr == args.sbs_lr else None
                run = run_lr(args, lr, work, sbs_dir, status.update)
                sbs_info = run.pop("sbs") or sbs_info
                runs.append(run)
                s = run["summary"]
                console.print(
                    f"[bold]lr {lr:g}[/bold]: median delta/full {pct(s['median_delta_over_full'], 3)},"
                    f" max {pct(s['max_delta_over_full'], 3)}, median changed"
                    f" {pct(s['median_changed_fraction'], 3)}, median publish"
                    f" {s['median_publish_s']:.2f} s, {s['wall_s']:.0f} s"
                )
                shutil.rmtree(work / f"lr_{lr:g}", ignore_errors=True)
            result["training_wall_s"] = time.time() - t0
            result["runs"] = runs
            assert sbs_info is not None
            status.update("side by side")
            t1 = time.time()
            result["side_by_side"] = side_by_side(
                args, work / "side_by_side", sbs_info, status.update
            )
            result["side_by_side"]["wall_s"] = time.time() - t1
    finally:
        if args.keep:
            console.print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    for r in (result["side_by_side"]["full"], result["side_by_side"]["delta"]):
        r.pop("dests", None)
    result["targets"] = targets(result)
    result["checks"] = checks(result)
    result["bench_wall_s"] = time.time() - t0
    print_tables(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    plot(result, args.out)
    console.print(
        f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.png')}"
        f" in {result['bench_wall_s']:.0f} s"
    )
    if not all(result["checks"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
