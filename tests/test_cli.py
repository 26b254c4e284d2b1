"""The real `specexec` command, run as a subprocess."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from common.decoding.sampling import SamplingParams
from tests.helpers import free_port, reference_decode

SPECEXEC = [sys.executable, "-m", "client.cli.main"]
ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [*SPECEXEC, *args], capture_output=True, text=True, env=env, check=check, cwd=ROOT, timeout=120
    )


def pair_args(model_dirs) -> list[str]:
    """The in-process model pair: a draft sharing the target's tokenizer."""
    return ["--draft-model", str(model_dirs["truncated"]), "--target-model", str(model_dirs["target"])]


@pytest.mark.parametrize(
    ("mode", "extra"),
    [
        ("specexec", []),
        ("chain", []),
        ("autoregressive", []),
        ("specexec", ["--compile", "--compile-buckets", "1,16"]),
        ("specexec", ["--min-prob", "0.3"]),
        ("chain", ["--min-prob", "0.5"]),
        ("specexec", ["--min-prob", "0.2", "--min-node-prob", "0.05"]),
    ],
    ids=[
        "specexec",
        "chain",
        "autoregressive",
        "specexec-compiled",
        "specexec-floor",
        "chain-floor",
        "specexec-node-floor",
    ],
)
def test_generate_json_matches_target_alone(model_dirs, loaded, mode, extra):
    prompt = "Hello, "
    out = run(
        "generate",
        *extra,
        *pair_args(model_dirs),
        "--prompt",
        prompt,
        "--max-new-tokens",
        "12",
        "--mode",
        mode,
        "--budget",
        "8",
        "--temperature",
        "0.9",
        "--seed",
        "42",
        "--ignore-eos",
        "--json",
    )
    result = json.loads(out.stdout)
    ids = loaded["target"].tokenizer.encode(prompt)
    params = SamplingParams(temperature=0.9, seed=42, max_new_tokens=12, ignore_eos=True)
    assert result["token_ids"] == reference_decode(model_dirs["target"], ids, params)
    assert set(result["stats"]) >= {
        "new_tokens",
        "target_steps",
        "tokens_per_step",
        "wall_seconds",
        "draft_seconds",
        "target_seconds",
    }
    assert result["stats"]["new_tokens"] == 12
    assert result["text"] == loaded["target"].tokenizer.decode(result["token_ids"], skip_special_tokens=True)


def test_generate_streams_text_and_reports_stats(model_dirs):
    out = run(
        "generate",
        *pair_args(model_dirs),
        "--prompt",
        "Hi",
        "--max-new-tokens",
        "8",
    )
    assert "tokens per target step" in out.stderr


def test_profile_prints_both_curves_the_planner_numbers_and_its_choice(model_dirs):
    out = run(
        "profile",
        *pair_args(model_dirs),
        "--max-new-tokens",
        "24",
        "--max-budget",
        "16",
    )
    assert "target forward pass: 1 tok" in out.stdout and "draft forward pass: 1 tok" in out.stdout
    assert "running rate" in out.stdout and "calibration" in out.stdout
    assert "planner state: not kept (--no-planner-memory)" in out.stdout  # the tests' conftest sets it
    choice = out.stdout.strip().splitlines()[-1]
    assert choice.startswith("choice: --budget 16 --min-prob "), choice
    assert " --min-node-prob " in choice


def test_bad_arguments_exit_with_a_clear_message(model_dirs):
    out = run(
        "generate",
        "--target-model",
        str(model_dirs["target"]),
        "--prompt",
        "x",
        "--mode",
        "autoregressive",
        "--top-p",
        "2",
        check=False,
    )
    assert out.returncode == 2
    assert "--top-p must be in (0, 1]" in out.stderr
    # Named before any node is reached: this target address has no node behind it.
    out = run("generate", "--target", "127.0.0.1:9", "--mode", "autoregressive", "--prompt", "x",
              "--max-new-tokens", "0", check=False)  # fmt: skip
    assert out.returncode == 2 and "--max-new-tokens must be >= 1, got 0" in out.stderr, out.stderr
    out = run("generate", "--target", "127.0.0.1:9", "--mode", "autoregressive", "--prompt", "a\udcffb", check=False)
    assert out.returncode == 2 and "--prompt is not valid Unicode text" in out.stderr, out.stderr  # bytes not UTF-8
    out = run(
        "generate", "--target-model", "/nonexistent", "--prompt", "x", "--mode", "autoregressive", check=False
    )
    assert out.returncode == 2 and "target_model (--target-model): model path /nonexistent does not exist" in out.stderr
    out = run("generate", "--target-model", "t", "--prompt", "x", "--compile-buckets", "0,4", check=False)
    assert out.returncode == 2 and "compile buckets must be in [1, 4096], got '0,4'" in out.stderr
    # An ask the context cannot hold is refused, as the gateway and the OpenAI route refuse it: not cut short.
    out = run("generate", *pair_args(model_dirs), "--prompt", "Hello", "--max-new-tokens", "5000", check=False)
    assert out.returncode == 2 and not out.stdout, out.stdout
    assert "--max-new-tokens asks for 5000 tokens after a 5-token prompt, but the target's context is 1024 tokens: " \
           "at most 1019 fit" in out.stderr, out.stderr  # fmt: skip


