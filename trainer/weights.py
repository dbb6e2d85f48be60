"""Weight transport: how each new policy leaves the trainer and reaches the workers.

`WeightTransport` is the interface (DESIGN.md section 2, step 8). The trainer calls
`save` after every step; the orchestrator calls `latest` to learn which versions exist
and `update` to get the signed-message payload that tells workers where to load one.

- `filesystem`: one machine or a shared filesystem; the update names the folder.
- `swarm`: the trainer (rank 0) also cuts each folder into pieces under a manifest signed
  with the trainer key and seeds it over libp2p (`protocol.swarm`); the update carries
  the manifest and the seed's addresses, and workers fetch pieces from each other. With
  `deltas`, step n is also published as a delta against step n-1 (`protocol.swarm.delta`,
  in `step_n/.delta/` under its own signed manifest, which names n-1's manifest hash and
  carries n's full manifest); the update lists the unbroken chain of deltas ending at n.
  Every `keyframe_interval` steps, and whenever a delta would not pay, n is full only.

Weights are written in the pool's serving dtype (`WeightsConfig.dtype`); the fp32 master
weights live in checkpoints only.

Invariants: `<run_dir>/weights/step_<n>/` is a Hugging Face model folder (safetensors,
config, tokenizer) whose `STABLE` marker is written last (after the signed manifest, for
the swarm), so a folder without the marker is never announced or loaded; `cleanup` never
deletes a version that a step still inside the async_level window may need, and stops
seeding what it deletes; a restarted trainer seeds again every version still on disk.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from abc import ABC, abstractmethod
from pathlib import Path

import torch
from safetensors.torch import save_file

from protocol.envelope import open_envelope
from protocol.identity import Identity
from protocol.messages import Manifest, WeightUpdate
from protocol.swarm.delta import make_delta
from protocol.swarm.manifest import MANIFEST_FILE, build_manifest, publish_folder, sign_manifest
from trainer.config import WeightsConfig

MARKER = "STABLE"
DELTA_DIR = ".delta"  # inside a version's folder: its delta against the step before
MAX_CHAIN = 16  # deltas an update carries at most (WeightUpdate.deltas' cap)
DELTA_PIECES = 64  # a delta is cut into about this many pieces...
DELTA_MIN_PIECE = 16 * 1024  # ...of at least this size (the manifest's floor is 1 KiB)


class WeightTransport(ABC):
    @abstractmethod
    def save(self, step: int, state_dict: dict[str, torch.Tensor], config, tokenizer) -> None:
        """Trainer side (rank 0): make the weights of `step` available."""

    @abstractmethod
    def latest(self) -> int | None:
        """The newest version available to workers (None: none yet)."""

    @abstractmethod
    def update(self, step: int) -> WeightUpdate:
        """The message (to be signed by the trainer key) that makes workers load `step`."""

    @abstractmethod
    def cleanup(self, keep_from: int) -> None:
        """Forget versions older than `keep_from`."""


def save_hf_folder(
    folder: Path, state_dict: dict[str, torch.Tensor], config, tokenizer, dtype: str | None = None
) -> None:
    """Write a loadable Hugging Face model folder from a full (gathered) state dict, its
    floating-point tensors in `dtype` (None: as they are)."""
    folder.mkdir(parents=True, exist_ok=True)
    cast = getattr(torch, dtype) if dtype else None
    state = {
        k: v.detach()
        .to("cpu", cast if cast is not None and v.is_floating_point() else None)
        .contiguous()
        for k, v in state_dict.items()
    }
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # shared with the embedding; safetensors refuses aliases
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


class FilesystemTransport(WeightTransport):
    def __init__(self, run_dir: Path, keep_last: int = 3, dtype: str | None = None):
        self.root = Path(run_dir).resolve() / "weights"
        self.keep_last = keep_last
        self.dtype = dtype  # what the pool serves (`WeightsConfig.dtype`); None: as trained

    def folder(self, step: int) -> Path:
        return self.root / f"step_{step}"

    def save(self, step: int, state_dict, config, tokenizer) -> None:
        folder = self.folder(step)
        if folder.exists():
            shutil.rmtree(folder)  # a half-written folder from a crash before its marker
        save_hf_folder(folder, state_dict, config, tokenizer, self.dtype)
        self._publish(step, folder)
        (folder / MARKER).touch()

    def _publish(self, step: int, folder: Path) -> None:
        """Hook run before the marker is written (the swarm signs and seeds here)."""

    def _unpublish(self, folder: Path) -> None:
        """Hook run before a version is deleted."""

    def reopen(self) -> None:
        """A resumed trainer, before its first step: serve again the versions it published
        before the restart (the pool may hold none of them: a whole run restarted)."""

    def versions(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(
            int(p.name.removeprefix("step_"))
            for p in self.root.glob("step_*")
            if (p / MARKER).exists()
        )

    def latest(self) -> int | None:
        v = self.versions()
        return v[-1] if v else None

    def update(self, step: int) -> WeightUpdate:
        folder = self.folder(step)
        if not (folder / MARKER).exists():
            raise FileNotFoundError(f"weights of step {step} are not complete in {folder}")
        return WeightUpdate(version=step, path=str(folder))

    def cleanup(self, keep_from: int) -> None:
        versions = self.versions()
        keep = set(versions[-self.keep_last :]) | {v for v in versions if v >= keep_from}
        for v in versions:
            if v not in keep:
                self._unpublish(self.folder(v))
                shutil.rmtree(self.folder(v), ignore_errors=True)


class SwarmTransport(FilesystemTransport):
    """The filesystem layout plus a libp2p seed of every version (started by the trainer,
    on its first `save`); the orchestrator only reads the manifests and the seed's
    addresses (`weights/seeders.json`)."""

    SEEDERS = "seeders.json"
    UPLOADS = "seed_uploads.jsonl"
    DELTAS = "published.jsonl"  # per step: full and delta bytes, publish time

    def __init__(self, run_dir: Path, cfg: WeightsConfig):
        super().__init__(run_dir, cfg.keep_last, _dtype(cfg))
        self.cfg = cfg.swarm
        self.weights_cfg = cfg
        self.trainer_key = cfg.trainer_key
        self.host = None
        self.seeded: dict[Path, str] = {}  # folder (a version's, or its delta's) -> manifest hash
        self.delta_log = self.root / self.DELTAS

    def _seeder(self):
        from protocol.swarm.host import SwarmHost  # libp2p only where it seeds

        if self.host is None:
            self.identity = Identity.load_or_create(self.trainer_key)
            self.host = SwarmHost(self.identity, self.cfg, {self.identity.public_key}).start()
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = self.root / (self.SEEDERS + ".tmp")
            tmp.write_text(json.dumps(self.host.addrs))
            os.replace(tmp, self.root / self.SEEDERS)
            for v in self.versions():  # a restarted trainer: seed what is still needed
                for folder in (self.folder(v), self.folder(v) / DELTA_DIR):
                    if (folder / MANIFEST_FILE).exists():
                        envelope = (folder / MANIFEST_FILE).read_bytes()
                        self.seeded[folder] = self.host.seed(envelope, folder)
        return self.host

    def reopen(self) -> None:
        # Seed now, not at the next save: a restarted pool's workers need the last version
        # before the orchestrator can make the batch that leads to that save.
        if self.versions():
            self._seeder()

    def _publish(self, step: int, folder: Path) -> None:
        host = self._seeder()
        parent = step - 1 if step > 0 else None
        t0 = time.monotonic()
        full, envelope = publish_folder(folder, self.identity, step, self.cfg.piece_size, parent)
        self.seeded[folder] = host.seed(envelope, folder)
        record = {"step": step, "full_bytes": full.total_size, "delta_bytes": None}
        base = self.folder(step - 1)
        wc = self.weights_cfg
        if wc.deltas and step > 0 and step % wc.keyframe_interval and (base / MARKER).exists():
            record |= self._publish_delta(step, base, folder, envelope)
        record["publish_s"] = time.monotonic() - t0
        with self.delta_log.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def _publish_delta(self, step: int, base: Path, folder: Path, full_envelope: bytes) -> dict:
        """Publish `folder` also as a delta against `base` (the step before), if it pays."""
        out = folder / DELTA_DIR
        stats = make_delta(
            base, folder, out, self.weights_cfg.delta_max_fraction, frozenset({MARKER})
        )
        if stats is None:
            return {"delta_bytes": None}
        base_manifest = open_envelope(
            (base / MANIFEST_FILE).read_bytes(), Manifest, check_expiry=False
        ).message
        # Pieces small enough that peers trade a delta too (at the full version's piece
        # size a small delta is one piece, which only its seed can serve).
        piece = min(self.cfg.piece_size, max(DELTA_MIN_PIECE, stats.delta_bytes // DELTA_PIECES))
        delta = build_manifest(out, step, piece, step - 1).model_copy(
            update={"delta_of": base_manifest.digest(), "result": full_envelope}
        )
        envelope = sign_manifest(self.identity, delta)
        (out / MANIFEST_FILE).write_bytes(envelope)
        self.seeded[out] = self._seeder().seed(envelope, out)
        return {
            "delta_bytes": stats.delta_bytes,
            "changed": stats.changed,
            "elements": stats.elements,
        }

    def _unpublish(self, folder: Path) -> None:
        for f in (folder / DELTA_DIR, folder):
            digest = self.seeded.pop(f, None)
            if digest is not None and self.host is not None:
                self._record_upload(digest)
                self.host.remove(digest)

    def _record_upload(self, digest: str) -> None:
        """Append what the seed uploaded of a version (or delta) it stops seeding to
        `weights/seed_uploads.jsonl` (step, bytes, bytes uploaded, full or delta): the
        trainer's share of a broadcast, which the swarm is there to keep small."""
        assert self.host is not None
        status = self.host.status(digest)
        if status is None:
            return
        kind = "delta" if Path(status.folder).name == DELTA_DIR else "full"
        line = {
            "step": status.step,
            "size": status.total,
            "uploaded": status.uploaded,
            "kind": kind,
        }
        with (self.root / self.UPLOADS).open("a") as f:
            f.write(json.dumps(line) + "\n")

    def update(self, step: int) -> WeightUpdate:
        folder = self.folder(step)
        if not (folder / MARKER).exists():
            raise FileNotFoundError(f"weights of step {step} are not complete in {folder}")
        envelope = (folder / MANIFEST_FILE).read_bytes()
        manifest = open_envelope(envelope, Manifest, check_expiry=False).message
        seeders = json.loads((self.root / self.SEEDERS).read_text())
        # The chain of deltas ending at `step`, oldest first, as far back as it is unbroken.
        deltas: list[bytes] = []
        k = step
        while len(deltas) < MAX_CHAIN and (self.folder(k) / DELTA_DIR / MANIFEST_FILE).exists():
            deltas.insert(0, (self.folder(k) / DELTA_DIR / MANIFEST_FILE).read_bytes())
            k -= 1
        return WeightUpdate(
            version=step,
            weights_hash=manifest.digest(),
            manifest=envelope,
            seeders=seeders,
            deltas=deltas,
        )

    def close(self) -> None:
        if self.host is not None:
            for digest in self.seeded.values():
                self._record_upload(digest)
            self.host.close()


def _dtype(cfg: WeightsConfig) -> str | None:
    """The publishing dtype; 'auto' left unresolved (no pool known) publishes as trained."""
    return None if cfg.dtype == "auto" else cfg.dtype


def make_transport(cfg: WeightsConfig, run_dir: Path) -> WeightTransport:
    if cfg.transport == "filesystem":
        return FilesystemTransport(run_dir, cfg.keep_last, _dtype(cfg))
    if cfg.transport == "swarm":
        return SwarmTransport(run_dir, cfg)
    raise ValueError(f"unknown weight transport {cfg.transport!r}")
