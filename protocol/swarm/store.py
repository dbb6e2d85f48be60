"""Piece storage: reads and writes pieces of one version inside its folder.

A download lives in `<dest>.partial/` (files pre-sized, pieces written in place) and is
renamed to `<dest>` once every piece is in; a seed serves straight from its folder.

Invariants: a piece is written only after its SHA-256 matched the manifest (`put`
checks it), so the store never holds, and so never serves, a corrupted piece; a folder is
renamed to its final name only when complete, with the signed manifest beside the files;
a `.partial` folder left by a killed process is re-checked piece by piece and resumed.
Reads and writes (threads of the torrent's sessions) open their files under the same lock
as the rename in `finish`, so a piece asked for while its download is finished is read
from wherever the files are, never from the moved `.partial` path (an open file stays
valid across the rename).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from contextlib import ExitStack
from pathlib import Path

from protocol.messages import Manifest
from protocol.swarm.manifest import MANIFEST_FILE

Segment = tuple[Path, int, int]  # file, offset in file, length


class PieceStore:
    def __init__(self, folder: Path, manifest: Manifest, have_all: bool):
        self.folder = folder
        self.manifest = manifest
        self.have = [have_all] * manifest.num_pieces
        self._files: list[tuple[Path, int, int]] = []  # path, start, end in the concatenation
        pos = 0
        for f in manifest.files:
            self._files.append((folder / f.name, pos, pos + f.size))
            pos += f.size
        # Held while file paths are resolved and opened, and while `finish` moves them.
        self._paths_lock = threading.Lock()

    # -- opening ---------------------------------------------------------------------
    @classmethod
    def seed(cls, folder: Path, manifest: Manifest) -> PieceStore:
        """A complete folder (files as the manifest lists them)."""
        for f in manifest.files:
            size = (folder / f.name).stat().st_size
            if size != f.size:
                raise ValueError(f"{folder / f.name} has {size} bytes, the manifest says {f.size}")
        return cls(folder, manifest, have_all=True)

    @classmethod
    def download(cls, dest: Path, manifest: Manifest) -> PieceStore:
        """Open (or resume) the download of `manifest` into `dest`."""
        partial = dest.with_name(dest.name + ".partial")
        partial.mkdir(parents=True, exist_ok=True)
        store = cls(partial, manifest, have_all=False)
        resumed = False
        for path, start, end in store._files:
            if path.exists() and path.stat().st_size == end - start:
                resumed = True
                continue
            with path.open("wb") as f:
                f.truncate(end - start)
        if resumed:
            for i in range(manifest.num_pieces):
                store.have[i] = store._hash(store.read(i)) == manifest.pieces[i]
        return store

    # -- pieces ----------------------------------------------------------------------
    def _segments(self, index: int) -> list[Segment]:
        start = index * self.manifest.piece_size
        end = start + self.manifest.piece_length(index)
        out = []
        for path, fs, fe in self._files:
            lo, hi = max(start, fs), min(end, fe)
            if lo < hi:
                out.append((path, lo - fs, hi - lo))
        return out

    @staticmethod
    def _hash(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()

    def _open(self, index: int, mode: str, stack: ExitStack) -> list[tuple]:
        """The piece's segments as (open file, offset, length); opened under the lock, so
        `finish` cannot move the folder between resolving a path and opening it."""
        with self._paths_lock:
            return [
                (stack.enter_context(path.open(mode)), off, n)
                for path, off, n in self._segments(index)
            ]

    def read(self, index: int) -> bytes:
        parts = []
        with ExitStack() as stack:
            for f, off, n in self._open(index, "rb", stack):
                f.seek(off)
                parts.append(f.read(n))
        return b"".join(parts)

    def check(self, index: int, data: bytes) -> bool:
        return len(data) == self.manifest.piece_length(index) and (
            self._hash(data) == self.manifest.pieces[index]
        )

    def put(self, index: int, data: bytes) -> bool:
        """Write a piece if its hash matches; False (nothing written) if it does not."""
        if not self.check(index, data):
            return False
        pos = 0
        with ExitStack() as stack:
            for f, off, n in self._open(index, "r+b", stack):
                f.seek(off)
                f.write(data[pos : pos + n])
                pos += n
        self.have[index] = True
        return True

    @property
    def complete(self) -> bool:
        return all(self.have)

    @property
    def left(self) -> int:
        return sum(self.manifest.piece_length(i) for i, h in enumerate(self.have) if not h)

    def finish(self, envelope: bytes) -> Path:
        """Move a complete download to its final folder (with its signed manifest); a
        second call returns the folder it already moved."""
        assert self.complete
        if not self.folder.name.endswith(".partial"):
            return self.folder
        for path, _, _ in self._files:
            with path.open("rb") as f:
                os.fsync(f.fileno())
        (self.folder / MANIFEST_FILE).write_bytes(envelope)
        dest = self.folder.with_name(self.folder.name.removesuffix(".partial"))
        if dest.exists():
            shutil.rmtree(dest)
        with self._paths_lock:  # no read or write opens a path while they change
            self.folder.rename(dest)
            self.folder = dest
            self._files = [(dest / p.name, s, e) for p, s, e in self._files]
        return dest