def test_chat_flag_renders_the_chat_template(model_dirs, loaded):
    from client.api import render_chat

    out = run(
        "generate", "--target-model", str(model_dirs["target"]), "--mode", "autoregressive", "--prompt", "Hi",
        "--chat", "--max-new-tokens", "5", "--ignore-eos", "--json",
    )  # fmt: skip
    ids = render_chat(loaded["target"].tokenizer, [{"role": "user", "content": "Hi"}])
    assert ids[-len("<assistant>") :] == loaded["target"].tokenizer.encode("<assistant>")
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    assert json.loads(out.stdout)["token_ids"] == reference_decode(model_dirs["target"], ids, params)


@pytest.mark.parametrize(
    "flag, value, needle",
    [("--max-sessions", "0", "--max-sessions must be >= 1, got 0"),
     ("--max-context", "0", "--max-context must be >= 1, got 0"),
     ("--max-tree", "0", "--max-tree must be >= 1, got 0"),
     ("--idle-timeout", "0", "--idle-timeout must be > 0 seconds, got 0"),
     ("--evict-after", "-5", "--evict-after must be >= 0 seconds, or -1 to refuse new sessions; got -5"),
     ("--evict-after", "nan", "--evict-after must be >= 0 seconds, or -1 to refuse new sessions; got nan"),
     ("--metrics-port", "99999", "--metrics-port: the port must be in [0, 65535], got 99999"),  # was a traceback
     # llama.cpp's flags on a torch node were ignored (--kv-cache-tokens alone was refused, after loading)
     ("--n-gpu-layers", "5", "--n-gpu-layers is for the llama.cpp backend; this node runs no-such-model on torch"),
     ("--kv-type", "f32", "--kv-type is for the llama.cpp backend")],
)  # fmt: skip
def test_bad_node_limits_are_refused_before_the_node_listens(flag, value, needle):
    out = run("target", "--model", "no-such-model", "--listen", "127.0.0.1:0", flag, value, check=False)
    assert out.returncode == 2 and needle in out.stderr, out.stderr[-2000:]
    assert "listening" not in out.stdout + out.stderr


@pytest.mark.parametrize(
    "args, needle",
    [(["generate", "--target", "127.0.0.1:9", "--prompt", "x", "--step-timeout", "0"], "--step-timeout: must be a number of seconds > 0"),
     (["generate", "--target", "127.0.0.1:9", "--prompt", "x", "--draft-retry", "-1"], "--draft-retry: must be a number >= 0"),
     (["serve", "--target", "127.0.0.1:9", "--default-max-tokens", "0"], "--default-max-tokens: must be >= 1, got 0"),
     (["status", "--target", "127.0.0.1:9", "--pings", "0"], "--pings: must be >= 1, got 0"),
     (["status", "--target", "127.0.0.1:9", "--timeout", "-1"], "--timeout: must be a number of seconds > 0"),
     (["status", "--target", "127.0.0.1:99999"], "--target must be HOST:PORT with a port in [1, 65535]"),
     (["certs", "--out", "/nonexistent/x", "--hosts", "127.0.0.1", "--days", "99999999"], "--days must be in [1, 36500]"),
     (["serve", "--target", "127.0.0.1:9", "--served-model-name", " "], "--served-model-name must not be empty"),
     (["generate", "--target", "127.0.0.1:9", "--draft", "localhost", "--prompt", "x"], "--draft must be HOST:PORT"),
     (["generate", "--target", "127.0.0.1:9", "--draft", "127.0.0.1:9", "--prompt", "x", "--budget", "0"],
      "--budget must be in [1, 8192], got 0"),
     (["generate", "--target", "127.0.0.1:9", "--draft", "127.0.0.1:9", "--prompt", "x", "--max-depth", "0"],
      "--max-depth must be in [1, 128], got 0"),
     # model flags given with nodes were ignored, and --target ignored beside --target-model
     (["generate", "--target", "127.0.0.1:9", "--draft", "127.0.0.1:9", "--prompt", "x", "--dtype", "bfloat16",
       "--draft-quantize", "int8", "--n-gpu-layers", "5", "--no-repack"],
      "--dtype, --n-gpu-layers, --no-repack, --draft-quantize apply only to models run in this process"),
     (["chat", "--target", "127.0.0.1:9", "--draft-model", "d"], "--draft-model applies only to models run in"),
     (["generate", "--target", "127.0.0.1:9", "--target-model", "t", "--prompt", "x", "--mode", "autoregressive"],
      "give --target HOST:PORT (a node) or --target-model (in this process), not both")],
)  # fmt: skip
def test_bad_client_numbers_are_refused_by_their_flag(args, needle):
    out = run(*args, check=False)
    assert out.returncode == 2 and needle in out.stderr, out.stderr[-2000:]


