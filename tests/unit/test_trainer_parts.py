"""The trusted side's small parts: config validation, episode filtering, advantages,
prompt sampling, rewards, SFT tokenization, batch files, weight folders."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from protocol.config import ConfigError, load_config, write_resolved
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.messages import PoolConfig, Rollout, SamplingParams
from trainer.batch import Batch, TrainingSample, read_batch, write_batch
from trainer.config import OrchestratorConfig, RLConfig, TrainerConfig
from trainer.difficulty import round_rng, uniform_rows
from trainer.envs.reverse_text import lcs_ratio, reward_lcs
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


@pytest.mark.parametrize(
    "path",
    sorted(Path("configs/rl").glob("*.toml")) + sorted(Path("configs/trainer").glob("*.toml")),
)
def test_trainer_side_config_files_load(path):
    """Every run config in configs/ loads into its model (unknown or moved keys fail)."""
    from trainer.config import SFTConfig

    model = SFTConfig if path.name.startswith("sft-") else RLConfig
    model = TrainerConfig if path.parent.name == "trainer" else model
    cfg = load_config(model, ["@", str(path)])
    if isinstance(cfg, RLConfig):
        assert cfg.trainer_config().async_level == cfg.orchestrator_config().async_level


def signed_pool(path: Path, async_level: int, trainer_key: Path | None = None) -> Path:
    """An owner-signed pool file signed with `async_level` (its trainer key created)."""
    trainer = Identity.load_or_create(trainer_key or path.parent / "trainer.key")
    owner = Identity.load_or_create(path.parent / "owner.key")
    pool = PoolConfig(
        pool_id="p", model="tiny", trainer_public_key=trainer.public_key, async_level=async_level
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(seal(owner, pool))
    return path


def test_rl_passes_on_every_trainer_and_orchestrator_setting(tmp_path):
    """`rl` once dropped batch_timeout_s, peak_flops and model_name: every field of the
    process configs is now reachable under `trainer.`/`orchestrator.` and reaches the
    config the child reads (its resolved TOML loads back to what `rl` built)."""
    cfg = load_config(
        RLConfig,
        [
            "--run-dir", str(tmp_path),
            "--trainer.batch-timeout-s", "12.5",
            "--trainer.peak-flops", "1e15",
            "--orchestrator.model-name", "served-name",
            "--trainer.nproc", "2",
        ],
    )  # fmt: skip
    t, o = cfg.trainer_config(), cfg.orchestrator_config()
    assert (t.batch_timeout_s, t.peak_flops, o.model_name) == (12.5, 1e15, "served-name")
    back = load_config(TrainerConfig, ["@", str(write_resolved(t, tmp_path / "t.toml"))])
    assert back == t
    back = load_config(OrchestratorConfig, ["@", str(write_resolved(o, tmp_path / "o.toml"))])
    assert back == o
    for part, process in (("trainer", TrainerConfig), ("orchestrator", OrchestratorConfig)):
        contained = RLConfig.model_fields[part].annotation.model_fields
        assert set(process.model_fields) <= set(contained), f"rl cannot set all of {part}"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--trainer.async-level", "3"], r"trainer.async_level is 3 but the run's async_level is 2"),
        (["--orchestrator.max-steps", "5"], r"orchestrator.max_steps is 5 but the run's max_steps is 20"),
        (["--trainer.model.name", "smollm2"], r"trainer.model.name is 'smollm2' but the run's model.name is 'tiny'"),
        (["--orchestrator.group-size", "4"], r"orchestrator.group_size is 4 but the run's group_size is 8"),
        (["--weights.trainer-key", "a.key", "--orchestrator.trainer-key", "b.key"], r"weights.trainer_key \(a.key\) differs from orchestrator.trainer_key \(b.key\)"),
    ],
)  # fmt: skip
def test_rl_refuses_a_second_value_for_a_run_wide_setting(argv, message):
    with pytest.raises(ConfigError, match=message):
        load_config(RLConfig, argv)


def test_rl_shared_settings_set_once_reach_both_processes_and_read_back(tmp_path):
    cfg = load_config(
        RLConfig,
        [
            "--run-dir", str(tmp_path), "--async-level", "0", "--batch-size", "16",
            "--group-size", "4", "--model.dtype", "float32", "--weights.transport", "swarm",
            "--orchestrator.trainer-key", str(tmp_path / "k.key"),
            "--trainer.async-level", "0",  # the run's value again: accepted
        ],
    )  # fmt: skip
    t, o = cfg.trainer_config(), cfg.orchestrator_config()
    assert (t.async_level, o.async_level, o.batch_size, o.group_size) == (0, 0, 16, 4)
    assert t.model.dtype == "float32" and t.weights.transport == o.weights.transport == "swarm"
    assert t.weights.trainer_key == o.trainer_key == tmp_path / "k.key"
    back = load_config(RLConfig, ["@", str(write_resolved(cfg, tmp_path / "rl.toml"))])
    assert back == cfg


def test_rl_loss_temperature_is_the_sampling_temperature():
    cfg = load_config(RLConfig, ["--orchestrator.sampling.temperature", "0.7"])
    assert cfg.trainer_config().loss.temperature == 0.7
    same = ["--orchestrator.sampling.temperature", "0.7", "--trainer.loss.temperature", "0.7"]
    assert load_config(RLConfig, same).trainer_config().loss.temperature == 0.7
    with pytest.raises(
        ConfigError,
        match=r"trainer.loss.temperature \(0.5\) differs from orchestrator.sampling.temperature \(1.0\)",
    ):
        load_config(RLConfig, ["--trainer.loss.temperature", "0.5"])


def test_rl_refuses_a_pool_signed_with_another_async_level(tmp_path):
    pool = signed_pool(tmp_path / "p.pool", async_level=2)
    with pytest.raises(ConfigError, match=r"async_level 3 differs from the async_level 2"):
        load_config(RLConfig, ["--async-level", "3", "--orchestrator.pool", str(pool)])
    cfg = load_config(RLConfig, ["--async-level", "2", "--orchestrator.pool", str(pool)])
    assert cfg.orchestrator_config().async_level == 2


def test_orchestrator_refuses_a_pool_signed_with_another_async_level(tmp_path):
    from trainer.orchestrator import Orchestrator, OrchestratorError

    pool = signed_pool(tmp_path / "p.pool", async_level=1)
    cfg = OrchestratorConfig(pool=pool, trainer_key=tmp_path / "trainer.key", async_level=2)
    with pytest.raises(OrchestratorError, match=r"async_level 2 differs from the async_level 1"):
        Orchestrator(cfg)


def test_local_swarm_refuses_its_pool_signed_with_another_async_level(tmp_path):
    """The launcher signs the local pool with the run's async_level; pool_args cannot
    change it, and a pool file that says otherwise stops the run before any child starts."""
    from trainer.local_swarm import LaunchError, LocalPool

    with pytest.raises(ConfigError, match="pool_args must not set --async-level"):
        load_config(RLConfig, ["--local-swarm.pool-args", '["--async-level", "3"]'])
    cfg = load_config(
        RLConfig, ["--run-dir", str(tmp_path), "--local-swarm.enabled", "--async-level", "3"]
    )
    local = LocalPool(cfg)
    local.api_key_file.touch()  # `create_pool` writes it
    signed_pool(local.pool_file, async_level=2, trainer_key=local.keys / "trainer.key")
    with pytest.raises(LaunchError, match=r"async_level 3 differs from the async_level 2"):
        local.rl_config()
    signed_pool(local.pool_file, async_level=3, trainer_key=local.keys / "trainer.key")
    run = local.rl_config()
    assert run.orchestrator_config().pool == local.pool_file
    assert run.trainer_config().weights.trainer_key == local.keys / "trainer.key"


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
        proof=[b"p"] * -(-n // 32),
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
    assert filt.counts == {"mismatch": 4, "small_group": 1}
    assert groups == {}


def test_a_tool_call_the_environment_read_must_be_the_one_the_signed_ids_make():
    """With tools (issue 29), the trusted side parses each turn's calls from the signed
    text; an environment that ran another call (a forged id, name or arguments, or a call
    where the ids hold none) trained nothing of that episode."""
    from protocol.tools import ToolContext

    tools = ToolContext(frozenset({"add"}))
    block = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    ids = [ord(c) for c in block]

    def char_decode(xs: list[int]) -> str:
        return "".join(chr(x) for x in xs)

    def calling(rid: str, calls) -> Turn:
        return Turn(rid, [1, 2], ids, [1] * len(ids), [-0.5] * len(ids), "", calls)

    honest = [("call_ok_0", "add", '{"a": 1}')]
    turns = {
        "ok": calling("ok", honest),
        "other_args": calling("other_args", [("call_other_args_0", "add", '{"a": 2}')]),
        "other_id": calling("other_id", [("c9", "add", '{"a": 1}')]),
        "no_call": calling("no_call", []),
    }
    verdicts = {rid: accepted(t, 0) for rid, t in turns.items()}
    eps = [Episode("g", float(i), [t]) for i, t in enumerate(turns.values())]
    eps.append(Episode("g", 9.0, [calling("ok2", [("call_ok2_0", "add", '{"a": 1}')])]))
    verdicts["ok2"] = accepted(eps[-1].turns[0], 0)
    groups, filt = build_samples(eps, verdicts, 0, char_decode, tools)
    assert filt.counts == {"mismatch": 3}
    assert [s.rollout_id for s in groups["g"]] == ["ok", "ok2"]
    assert (filt.turns, filt.tool_calls, filt.invalid_calls) == (5, 4, 0)


def test_groups_with_equal_rewards_carry_no_signal_and_are_counted():
    eps = [Episode("same", 1.0, [turn(f"s{i}")]) for i in range(4)]
    eps += [Episode("lone", 1.0, [turn("l0")]), Episode("lone", 0.0, [turn("l1")])]
    verdicts = {e.turns[0].rollout_id: accepted(e.turns[0], 0) for e in eps}
    verdicts["l1"] = Verdict("failed", 0)
    groups, filt = build_samples(eps, verdicts, 0, decode)
    assert groups == {}
    assert filt.counts == {"uniform_group": 1, "small_group": 1, "failed": 1}


def test_a_group_short_of_episodes_trains_at_its_size_when_it_carries_signal():
    """Three of a group of eight verified (the rest lost): trained, advantages over the
    three; with a minimum of four it is dropped and counted."""
    eps = [Episode("g", float(i % 2), [turn(f"g{i}")]) for i in range(8)]
    verdicts = {e.turns[0].rollout_id: accepted(e.turns[0], 0) for e in eps[:3]}
    verdicts |= {e.turns[0].rollout_id: Verdict("rejected", 0) for e in eps[3:]}
    groups, filt = build_samples(eps, verdicts, 0, decode)
    assert [s.advantage for s in groups["g"]] == pytest.approx([-1 / 3, 2 / 3, -1 / 3])
    assert filt.counts == {"rejected": 5} and filt.verified == {"g": [0.0, 1.0, 0.0]}
    assert filt.generated == 8
    groups, filt = build_samples(eps, verdicts, 0, decode, min_size=4)
    assert groups == {} and filt.counts == {"rejected": 5, "small_group": 1}


def rows(pool: str, seed: int, step: int, rnd: int) -> list[int]:
    return uniform_rows(round_rng(pool, seed, step, rnd), 8, 1000)


def test_prompts_depend_on_pool_seed_and_step_only():
    a = rows("pool", 0, 5, 0)
    assert a == rows("pool", 0, 5, 0)
    assert len(set(a)) == 8
    assert a != rows("pool", 0, 6, 0)
    assert a != rows("other", 0, 5, 0)


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
    from tests.pools import make_pool
    from trainer.orchestrator import Orchestrator, OrchestratorError

    pool = make_pool(tmp_path)
    Identity.load_or_create(tmp_path / "other.key")
    cfg = OrchestratorConfig(pool=pool.pool_file, trainer_key=tmp_path / "other.key")
    with pytest.raises(OrchestratorError, match="not the trainer key"):
        Orchestrator(cfg)
