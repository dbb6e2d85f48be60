"""deploy/: every file parses, and every prime-node / prime-scheduler / prime-trainer /
trainer.train command line in it names a real subcommand with flags its config accepts.

No docker, kubectl or Slurm here: this only parses and cross-checks (deploy/README.md).
"""

from __future__ import annotations

import configparser
import json
import re
import shlex
from pathlib import Path

import pytest
import typer
import yaml
from pydantic import BaseModel, ValidationError

from protocol.config import parse_args

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SCRIPTS = ("prime-node", "prime-scheduler", "prime-trainer")
# Paths the images use for the repository's configs/ folder.
CONFIG_PREFIXES = ("/opt/prime-swarm/configs/", "/src/configs/")
# Shell and Kubernetes variables get a value of the right shape for the flag they fill.
PLACEHOLDERS = {"SCHEDULER": "http://scheduler:7000", "SCHEDULER_URL": "http://scheduler:7000"}
SHELL_SEPARATORS = {";", "&&", "||", "|", "&", "(", ")", "\n"}
# Value errors that are about this machine, not about the command line.
TOLERATED_ERRORS = {"value_error", "missing", "assertion_error"}


def _configs() -> dict[tuple[str, ...], type[BaseModel]]:
    from node.config import CalibrateConfig, FetchConfig, JoinConfig, NodeConfig
    from scheduler.config import PoolCreateConfig, SchedulerConfig
    from trainer.config import (
        EvalConfig,
        OrchestratorConfig,
        PublishConfig,
        RLConfig,
        SFTConfig,
        TrainerConfig,
    )

    return {
        ("prime-node", "serve"): NodeConfig,
        ("prime-node", "join"): JoinConfig,
        ("prime-node", "fetch"): FetchConfig,
        ("prime-node", "calibrate"): CalibrateConfig,
        ("prime-scheduler", "serve"): SchedulerConfig,
        ("prime-scheduler", "pool", "create"): PoolCreateConfig,
        ("prime-trainer", "rl"): RLConfig,
        ("prime-trainer", "train"): TrainerConfig,
        ("prime-trainer", "orchestrate"): OrchestratorConfig,
        ("prime-trainer", "sft"): SFTConfig,
        ("prime-trainer", "eval"): EvalConfig,
        ("prime-trainer", "publish"): PublishConfig,
        ("trainer.train",): TrainerConfig,
    }


def _apps() -> dict[str, typer.Typer]:
    import node.cli
    import scheduler.cli
    import trainer.cli

    return {
        "prime-node": node.cli.app,
        "prime-scheduler": scheduler.cli.app,
        "prime-trainer": trainer.cli.app,
    }


def _substitute(text: str) -> str:
    """$FOO, ${FOO}, ${FOO:-x}, ${FOO:?msg} and Kubernetes' $(FOO) -> a placeholder value."""

    def repl(m: re.Match) -> str:
        name = next(g for g in m.groups() if g)
        return PLACEHOLDERS.get(name, "10.0.0.1" if name.endswith("IP") else "placeholder")

    return re.sub(r"\$\{(\w+)(?::[-?][^}]*)?\}|\$\((\w+)\)|\$(\w+)", repl, text)


def _shell_commands(script: str) -> list[list[str]]:
    """Split shell text into simple commands (continuations joined, comments dropped)."""
    script = _substitute(script.replace("\\\n", " "))
    out, cur = [], []
    for line in script.splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        lex.commenters = "#"
        for tok in [*lex, "\n"]:
            if tok in SHELL_SEPARATORS or set(tok) <= set(";&|()<>"):
                if cur:
                    out.append(cur)
                cur = []
            else:
                cur.append(tok)
    return out


