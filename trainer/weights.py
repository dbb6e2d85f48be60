"""Weight transport: how each new policy leaves the trainer and reaches the workers.

`WeightTransport` is the interface (DESIGN.md section 2, step 8). The trainer calls
`save` after every step; the orchestrator calls `latest` to learn which versions exist
and `update` to get the signed-message payload that tells workers where to load one.

- `filesystem`: one machine or a shared filesystem; the update names the folder.
- `swarm`: the trainer (rank 0) also cuts each folder into pieces under a manifest signed
  with the trainer key and seeds it over libp2p (`protocol.swarm`); the update carries
  the manifest and the seed's addresses, and workers fetch pieces from each other.

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
from abc import ABC, abstractmethod
from pathlib import Path

import torch
from safetensors.torch import save_file

from protocol.envelope import open_envelope
from protocol.identity import Identity
from protocol.messages import Manifest, WeightUpdate
from protocol.swarm.config import SwarmConfig
from protocol.swarm.manifest import MANIFEST_FILE, publish_folder
from trainer.config import WeightsConfig

MARKER = "STABLE"


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


def save_hf_folder(folder: Path, state_dict: dict[str, torch.Tensor], config, tokenizer) -> None:
    """Write a loadable Hugging Face model folder from a full (gathered) state dict."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # shared with the embedding; safetensors refuses aliases
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


class FilesystemTransport(WeightTransport):
    def __init__(self, run_dir: Path, keep_last: int = 3):
        self.root = Path(run_dir).resolve() / "weights"
        self.keep_last = keep_last

    def folder(self, step: int) -> Path:
        return self.root / f"step_{step}"

    def save(self, step: int, state_dict, config, tokenizer) -> None:
        folder = self.folder(step)
        if folder.exists():
            shutil.rmtree(folder)  # a half-written folder from a crash before its marker
        save_hf_folder(folder, state_dict, config, tokenizer)
        self._publish(step, folder)
        (folder / MARKER).touch()

    def _publish(self, step: int, folder: Path) -> None:
        """Hook run before the marker is written (the swarm signs and seeds here)."""

    def _unpublish(self, folder: Path) -> None:
        """Hook run before a version is deleted."""

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

    def __init__(self, run_dir: Path, keep_last: int, cfg: SwarmConfig, trainer_key: Path):
        super().__init__(run_dir, keep_last)
        self.cfg = cfg
        self.trainer_key = trainer_key
        self.host = None
        self.seeded: dict[Path, str] = {}  # folder -> manifest hash

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
                folder = self.folder(v)
                if (folder / MANIFEST_FILE).exists():
                    self.seeded[folder] = self.host.seed(
                        (folder / MANIFEST_FILE).read_bytes(), folder
                    )
        return self.host

    def _publish(self, step: int, folder: Path) -> None:
        host = self._seeder()
        parent = step - 1 if step > 0 else None
        _, envelope = publish_folder(folder, self.identity, step, self.cfg.piece_size, parent)
        self.seeded[folder] = host.seed(envelope, folder)

    def _unpublish(self, folder: Path) -> None:
        digest = self.seeded.pop(folder, None)
        if digest is not None and self.host is not None:
            self.host.remove(digest)

    def update(self, step: int) -> WeightUpdate:
        folder = self.folder(step)
        if not (folder / MARKER).exists():
            raise FileNotFoundError(f"weights of step {step} are not complete in {folder}")
        envelope = (folder / MANIFEST_FILE).read_bytes()
        manifest = open_envelope(envelope, Manifest, check_expiry=False).message
        seeders = json.loads((self.root / self.SEEDERS).read_text())
        return WeightUpdate(
            version=step, weights_hash=manifest.digest(), manifest=envelope, seeders=seeders
        )

    def close(self) -> None:
        if self.host is not None:
            self.host.close()


def make_transport(cfg: WeightsConfig, run_dir: Path) -> WeightTransport:
    if cfg.transport == "filesystem":
        return FilesystemTransport(run_dir, cfg.keep_last)
    if cfg.transport == "swarm":
        return SwarmTransport(run_dir, cfg.keep_last, cfg.swarm, cfg.trainer_key)
    raise ValueError(f"unknown weight transport {cfg.transport!r}")
