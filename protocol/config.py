"""The configuration loader shared by every process (DESIGN.md section 7).

Each package declares its settings as a pydantic-settings model in its own `config.py`;
this module turns a command line into one of them. Sources, highest priority first:

1. CLI flags with dotted paths: ``--engine.dtype bfloat16`` or ``--engine.dtype=bfloat16``
   (a flag with no value is ``true``; a value starting with ``[`` or ``{`` is JSON);
2. TOML files given as ``@ path.toml`` (several compose; a later file wins);
3. ``PRIME_`` environment variables with ``__`` for nesting (``PRIME_ENGINE__DTYPE``);
4. the defaults declared on the models.

Invariants: an unknown key, a missing file or a bad value fails before anything starts,
with a message naming the key and the source; the resolved config can be written out
(`write_resolved`) and read back to the same model.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, TypeVar

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

S = TypeVar("S", bound=BaseSettings)


class ConfigError(ValueError):
    """A configuration that cannot be used; the message says what to fix."""


class Section(BaseModel):
    """Base for a config section: unknown keys refused, field docstrings kept as docs."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class HttpServerConfig(Section):
    """What every HTTP API of the project (a node's, the scheduler's) is configured with;
    each package's `ServerConfig` extends it with its own fields and defaults."""

    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = Field(0, ge=0, le=65535)
    """Port to listen on (0 picks a free one)."""
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    """Largest request body accepted; larger ones get 413."""
    body_read_timeout_s: float = Field(30.0, gt=0, le=3600)
    """A request body not received in full within this many seconds gets a JSON 408 and a
    closed connection (a client that sends part of its body cannot hold a slot)."""


class PrimeSettings(BaseSettings):
    """Base for process configs: PRIME_ env vars, '__' nesting, unknown keys refused."""

    model_config = SettingsConfigDict(
        env_prefix="PRIME_",
        env_nested_delimiter="__",
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
    )


def _set_path(target: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.replace("-", "_").split(".")
    for key in keys[:-1]:
        node = target.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--{dotted}: '{key}' is a value, not a section")
        target = node
    target[keys[-1]] = value


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` laid on `base`: sections merge key by key, any other value of `over` wins."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _read_toml(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from exc


def _parse_value(key: str, value: str) -> Any:
    """Flag values are strings, except JSON lists and tables (``--trusted-keys '["a", "b"]'``)."""
    if value[:1] and value[0] in "[{":  # ("" is in every string)
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--{key}: {value!r} is not valid JSON: {exc}") from exc
    return value


def parse_args(argv: list[str]) -> dict[str, Any]:
    """Turn ``@ a.toml --x.y 1 --flag`` into a nested dict (TOML files first, flags over them)."""
    files: dict[str, Any] = {}
    flags: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "@" or arg.startswith("@"):
            path = arg[1:] if len(arg) > 1 else (argv[i + 1] if i + 1 < len(argv) else None)
            if not path:
                raise ConfigError("'@' must be followed by a TOML file path")
            files = deep_merge(files, _read_toml(path))
            i += 1 if len(arg) > 1 else 2
            continue
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}: use --key value or @ file.toml")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 < len(argv) and not argv[i + 1].startswith(("--", "@")):
                value = argv[i + 1]
                i += 1
            else:
                value = "true"
        _set_path(flags, key, _parse_value(key, value))
        i += 1
    return deep_merge(files, flags)


def load_config(model: type[S], argv: list[str] | None = None, **overrides: Any) -> S:
    """Build `model` from argv (flags and @ files), PRIME_ env vars and defaults."""
    values = deep_merge(parse_args(argv or []), overrides)
    try:
        return model(**values)
    except ValidationError as exc:
        lines = [f"  {'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
        raise ConfigError(f"invalid {model.__name__}:\n" + "\n".join(lines)) from exc


def load_config_or_exit(model: type[S], argv: list[str]) -> S:
    """`load_config` for command lines: a bad config prints what to fix and exits 2."""
    try:
        return load_config(model, argv)
    except ConfigError as exc:
        from rich.console import Console

        Console(stderr=True).print(f"[red]config error:[/red] {exc}")
        raise SystemExit(2) from exc


def _drop_none(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _drop_none(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list | tuple):
        return [_drop_none(v) for v in obj]
    return obj


def write_resolved(config: BaseModel, path: str | Path) -> Path:
    """Write the resolved config as TOML (it loads back with ``@ path``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(_drop_none(config.model_dump(mode="json"))))
    return path
