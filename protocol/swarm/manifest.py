"""Manifests: a weights folder cut into fixed-size pieces, hashed, and signed.

A weights version is the concatenation of the folder's files (sorted by name) cut into
`piece_size` pieces; the manifest lists the files, the safetensors tensor layout and the
SHA-256 of every piece, and is signed by the trainer key. Its hash (`Manifest.digest()`)
names the version on the wire.

Invariants: a manifest is accepted only from a trusted key (`open_manifest`); building
twice from the same files gives the same manifest; hidden files (the `.partial` folder's
bookkeeping, markers) are never part of a version.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from protocol.envelope import open_envelope, seal
from protocol.identity import Identity
from protocol.messages import FileEntry, Manifest, TensorInfo

MANIFEST_FILE = ".manifest"  # the signed envelope, beside the files it describes
_TTL_S = 3600.0  # a manifest's authority is its signature; expiry is not checked


class ManifestError(ValueError):
    """A manifest that must not be used (bad signature, untrusted signer, wrong shape)."""


def version_files(folder: Path) -> list[Path]:
    """The files that make up a version: every non-hidden regular file, by name."""
    return sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))


def _tensor_layout(path: Path, base: int) -> list[TensorInfo]:
    """Tensor table of a safetensors file (8-byte header length, JSON header, data)."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    data_start = base + 8 + n
    out = []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        start, end = t["data_offsets"]
        out.append(
            TensorInfo(
                name=name,
                file=path.name,
                dtype=t["dtype"],
                shape=t["shape"],
                offset=data_start + start,
                size=end - start,
            )
        )
    return out


def build_manifest(
    source: Path, step: int, piece_size: int, parent_step: int | None = None
) -> Manifest:
    """Hash a folder's files (or one file) into pieces of `piece_size` bytes."""
    files = [source] if source.is_file() else version_files(source)
    if not files:
        raise FileNotFoundError(f"no files to publish in {source}")
    hashes: list[str] = []
    tensors: list[TensorInfo] = []
    piece = hashlib.sha256()
    filled = 0
    offset = 0
    for path in files:
        if path.suffix == ".safetensors":
            tensors += _tensor_layout(path, offset)
        with path.open("rb") as f:
            while chunk := f.read(piece_size - filled):
                piece.update(chunk)
                filled += len(chunk)
                if filled == piece_size:
                    hashes.append(piece.hexdigest())
                    piece, filled = hashlib.sha256(), 0
        offset += path.stat().st_size
    if filled:
        hashes.append(piece.hexdigest())
    return Manifest(
        step=step,
        parent_step=parent_step,
        piece_size=piece_size,
        total_size=offset,
        files=[FileEntry(name=p.name, size=p.stat().st_size) for p in files],
        tensors=tensors,
        pieces=hashes,
    )


def sign_manifest(identity: Identity, manifest: Manifest) -> bytes:
    return seal(identity, manifest, ttl_s=_TTL_S)


def open_manifest(envelope: bytes, trusted: set[bytes]) -> Manifest:
    """The manifest inside `envelope` if a trusted key signed it, else `ManifestError`."""
    try:
        return open_envelope(
            envelope,
            Manifest,
            trusted_senders=trusted,
            check_expiry=False,
            max_bytes=len(envelope) + 1,
        ).message
    except ValueError as exc:  # EnvelopeError, CodecError (both ValueErrors)
        raise ManifestError(f"manifest refused: {exc}") from exc


def publish_folder(
    folder: Path, identity: Identity, step: int, piece_size: int, parent_step: int | None = None
) -> tuple[Manifest, bytes]:
    """Build and sign the manifest of `folder` and store it beside the files."""
    manifest = build_manifest(folder, step, piece_size, parent_step)
    envelope = sign_manifest(identity, manifest)
    (folder / MANIFEST_FILE).write_bytes(envelope)
    return manifest, envelope
