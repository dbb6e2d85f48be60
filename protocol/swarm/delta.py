"""Delta versions: the exact elements a training step changed, against the version before.

A delta folder holds one file, `DELTA_FILE`: zstd over a msgpack map listing, for every
tensor of the version's safetensors files whose bytes changed, the positions of the
changed elements (as gaps between consecutive indices, uint32) and their new values (the
raw element bytes, whatever the dtype). Applying it to the base version's folder gives the
new version byte for byte; the caller proves that by hashing the result against the new
version's signed full manifest (`protocol.swarm.manifest`) before using it.

Invariants:
- `make_delta` writes a delta only when it reproduces the new version exactly from the
  base: same files, every file other than the safetensors ones byte-identical, the same
  safetensors headers (names, dtypes, shapes, offsets); otherwise, or when the delta would
  not be smaller than `max_fraction` of the version, it returns None (ship the full one).
- Values are compared and copied as raw element bytes (a bf16 element is 2 bytes): no
  float arithmetic, so -0.0, NaNs and subnormals survive untouched.
- `apply_delta` never writes into the base folder; it raises `DeltaError` on any delta
  that does not fit the base (unknown tensor, index out of range, truncated data).
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import msgpack
import numpy as np
import zstandard

from protocol.swarm.manifest import version_files

DELTA_FILE = "delta.zst"
ZSTD_LEVEL = 3
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class DeltaError(ValueError):
    """A delta that cannot be applied to this base."""


@dataclass
class DeltaStats:
    changed: int  # elements that differ
    elements: int  # elements in all tensors
    delta_bytes: int  # size of DELTA_FILE
    full_bytes: int  # size of the new version's files


def _header(path: Path) -> tuple[bytes, int, dict]:
    """A safetensors file's raw header, where its data starts, and the parsed tensor table."""
    with path.open("rb") as f:
        raw_n = f.read(8)
        (n,) = struct.unpack("<Q", raw_n)
        raw = f.read(n)
    table = {k: v for k, v in json.loads(raw).items() if k != "__metadata__"}
    return raw_n + raw, 8 + n, table


def _elements(data: np.ndarray, info: dict) -> np.ndarray:
    """The tensor's elements as unsigned integers of its element size (raw bytes)."""
    start, end = info["data_offsets"]
    numel = math.prod(info["shape"])
    if numel == 0:
        return data[start:start]
    itemsize = (end - start) // numel
    return data[start:end].view(_UINT[itemsize])


def make_delta(
    base: Path,
    new: Path,
    out: Path,
    max_fraction: float = 0.5,
    ignore: frozenset[str] = frozenset(),
) -> DeltaStats | None:
    """Write `out/DELTA_FILE` (from `base` to `new`), or None when a full version pays.
    `ignore`: names in the folders that are not part of a version (a writer's markers)."""
    base_files = [p for p in version_files(base) if p.name not in ignore]
    new_files = [p for p in version_files(new) if p.name not in ignore]
    if [p.name for p in base_files] != [p.name for p in new_files]:
        return None
    tensors: list[dict] = []
    changed = elements = 0
    for b, n in zip(base_files, new_files, strict=True):
        if n.suffix != ".safetensors":
            if b.read_bytes() != n.read_bytes():
                return None  # config or tokenizer changed: not a weights-only step
            continue
        b_head, b_start, table = _header(b)
        n_head, n_start, _ = _header(n)
        if b_head != n_head or b.stat().st_size != n.stat().st_size:
            return None
        b_data = np.memmap(b, dtype=np.uint8, mode="r", offset=b_start)
        n_data = np.memmap(n, dtype=np.uint8, mode="r", offset=n_start)
        for name, info in table.items():
            old, cur = _elements(b_data, info), _elements(n_data, info)
            idx = np.flatnonzero(old != cur)
            elements += cur.size
            if idx.size == 0:
                continue
            changed += idx.size
            gaps = np.diff(idx, prepend=0).astype(np.uint32)
            tensors.append(
                {"file": n.name, "name": name, "gaps": gaps.tobytes(), "values": cur[idx].tobytes()}
            )
    full_bytes = sum(p.stat().st_size for p in new_files)
    raw = msgpack.packb({"v": 1, "tensors": tensors}, use_bin_type=True)
    packed = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)
    if len(packed) > max_fraction * full_bytes:
        return None
    out.mkdir(parents=True, exist_ok=True)
    (out / DELTA_FILE).write_bytes(packed)
    return DeltaStats(changed, elements, len(packed), full_bytes)


def apply_delta(base: Path, delta: Path, out: Path, max_bytes: int = 1 << 34) -> None:
    """Build the folder `out` from the base version's folder and a delta folder."""
    try:
        raw = zstandard.ZstdDecompressor().decompress(
            (delta / DELTA_FILE).read_bytes(), max_output_size=max_bytes
        )
        body = msgpack.unpackb(raw, raw=False)
        entries = body["tensors"]
    except (OSError, zstandard.ZstdError, ValueError, KeyError, TypeError) as exc:
        raise DeltaError(f"unreadable delta in {delta}: {exc}") from exc
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for p in version_files(base):
        shutil.copyfile(p, out / p.name)
    tables: dict[str, tuple[np.memmap, dict]] = {}
    try:
        for e in entries:
            if e["file"] not in tables:
                path = out / Path(e["file"]).name
                if path.suffix != ".safetensors" or not path.is_file():
                    raise DeltaError(f"the delta patches {e['file']!r}, not in the base")
                _, start, table = _header(path)
                tables[e["file"]] = (
                    np.memmap(path, dtype=np.uint8, mode="r+", offset=start),
                    table,
                )
            data, table = tables[e["file"]]
            if e["name"] not in table:
                raise DeltaError(f"the delta patches tensor {e['name']!r}, not in the base")
            target = _elements(data, table[e["name"]])
            idx = np.cumsum(np.frombuffer(e["gaps"], dtype=np.uint32), dtype=np.int64)
            values = np.frombuffer(e["values"], dtype=target.dtype)
            if idx.size != values.size or (idx.size and idx[-1] >= target.size):
                raise DeltaError(f"the delta of {e['name']!r} does not fit its tensor")
            target[idx] = values
        for data, _ in tables.values():
            data.flush()
    except DeltaError:
        shutil.rmtree(out, ignore_errors=True)
        raise
    except (KeyError, TypeError, ValueError) as exc:
        shutil.rmtree(out, ignore_errors=True)
        raise DeltaError(f"malformed delta in {delta}: {exc}") from exc