def _find_invocations(argv: list[str]) -> list[tuple[tuple[str, ...], list[str]]]:
    """(command path, args) of prime-* and trainer.train calls inside one argv."""
    if len(argv) >= 3 and Path(argv[0]).name in ("sh", "bash") and argv[1] == "-c":
        return [inv for cmd in _shell_commands(argv[2]) for inv in _find_invocations(cmd)]
    for i, tok in enumerate(argv):
        name = Path(tok).name
        if name in SCRIPTS:
            rest = argv[i + 1 :]
            group = rest[:2] if rest[:1] in (["pool"], ["db"]) else rest[:1]
            return [((name, *group), rest[len(group) :])]
        if tok == "-m" and argv[i + 1 : i + 2] == ["trainer.train"]:
            return [(("trainer.train",), argv[i + 2 :])]
    return []


def _check_keys(cls: type[BaseModel], values: dict, where: str) -> None:
    """Fail on unknown keys and on values of the wrong type; tolerate checks of this
    machine's files (pool file, model folder) and missing required values."""
    try:
        cls.model_validate(values)
    except ValidationError as exc:
        bad = [e for e in exc.errors() if e["type"] not in TOLERATED_ERRORS]
        if bad:
            lines = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in bad]
            raise AssertionError(f"{where}: {cls.__name__} refuses " + "; ".join(lines)) from exc


def check_invocation(path: tuple[str, ...], args: list[str], where: str) -> None:
    """The subcommand exists and its config (or Typer options) accept the flags."""
    if path[0] != "trainer.train":
        cmd = typer.main.get_command(_apps()[path[0]])
        for part in path[1:]:
            assert part in cmd.commands, f"{where}: no subcommand {' '.join(path)}"
            cmd = cmd.commands[part]
        assert not hasattr(cmd, "commands"), f"{where}: {' '.join(path)} needs a subcommand"
    if "--help" in args:
        return
    cls = _configs().get(path)
    if cls is None:  # a plain Typer command: its options only
        opts = {o for p in cmd.params for o in p.opts}
        for a in args:
            if a.startswith("--"):
                assert a.split("=")[0] in opts, f"{where}: {' '.join(path)} has no option {a}"
        return
    if path == ("prime-node", "join") or path == ("prime-node", "serve"):
        from node.cli import expand_aliases

        args = expand_aliases(args)
    kept, skip = [], False
    for i, a in enumerate(args):  # keep @ files of this repository's configs/, drop others
        if skip:
            skip = False
            continue
        if a == "@":
            target, skip = args[i + 1], True
            for prefix in CONFIG_PREFIXES:
                if target.startswith(prefix):
                    local = ROOT / "configs" / target[len(prefix) :]
                    assert local.is_file(), f"{where}: {target} is not in configs/"
                    kept += ["@", str(local)]
            continue
        kept.append(a)
    _check_keys(cls, parse_args(kept), where)


def check_env(cls: type[BaseModel], env: dict[str, str], where: str) -> None:
    """PRIME_SECTION__KEY variables name real keys of `cls` (a top-level typo would be
    silently ignored by pydantic-settings)."""
    values: dict = {}
    for name, value in env.items():
        if not name.startswith("PRIME_") or name in ("PRIME_CACHE_DIR", "PRIME_LOG_LEVEL"):
            continue
        keys = name[len("PRIME_") :].lower().split("__")
        node = values
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = json.loads(value) if value[:1] in "[{" else value
    for key in values:
        assert key in cls.model_fields, f"{where}: PRIME_{key.upper()} is no key of {cls.__name__}"
    _check_keys(cls, values, where)


# -- the files -------------------------------------------------------------------------------


