"""Fill in the middle (`client.infill`): the model's own prompt from the two ends of a file, through
OpenAI's and Ollama's `suffix`; the middle is the Python API's text from that prompt, and the tokens
a code model ends a middle with end it."""

from __future__ import annotations

import ollama
import openai
import pytest

from client.infill import FimFormat, fim_format
from client.openai.server import OpenAIServer
from common.decoding.sampling import SamplingParams
from tests.conftest import CODER, FIM

MODEL = CODER
BEFORE, AFTER = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def api(coder_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=coder_server.url, api_key="unused", max_retries=0, timeout=60)


def middle(coder, before: str = BEFORE, after: str = AFTER, **sampling) -> str:
    fim = FimFormat.of(coder.tokenizer)
    ids = fim.prompt(coder.tokenizer, before, after)
    return coder.generate(ids, SamplingParams(stop_token_ids=fim.ends, **sampling)).text


def test_the_format_is_read_from_the_vocabulary(coder, loaded):
    tok = coder.tokenizer
    fim = FimFormat.of(tok)
    assert (fim.prefix, fim.suffix, fim.middle) == tuple(tok.convert_tokens_to_ids(FIM[:3]))
    assert set(fim.ends) == set(tok.convert_tokens_to_ids(["<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]))
    assert FimFormat.of(loaded["target"].tokenizer) is None  # a model without them
    with pytest.raises(ValueError, match="'suffix' asks to fill in the middle, and this model's vocabulary has no"):
        fim_format(loaded["target"].tokenizer, "suffix")


def test_the_prompt_is_prefix_suffix_middle_and_user_text_stays_text(coder):
    tok = coder.tokenizer
    fim = FimFormat.of(tok)
    ids = fim.prompt(tok, BEFORE, AFTER)
    assert ids == [fim.prefix, *tok.encode(BEFORE), fim.suffix, *tok.encode(AFTER), fim.middle]
    sneaky = fim.prompt(tok, "x = '<|fim_middle|>'", "")
    assert sneaky.count(fim.middle) == 1 and sneaky[-1] == fim.middle  # the user's copy is bytes
    extra = fim.prompt(tok, BEFORE, AFTER, extra=[("util.py", "X = 1\n")], middle="return")
    assert tok.decode(extra) == ("<|repo_name|>project\n<|file_sep|>util.py\nX = 1\n<|file_sep|>filename\n"
                                 f"<|fim_prefix|>{BEFORE}return<|fim_suffix|>{AFTER}<|fim_middle|>")  # fmt: skip


def test_a_limit_keeps_the_end_of_the_prefix_and_the_start_of_the_suffix(coder):
    tok = coder.tokenizer
    fim = FimFormat.of(tok)
    before, after = "".join(f"a{i} " for i in range(100)), "".join(f"b{i} " for i in range(100))
    ids = fim.prompt(tok, before, after, extra=[("x.py", "c" * 50)], limit=83)
    assert len(ids) == 83 and ids[0] == fim.prefix  # no room left for the extra file
    text = tok.decode(ids)
    assert text.startswith("<|fim_prefix|>") and "a99 <|fim_suffix|>b0 b1" in text and "a0 " not in text
    assert len(tok.encode(text.split("<|fim_suffix|>")[0])) - 1 == 60  # three quarters of the 80 left
    short = fim.prompt(tok, before, "end", extra=[("x.py", "c" * 50)], limit=83)
    assert len(short) == 83 and tok.decode(short).endswith("<|fim_suffix|>end<|fim_middle|>")
    roomy = fim.prompt(tok, "x", "y", extra=[("x.py", "c" * 50)], limit=40)
    assert len(roomy) == 40 and tok.decode(roomy).endswith("cc<|file_sep|>filename\n<|fim_prefix|>x<|fim_suffix|>y<|fim_middle|>")
    with pytest.raises(ValueError, match="needs more than 3 tokens"):
        fim.prompt(tok, "x", "y", limit=3)


def test_completions_suffix_fills_in_the_middle(api, coder):
    body = dict(model=MODEL, prompt=BEFORE, suffix=AFTER, max_tokens=20, temperature=0.8, seed=3)
    out = api.completions.create(**body)
    assert out.choices[0].text == middle(coder, max_new_tokens=20, temperature=0.8, seed=3)
    assert "".join(e.choices[0].text for e in api.completions.create(stream=True, **body)) == out.choices[0].text
    fim = FimFormat.of(coder.tokenizer)
    assert out.usage.prompt_tokens == len(fim.prompt(coder.tokenizer, BEFORE, AFTER))
    empty = api.completions.create(**{**body, "prompt": ""})  # the cursor at the top of the file
    assert empty.choices[0].text == middle(coder, "", AFTER, max_new_tokens=20, temperature=0.8, seed=3)


def test_a_middle_ends_at_the_models_end_tokens(api, coder):
    pad = coder.tokenizer.convert_tokens_to_ids("<|fim_pad|>")
    out = api.completions.create(model=MODEL, prompt=BEFORE, suffix=AFTER, max_tokens=20, temperature=0,
                                 logit_bias={str(pad): 100})  # fmt: skip
    assert out.choices[0].text == "" and out.choices[0].finish_reason == "stop"
    plain = api.completions.create(model=MODEL, prompt=BEFORE, max_tokens=5, temperature=0, logit_bias={str(pad): 100})
    assert plain.choices[0].text == "" and plain.choices[0].finish_reason == "stop"  # any text, as llama.cpp's
    sep = coder.tokenizer.convert_tokens_to_ids("<|file_sep|>")  # a new file: the end of this one's text
    assert {sep, pad} <= set(coder.target.info().eos_token_ids)


@pytest.mark.parametrize("body, param, needle", [
    (dict(prompt=["a", "b"]), "suffix", "'suffix' takes one prompt, as text"),
    (dict(prompt=[1, 2, 3]), "suffix", "'suffix' takes one prompt, as text"),
    (dict(echo=True), "echo", "'suffix' and 'echo' do not go together"),
    (dict(suffix=5), "suffix", "should be a valid string"),
])  # fmt: skip
def test_bad_suffix_requests_are_400s_naming_the_field(api, body, param, needle):
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(**{"model": MODEL, "prompt": BEFORE, "suffix": AFTER, "max_tokens": 4, **body})
    assert err.value.body["param"] == param and needle in err.value.body["message"], err.value.body


def test_a_model_without_fim_tokens_is_a_400_and_an_empty_prompt_still_one(loaded):
    from tests.test_structured_outputs import hermes_pair

    server = OpenAIServer("127.0.0.1:0", hermes_pair(loaded), model_name=MODEL).start()
    try:
        api = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as err:
            api.completions.create(model=MODEL, prompt=BEFORE, suffix=AFTER, max_tokens=4)
        assert err.value.body["param"] == "suffix" and "no fill-in-the-middle tokens" in err.value.body["message"]
        assert api.completions.create(model=MODEL, prompt=BEFORE, suffix="", max_tokens=4).choices  # "": none
        with pytest.raises(openai.BadRequestError) as err:
            api.completions.create(model=MODEL, prompt="", max_tokens=4)
        assert err.value.body["param"] == "prompt" and "'prompt' is empty" in err.value.body["message"]
    finally:
        server.stop()


def test_ollama_generate_with_a_suffix_fills_in_the_middle(coder_server, coder):
    client = ollama.Client(host=coder_server.url.removesuffix("/v1"), timeout=60)
    options = {"seed": 5, "num_predict": 16}
    out = client.generate(MODEL, BEFORE, suffix=AFTER, options=options)
    ollama_defaults = dict(temperature=0.8, top_k=40, top_p=0.9)
    from common.decoding.penalties import Penalties

    expected = middle(coder, max_new_tokens=16, seed=5, penalties=Penalties(repetition=1.1, repetition_window=64),
                      **ollama_defaults)  # fmt: skip
    assert out.response == expected and out.done
    streamed = "".join(p.response for p in client.generate(MODEL, BEFORE, suffix=AFTER, options=options, stream=True))
    assert streamed == expected
    assert "insert" in client.show(MODEL).capabilities  # Ollama's word for a model that fills in
    top = client.generate(MODEL, "", suffix=AFTER, options=options)  # not Ollama's "load": there is a suffix
    assert top.done_reason != "load" and top.eval_count
    for extra, param in ((dict(raw=True), "raw"), (dict(system="Be brief."), "system")):
        with pytest.raises(ollama.ResponseError) as err:
            client.generate(MODEL, BEFORE, suffix=AFTER, **extra)
        assert err.value.status_code == 400 and f"'{param}' does not go with 'suffix'" in err.value.error
