"""deploy/: every `specexec` command that the compose file and the systemd units run parses with our CLI,
the example configs load, and config files and SPECEXEC_* variables behave as documented."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import pytest
import yaml

from client.cli.main import build_parser, parser_for, subcommand
from common.ops import config
from common.ops.logs import JsonFormatter, TextFormatter, event

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
EXAMPLES = sorted((DEPLOY / "examples").glob("*.toml"))
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
ETC_CONFIG = "/etc/specexec/specexec.toml"
REQUIRED_EXTRA = {"generate": ["--prompt", "x"]}  # options a config file cannot sensibly hold


def parse(argv: list[str], environ: dict[str, str] | None = None) -> argparse.Namespace:
    """As `specexec` parses: a node's subcommand with the node's own parser."""
    return config.parse_args(parser_for(subcommand(argv)), argv, environ or {})


def with_config(argv: list[str], path: Path) -> list[str]:
    return [str(path) if a == ETC_CONFIG else a for a in argv]


# ------------------------------------------------------------------------------------------------
# Example configs


def tables(path: Path) -> list[str]:
    return [k for k, v in config.load(path).items() if isinstance(v, dict)]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_configs_load_for_every_subcommand_they_configure(path):
    assert tables(path)
    for command in tables(path):
        args = parse([command, "--config", str(path), *REQUIRED_EXTRA.get(command, [])])
        assert args.command == command and args.config == str(path)
        if command in ("target", "draft"):
            assert args.model and args.listen
        if command == "serve":
            assert args.target and (args.listen or args.openai)


def test_example_configs_cover_the_three_setups():
    names = {p.name for p in EXAMPLES}
    assert {"one-machine.toml", "desktop-target.toml", "laptop-draft.toml", "cpu-target.toml"} <= names
    laptop = parse(["serve", "--config", str(DEPLOY / "examples" / "laptop-draft.toml")])
    assert laptop.node_tls_ca and laptop.node_auth_token_file and laptop.target == "desktop.lan:50051"
    desktop = parse(["target", "--config", str(DEPLOY / "examples" / "desktop-target.toml")])
    assert desktop.tls_cert and desktop.tls_client_ca and desktop.auth_token_file
    cpu = parse(["serve", "--config", str(DEPLOY / "examples" / "cpu-target.toml")])
    assert cpu.listen is None and cpu.openai and cpu.max_budget == 64


def test_the_config_keys_file_lists_every_subcommands_options():
    """A node checks the other services' tables of a shared file against it: stale, a new option
    there would be refused by the nodes. Regenerate with scripts/gen_config_keys.sh."""
    import json

    assert json.loads(config.KEYS_FILE.read_text()) == config.config_keys(build_parser())


def test_a_node_refuses_a_typo_in_another_services_table_of_its_file(tmp_path):
    """Its parser holds its own subcommand only; before the keys file it refused every other table."""
    path = tmp_path / "c.toml"
    path.write_text('[target]\nmodel = "m"\n[serve]\ntarget = "h:1"\n[draft]\nmodel = "d"\n')
    assert parse(["draft", "--config", str(path)]).model == "d"
    path.write_text('[target]\nmodel = "m"\n[serve]\ntarget_adress = "h:1"\n')
    with pytest.raises(config.ConfigError, match="unknown option 'target_adress' in \\[serve\\]"):
        parse(["target", "--config", str(path)])
    path.write_text('[target]\nmodel = "m"\nserved_model_name = "x"\n')
    with pytest.raises(config.ConfigError, match="unknown option 'served_model_name' in \\[target\\]"):
        parse(["target", "--config", str(path)])
    path.write_text('served_model_name = "x"\n[target]\nmodel = "m"\n')  # top level: any subcommand's
    assert parse(["target", "--config", str(path)]).model == "m"


# ------------------------------------------------------------------------------------------------
# systemd units


def unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """systemd's format is not INI (keys repeat): a minimal reader."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        assert current is not None, f"{path.name}: {line!r} outside a section"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_systemd_units(path):
    u = unit(path)
    service = u["Service"]
    assert service["User"] == ["specexec"] and service["Restart"] == ["on-failure"]
    for key, want in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "PrivateTmp": "yes"}.items():
        assert service[key] == [want], key
    assert u["Install"]["WantedBy"] == ["multi-user.target"]
    (exec_start,) = service["ExecStart"]
    argv = shlex.split(exec_start)
    assert argv[0].endswith("/bin/specexec")
    role = path.stem.removeprefix("specexec-")
    args = parse(with_config(argv[1:], DEPLOY / "examples" / "one-machine.toml"))
    assert args.command == {"gateway": "serve"}.get(role, role)
    assert args.config.endswith("one-machine.toml")


# ------------------------------------------------------------------------------------------------
# Docker