def dockerfile(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuations joined and comments dropped."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        buf += line.rstrip()
        if buf.endswith("\\"):
            buf = buf[:-1] + " "
            continue
        if buf.strip():
            word, _, rest = buf.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def _exec_form(arg: str) -> list[str]:
    return json.loads(arg) if arg.startswith("[") else ["sh", "-c", arg]


def _docker_env(instrs: list[tuple[str, str]]) -> dict[str, str]:
    env = {}
    for word, rest in instrs:
        if word == "ENV":
            for item in shlex.split(rest):
                k, _, v = item.partition("=")
                env[k] = v
    return env


def systemd_unit(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read_string(path.read_text())
    return parser


def env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            k, _, v = line.partition("=")
            env[k.strip()] = shlex.split(v)[0] if v.strip() else ""
    return env


def _containers(doc: dict) -> list[dict]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("initContainers", []) + spec.get("containers", [])


def all_invocations() -> list[tuple[str, tuple[str, ...], list[str]]]:
    found = []

    def add(where: str, argv: list[str]) -> None:
        found.extend((where, p, a) for p, a in _find_invocations(argv))

    entrypoints = {}
    for df in DEPLOY.rglob("Dockerfile*"):
        instrs = dockerfile(df)
        last = {w: _exec_form(r) for w, r in instrs if w in ("ENTRYPOINT", "CMD")}
        entrypoints[df] = last.get("ENTRYPOINT", [])
        add(str(df), [_substitute(a) for a in last.get("ENTRYPOINT", []) + last.get("CMD", [])])
        for word, rest in instrs:
            if word == "RUN":
                for cmd in _shell_commands(rest):
                    add(f"{df} RUN", cmd)
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    for name, svc in compose["services"].items():
        image_ep = entrypoints.get(DEPLOY.parent / svc.get("build", {}).get("dockerfile", "-"))
        entry = svc.get("entrypoint", image_ep or [])
        cmd = svc.get("command", [])
        cmd = shlex.split(cmd) if isinstance(cmd, str) else cmd
        add(f"compose {name}", [_substitute(str(a)) for a in entry + cmd])
    for f in (DEPLOY / "k8s").glob("*.yaml"):
        for doc in yaml.safe_load_all(f.read_text()):
            for c in _containers(doc or {}):
                argv = c.get("command", []) + c.get("args", [])
                add(f"{f.name} {c['name']}", [_substitute(str(a)) for a in argv])
    unit = systemd_unit(DEPLOY / "systemd" / "prime-node.service")
    exec_start = unit["Service"]["ExecStart"].lstrip("-@+!:")
    for cmd in _shell_commands(exec_start):
        add("prime-node.service", cmd)
    for cmd in _shell_commands((DEPLOY / "slurm" / "trainer.sbatch").read_text()):
        add("trainer.sbatch", cmd)
    return found


# -- tests -----------------------------------------------------------------------------------


def test_yaml_files_parse_and_compose_has_the_pool() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert {"postgres", "pool-init", "scheduler", "node-a", "node-b"} <= set(services)
    assert services["postgres"]["image"].startswith("postgres:16")
    for name in ("scheduler", "node-a", "node-b"):
        assert "healthcheck" in services[name]
    for name, dep in (("scheduler", "postgres"), ("node-a", "scheduler"), ("node-b", "scheduler")):
        assert services[name]["depends_on"][dep]["condition"] == "service_healthy"
    assert "postgresql+asyncpg://" in " ".join(services["scheduler"]["command"])


def test_k8s_objects_and_kustomization() -> None:
    kinds = set()
    for f in (DEPLOY / "k8s").glob("*.yaml"):
        for doc in yaml.safe_load_all(f.read_text()):
            assert doc and {"apiVersion", "kind", "metadata"} <= set(doc), f
            kinds.add(doc["kind"])
    assert {"Deployment", "Service", "StatefulSet", "Secret", "Kustomization"} <= kinds
    kust = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    for res in kust["resources"]:
        assert (DEPLOY / "k8s" / res).is_file(), res
    node = next(
        d
        for d in yaml.safe_load_all((DEPLOY / "k8s" / "node.yaml").read_text())
        if d["kind"] == "Deployment"
    )
    (c,) = node["spec"]["template"]["spec"]["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert any(
        e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP"
        for e in c["env"]
    )


@pytest.mark.parametrize("name", ["node/Dockerfile", "scheduler/Dockerfile"])
def test_dockerfile(name: str) -> None:
    instrs = dockerfile(DEPLOY / name)
    words = [w for w, _ in instrs]
    assert words[0] in ("FROM", "ARG")
    users = [r for w, r in instrs if w == "USER"]
    assert users and users[-1] not in ("root", "0"), "must run as a non-root user"
    entry = _exec_form(dict(instrs)["ENTRYPOINT"])
    assert entry[0] in SCRIPTS
    assert "EXPOSE" in words and "HEALTHCHECK" in words


def test_systemd_unit() -> None:
    from node.config import JoinConfig

    unit = systemd_unit(DEPLOY / "systemd" / "prime-node.service")
    assert {"Unit", "Service", "Install"} <= set(unit.sections())
    svc = unit["Service"]
    assert "prime-node join" in svc["ExecStart"]
    assert svc["Restart"] == "on-failure" and svc["KillSignal"] == "SIGTERM"
    assert svc["User"] not in ("root", "0")
    env = env_file(DEPLOY / "systemd" / "prime-node.env")
    drain = float(
        env.get("PRIME_DRAIN_TIMEOUT_S", JoinConfig.model_fields["drain_timeout_s"].default)
    )
    assert float(svc["TimeoutStopSec"]) > drain


def test_every_command_line_is_real() -> None:
    found = all_invocations()
    paths = {p for _, p, _ in found}
    # Each kind of file contributes commands (a broken extractor must not pass vacuously).
    assert {
        ("prime-node", "join"),
        ("prime-scheduler", "serve"),
        ("prime-scheduler", "pool", "create"),
    } <= paths
    assert {("prime-trainer", "orchestrate"), ("trainer.train",), ("prime-node", "keygen")} <= paths
    wheres = {w.split()[0] for w, _, _ in found}
    assert {
        "compose",
        "node.yaml",
        "scheduler.yaml",
        "prime-node.service",
        "trainer.sbatch",
    } <= wheres
    for where, path, args in found:
        check_invocation(path, args, where)


def test_env_variables_name_real_keys() -> None:
    from node.config import JoinConfig
    from scheduler.config import SchedulerConfig

    check_env(JoinConfig, env_file(DEPLOY / "systemd" / "prime-node.env"), "prime-node.env")
    check_env(
        JoinConfig, _docker_env(dockerfile(DEPLOY / "node" / "Dockerfile")), "node/Dockerfile"
    )
    docs = yaml.safe_load_all((DEPLOY / "k8s" / "scheduler.yaml").read_text())
    dep = next(d for d in docs if d["kind"] == "Deployment")
    env = {
        e["name"]: "postgresql+asyncpg://x@y/z"
        for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert "PRIME_DATABASE__URL" in env
    check_env(SchedulerConfig, env, "scheduler.yaml")


def test_the_checker_catches_typos() -> None:
    from node.config import JoinConfig

    base = ["--pool", "demo", "--scheduler", "http://s:7000"]
    check_invocation(("prime-node", "join"), [*base, "--engine.model", "tiny"], "ok")
    bad = [
        (("prime-node", "join"), [*base, "--engine.modle", "tiny"]),
        (("prime-node", "join"), [*base, "--server.port", "eighty"]),
        (("prime-node", "jion"), base),
        (
            ("prime-scheduler", "serve"),
            ["--pool-file", "x.pool", "--databse.url", "sqlite+aiosqlite:///x"],
        ),
        (("trainer.train",), ["--run-dir", "r", "--optim.lr", "1e-3", "--optimiser.lr", "1"]),
        (("prime-node", "keygen"), ["--keyfile", "k"]),
    ]
    for path, args in bad:
        with pytest.raises(AssertionError):
            check_invocation(path, args, "typo")
    with pytest.raises(AssertionError):
        check_env(JoinConfig, {"PRIME_SCHEDULR": "http://s"}, "typo")
    with pytest.raises(AssertionError):
        check_env(JoinConfig, {"PRIME_ENGINE__KINDD": "vllm"}, "typo")
    cmds = _shell_commands("a && prime-node join --pool ${P:-x} \\\n  --scheduler $S & b")
    assert _find_invocations(cmds[1]) == [
        (("prime-node", "join"), ["--pool", "placeholder", "--scheduler", "placeholder"])
    ]
