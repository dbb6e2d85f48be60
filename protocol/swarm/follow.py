"""Watching a torrent from a command line: a rich progress bar and a JSON status file.

Used by `prime-trainer publish` and `prime-node fetch`, the operators' tools for testing
their links. The status file is rewritten atomically every `every_s` (benchmarks and
scripts read it); it holds the torrent's counters and, per peer, the bytes exchanged.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from protocol.swarm.host import SwarmHost
from protocol.swarm.torrent import TorrentStatus


def write_status(path: Path, status: TorrentStatus, **extra) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({**dataclasses.asdict(status), **extra}))
    os.replace(tmp, path)


def follow(
    host: SwarmHost,
    digest: str,
    *,
    until: Callable[[TorrentStatus], bool],
    status_file: Path | None = None,
    show_progress: bool = True,
    every_s: float = 0.5,
) -> TorrentStatus:
    """Poll the torrent until `until(status)` holds; returns the last status."""
    first = host.status(digest)
    assert first is not None
    with Progress(
        TextColumn("[bold]step {task.fields[step]}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TextColumn("{task.fields[peers]} peers, up {task.fields[up]:.1f} MiB"),
        disable=not show_progress,
        transient=False,
    ) as progress:
        task = progress.add_task(
            "fetch", total=first.total, step=first.step, peers=0, up=0.0, completed=0
        )
        while True:
            status = host.status(digest)
            assert status is not None
            progress.update(
                task,
                completed=status.total - status.left,
                peers=len(status.peers),
                up=status.uploaded / 2**20,
            )
            if status_file is not None:
                write_status(status_file, status, written_at=time.time())
            if until(status):
                return status
            time.sleep(every_s)
