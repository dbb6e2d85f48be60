"""The scheduler installs without torch (`pip install 'prime-swarm[scheduler]'` into a
fresh venv, dependencies from PyPI): the venv holds no torch, toploc, transformers,
verifiers, numpy or libp2p, and its `prime-scheduler serve` runs a pool whose nodes (the
full install) generate and verify rollouts for a client."""

from __future__ import annotations

import os
import shutil
import subprocess
import venv

import pytest

from protocol.messages import RolloutSpec, SamplingParams
from tests.pools import FAST_LIFECYCLE, REPO, collect, make_pool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
HEAVY = ("torch", "toploc", "transformers", "verifiers", "numpy", "libp2p")


async def test_scheduler_installs_and_serves_without_torch(tmp_path):
    # A copy of the distribution's files: pip builds in the source tree (build/, egg-info).
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for package in ("protocol", "verifier", "node", "scheduler", "trainer"):
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    # Built from this checkout (a wheel, not editable), its dependencies from PyPI.
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", f"{src}[scheduler]"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    listed = subprocess.run(
        [str(python), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True
    ).stdout.lower()
    installed = {line.split("==")[0].replace("_", "-") for line in listed.splitlines()}
    assert "prime-swarm" in installed
    assert not installed & set(HEAVY), installed & set(HEAVY)
    probe = subprocess.run(
        [str(python), "-c", "import scheduler.cli, scheduler.server, sys; "
         f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert probe.returncode == 0 and probe.stdout.strip() == "[]", probe.stderr[-2000:]

    pool = make_pool(tmp_path / "pool")
    pool.scheduler_command = (str(env_dir / "bin" / "prime-scheduler"),)
    try:
        pool.start_scheduler(*FAST_LIFECYCLE)
        pool.join_many(["a", "b"])
        specs = [
            RolloutSpec(
                request_id=f"r{i}", prompt_ids=[5 + i, 9, 12], sampling=SamplingParams(max_tokens=8)
            )
            for i in range(8)
        ]
        async with pool.client() as client:
            await client.submit(specs)
            results = await collect(client, len(specs), 120)
        assert sorted(r.request_id for r in results) == sorted(s.request_id for s in specs)
        assert {r.status for r in results} == {"accepted"}
    finally:
        pool.close()
