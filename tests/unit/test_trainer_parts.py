"""The trusted side's small parts: config validation, episode filtering, advantages,
prompt sampling, rewards, SFT tokenization, batch files, weight folders."""

from __future__ import annotations

import subprocess
import sys

import pytest

from protocol.config import ConfigError, load_config
from protocol.messages import Rollout, SamplingParams
from trainer.batch import Batch, TrainingSample, read_batch, write_batch
from trainer.config import OrchestratorConfig, RLConfig, TrainerConfig
from trainer.envs.reverse_text import lcs_ratio, reward_lcs
from trainer.orchestrator import prompt_indices
from trainer.rollouts import Episode, Turn, Verdict, build_samples


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--async-level", "-1"], "async_level"),
        (["--batch-size", "30", "--group-size", "8"], "multiple of group_size"),
        (["--no-such-key", "1"], "no_such_key"),
        (["--trainer.optim.lr", "fast"], "trainer.optim.lr"),
        (["--model.name", "/nonexistent/model"], "neither a bundled model"),
        (["--trainer.optim.betas", "[0.9, 1.5]"], "betas"),
    ],
)
def test_bad_rl_config_stops_with_a_clear_message(argv, message):
    with pytest.raises(ConfigError, match=message):
        load_config(RLConfig, argv)


