"""llama.cpp's own server API (`client.openai.llama_server`): `/completion`, `/infill` and `/props`
on the OpenAI server. Each answer's text is the Python API's under llama.cpp's defaults and fields,
in llama.cpp's shape; the code-completion stops (`n_indent`, `t_max_predict_ms`) cut as its do."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from client.api import Chunk
from client.infill import FimFormat
from client.openai.llama_server import Asked, LlamaAnswer
from client.openai.protocol import CompletionRequest, Job
from common.decoding.penalties import Penalties
from common.decoding.sampling import SamplingParams
from tests.test_infill import AFTER, BEFORE

LLAMA_DEFAULTS = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)


def post(server, path: str, body: dict, raw: bool = False) -> tuple[int, object]:
    request = urllib.request.Request(server.url.removesuffix("/v1") + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            text = answer.read().decode()
            return answer.status, text if raw else json.loads(text)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read().decode())


def events(text: str) -> list[dict]:
    return [json.loads(line.removeprefix("data: ")) for line in text.split("\n\n") if line.startswith("data: ")]


def test_completion_is_the_python_apis_text_under_llama_cpps_defaults(coder_server, coder):
    status, out = post(coder_server, "/completion", {"prompt": "def f(x):", "n_predict": 12, "seed": 3, "return_tokens": True})
    expected = coder.generate("def f(x):", SamplingParams(**LLAMA_DEFAULTS, seed=3, max_new_tokens=12))
    assert status == 200 and out["content"] == expected.text and out["tokens"] == expected.token_ids
    n = len(expected.token_ids)
    assert out["stop"] and out["stop_type"] == {"length": "limit", "stop": "eos"}[expected.finish_reason]
    assert out["tokens_predicted"] == n == out["timings"]["predicted_n"]
    assert out["tokens_evaluated"] == len(coder.tokenizer.encode("def f(x):"))
    assert out["generation_settings"]["top_p"] == 0.95 and out["prompt"] == "def f(x):"
    status, text = post(coder_server, "/completion", {"prompt": "def f(x):", "n_predict": 12, "seed": 3, "stream": True}, raw=True)
    streamed = events(text)
    assert "".join(e["content"] for e in streamed) == expected.text
    assert [e["stop"] for e in streamed] == [False] * (len(streamed) - 1) + [True]
    assert [t for e in streamed[:-1] for t in e["tokens"]] == expected.token_ids


def test_fields_map_to_the_same_sampling(coder_server, coder):
    tok = coder.tokenizer
    ids = tok.encode("def f(x):")
    body = {"prompt": [*ids[:3], "f(x):"], "n_predict": 10, "seed": 5, "temperature": 1.1, "top_k": 0, "top_p": 1.0,
            "min_p": 0.1, "typical_p": 0.9, "repeat_penalty": 1.3, "repeat_last_n": 8, "presence_penalty": 0.2,
            "logit_bias": [[70, 2.0], ["A", -1.5]], "cache_prompt": True, "id_slot": -1}  # fmt: skip
    status, out = post(coder_server, "/completion", body)
    bias = ((70, 2.0), (tok.convert_tokens_to_ids("A"), -1.5))
    params = SamplingParams(temperature=1.1, seed=5, max_new_tokens=10, min_p=0.1, typical_p=0.9,
                            penalties=Penalties(presence=0.2, repetition=1.3, repetition_window=8, logit_bias=bias))  # fmt: skip
    assert status == 200 and out["content"] == coder.generate(ids[:3] + tok.encode("f(x):", add_special_tokens=False), params).text
    only_top_k = post(coder_server, "/completion", {"prompt": "def f(x):", "n_predict": 10, "seed": 5, "samplers": ["top_k"]})[1]
    assert only_top_k["content"] == coder.generate("def f(x):", SamplingParams(temperature=1.0, top_k=40, seed=5,
                                                                               max_new_tokens=10)).text  # fmt: skip
    letters = post(coder_server, "/completion", {"prompt": "def f(x):", "n_predict": 10, "seed": 5, "samplers": "k"})[1]
    assert letters["content"] == only_top_k["content"]


def test_stop_types_say_why_the_text_ended(coder_server, coder):
    full = coder.generate("def f(x):", SamplingParams(max_new_tokens=20, ignore_eos=True)).text
    stop = next(c for c in full[2:] if c.isascii() and c.isalnum())
    out = post(coder_server, "/completion", {"prompt": "def f(x):", "n_predict": 20, "temperature": 0, "stop": [stop]})[1]
    assert out["stop_type"] == "word" and out["stopping_word"] == stop and out["content"] == full[: full.index(stop)]
    eos = coder.tokenizer.eos_token_id
    out = post(coder_server, "/completion", {"prompt": "def f(x):", "n_predict": 20, "temperature": 0, "logit_bias": [[eos, 100]]})[1]
    assert out["stop_type"] == "eos" and out["content"] == "" and out["tokens_predicted"] == 1
    first = coder.generate("def f(x):", SamplingParams(max_new_tokens=1, ignore_eos=True)).token_ids[0]
    banned = post(coder_server, "/completion", {"prompt": "def f(x):", "n_predict": 1, "temperature": 0,
                                          "logit_bias": [[first, False]], "return_tokens": True})[1]  # fmt: skip
    assert banned["tokens"] != [first]


def test_n_probs_are_the_targets_log_probs(coder_server, coder):
    out = post(coder_server, "/completion", {"prompt": "def f(x):", "n_predict": 6, "temperature": 0, "n_probs": 3})[1]
    expected = coder.generate("def f(x):", SamplingParams(max_new_tokens=6, logprobs=3, temperature=0.0))
    probs = out["completion_probabilities"]
    assert [p["id"] for p in probs] == expected.token_ids
    assert [p["logprob"] for p in probs] == pytest.approx([lp.logprob for lp in expected.logprobs])
    assert [[t["id"] for t in p["top_logprobs"]] for p in probs] == [[i for i, _ in lp.top] for lp in expected.logprobs]


def test_infill_is_the_fill_in_the_middle_prompts_text(coder_server, coder):
    body = {"input_prefix": BEFORE, "input_suffix": AFTER, "input_extra": [{"filename": "util.py", "text": "X = 1\n"}],
            "prompt": "re", "n_predict": 16, "seed": 2}  # fmt: skip
    status, out = post(coder_server, "/infill", body)
    fim = FimFormat.of(coder.tokenizer)
    ids = fim.prompt(coder.tokenizer, BEFORE, AFTER, [("util.py", "X = 1\n")], middle="re", limit=512 - 16)
    expected = coder.generate(ids, SamplingParams(**LLAMA_DEFAULTS, seed=2, max_new_tokens=16, stop_token_ids=fim.ends))
    assert status == 200 and out["content"] == expected.text and out["tokens_evaluated"] == len(ids)
    # llama.vscode's request: its samplers, time limits and fields
    vscode = {"input_prefix": BEFORE, "input_suffix": AFTER, "input_extra": [], "prompt": "", "n_predict": 16,
              "n_indent": 0, "top_k": 40, "top_p": 0.99, "stream": False, "samplers": ["top_k", "top_p", "infill"],
              "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 60000,
              "response_fields": ["content", "timings/prompt_n", "timings/predicted_n", "truncated", "tokens_cached"]}  # fmt: skip
    status, out = post(coder_server, "/infill", vscode)
    assert status == 200 and set(out) == {"content", "timings/prompt_n", "timings/predicted_n", "truncated", "tokens_cached"}
    ids = fim.prompt(coder.tokenizer, BEFORE, AFTER, limit=512 - 16)
    assert out["timings/prompt_n"] == len(ids) and out["timings/predicted_n"] >= 1  # (no seed: a random text)
    warm = post(coder_server, "/infill", {**vscode, "n_predict": 0, "response_fields": ["content", "tokens_predicted", "stop_type", "timings/prompt_n"]})[1]  # llama.vscode's cache warm-up: nothing said
    assert warm == {"content": "", "tokens_predicted": 0, "stop_type": "limit", "timings/prompt_n": 0}  # no cache: none read
    status, text = post(coder_server, "/infill", {**vscode, "n_predict": 0, "stream": True, "response_fields": ["content", "stop", "tokens_predicted"]}, raw=True)
    assert status == 200 and [(e["content"], e["stop"], e["tokens_predicted"]) for e in events(text)] == [("", True, 0)]


def test_a_long_file_is_cut_to_the_context(coder_server, coder):
    before = "".join(f"x{i} = {i}\n" for i in range(400))
    status, out = post(coder_server, "/infill", {"input_prefix": before, "input_suffix": AFTER, "n_predict": 8, "seed": 1})
    assert status == 200 and out["tokens_evaluated"] == 512 - 8


def _answer(coder, **asked) -> LlamaAnswer:
    job = Job.of(CompletionRequest(prompt="x"), coder.tokenizer, 16)
    return LlamaAnswer(job, Asked(n_predict=None, **asked), "m", coder.tokenizer)


def read(reply: LlamaAnswer, text: str) -> str:
    """Feed `text` as its own tokens; the piece to send."""
    piece, kept = reply.read(Chunk(text, reply.tokenizer.encode(text)))
    assert reply.tokenizer.decode(reply.tokens).startswith(reply.text)  # the tokens kept cover the text
    assert kept == reply.tokens[len(reply.tokens) - len(kept) :]  # and the piece's are the last of them
    return piece


def test_n_indent_ends_the_text_at_a_line_indented_less(coder):
    reply = _answer(coder, n_indent=2)
    assert [read(reply, t) for t in ("a\n", "  b\n", "    c\n  ")] == ["a\n", "  b\n", "    c\n  "]
    assert reply.stopped is None
    assert read(reply, "  d\nef") == "  d\n" and reply.stopped == "limit"  # "e" has no indentation
    assert reply.text == "a\n  b\n    c\n    d\n"
    assert reply.tokenizer.decode(reply.tokens) == reply.text + "e"  # through the token that reached the cut, not "f"
    one = _answer(coder, n_indent=4)
    assert read(one, "first line\n\n  x") == "first line\n\n  " and one.stopped == "limit"


def test_t_max_predict_ms_ends_the_text_after_a_line(coder):
    reply = _answer(coder, t_max_predict_ms=5)
    read(reply, "a")
    time.sleep(0.02)
    read(reply, "b")
    assert reply.stopped is None  # past the time, but no line yet
    read(reply, "\nc")
    assert reply.stopped == "limit" and reply.stop_type("length") == ("limit", "")


def test_props_and_errors(coder_server, coder, loaded):
    with urllib.request.urlopen(coder_server.url.removesuffix("/v1") + "/props", timeout=60) as answer:
        props = json.loads(answer.read())
    assert props["default_generation_settings"]["n_ctx"] == coder.target.info().max_context
    assert props["default_generation_settings"]["params"]["top_p"] == 0.95
    for body, param, needle in (
        ({"prompt": "x", "n_predict": "5"}, "n_predict", "must be -1 (no limit)"),
        ({"prompt": ["a", "b"]}, "prompt", "several prompts"),
        ({"prompt": "x", "logit_bias": [[1]]}, "logit_bias", "pairs are [token id or text, bias or false]"),
        ({"prompt": "x", "lora": [{"id": 0, "scale": 1}]}, "lora", "not supported"),
        ({"prompt": "x", "mirostat": 2}, "mirostat", "not supported"),
        ({"prompt": "x", "n_probs": 30}, "n_probs", "'n_probs' must be between 0 and 20"),
        ({"prompt": "x", "samplers": "kq"}, "samplers", "unknown letters ['q']"),
        ({"prompt": ""}, "prompt", "'prompt' is empty"),
        ({"prompt": [1, -5]}, "prompt", "holds token id -5: ids are >= 0"),
        ({"prompt": "x", "return_tokens": "false"}, "return_tokens", "must be true or false"),
        ({"prompt": "x", "top_n_sigma": "2"}, "top_n_sigma", "should be a valid number"),
        ({"prompt": "x", "logit_bias": [[True, 1]]}, "logit_bias", "pairs are [token id or text, bias or false]"),
    ):
        status, out = post(coder_server, "/completion", body)
        assert status == 400 and out["error"]["param"] == param and needle in out["error"]["message"], out
    status, out = post(coder_server, "/infill", {"input_prefix": "x", "input_extra": "no"})
    assert status == 400 and out["error"]["param"] == "input_extra"
    for n in (509, 5000):  # more than the 512-token context leaves room for
        status, out = post(coder_server, "/infill", {"input_prefix": "x", "n_predict": n})
        assert status == 400 and out["error"]["param"] == "n_predict" and "leaves no room" in out["error"]["message"], out


def test_a_whole_answer_is_logged_finished_not_cancelled(coder_server, caplog):
    with caplog.at_level("INFO"):
        for stream in (False, True):
            post(coder_server, "/completion", {"prompt": "def f(x):", "n_predict": 4, "stream": stream}, raw=True)
    outcomes = [r.event_fields["outcome"] for r in caplog.records if getattr(r, "event_fields", None)
                and r.getMessage() == "request_finished"]  # fmt: skip
    assert outcomes == ["finished", "finished"]


def test_infill_on_a_model_without_fim_tokens_is_a_501(loaded):
    from client.openai.server import OpenAIServer
    from tests.test_structured_outputs import hermes_pair

    plain = OpenAIServer("127.0.0.1:0", hermes_pair(loaded), model_name="m").start()
    try:
        status, out = post(plain, "/infill", {"input_prefix": "x", "input_suffix": "y"})
        assert status == 501 and "infill is not supported by this model" in out["error"]["message"]
    finally:
        plain.stop()


def test_n_predict_0_warms_the_cache_for_the_next_request(coder):
    """llama.vscode sends its context with n_predict 0 while the user types, so that the completion it
    asks next reads only the rest: both nodes read the prompt, and the prompt cache keeps it."""
    from client.api import SpecExec
    from client.openai.server import OpenAIServer

    gen = SpecExec(coder.target, coder.draft, coder.tokenizer, tree=coder.tree)
    gen.use_prompt_cache(2)
    server = OpenAIServer("127.0.0.1:0", gen, model_name="coder").start()
    try:
        extra = [{"filename": "util.py", "text": "".join(f"X{i} = {i}\n" for i in range(30))}]
        warm = {"input_prefix": "", "input_suffix": "", "input_extra": extra, "prompt": "", "n_predict": 0,
                "samplers": [], "cache_prompt": True, "t_max_prompt_ms": 1}  # fmt: skip
        status, text = post(server, "/infill", {**warm, "stream": True}, raw=True)  # a stream: its last event only
        assert status == 200 and [(e["content"], e["stop"], e["tokens_predicted"]) for e in events(text)] == [("", True, 0)]
        assert events(text)[0]["timings"]["prompt_n"] > 0
        fim = FimFormat.of(coder.tokenizer)
        chunks = [(e["filename"], e["text"]) for e in extra]
        warmed = fim.prompt(coder.tokenizer, "", "", chunks, limit=512 - 512 // 4)
        asked = fim.prompt(coder.tokenizer, BEFORE, AFTER, chunks, limit=512 - 8)
        shared = next(i for i, (a, b) in enumerate(zip(warmed, asked, strict=False)) if a != b)
        assert shared > 100
        status, out = post(server, "/infill", {**warm, "input_prefix": BEFORE, "input_suffix": AFTER, "n_predict": 8,
                                               "seed": 5, "samplers": ["top_k"], "top_k": 1})  # fmt: skip
        assert status == 200 and out["timings"]["cache_n"] == shared
        assert out["timings"]["prompt_n"] == len(asked) - shared and out["tokens_evaluated"] == len(asked)
        assert out["content"] == coder.generate(asked, max_new_tokens=8, stop_token_ids=fim.ends).text
    finally:
        server.stop()
        gen.close()


def test_prompt_time_counts_from_the_request(coder):
    """The prompt's pass runs before the answer is made (its first chunk comes with the generation's
    start): llama.cpp's `prompt_ms` counts from the request's arrival, not from the answer's making."""
    job = Job.of(CompletionRequest(prompt="x"), coder.tokenizer, 16)
    reply = LlamaAnswer(job, Asked(n_predict=None, received=time.monotonic() - 2.0), "m", coder.tokenizer)
    reply.read(Chunk("a", coder.tokenizer.encode("a")))
    timings = reply.last("length", stream=False)["timings"]
    assert timings["prompt_ms"] >= 2000 and timings["prompt_n"] == len(job.prompt_ids)


