"""Weight transport: how each new policy leaves the trainer and reaches the workers.

`WeightTransport` is the interface (DESIGN.md section 2, step 8). The trainer calls
`save` after every step; the orchestrator calls `latest` to learn which versions exist
and `update` to get the signed-message payload that tells workers where to load one. The
filesystem transport is for one machine or a shared filesystem; the peer-to-peer swarm
transport implements the same three calls.

Invariants (filesystem): `<run_dir>/weights/step_<n>/` is a Hugging Face model folder
(safetensors, config, tokenizer) whose `STABLE` marker is written last, so a folder
without the marker is never announced or loaded; `cleanup` never deletes a version that a
step still inside the async_level window may need.
"""

from __future__ import annotations

import shutil
from abc import ABC, abstractmethod
from pathlib import Path

import torch
from safetensors.torch import save_file

from protocol.messages import WeightUpdate

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
        (folder / MARKER).touch()

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
                shutil.rmtree(self.folder(v), ignore_errors=True)


def make_transport(kind: str, run_dir: Path, keep_last: int) -> WeightTransport:
    if kind == "filesystem":
        return FilesystemTransport(run_dir, keep_last)
    raise ValueError(f"unknown weight transport {kind!r}")