def test_compose_commands_parse():
    compose = yaml.safe_load((DEPLOY / "docker" / "compose.yaml").read_text())
    docker_config = DEPLOY / "docker" / "specexec.toml"
    ours = {name: s for name, s in compose["services"].items() if s.get("image", "").startswith("specexec")}
    assert {"models", "target", "draft", "gateway"} <= set(ours)
    commands = []
    for name, service in ours.items():
        assert service["build"]["dockerfile"] == "deploy/docker/Dockerfile"
        assert (DEPLOY / "docker" / service["build"]["context"] / service["build"]["dockerfile"]).is_file()
        commands.append((name, service["command"]))
        check = service.get("healthcheck", {}).get("test", [])
        if check[1:2] == ["specexec"]:
            commands.append((f"{name} healthcheck", check[2:]))
    for name, argv in commands:
        args = parse(with_config(argv, docker_config))
        assert args.command, name
    gateway = parse(with_config(ours["gateway"]["command"], docker_config))
    published = {p.split(":")[-1] for p in ours["gateway"]["ports"]}
    assert {gateway.openai.rsplit(":", 1)[1], gateway.listen.rsplit(":", 1)[1]} <= published
    assert all(p.startswith("127.0.0.1:") for p in ours["gateway"]["ports"])
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["specexec"]' in dockerfile and "USER specexec" in dockerfile


# ------------------------------------------------------------------------------------------------
# Config semantics


def test_precedence_command_line_over_env_over_table_over_top_level(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        'max_tree = 10\nlog_format = "json"\n[target]\nmodel = "m"\nmax_tree = 20\nprofile = false\n'
    )
    args = parse(["target", "--config", str(path)])
    assert (args.model, args.max_tree, args.log_format, args.profile) == ("m", 20, "json", False)
    env = {"SPECEXEC_MAX_TREE": "30", "SPECEXEC_PROFILE": "yes", "SPECEXEC_HOME": "/x", "SPECEXEC_NOPE": "1"}
    args = parse(["target", "--config", str(path)], env)
    assert (args.max_tree, args.profile) == (30, True)
    assert parse(["target", "--config", str(path), "--max-tree", "40"], env).max_tree == 40
    assert args.config_sources["max_tree"] == "env" and args.config_sources["model"] == str(path)
    # SPECEXEC_CONFIG names the file; `specexec --config PATH target` works too.
    assert parse(["target"], {"SPECEXEC_CONFIG": str(path)}).model == "m"
    assert parse(["--config", str(path), "target"]).max_tree == 20


def test_an_unknown_specexec_variable_is_warned_about_with_the_nearest_option(capsys):
    """A typo in a systemd unit's Environment= would silently do nothing."""
    env = {"SPECEXEC_MAX_TRE": "5", "SPECEXEC_HOME": "/x", "SPECEXEC_HUGE_PAGES": "0", "SPECEXEC_MAX_QUEUE": "3",
           "SPECEXEC_NO_PROFILE": "1", "SPECEXEC_DEBUG": "1"}  # fmt: skip
    args = parse(["target", "--model", "m"], env)  # the node's parser: --max-queue is serve's, known all the same
    assert args.profile is False
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["specexec: warning: SPECEXEC_DEBUG is not an option of any command and is ignored",  # no guess
                   "specexec: warning: SPECEXEC_MAX_TRE is not an option of any command and is ignored; "
                   "did you mean SPECEXEC_MAX_TREE?"]  # fmt: skip


def test_flag_and_list_options(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[generate]\nno_profile = 1\n")
    with pytest.raises(config.ConfigError, match="unknown option 'no_profile' in \\[generate\\]"):
        parse(["generate", "--config", str(path), "--prompt", "x"])
    path.write_text(
        '[target]\nmodel = "m"\nno_profile = true\n[generate]\nstop = ["a", "b"]\nignore_eos = true\n'
    )
    assert parse(["target", "--config", str(path)]).profile is False
    args = parse(["generate", "--config", str(path), "--prompt", "x"])
    assert args.stop == ["a", "b"] and args.ignore_eos is True


@pytest.mark.parametrize(
    "text, message",
    [
        ("[tagret]\nmodel = 'm'\n", "unknown table"),
        ("[target]\nmodle = 'm'\n", "unknown option 'modle'"),
        ("nonsense = 1\n", "unknown top-level option"),
        ("[target]\nmodel = 'm'\nmax_tree = 'many'\n", "invalid value"),
        ("[target]\nmodel = 'm'\nmax_tree = 2.5\n", "whole number"),
        ("[target]\nmodel = 'm'\ndtype = 'float8'\n", "must be one of"),
        ("[target]\nmodel = 'm'\ninsecure = 'maybe'\n", "is a flag"),
        ("[target\n", "not valid TOML"),
    ],
)
def test_config_errors_are_clear(tmp_path, text, message):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(config.ConfigError, match=message):
        parse(["target", "--config", str(path)])


def test_a_no_flag_reads_as_its_positive_name_and_checked_numbers_stay_checked(tmp_path):
    """usage.md's rule: `X = false` for `--no-X`, whatever the flag's dest; and a number in the file
    passes the same check as on the command line."""
    path = tmp_path / "c.toml"
    path.write_text("[generate]\nplanner_memory = false\n")
    assert parse(["generate", "--config", str(path), "--prompt", "x"]).no_planner_memory is True
    path.write_text("[generate]\nstep_timeout = 0\n")
    with pytest.raises(config.ConfigError, match="--step-timeout must be a number of seconds > 0"):
        parse(["generate", "--config", str(path), "--prompt", "x"])
    # The environment reads the same names: SPECEXEC_NO_PROFILE=1 was ignored (only the dest's name was)
    node = ["draft", "--model", "m"]
    assert parse(node, {"SPECEXEC_NO_PROFILE": "1"}).profile is False
    assert parse(node, {"SPECEXEC_PROFILE": "false"}).profile is False
    assert parse(node, {"SPECEXEC_NO_LOOKAHEAD": "true"}).lookahead is False and parse(node).lookahead is True
    assert parse(["generate", "--prompt", "x"], {"SPECEXEC_PLANNER_MEMORY": "0"}).no_planner_memory is True


def test_bad_config_is_a_usage_error_from_the_cli(tmp_path, capsys):
    from client.cli.main import main

    path = tmp_path / "c.toml"
    path.write_text("[target]\nmodle = 'm'\n")
    with pytest.raises(SystemExit) as exit_:
        main(["target", "--config", str(path)])
    assert exit_.value.code == 2 and "unknown option 'modle'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["target", "--config", str(tmp_path / "missing.toml")])
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["target", "--config", str(tmp_path)])
    assert "is a directory, not a TOML file" in capsys.readouterr().err
    path.write_bytes(b"[target]\nmodel = '\xff'\n")
    with pytest.raises(SystemExit):
        main(["target", "--config", str(path)])
    assert "it is not UTF-8 text" in capsys.readouterr().err


