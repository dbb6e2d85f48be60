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


@pytest.fixture(scope="session")
def report():
    def add(key: str, value: object) -> None:
        _REPORT[key] = value

    return add


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
    test session): the policy of every test that runs real RL."""
    from tests.rl_runs import sft_warmup
    from trainer.monitor import read_metrics

    run = tmp_path_factory.mktemp("sft")
    model, seconds = sft_warmup(run)
    SFT_SECONDS.append(seconds)
    sft = read_metrics(run, "sft")
    assert sft[-1]["loss"] < sft[0]["loss"] / 2, "SFT warm-up did not learn"
    return model


@pytest.fixture
def sft_model_seconds(sft_model) -> list[float]:
    """How long the session's SFT warm-up took (one entry)."""
    return SFT_SECONDS
