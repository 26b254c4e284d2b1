"""Config files and environment overrides, applied as argparse defaults.

The command line stays the one place option names are defined: a config key is an option's name
without the leading dashes (`max-tree` or `max_tree`), and `SPECEXEC_MAX_TREE` is its environment
override. Precedence, highest first:

    command line  >  SPECEXEC_<OPTION>  >  [subcommand] table  >  top-level keys  >  built-in default

A TOML file may hold one table per subcommand (`[target]`, `[draft]`, `[serve]`, `[generate]`, ...)
and top-level keys that apply to every subcommand having that option (`log_format = "json"`), so
one file can configure all the services of a machine:

    specexec --config /etc/specexec/specexec.toml target     # or: specexec target --config PATH
    SPECEXEC_CONFIG=/etc/specexec/specexec.toml specexec draft

Unknown tables and keys are errors (a typo must not be ignored silently); unknown `SPECEXEC_*`
variables are not (`SPECEXEC_HOME` is the model cache, for one). For a `--no-X` flag write `X = false`
or `no_X = true`; a repeatable option (`--stop`) takes a list.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ENV_PREFIX = "SPECEXEC_"
CONFIG_ENV = "SPECEXEC_CONFIG"
RESERVED_ENV = {"SPECEXEC_HOME", CONFIG_ENV}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_SKIP = {"help", "config", "func", "command", "version"}


class ConfigError(ValueError):
    pass


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def add_config_option(parser: argparse.ArgumentParser) -> None:
    """`--config PATH` on every subcommand (it is read before parsing; see `apply`)."""
    parser.add_argument("--config", metavar="PATH", help=f"TOML config file (or ${CONFIG_ENV})")
    for sub in subcommands(parser).values():
        sub.add_argument(
            "--config",
            metavar="PATH",
            help=f"TOML config file: option defaults, overridden by {ENV_PREFIX}<OPTION> and the command line",
        )


def _options(sub: argparse.ArgumentParser) -> dict[str, tuple[argparse.Action, bool]]:
    """Config key -> (action, inverted): keys are dests and long option names, `-` read as `_`."""
    keys: dict[str, tuple[argparse.Action, bool]] = {}
    for action in sub._actions:
        if action.dest in _SKIP or not action.option_strings:
            continue
        keys[action.dest] = (action, False)
        for flag in action.option_strings:
            if flag.startswith("--"):
                name = flag[2:].replace("-", "_")
                keys.setdefault(name, (action, name != action.dest and _is_flag(action)))
            if flag.startswith("--no-") and _is_flag(action):  # `planner_memory = false` for --no-planner-memory
                positive = flag[5:].replace("-", "_")
                keys.setdefault(positive, (action, action.dest != positive))
    return keys


def _is_flag(action: argparse.Action) -> bool:
    return isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction)


def _key(name: str) -> str:
    return name.replace("-", "_").lower()


def _convert(action: argparse.Action, value: Any, inverted: bool, where: str) -> Any:
    name = action.option_strings[-1]
    if _is_flag(action):
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            value = value.strip().lower() in _TRUE
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {name} is a flag: give true or false, not {value!r}")
        return (not value) if inverted else value
    if isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
        return [_scalar(action, v, name, where) for v in items]
    return _scalar(action, value, name, where)


def _scalar(action: argparse.Action, value: Any, name: str, where: str) -> Any:
    if isinstance(value, dict | list) or (isinstance(value, bool) and action.type is not None):
        raise ConfigError(f"{where}: {name} takes one value, not {value!r}")
    if action.type in (int, float) and not isinstance(value, str):
        if action.type is int and not isinstance(value, int):
            raise ConfigError(f"{where}: {name} takes a whole number, not {value!r}")
        value = action.type(value)
    elif callable(action.type) and isinstance(value, str | int | float):  # a checking type (positive_int) too
        try:
            value = action.type(value if isinstance(value, str) else str(value))
        except argparse.ArgumentTypeError as exc:
            raise ConfigError(f"{where}: {name} {exc}") from exc
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: {name}: invalid value {value!r}") from exc
    elif action.type is None and not isinstance(value, str):
        value = str(value).lower() if isinstance(value, bool) else str(value)
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ConfigError(f"{where}: {name} must be one of {choices}, not {value!r}")
    return value


def load(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory, not a TOML file") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not valid TOML: it is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def config_path(argv: list[str], environ: Mapping[str, str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return environ.get(CONFIG_ENV) or None


def _command(argv: list[str]) -> str | None:
    """The subcommand: the first word that is not an option (the top level has only --config)."""
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--config":
            skip = True
        elif not arg.startswith("-"):
            return arg
    return None


def check(parser: argparse.ArgumentParser, data: dict[str, Any], path: str | Path) -> None:
    """Every table must be a subcommand and every key one of its options (top level: any's)."""
    subs = subcommands(parser)
    everywhere = {k for sub in subs.values() for k in _options(sub)}
    for key, value in data.items():
        if isinstance(value, dict):
            if key not in subs:
                raise ConfigError(f"{path}: unknown table [{key}]; tables are subcommands: {', '.join(subs)}")
            known = _options(subs[key])
            for option in value:
                if _key(option) not in known:
                    raise ConfigError(
                        f"{path}: unknown option {option!r} in [{key}]; `specexec {key} --help` lists them"
                    )
        elif _key(key) not in everywhere:
            raise ConfigError(f"{path}: unknown top-level option {key!r}")


def apply(
    parser: argparse.ArgumentParser, argv: list[str], environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Set the chosen subcommand's defaults from the config file and the environment.

    Returns where each changed default came from (dest -> "PATH" or "env")."""
    environ = os.environ if environ is None else environ
    subs = subcommands(parser)
    command = _command(argv)
    if command not in subs:
        return {}
    sub = subs[command]
    options = _options(sub)
    found: dict[str, tuple[argparse.Action, Any]] = {}
    sources: dict[str, str] = {}
    path = config_path(argv, environ)
    if path:
        data = load(path)
        check(parser, data, path)
        top = {k: v for k, v in data.items() if not isinstance(v, dict)}
        for layer, where in ((top, f"{path}"), (data.get(command, {}), f"{path} [{command}]")):
            for key, value in layer.items():
                if _key(key) in options:
                    action, inverted = options[_key(key)]
                    found[action.dest] = (action, _convert(action, value, inverted, where))
                    sources[action.dest] = str(path)
    for dest, (action, _) in {k: v for k, v in options.items() if k == v[0].dest}.items():
        name = ENV_PREFIX + dest.upper()
        if name in environ and name not in RESERVED_ENV:
            found[dest] = (action, _convert(action, environ[name], False, name))
            sources[dest] = "env"
    for dest, (action, value) in found.items():
        sub.set_defaults(**{dest: value})
        action.required = False  # a required option given by the config file is given
    return sources


def parse_args(
    parser: argparse.ArgumentParser, argv: list[str], environ: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """`apply`, then parse: what `specexec` itself does."""
    environ = os.environ if environ is None else environ
    sources = apply(parser, argv, environ)
    args = parser.parse_args(argv)
    args.config = config_path(argv, environ)  # however it was given (a subcommand's default hides it)
    args.config_sources = sources
    return args


def is_secret(name: str) -> bool:
    n = name.lower()
    if n.endswith(("_file", "_path", "_dir", "_sources")):
        return False
    return any(s in n for s in ("secret", "password", "passwd", "api_key", "credential")) or n.endswith(
        ("_token", "_key")
    )


def effective_config(args: argparse.Namespace) -> dict[str, Any]:
    """The options a service runs with, secrets masked, for its start-up log line."""
    options = {}
    for name, value in sorted(vars(args).items()):
        if name in ("func", "config_sources", "config"):
            continue
        if is_secret(name) and value:
            value = "***"
        elif isinstance(value, Path):
            value = str(value)
        options[name] = value
    return {
        "config_file": getattr(args, "config", None),
        "options": options,
        "from": getattr(args, "config_sources", {}),
    }