def test_a_bad_value_from_the_config_or_the_environment_names_where_it_was_set(tmp_path, capsys, monkeypatch):
    """Errors found after parsing (a value each option's type accepts, but the command refuses)."""
    from client.cli.main import main

    path = tmp_path / "c.toml"
    path.write_text("[target]\nmodel = 'm'\nlisten = 47121\n")
    assert main(["target", "--config", str(path)]) == 2
    assert f"--listen must be HOST:PORT, got '47121' (--listen set in {path})" in capsys.readouterr().err
    path.write_text("[target]\nmodel = 'm'\nmax_sessions = -3\n")
    assert main(["target", "--config", str(path)]) == 2
    assert f"--max-sessions must be >= 1, got -3 (--max-sessions set in {path})" in capsys.readouterr().err
    monkeypatch.setenv("SPECEXEC_MAX_SESSIONS", "-4")
    assert main(["target", "--model", "m"]) == 2
    assert "--max-sessions must be >= 1, got -4 (--max-sessions set by SPECEXEC_MAX_SESSIONS)" in capsys.readouterr().err
    assert main(["target", "--model", "m", "--max-sessions", "-5"]) == 2
    assert capsys.readouterr().err.strip().endswith("got -5")  # the command line: nothing to add
    monkeypatch.delenv("SPECEXEC_MAX_SESSIONS")
    monkeypatch.setenv("SPECEXEC_BATCH_WINDOW_MS", "nan")  # nan != nan: it was not traced to its source
    assert main(["target", "--model", "m"]) == 2
    assert capsys.readouterr().err.strip().endswith("got nan (--batch-window-ms set by SPECEXEC_BATCH_WINDOW_MS)")
    monkeypatch.delenv("SPECEXEC_BATCH_WINDOW_MS")
    path.write_text("[serve]\ninsecure = false\n")  # named only in the error's advice: not blamed
    monkeypatch.setenv("SPECEXEC_OPENAI", "0.0.0.0:8000")
    assert main(["serve", "--config", str(path), "--target", "127.0.0.1:9"]) == 2
    assert capsys.readouterr().err.strip().endswith("(--openai set by SPECEXEC_OPENAI)")


def test_effective_config_masks_secrets():
    args = argparse.Namespace(api_key="sk-123", auth_token_file="/etc/t", max_new_tokens=5, password="p",
                              config="/c.toml", config_sources={"max_new_tokens": "env"})  # fmt: skip
    shown = config.effective_config(args)
    assert shown["options"] == {
        "api_key": "***",
        "auth_token_file": "/etc/t",
        "max_new_tokens": 5,
        "password": "***",
    }
    assert shown["config_file"] == "/c.toml" and shown["from"] == {"max_new_tokens": "env"}


def test_log_formats():
    import json
    import logging

    record = logging.LogRecord("specexec.node", logging.INFO, __file__, 1, "session_opened", None, None)
    record.event_fields = {"session": "ab12", "prompt_tokens": 3, "note": "two words"}
    line = json.loads(JsonFormatter("target").format(record))
    assert line["event"] == "session_opened" and line["session"] == "ab12" and line["role"] == "target"
    assert line["ts"].endswith("Z") and line["level"] == "info"
    text = TextFormatter("target").format(record)
    assert text.endswith(
        'INFO specexec.node [target] session_opened session=ab12 prompt_tokens=3 note="two words"'
    )
    event(logging.getLogger("specexec.test"), "nothing_enabled")  # no handler: no error