def test_bad_config_stops_the_cli_before_anything_starts(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.cli",
            "rl",
            "--batch-size",
            "30",
            "--group-size",
            "8",
            "--run-dir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "multiple of group_size" in out.stderr
    assert not (tmp_path / "run").exists(), "a rejected config must not start a run"


def test_trainer_warmup_longer_than_run_is_refused():
    with pytest.raises(ConfigError, match="warmup_steps"):
        load_config(TrainerConfig, ["--max-steps", "3", "--optim.warmup-steps", "5"])


def test_rl_config_hands_shared_settings_to_both_processes(tmp_path):
    cfg = load_config(
        RLConfig, ["--run-dir", str(tmp_path), "--async-level", "3", "--max-steps", "7"]
    )
    t, o = cfg.trainer_config(), cfg.orchestrator_config()
    assert (t.async_level, o.async_level, t.max_steps, o.max_steps) == (3, 3, 7, 7)
    assert t.run_dir == o.run_dir == tmp_path


def decode(ids: list[int]) -> str:
    """A stand-in for the trusted tokenizer's decode (letters by id)."""
    return "".join(chr(97 + i % 26) for i in ids)


def turn(rid: str, n: int = 3) -> Turn:
    ids = list(range(5, 5 + n))
    return Turn(rid, [1, 2], ids, [1] * n, [-0.5] * n, text=decode(ids))


def signed(t: Turn, **lies) -> Rollout:
    """The signed rollout behind a turn (what the scheduler released)."""
    n = len(t.completion_ids)
    fields = dict(
        request_id=t.rollout_id,
        node_id="n0",
        prompt_ids=t.prompt_ids,
        completion_ids=t.completion_ids,
        logprobs=[-0.25] * n,
        finish_reason="length",
        sampling=SamplingParams(max_tokens=n),
        seed=1,
        weights_version=0,
        weights_hash="h",
        proof=[b"p"],
    )
    return Rollout(**(fields | lies))


def accepted(t: Turn, version: int, **lies) -> Verdict:
    return Verdict("accepted", version, signed(t, **lies))


def test_episodes_with_any_unaccepted_turn_are_dropped_and_advantages_centre_on_kept():
    a1, a2, b1, c1, c2, d1 = (turn(x) for x in ("a1", "a2", "b1", "c1", "c2", "d1"))
    eps = [
        Episode("g", 1.0, [a1, a2]),
        Episode("g", 0.0, [b1]),
        Episode("g", 0.5, [c1, c2]),  # second turn failed
        Episode("g", 0.2, [d1]),  # stale
    ]
    verdicts = {
        "a1": accepted(a1, 4),
        "a2": accepted(a2, 5),
        "b1": accepted(b1, 5),
        "c1": accepted(c1, 5),
        "c2": Verdict("failed", 5),
        "d1": accepted(d1, 2),
    }
    groups, filt = build_samples(eps, verdicts, 3, decode)
    samples = groups["g"]
    assert len(samples) == 3  # a's two turns, b's one
    assert [s.advantage for s in samples] == [0.5, 0.5, -0.5]
    assert samples[0].version == 4, "an episode is as old as its oldest turn"
    assert filt.counts == {"failed": 1, "stale": 1}
    s = samples[0]
    assert s.loss_mask == [False, False, True, True, True]
    # mu is the signed rollout's, not the -0.5 the environment was shown.
    assert s.logprobs == [0.0, 0.0, -0.25, -0.25, -0.25]
    assert s.text == decode(a1.completion_ids)


def test_a_turn_that_differs_from_its_signed_rollout_is_never_trained():
    """The environment's copy of a turn (ids it saw, text its rubric scored) must be the
    signed rollout; any difference drops the episode, whoever lied."""
    t = [turn(f"t{i}") for i in range(5)]
    liars = {
        "t1": accepted(t[1], 0, prompt_ids=[1, 3]),
        "t2": accepted(t[2], 0, completion_ids=[5, 6, 8]),
        "t3": Verdict("accepted", 0, None),
    }
    t[4].text = "something else"  # the rubric scored text nobody verified
    verdicts = {x.rollout_id: accepted(x, 0) for x in t} | liars
    eps = [Episode("g", float(i), [x]) for i, x in enumerate(t)]
    groups, filt = build_samples(eps, verdicts, 0, decode)
    assert filt.counts == {"mismatch": 4, "uniform_group": 1}
    assert groups == {}


def test_groups_with_equal_rewards_carry_no_signal_and_are_counted():
    eps = [Episode("same", 1.0, [turn(f"s{i}")]) for i in range(4)]
    eps += [Episode("lone", 1.0, [turn("l0")]), Episode("lone", 0.0, [turn("l1")])]
    verdicts = {e.turns[0].rollout_id: accepted(e.turns[0], 0) for e in eps}
    verdicts["l1"] = Verdict("failed", 0)
    groups, filt = build_samples(eps, verdicts, 0, decode)
    assert groups == {}
    assert filt.counts == {"uniform_group": 2, "failed": 1}


def test_prompts_depend_on_pool_seed_and_step_only():
    a = prompt_indices("pool", 0, 5, 0, 8, 1000)
    assert a == prompt_indices("pool", 0, 5, 0, 8, 1000)
    assert len(set(a)) == 8
    assert a != prompt_indices("pool", 0, 6, 0, 8, 1000)
    assert a != prompt_indices("other", 0, 5, 0, 8, 1000)


def test_reverse_text_reward_is_the_lcs_ratio():
    assert lcs_ratio("abc", "abc") == 1.0
    assert lcs_ratio("", "abc") == 0.0
    assert lcs_ratio("abd", "abc") == pytest.approx(2 / 3)
    assert reward_lcs([{"role": "assistant", "content": " cba "}], "cba") == 1.0


def test_batch_file_drops_stale_samples(tmp_path):
    def sample(v: int) -> TrainingSample:
        return TrainingSample([1, 2, 3], [False, True, True], [0, -1, -1], 0.5, version=v)

    # Step 6 turns policy 5 into 6: policy 5 is on-policy, 3 two updates stale, 2 three.
    write_batch(tmp_path, Batch(6, [sample(5), sample(2), sample(3)], {"reward_mean": 0.3}))
    batch, stale = read_batch(tmp_path, 6, async_level=2)
    assert stale == 1 and [s.version for s in batch.samples] == [5, 3]
    _, stale = read_batch(tmp_path, 6, async_level=0)
    assert stale == 2, "async_level 0 trains on-policy samples only"
    assert batch.metrics == {"reward_mean": 0.3}
    with pytest.raises(ValueError, match="disagree in length"):
        TrainingSample([1, 2], [True], [0.0, 0.0], 1.0)


def test_orchestrator_refuses_a_key_that_is_not_the_pools_trainer(tmp_path):
    from protocol.identity import Identity
    from tests.pools import make_pool
    from trainer.orchestrator import Orchestrator, OrchestratorError

    pool = make_pool(tmp_path)
    Identity.load_or_create(tmp_path / "other.key")
    cfg = OrchestratorConfig(pool=pool.pool_file, trainer_key=tmp_path / "other.key")
    with pytest.raises(OrchestratorError, match="not the trainer key"):
        Orchestrator(cfg)
