"""The draft is optional at every moment: down at start, dying mid-generation, coming back, or coming
back as a model the target cannot use. The target alone goes on meanwhile, and the output is the
target alone's throughout. Real node processes on loopback; the draft's is started and killed at will."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from client.api import Chat, SpecExec, collect
from client.generation import GenerationStats, Recovery
from client.remote import connect, open_channel
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeParams
from common.decoding.types import TokenizerMismatch
from common.pb.specexec.v1 import specexec_pb2 as pb
from common.pb.specexec.v1 import specexec_pb2_grpc as pb_grpc
from tests.helpers import Proc, free_port, reference_decode
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [72, 101, 108, 108, 111, 44, 32]
GREEDY = SamplingParams(max_new_tokens=100, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=21, max_new_tokens=100, ignore_eos=True)
SHORT = SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_new_tokens=12, ignore_eos=True)
DOWN = "generating with the target alone until it comes up"


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Iterator[dict[str, str]]:
    """Tokenizers and forward-time curves are cached under SPECEXEC_HOME: keep them out of $HOME."""
    home = str(tmp_path_factory.mktemp("specexec_home"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECEXEC_HOME", home)
        yield {**os.environ, "PYTHONPATH": str(ROOT), "SPECEXEC_HOME": home}


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("node_logs")


def node_args(module: str, model: Path, address: str) -> list[str]:
    """Profiled (forward-time curves, for --budget auto): cached on disk after the first start."""
    return ["-m", module, "--model", str(model), "--listen", address, "--max-tree", "32"]


@pytest.fixture(scope="module")
def target(model_dirs, env, logs) -> Iterator[str]:
    address = f"127.0.0.1:{free_port()}"
    proc = Proc("target", node_args("target_node", model_dirs["target"], address), env, logs)
    try:
        proc.wait_serving(address)
        yield address
    finally:
        proc.stop()


class DraftNode:
    """A draft node's address, and the node behind it, started and killed while a client uses it."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env, self.logs = env, logs
        self.address = f"127.0.0.1:{free_port()}"
        self.proc: Proc | None = None
        self.starts = 0

    def start(self, model: Path, *extra: str) -> None:
        self.starts += 1
        args = [*node_args("draft_node", model, self.address), *extra]
        self.proc = Proc(f"draft-{self.address.rsplit(':')[-1]}-{self.starts}", args, self.env, self.logs)
        self.proc.wait_serving(self.address)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.popen.kill()
            self.proc.finish()
            self.proc = None


@pytest.fixture
def draft(env, logs) -> Iterator[DraftNode]:
    node = DraftNode(env, logs)
    yield node
    node.kill()


@pytest.fixture(scope="module")
def odd_model(tmp_path_factory) -> Path:
    """Same byte-level vocabulary plus one added token: another tokenizer fingerprint."""
    from transformers import AutoTokenizer

    path = make_tiny_model(tmp_path_factory.mktemp("odd") / "odd-tokenizer", vocab_size=300)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def narrow_model(tmp_path_factory, odd_model) -> Path:
    """The odd tokenizer on a model of 100 ids: the prompt's own ids are past its vocabulary."""
    import shutil

    path = make_tiny_model(tmp_path_factory.mktemp("narrow") / "narrow-vocabulary", vocab_size=100)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json"):
        if (odd_model / name).exists():
            shutil.copy(odd_model / name, path / name)
    return path


def recovery(notices: list[str]) -> Recovery:
    return Recovery(draft_retry_seconds=0.2, notify=notices.append)


def with_events(gen: SpecExec, params: SamplingParams, events: list[tuple[Callable[[int], bool], Callable[[], None]]]):
    """Generate, running each event's action, in order, once its condition holds for a chunk's index
    (between two chunks: a run on the target alone streams several)."""

    def chunks():
        for i, chunk in enumerate(gen.stream(PROMPT, params)):
            if events and events[0][0](i):
                events.pop(0)[1]()
            yield chunk

    return collect(chunks())


