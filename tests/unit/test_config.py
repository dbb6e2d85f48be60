"""Configuration loading: flags, TOML files, PRIME_ env vars, defaults (DESIGN.md section 7)."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from node.config import CalibrateConfig, NodeConfig
from protocol.config import ConfigError, load_config, parse_args, write_resolved
from protocol.identity import Identity


@pytest.fixture(autouse=True)
def _no_prime_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("PRIME_"):
            monkeypatch.delenv(name)


def toml(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return str(p)


# ---------------------------------------------------------------- parse_args


def test_flag_with_separate_value():
    assert parse_args(["--a.b", "1"]) == {"a": {"b": "1"}}


def test_flag_with_equals_value():
    assert parse_args(["--a.b=1"]) == {"a": {"b": "1"}}
    assert parse_args(["--a.b=x=y"]) == {"a": {"b": "x=y"}}


def test_bare_flag_is_true():
    assert parse_args(["--flag"]) == {"flag": "true"}
    assert parse_args(["--flag", "--a.b", "2"]) == {"flag": "true", "a": {"b": "2"}}


def test_bare_flag_before_spaced_file(tmp_path):
    f = toml(tmp_path, "a.toml", "x = 1\n")
    assert parse_args(["--flag", "@", f]) == {"flag": "true", "x": 1}


def test_bare_flag_before_compact_file(tmp_path):
    f = toml(tmp_path, "a.toml", "x = 1\n")
    assert parse_args(["--flag", "@" + f]) == {"flag": "true", "x": 1}


def test_negative_number_is_a_value_not_a_flag():
    assert parse_args(["--a", "-1"]) == {"a": "-1"}


def test_dashes_in_keys_become_underscores():
    assert parse_args(["--engine.max-batch-size", "4"]) == {"engine": {"max_batch_size": "4"}}


def test_several_keys_share_a_section():
    assert parse_args(["--a.b", "1", "--a.c", "2", "--d", "3"]) == {
        "a": {"b": "1", "c": "2"},
        "d": "3",
    }


def test_files_compose_later_wins_flags_beat_files(tmp_path):
    f1 = toml(
        tmp_path,
        "one.toml",
        """
        top = "one"
        [a]
        b = 1
        c = 1
        keep = "from-one"
    """,
    )
    f2 = toml(
        tmp_path,
        "two.toml",
        """
        [a]
        b = 2
        c = 2
    """,
    )
    # The flag comes first on the command line but still beats both files.
    out = parse_args(["--a.c", "flag", "@", f1, f"@{f2}"])
    assert out == {"top": "one", "a": {"b": 2, "c": "flag", "keep": "from-one"}}
    # Order of files decides.
    assert parse_args(["@", f2, "@", f1])["a"]["b"] == 1


def test_missing_file_is_a_config_error(tmp_path):
    missing = str(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not found.*nope.toml"):
        parse_args(["@", missing])
    with pytest.raises(ConfigError, match="nope.toml"):
        load_config(NodeConfig, [f"@{missing}"])


def test_invalid_toml_is_a_config_error(tmp_path):
    bad = toml(tmp_path, "bad.toml", "this is = = not toml\n")
    with pytest.raises(ConfigError, match="bad.toml is not valid TOML"):
        parse_args(["@", bad])


@pytest.mark.parametrize("argv", [["positional"], ["--"], ["@"], ["-x", "1"]])
def test_malformed_command_lines_are_config_errors(argv):
    with pytest.raises(ConfigError):
        parse_args(argv)


def test_value_and_section_conflict_is_a_config_error():
    with pytest.raises(ConfigError, match="not a section"):
        parse_args(["--a", "1", "--a.b", "2"])


# ---------------------------------------------------------------- load_config with NodeConfig


def test_defaults():
    cfg = load_config(NodeConfig, [])
    assert cfg.server.port == 8000
    assert cfg.engine.max_batch_size == 16
    assert cfg.engine.model == "tiny"


def test_flags_are_converted_to_field_types():
    cfg = load_config(NodeConfig, ["--server.port", "9100", "--engine.batch_wait_ms=2.5"])
    assert cfg.server.port == 9100
    assert cfg.engine.batch_wait_ms == 2.5


def test_env_beats_defaults(monkeypatch):
    monkeypatch.setenv("PRIME_SERVER__PORT", "9001")
    monkeypatch.setenv("PRIME_ENGINE__MAX_BATCH_SIZE", "3")
    cfg = load_config(NodeConfig, [])
    assert cfg.server.port == 9001
    assert cfg.engine.max_batch_size == 3


def test_toml_beats_env_and_env_fills_what_toml_leaves(monkeypatch, tmp_path):
    monkeypatch.setenv("PRIME_SERVER__PORT", "9001")
    monkeypatch.setenv("PRIME_ENGINE__MAX_BATCH_SIZE", "3")
    f = toml(
        tmp_path,
        "node.toml",
        """
        [server]
        port = 9002
        [engine]
        dtype = "float32"
    """,
    )
    cfg = load_config(NodeConfig, ["@", f])
    assert cfg.server.port == 9002  # TOML over env
    assert cfg.engine.max_batch_size == 3  # env still applies inside a section TOML touched
    assert cfg.engine.dtype == "float32"


def test_flags_beat_toml_and_env(monkeypatch, tmp_path):
    monkeypatch.setenv("PRIME_SERVER__PORT", "9001")
    monkeypatch.setenv("PRIME_ENGINE__MAX_BATCH_SIZE", "3")
    f = toml(tmp_path, "node.toml", "[server]\nport = 9002\n[engine]\nmax_batch_size = 4\n")
    cfg = load_config(NodeConfig, ["@", f, "--server.port", "9003"])
    assert cfg.server.port == 9003
    assert cfg.engine.max_batch_size == 4


def test_composed_config_takes_a_shared_field_from_env_once(monkeypatch, tmp_path):
    """`rl`: a run-wide field set by env (or a TOML file) reaches both process configs it
    contains; the same field set for one of them to another value is refused."""
    from trainer.config import RLConfig

    monkeypatch.setenv("PRIME_ASYNC_LEVEL", "4")
    f = toml(tmp_path, "rl.toml", "max_steps = 9\n[trainer.optim]\nlr = 0.001\n")
    cfg = load_config(RLConfig, ["@", f])
    t, o = cfg.trainer_config(), cfg.orchestrator_config()
    assert (t.async_level, o.async_level, t.max_steps, o.max_steps) == (4, 4, 9, 9)
    assert t.optim.lr == 0.001
    monkeypatch.setenv("PRIME_ORCHESTRATOR__ASYNC_LEVEL", "1")
    with pytest.raises(
        ConfigError, match="orchestrator.async_level is 1 but the run's async_level is 4"
    ):
        load_config(RLConfig, ["@", f])


def test_unknown_key_is_a_config_error_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=r"server\.prot"):
        load_config(NodeConfig, ["--server.prot", "1"])
    with pytest.raises(ConfigError, match="bogus_key"):
        load_config(NodeConfig, ["--bogus-key", "1"])
    f = toml(tmp_path, "x.toml", "[engine]\nmax_batchsize = 2\n")
    with pytest.raises(ConfigError, match=r"engine\.max_batchsize"):
        load_config(NodeConfig, ["@", f])


def test_bad_value_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"server\.port"):
        load_config(NodeConfig, ["--server.port", "70000"])
    with pytest.raises(ConfigError, match=r"engine\.max_batch_size"):
        load_config(NodeConfig, ["--engine.max_batch_size", "many"])
    with pytest.raises(ConfigError, match=r"engine\.dtype"):
        load_config(NodeConfig, ["--engine.dtype", "int3"])


def test_bad_model_path_gives_clear_error(tmp_path):
    missing = tmp_path / "no-model"
    with pytest.raises(ConfigError) as info:
        load_config(NodeConfig, ["--engine.model", str(missing)])
    msg = str(info.value)
    assert "engine.model" in msg
    assert str(missing) in msg
    assert "config.json" in msg
    # A folder without config.json is refused too.
    missing.mkdir()
    with pytest.raises(ConfigError, match="config.json"):
        load_config(NodeConfig, ["--engine.model", str(missing)])


def test_model_folder_with_config_json_is_accepted(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    cfg = load_config(NodeConfig, ["--engine.model", str(tmp_path)])
    assert Path(cfg.engine.model) == tmp_path


def test_trusted_keys_must_be_node_ids(tmp_path):
    good = Identity.from_seed(bytes(32)).node_id
    f = toml(tmp_path, "keys.toml", f'trusted_keys = ["{good}"]\n')
    assert load_config(NodeConfig, ["@", f]).trusted_keys == [good]
    f = toml(tmp_path, "bad.toml", f'trusted_keys = ["{good}", "not-a-node-id"]\n')
    with pytest.raises(ConfigError) as info:
        load_config(NodeConfig, ["@", f])
    assert "trusted_keys" in str(info.value)
    assert "not-a-node-id" in str(info.value)


def test_trusted_keys_from_env_are_validated(monkeypatch):
    monkeypatch.setenv("PRIME_TRUSTED_KEYS", '["QmNotEd25519"]')
    with pytest.raises(ConfigError, match="trusted_keys"):
        load_config(NodeConfig, [])


# ---------------------------------------------------------------- write_resolved


def test_write_resolved_loads_back_equal(tmp_path):
    good = Identity.from_seed(bytes(32)).node_id
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    cfg = load_config(
        NodeConfig,
        [
            "--server.port",
            "9123",
            "--engine.max_batch_size",
            "7",
            "--engine.model",
            str(tmp_path / "m"),
            "--verification.proof.chunk_tokens",
            "16",
            "--verification.sampling_tolerance",
            "0.125",
            "--key_file",
            str(tmp_path / "k.key"),
        ],
        trusted_keys=[good],
    )
    path = write_resolved(cfg, tmp_path / "logs" / "resolved.toml")
    assert path.is_file()
    back = load_config(NodeConfig, ["@", str(path)])
    assert back == cfg
    assert back.trusted_keys == [good]
    assert back.verification.proof.chunk_tokens == 16


def test_write_resolved_with_none_fields_loads_back_equal(tmp_path):
    cfg = load_config(CalibrateConfig, ["--rollouts", "8", "--temperature", "0.5"])
    assert cfg.verifier is None and cfg.out is None
    back = load_config(CalibrateConfig, ["@", str(write_resolved(cfg, tmp_path / "c.toml"))])
    assert back == cfg


def test_resolved_file_is_not_overridden_by_env(monkeypatch, tmp_path):
    cfg = load_config(NodeConfig, ["--server.port", "9123"])
    path = write_resolved(cfg, tmp_path / "r.toml")
    monkeypatch.setenv("PRIME_SERVER__PORT", "1")
    assert load_config(NodeConfig, ["@", str(path)]).server.port == 9123


# ---------------------------------------------------------------- JSON list values on flags


def test_json_list_flag_sets_trusted_keys():
    good = Identity.from_seed(bytes(32)).node_id
    cfg = load_config(NodeConfig, ["--trusted-keys", f'["{good}"]'])
    assert cfg.trusted_keys == [good]
    assert load_config(NodeConfig, [f'--trusted_keys=["{good}"]']).trusted_keys == [good]


def test_non_node_id_on_the_command_line_is_refused():
    with pytest.raises(ConfigError, match="trusted_keys.*not-a-node-id"):
        load_config(NodeConfig, ["--trusted-keys", '["not-a-node-id"]'])


def test_invalid_json_flag_value_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match="--trusted-keys.*not valid JSON"):
        parse_args(["--trusted-keys", '["unterminated'])


def test_log_lines_are_json_whatever_the_message(capsys):
    import json
    import logging

    from protocol.logs import setup_logging

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        setup_logging("INFO")
        logging.getLogger("prime.test").warning('a "quoted" message\nwith a newline')
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
    line = capsys.readouterr().err.strip().splitlines()[-1]
    entry = json.loads(line)
    assert entry["msg"] == 'a "quoted" message\nwith a newline' and entry["level"] == "WARNING"