def test_an_answer_cut_early_reports_the_prompt_tokens_held(coder):
    """`n_indent` and `t_max_predict_ms` stop reading before the generation's last chunk, which
    carries the stats: the first step's chunk says what the target held, so `cache_n` is not 0."""
    job = Job.of(CompletionRequest(prompt="a b c d e f"), coder.tokenizer, 16)
    reply = LlamaAnswer(job, Asked(n_predict=None, n_indent=2), "m", coder.tokenizer)
    reply.read(Chunk("x\n", coder.tokenizer.encode("x\n"), cached_prompt_tokens=3))
    reply.read(Chunk("y", coder.tokenizer.encode("y")))
    assert reply.stopped == "limit"
    timings = reply.last(None, stream=False)["timings"]
    assert timings["cache_n"] == 3 and timings["prompt_n"] == len(job.prompt_ids) - 3


def test_the_first_chunk_says_what_the_target_held(coder):
    from client.api import SpecExec

    gen = SpecExec(coder.target, coder.draft, coder.tokenizer, tree=coder.tree)
    gen.use_prompt_cache(2)
    try:
        prompt = "".join(f"x{i} = {i}\n" for i in range(20))
        list(gen.stream(prompt, SamplingParams(max_new_tokens=2)))
        chunks = list(gen.stream(prompt + "y = 1\n", SamplingParams(max_new_tokens=4)))
        firsts = [c.cached_prompt_tokens for c in chunks if c.cached_prompt_tokens is not None]
        assert len(firsts) == 1 and firsts[0] == chunks[-1].stats.cached_prompt_tokens > 0
    finally:
        gen.close()