def kinds(notices: list[str]) -> list[str]:
    """Each notice by what it says happened to the draft."""
    signs = {DOWN: "down", "speculative decoding starts": "up", "continuing with the target alone": "lost",
             "speculative decoding resumes": "back", "refused": "refused"}  # fmt: skip
    return [next((kind for sign, kind in signs.items() if sign in n), n) for n in notices]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_down_at_start_then_up_then_dead_then_back_is_the_target_alone(target, draft, model_dirs, params):
    notices: list[str] = []
    gen = connect(draft.address, target, tree=TreeParams(budget=16), recovery=recovery(notices))
    assert kinds(notices) == ["down"] and draft.address in notices[0]
    events = [  # each after the chunk of the step the last one showed in: trees, then none, then trees
        (lambda i: i == 1, lambda: draft.start(model_dirs["truncated"])),
        (lambda i: kinds(notices)[-1] == "up", draft.kill),
        (lambda i: kinds(notices)[-1] == "lost", lambda: draft.start(model_dirs["truncated"])),
    ]
    out = with_events(gen, params, events)
    assert not events, "the generation ended before the draft came, went and came back"
    assert out.token_ids == reference_decode(model_dirs["target"], PROMPT, params)
    assert kinds(notices) == ["down", "up", "lost", "back"]
    assert out.stats.draft_failures == 1 and len(out.stats.budgets) >= 2


def test_a_draft_started_after_the_generator_speculates(target, draft, model_dirs):
    notices: list[str] = []
    gen = connect(draft.address, target, tree=TreeParams(budget=16), recovery=recovery(notices))
    alone = gen.generate(PROMPT, SEEDED)
    assert not alone.stats.budgets and alone.stats.tokens_per_step == 1
    draft.start(model_dirs["truncated"])
    time.sleep(0.2)  # the retry period: the next step may probe the draft
    out = gen.generate(PROMPT, SEEDED)
    assert out.token_ids == alone.token_ids == reference_decode(model_dirs["target"], PROMPT, SEEDED)
    assert out.stats.budgets and sum(out.stats.accepted_per_step) > 0
    assert out.stats.target_steps < alone.stats.target_steps
    assert kinds(notices) == ["down", "up"]


def test_auto_budget_plans_once_a_late_draft_brings_its_curve(target, draft, model_dirs):
    notices: list[str] = []
    tree = TreeParams(budget=16)
    gen = connect(draft.address, target, tree=tree, auto_budget=True, recovery=recovery(notices))
    assert gen.planner is None
    alone = gen.generate(PROMPT, SHORT)
    assert alone.token_ids == reference_decode(model_dirs["target"], PROMPT, SHORT)
    draft.start(model_dirs["truncated"])
    time.sleep(0.2)
    out = gen.generate(PROMPT, SEEDED)
    assert gen.planner is not None and gen.planner.draft_curve
    assert out.token_ids == reference_decode(model_dirs["target"], PROMPT, SEEDED)
    assert out.stats.budgets and max(out.stats.budgets) <= tree.budget
    assert kinds(notices) == ["down", "up"]


@pytest.mark.parametrize("extra", [1, 40], ids=["in line", "caught up in the background"])
def test_a_draft_with_no_session_free_leaves_a_generation_on_the_target_alone(target, draft, model_dirs, extra):
    """The draft is up but at its --max-sessions (another generation holds its one session): a new
    generation runs on the target alone, exactly, with one notice, and the draft stays up for the
    one that holds it; once that closes, the next generation drafts. A prompt of 32 tokens or more
    opens its draft session in the background (`Sequence._open_apart`): refused there too."""
    draft.start(model_dirs["truncated"], "--max-sessions", "1")
    notices: list[str] = []
    gen = connect(draft.address, target, tree=TreeParams(budget=8), recovery=recovery(notices))
    holder = gen.sequence([80, 81, 82, 83])
    steps = holder.steps(SHORT, gen.tree, GenerationStats())
    next(steps)
    assert holder.draft_session
    prompt = [*PROMPT, *range(90, 90 + extra)]
    out = gen.generate(prompt, SHORT)
    assert out.token_ids == reference_decode(model_dirs["target"], prompt, SHORT)
    assert not out.stats.budgets and [n for n in notices if "no session free" in n] == notices[-1:]
    assert next(steps).tokens  # the holder still drafts
    steps.close()
    holder.close()
    again = gen.generate(prompt, SHORT)
    assert again.token_ids == out.token_ids and again.stats.budgets