def test_local_refuses_a_port_another_process_holds(model_dirs):
    """Else its client would find that process's node serving there and generate through it."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = run("local", "--draft-model", str(model_dirs["truncated"]), "--target-model", str(model_dirs["target"]),
                  "--target-port", str(port), "--draft-port", str(free_port()), "--prompt", "x", check=False)  # fmt: skip
    assert out.returncode == 2 and f"--target-port {port}: 127.0.0.1:{port} is in use" in out.stderr, out.stderr
    assert "nodes ready" not in out.stderr


def test_local_names_the_node_that_fails_to_start(tmp_path, model_dirs):
    """The nodes load at once: one that exits is named as it exits, not after the other has loaded
    (a cold start: minutes)."""
    out = run("local", "--draft-model", str(tmp_path / "missing"), "--target-model", str(model_dirs["target"]),
              "--target-port", str(free_port()), "--draft-port", str(free_port()), "--prompt", "x", check=False)  # fmt: skip
    assert out.returncode == 2 and "the draft node exited while starting (code 2; its error is above)" in out.stderr
    assert "--model: model path" in out.stderr and "missing does not exist" in out.stderr, out.stderr
    assert "nodes ready" not in out.stderr, out.stderr


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.parametrize("ending", ["sigterm", "a node dies", "local is killed"])
def test_local_stops_its_nodes_on_sigterm_and_says_when_one_dies(model_dirs, ending):
    import signal
    import threading
    import time

    ports = [free_port(), free_port()]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([*SPECEXEC, "local", "--draft-model", str(model_dirs["truncated"]), "--target-model",
                             str(model_dirs["target"]), "--target-port", str(ports[0]), "--draft-port", str(ports[1]),
                             "--budget", "4"], env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)  # fmt: skip
    lines: list[str] = []
    ready = threading.Event()

    def read_stderr() -> None:
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("nodes ready"):
                ready.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        # local's own "nodes ready", not the ports: a node killed while local still waits on it
        # is "a node exited while starting", a different ending.
        assert ready.wait(timeout=180), "".join(lines)
        nodes = children(proc.pid)
        assert len(nodes) == 2
        if ending == "sigterm":
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0  # a requested stop, as for the servers
        elif ending == "local is killed":  # no finally runs: the nodes stop by their parent-death signal
            proc.kill()
            proc.wait(timeout=60)
        else:
            os.kill(nodes[1], signal.SIGKILL)
            assert proc.wait(timeout=60) == 1
            reader.join(timeout=30)
            assert "node exited (killed by SIGKILL); stopping the other" in "".join(lines)
        deadline = time.monotonic() + 30
        while any(_running(pid) for pid in nodes) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_running(pid) for pid in nodes), "a node outlived local"
    finally:
        proc.kill()
        proc.wait()


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_local_prints_client_commands_that_reach_its_secured_nodes():
    """With TLS and a token, the commands it printed for another client had neither, and failed."""
    from client.cli.commands import build_parser
    from client.cli.local import client_security_args

    base = ["local", "--draft-model", "d", "--target-model", "t"]
    assert client_security_args(build_parser().parse_args(base)) == []
    args = build_parser().parse_args([*base, "--tls-cert", "s.pem", "--tls-key", "s-key.pem", "--node-tls-ca", "ca.pem",
                                      "--auth-token-file", "tok"])  # fmt: skip
    assert client_security_args(args) == ["--node-tls-ca", "ca.pem", "--node-auth-token-file", "tok"]


def test_models_list_takes_names_and_a_format_and_refuses_what_it_cannot_use(tmp_path, monkeypatch, capsys):
    """`models list nosuch` and `--format gguf` printed the whole list; `models` alone said that
    `names`, which is optional, was required; a name after `--format gguf` was refused."""
    from client.cli.main import main

    monkeypatch.setenv("SPECEXEC_HOME", str(tmp_path))
    capsys.readouterr()
    assert main(["models", "list", "qwen2.5-coder-0.5b"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("qwen2.5-coder-0.5b") and "not installed" in lines[0]
    assert main(["models", "list", "--format", "gguf"]) == 0 and capsys.readouterr().out == ""
    assert main(["models", "list", "nosuch"]) == 2
    assert "unknown model 'nosuch'; known: qwen2.5-coder-0.5b" in capsys.readouterr().err
    assert main(["models", "list", "--force"]) == 2
    assert main(["models", "list", "--format", "gguf", "qwen2.5-coder-0.5b"]) == 0  # the name after an option
    assert capsys.readouterr().out == ""
    assert main(["models", "list", "--format", "gguf", "nosuch"]) == 2
    assert "unknown model 'nosuch'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["models", "list", "qwen2.5-coder-0.5b", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["models"])
    assert "models needs an action: install or list" in capsys.readouterr().err


def test_generate_follows_a_json_schema_regex_or_grammar_file(model_dirs, tmp_path):
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}  # fmt: skip
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    (tmp_path / "g.gbnf").write_text('root ::= "<" [a-c]{2} ">"')
    common = [*pair_args(model_dirs), "--prompt", "Hello, ", "--budget", "8", "--max-new-tokens", "40", "--json"]
    for flags, pattern in ((["--json-schema", f"@{tmp_path / 'schema.json'}"], r'\{"a":(true|false)\}'),
                           (["--regex", "[xy]{3}!"], r"[xy]{3}!"),
                           (["--grammar-file", str(tmp_path / "g.gbnf")], r"<[a-c]{2}>")):  # fmt: skip
        result = json.loads(run("generate", *common, *flags).stdout)
        assert result["finish_reason"] == "stop" and re.fullmatch(pattern, result["text"]), (flags, result)
    bad = run("generate", *common, "--regex", "[a-", check=False)
    assert bad.returncode != 0 and "--regex: grammar (regex) is invalid" in bad.stderr and "Traceback" not in bad.stderr
    both = run("generate", *common, "--regex", "a", "--json-schema", "{}", check=False)
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


def test_a_grammar_file_that_cannot_be_read_is_named_by_its_flag(tmp_path):
    """It read "None: [Errno 2] ...": the file was read before the flag was known."""
    from client.cli.args import grammar_from

    for path in (tmp_path / "missing.gbnf", tmp_path):
        with pytest.raises(ValueError, match=r"^--grammar-file: \[Errno"):
            grammar_from(argparse.Namespace(json_schema=None, regex=None, grammar_file=path))


@pytest.mark.parametrize("flags, needle", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),  # was found after loading both models
    (["--budget", "5"], "--budget 5: profile shows what --budget auto picks"),  # was ignored
    (["--mode", "autoregressive"], "profile needs --mode specexec and a draft"),
])  # fmt: skip
def test_profile_refuses_bad_flags_before_reaching_a_node(flags, needle, capsys):
    from client.cli.main import main

    assert main(["profile", "--target", "127.0.0.1:9", "--draft", "127.0.0.1:9", *flags]) == 2
    err = capsys.readouterr().err
    assert needle in err and "unavailable" not in err


def test_perplexity_names_a_file_it_cannot_read(tmp_path, capsys):
    from client.cli.main import main

    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe")
    for path, needle in ((tmp_path / "missing.txt", "No such file"), (tmp_path, "Is a directory"),
                         (tmp_path / "bin.txt", "is not UTF-8 text")):  # fmt: skip
        assert main(["perplexity", "--file", str(path), "--target", "127.0.0.1:9"]) == 2
        assert f"--file {path}" in (err := capsys.readouterr().err) and needle in err, err


def test_perplexity_refuses_a_draft_it_would_ignore(capsys, monkeypatch):
    from client.cli.main import main

    with pytest.raises(SystemExit):
        main(["perplexity", "--file", "t.txt", "--target", "127.0.0.1:9", "--draft", "127.0.0.1:8"])
    assert "--draft: perplexity scores the text with the target alone" in capsys.readouterr().err
    monkeypatch.setenv("SPECEXEC_DRAFT", "127.0.0.1:8")  # set for the other commands: not refused
    assert main(["perplexity", "--file", "/nonexistent", "--target", "127.0.0.1:9"]) == 2
    assert "--file /nonexistent: No such file" in capsys.readouterr().err


def test_local_checks_its_sampling_flags_without_a_prompt(capsys):
    """Without --prompt it serves; a bad flag was taken silently and the nodes started."""
    from client.cli.main import main

    assert main(["local", "--target-model", "x", "--draft-model", "y", "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens must be >= 1, got 0" in capsys.readouterr().err


def test_generate_takes_penalties_and_names_a_bad_one_by_its_flag(model_dirs, loaded):
    from common.decoding.penalties import Penalties
    from tests.test_penalties import reference

    common = [*pair_args(model_dirs), "--prompt", "Hello, ", "--budget", "8", "--max-new-tokens", "12", "--ignore-eos",
              "--json"]  # fmt: skip
    result = json.loads(run("generate", *common, "--presence-penalty", "1.5", "--repetition-penalty", "1.3").stdout)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ids = loaded["target"].tokenizer.encode("Hello, ")
    expected = reference(model_dirs["target"], Penalties(presence=1.5, repetition=1.3), params, prompt=ids)
    assert result["token_ids"] == expected
    windowed = [*common, "--repetition-penalty", "1.8", "--repetition-window", "3", "--temperature", "1.4", "--min-p", "0.3",
                "--typical-p", "0.9", "--top-n-sigma", "3", "--xtc-probability", "0.5", "--xtc-threshold", "0.05"]  # fmt: skip
    result = json.loads(run("generate", *windowed).stdout)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=1.4, min_p=0.3, typical_p=0.9, top_n_sigma=3.0,
                            xtc_probability=0.5, xtc_threshold=0.05)  # fmt: skip
    assert result["token_ids"] == reference(model_dirs["target"], Penalties(repetition=1.8, repetition_window=3),
                                            params, prompt=ids)  # fmt: skip
    unfiltered = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=1.4, min_p=0.3)
    assert result["token_ids"] != reference(model_dirs["target"], Penalties(repetition=1.8, repetition_window=3),
                                            unfiltered, prompt=ids)  # the llama.cpp filters count  # fmt: skip
    from client.dry import breaker_sequences
    from common.decoding.penalties import Dry

    tok = loaded["target"].tokenizer
    dry = [*common, "--dry-multiplier", "3", "--dry-allowed-length", "0", "--dry-sequence-breaker", "\\n",
           "--dry-sequence-breaker", "o"]  # fmt: skip
    result = json.loads(run("generate", *dry).stdout)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    expected = reference(model_dirs["target"], Penalties(dry=Dry(3.0, 1.75, 0, 0, breaker_sequences(tok, ("\n", "o")))),
                         params, prompt=ids)  # fmt: skip
    assert result["token_ids"] == expected
    assert expected != reference(model_dirs["target"], Penalties(), params, prompt=ids)  # DRY moved the text
    from argparse import Namespace

    from client.cli.args import dry_from

    flags = dict(dry_multiplier=1.0, dry_base=1.75, dry_allowed_length=2, dry_penalty_last_n=-1)
    cleared = dry_from(Namespace(**flags, dry_sequence_breaker=["a", "none", "\\n"]), tok)  # "none" drops those before it
    assert cleared.breakers == breaker_sequences(tok, ("\n",))
    assert dry_from(Namespace(**flags, dry_sequence_breaker=["none"]), tok).breakers == ()
    for flags, message in ((["--repetition-penalty", "0"], "--repetition-penalty must be in (0, 10]"),
                           (["--dry-multiplier", "1", "--dry-base", "0.5"], "--dry-base must be a number in [1, 100]"),
                           (["--dry-multiplier", "1", "--dry-penalty-last-n", "-2"], "--dry-penalty-last-n must be -1"),
                           (["--dry-multiplier", "1", "--dry-sequence-breaker", "x" * 41],
                            "--dry-sequence-breaker takes at most 16 strings of 1 to 40 characters"),
                           (["--min-p", "2"], "--min-p must be in [0, 1]"),
                           (["--typical-p", "0"], "--typical-p must be in (0, 1]"),
                           (["--xtc-threshold", "-1"], "--xtc-threshold must be in [0, 1]"),
                           (["--repetition-window", "-1"], "--repetition-window must be a whole number >= 0"),
                           (["--min-tokens", "-1"], "--min-tokens must be a whole number >= 0")):  # fmt: skip
        bad = run("generate", *common, *flags, check=False)
        assert bad.returncode != 0 and message in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