def test_a_mismatched_draft_is_refused_at_connect(target, draft, odd_model):
    draft.start(odd_model)
    with pytest.raises(TokenizerMismatch, match="odd-tokenizer"):
        connect(draft.address, target, tree=TreeParams(budget=16))


def test_a_mismatched_draft_that_comes_up_later_is_refused_and_never_used(
    target, draft, model_dirs, odd_model
):
    notices: list[str] = []
    gen = connect(draft.address, target, tree=TreeParams(budget=16), recovery=recovery(notices))
    out = with_events(gen, SHORT, [(lambda i: i == 1, lambda: draft.start(odd_model))])
    again = gen.generate(PROMPT, SHORT)  # probes again: refused, and not said twice
    reference = reference_decode(model_dirs["target"], PROMPT, SHORT)
    assert out.token_ids == again.token_ids == reference
    assert not out.stats.budgets and not again.stats.budgets and gen.planner is None
    assert kinds(notices) == ["down", "refused"]
    assert "odd-tokenizer" in notices[1] and draft.address in notices[1]
    from client.openai.app import Service

    assert Service(gen, "m").draft_state() == "refused"  # /health: up, but not used


@pytest.mark.parametrize("other", ["odd_model", "narrow_model"])
def test_a_draft_restarted_as_another_model_unseen_is_caught_at_the_next_session(
    target, draft, model_dirs, other, request
):
    """The draft restarts between two requests, too fast for the link to see it down. Another
    tokenizer must never propose a token: the next session says the model changed (a prompt the new
    model cannot even read included), the target alone answers, and the next probe refuses it."""
    notices: list[str] = []
    draft.start(model_dirs["truncated"])
    gen = connect(draft.address, target, tree=TreeParams(budget=16), recovery=recovery(notices))
    assert gen.generate(PROMPT, SHORT).stats.budgets
    draft.kill()
    draft.start(request.getfixturevalue(other))
    assert gen.link is not None
    gen.link.draft.info()  # another sequence's check (a lost session) may see the new model first
    out = gen.generate(PROMPT, SHORT)
    time.sleep(0.3)  # past the retry period: the next request probes it
    again = gen.generate(PROMPT, SHORT)
    assert out.token_ids == again.token_ids == reference_decode(model_dirs["target"], PROMPT, SHORT)
    assert not out.stats.budgets and not again.stats.budgets
    assert kinds(notices) == ["lost", "refused"]
    assert f"draft node at {draft.address} now serves" in notices[0] and "not 'truncated'" in notices[0]
    assert "do not share a tokenizer" in notices[1]


def test_a_draft_that_never_answers_costs_one_bounded_probe(target, model_dirs):
    """A listener that accepts connections and never speaks gRPC: a blackholed host, as far as the
    client can tell. The probe's deadline bounds it; the retry period spaces the next."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        notices: list[str] = []
        slow = Recovery(draft_retry_seconds=3600, notify=notices.append)
        gen = connect(address, target, tree=TreeParams(budget=16), recovery=slow)
        out = gen.generate(PROMPT, SHORT)
    assert out.token_ids == reference_decode(model_dirs["target"], PROMPT, SHORT)
    assert kinds(notices) == ["down"] and "DEADLINE_EXCEEDED" in notices[0]


def test_chat_with_the_draft_down(target, draft, model_dirs):
    notices: list[str] = []
    gen = connect(draft.address, target, tree=TreeParams(budget=16), recovery=recovery(notices))
    chat = Chat(gen)
    try:
        first = "".join(c.text for c in chat.send("Hello there", max_new_tokens=8, ignore_eos=True))
        draft.start(model_dirs["truncated"])
        time.sleep(0.2)
        last = list(chat.send("And then?", max_new_tokens=8, ignore_eos=True))
    finally:
        chat.close()
    assert first and last[-1].finish_reason == "length"
    assert kinds(notices) == ["down", "up"]


# ------------------------------------------------------------------------------------------------
# The commands: `specexec generate` and `specexec serve` with the draft down


def specexec(env: dict[str, str], *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "client.cli.main", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        input=stdin,
    )


def test_generate_with_the_draft_down_prints_the_target_alone_and_one_warning(
    target, draft, env, loaded, model_dirs
):
    out = specexec(env, "generate", "--target", target, "--draft", draft.address, "--prompt", "Hello, ",
                   "--max-new-tokens", "12", "--temperature", "0.9", "--seed", "42", "--ignore-eos",
                   "--budget", "8", "--json")  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    ids = loaded["target"].tokenizer.encode("Hello, ")
    params = SamplingParams(temperature=0.9, seed=42, max_new_tokens=12, ignore_eos=True)
    assert result["token_ids"] == reference_decode(model_dirs["target"], ids, params)
    assert result["stats"]["tokens_per_step"] == 1
    warnings = out.stderr.strip().splitlines()
    assert len(warnings) == 1 and draft.address in warnings[0] and DOWN in warnings[0], out.stderr


def test_chat_command_with_the_draft_down(target, draft, env):
    out = specexec(env, "chat", "--target", target, "--draft", draft.address, "--max-new-tokens", "6",
                   "--ignore-eos", stdin="Hello\n\n")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stderr.count(DOWN) == 1 and "tokens/step" in out.stderr


def test_generate_waits_for_a_target_started_after_it(env, logs, loaded, model_dirs):
    """Three commands started together (a script, tmux): the client comes up before the target has
    loaded. Without --wait-for-target it fails at once, saying the option exists; with it, it waits."""
    address = f"127.0.0.1:{free_port()}"
    args = ["generate", "--target", address, "--mode", "autoregressive", "--prompt", "Hello, ", "--max-new-tokens", "6",
            "--json"]
    refused = specexec(env, *args)
    assert refused.returncode == 2 and "--wait-for-target SECONDS waits for it" in refused.stderr
    client = subprocess.Popen([sys.executable, "-m", "client.cli.main", *args, "--wait-for-target", "120"],
                              env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    time.sleep(1)
    node = Proc("late-target", node_args("target_node", model_dirs["target"], address), env, logs)
    try:
        out, err = client.communicate(timeout=120)
    finally:
        node.stop()
    assert client.returncode == 0, err
    assert f"waiting up to 120 s for the target node at {address}" in err
    ids = loaded["target"].tokenizer.encode("Hello, ")
    assert json.loads(out)["token_ids"] == reference_decode(model_dirs["target"], ids, SamplingParams(max_new_tokens=6))


def gateway_generate(address: str, params: SamplingParams) -> tuple[list[int], pb.GenerateFinal]:
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=PROMPT),
        sampling=pb.SamplingParams(
            temperature=params.temperature,
            top_p=params.top_p,
            seed=params.seed,
            max_new_tokens=params.max_new_tokens,
            ignore_eos=params.ignore_eos,
        ),
    )
    with open_channel(address) as channel:
        responses = list(pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=60))
    ids = [t for r in responses[:-1] for t in r.chunk.token_ids]
    return ids, responses[-1].final


def gateway_draft(address: str) -> str:
    with open_channel(address) as channel:
        info = pb_grpc.GenerationServiceStub(channel).Info(pb.InfoRequest(), timeout=10)
    return info.draft.role


def test_serve_starts_with_the_draft_down_and_speculates_once_it_is_up(target, draft, env, logs, model_dirs):
    address = f"127.0.0.1:{free_port()}"
    args = ["-m", "client.cli.main", "serve", "--target", target, "--draft", draft.address,
            "--listen", address, "--budget", "16", "--draft-retry", "0.2"]  # fmt: skip
    gateway = Proc("gateway", args, env, logs)
    reference = reference_decode(model_dirs["target"], PROMPT, SHORT)
    try:
        gateway.wait_serving(address)
        ids, final = gateway_generate(address, SHORT)
        assert ids == reference and final.stats.tokens_per_step == 1
        assert gateway_draft(address) == ""
        draft.start(model_dirs["truncated"])
        time.sleep(0.2)
        # Within a few requests: a probe that times out on a loaded machine waits out another retry period.
        deadline = time.monotonic() + 30
        while True:
            ids, final = gateway_generate(address, SHORT)
            assert ids == reference
            if gateway_draft(address) == "draft" or time.monotonic() > deadline:
                break
        assert gateway_draft(address) == "draft"
        assert gateway.alive()
    finally:
        gateway.stop()
    output = gateway.output()
    assert output.count(DOWN) == 1 and "speculative decoding starts" in output, output
