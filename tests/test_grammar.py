"""Grammars (JSON schema, regex, choice, Lark, GBNF): the target's draws follow them, and the
output is still exactly the target alone's under the same grammar, greedy and seeded."""

from __future__ import annotations

import json
import math
import re

import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from client.api import SpecExec
from common.decoding.grammar import Constraint, Grammar, GrammarError, check
from common.decoding.sampling import SamplingParams, sample_rows
from common.rpc.wire import sampling_from_proto, sampling_to_proto
from draft_node.engine import DraftEngine
from draft_node.tree_builder import TreeParams
from target_node.engine import TargetEngine

PROMPT = [72, 101, 108, 108, 111, 44, 32]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}  # fmt: skip
GRAMMARS = {
    "schema": Grammar.json_schema(SCHEMA),
    "regex": Grammar("regex", r"(ab|ba)+![0-9]{2,5}"),
    "choice": Grammar.choice(["yes", "no", "maybe so"]),
    "lark": Grammar("lark", 'start: "x" NUM ("," NUM)*\nNUM: /[0-9]+/'),
    "gbnf": Grammar("gbnf", 'root ::= "<" [a-z]+ ">"'),
}


def pair(loaded, mode="specexec", budget=16, draft="truncated") -> SpecExec:
    tree = TreeParams(budget=budget, max_depth=8, max_branch=4, expand_batch=8)
    t = TargetEngine(loaded["target"], max_context=512, max_tree=budget)
    d = DraftEngine(loaded[draft], max_context=512, max_tree=budget) if mode != "autoregressive" else None
    return SpecExec(t, d, loaded["target"].tokenizer, mode=mode, tree=tree if d else None)


def reference(model_dir, tokenizer, grammar: Grammar, params: SamplingParams, eos: int) -> list[int]:
    """The target alone with llguidance's own mask, no KV cache, none of our session code."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lt = llguidance.hf.from_tokenizer(tokenizer, n_vocab=hf.config.vocab_size)
    matcher = llguidance.LLMatcher(lt, grammar.definition())
    seq, out = list(PROMPT), []
    with torch.no_grad():
        for _ in range(params.max_new_tokens):
            logits = hf(torch.tensor([seq])).logits[0, -1:].float().numpy()
            bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
            allowed = np.unpackbits(bits, bitorder="little")[: logits.shape[1]].astype(bool)
            token = int(sample_rows(np.where(allowed, logits, -np.inf), params, [len(seq)])[0])
            assert matcher.consume_token(token)
            seq.append(token)
            out.append(token)
            if token == eos:
                break
    return out


@pytest.mark.parametrize("name", sorted(GRAMMARS))
@pytest.mark.parametrize("sampling", [dict(), dict(temperature=1.0, seed=7), dict(temperature=0.8, top_k=20, seed=3)])
def test_constrained_output_equals_target_alone_with_the_grammar(loaded, model_dirs, name, sampling):
    grammar = GRAMMARS[name]
    params = SamplingParams(max_new_tokens=40, grammar=grammar, **sampling)
    tok = loaded["target"].tokenizer
    expected = reference(model_dirs["target"], tok, grammar, params, tok.eos_token_id)
    for mode in ("specexec", "autoregressive"):
        got = pair(loaded, mode).generate(PROMPT, params)
        assert got.token_ids == expected, mode
    text = tok.decode([t for t in expected if t != tok.eos_token_id])
    if name == "schema" and expected[-1] == tok.eos_token_id:
        assert set(json.loads(text)) == {"n", "ok"}
    if name == "regex" and expected[-1] == tok.eos_token_id:
        assert re.fullmatch(r"(ab|ba)+![0-9]{2,5}", text)
    if name == "choice":
        assert text in ("yes", "no", "maybe so") and got.finish_reason == "stop"


def test_a_grammar_covers_only_the_generated_text(loaded):
    """The prompt is not JSON; the grammar starts at the request's first new token, and a chat's
    next turn starts it again after its own prompt."""
    gen = pair(loaded)
    tight = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
             "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}  # fmt: skip
    params = SamplingParams(max_new_tokens=60, grammar=Grammar.json_schema(tight))
    first = gen.generate("not json {{{", params)
    assert first.finish_reason == "stop"
    assert first.text in ('{"a":true}', '{"a":false}')
    from client.api import Chat

    chat = Chat(gen)
    for turn in ("one", "two"):
        reply = "".join(c.text for c in chat.send(turn, params))
        assert reply in ('{"a":true}', '{"a":false}')


def test_prompt_cache_and_rollback_keep_the_matcher_in_step(loaded):
    """A kept sequence that a new request rolls back, and a stop string cutting an answer, leave
    the target's matcher where the committed tokens are."""
    gen = pair(loaded)
    gen.use_prompt_cache(4)
    try:
        params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=11, grammar=GRAMMARS["lark"])
        a = gen.generate(PROMPT, params)
        b = gen.generate(PROMPT + a.token_ids[:3], params)  # continues from a kept sequence's middle
        alone = pair(loaded, "autoregressive")
        assert a.token_ids == alone.generate(PROMPT, params).token_ids
        assert b.token_ids == alone.generate(PROMPT + a.token_ids[:3], params).token_ids
    finally:
        gen.close()


def test_wire_carries_the_grammar_and_its_start():
    params = SamplingParams(grammar=GRAMMARS["regex"].at(17))
    assert sampling_from_proto(sampling_to_proto(params)) == params
    assert sampling_from_proto(sampling_to_proto(SamplingParams())).grammar is None


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        (lambda: Grammar("yaml", "a: b"), "grammar kind must be one of"),
        (lambda: Grammar("regex", ""), "must be a non-empty string"),
        (lambda: Grammar("regex", "a" * 70000), "at most 65536 characters"),
        (lambda: Grammar.choice([]), "JSON list of non-empty strings"),
        (lambda: Grammar("choice", "[1, 2]"), "JSON list of non-empty strings"),
        (lambda: check(Grammar("regex", "[a-")), r"grammar \(regex\) is invalid: .*unclosed character class"),
        (lambda: check(Grammar("json_schema", '{"type": "objectx"}')), "Invalid type: objectx"),
        (lambda: check(Grammar("json_schema", "[1")), r"grammar \(json_schema\) is invalid"),
        (lambda: check(Grammar("gbnf", "root ::= (")), r"grammar \(gbnf\) is invalid"),
        (lambda: check(Grammar("lark", "start: undefined_rule")), r"grammar \(lark\) is invalid"),
    ],
)
def test_bad_grammars_get_clear_errors(grammar, message):
    with pytest.raises(GrammarError, match=message):
        grammar()


def test_a_bad_grammar_is_refused_before_any_session_opens(loaded):
    gen = pair(loaded)
    with pytest.raises(GrammarError, match="unclosed character class"):
        gen.stream(PROMPT, SamplingParams(grammar=Grammar("regex", "[a-")))
    assert len(gen.target.sessions) == 0


def test_a_target_without_grammars_is_refused(loaded):
    gen = pair(loaded)
    info = gen.target.info()
    gen.target.info = lambda: type(info)(**{**info.__dict__, "features": ()})
    with pytest.raises(ValueError, match="grammar: the target node does not apply grammar"):
        gen.stream(PROMPT, SamplingParams(grammar=Grammar.json_object()))


def test_matcher_follows_rollbacks_and_refuses_tokens_off_the_grammar(loaded):
    lt = loaded["target"].grammar_tokenizer()
    tok = loaded["target"].tokenizer
    c = Constraint(Grammar("regex", "(ab)+c"), lt, vocab_size=300)
    c.follow(tok.encode("ababab"))
    assert np.flatnonzero(c.allowed()).tolist() == sorted(tok.encode("a") + tok.encode("c"))
    c.follow(tok.encode("ab"))  # rolled back
    assert c.consumed == tok.encode("ab")
    c.follow(tok.encode("abc"))
    assert np.flatnonzero(c.allowed()).tolist() == [tok.eos_token_id]
    with pytest.raises(GrammarError, match="does not follow the grammar"):
        c.follow(tok.encode("abx"))
    c.follow(tok.encode("ab"))  # a refused token leaves the matcher usable
    assert c.consumed == tok.encode("ab")
    logits = np.zeros((1, 300), dtype=np.float32)
    assert np.isinf(c.mask(logits)).sum() == 300 - 2


@pytest.mark.parametrize("name, answer, off", [
    ("schema", '{"n": 3, "ok": true}', '{"n": "3"}'),
    ("regex", "abba!42", "abba!4x"),
    ("choice", "maybe so", "maybe"),
])  # fmt: skip
def test_a_grammar_after_a_thought_leaves_the_thought_free(loaded, name, answer, off):
    """A reasoning template opens the thought in the prompt: any text runs up to the first
    `</think>`, then the grammar holds (vLLM applies one after the reasoning as well)."""
    lt, tok = loaded["target"].grammar_tokenizer(), loaded["target"].tokenizer
    grammar = GRAMMARS[name].after_thought("</think>")
    assert grammar.kind == "lark" and check(grammar, lt) is None

    def takes(text: str) -> bool:
        c = Constraint(grammar, lt, vocab_size=300)
        try:
            c.follow(tok.encode(text))
        except GrammarError:
            return False
        return bool(c.matcher.is_accepting())

    assert takes("Let me see: {\"n\": 1} ok?\n</think>\n\n" + answer)
    assert not takes("Let me see.</think>\n\n" + off)
    assert not takes("a</think> b</think>" + answer)  # the first `</think>` ends the thought
    assert not takes(answer)  # no thought, no end to it
    assert takes("</think>" + answer)  # an empty thought


def test_lark_and_gbnf_cannot_follow_a_thought():
    for name in ("lark", "gbnf"):
        with pytest.raises(GrammarError, match=f"grammar .{name}. cannot follow a thought"):
            GRAMMARS[name].after_thought("</think>")


def test_a_schemas_size_counts_its_characters_and_names_it_after_a_thought():
    assert len(Grammar.json_schema({"enum": ["日本語"]}).text) == len('{"enum": ["日本語"]}')  # not \u escapes
    near = Grammar.json_schema({"enum": ["x" * 65500]})  # fits; wrapped, it does not
    with pytest.raises(GrammarError, match=r"grammar \(json_schema, after a thought\) must be at most 65536"):
        near.after_thought("</think>")


# ------------------------------------------------------------------------------------------------
# The draft's search under the grammar


def paths_follow(tree, tokenizer_lt, grammar: Grammar, committed_after_start: list[int]) -> bool:
    """Whether every node's path (from the root) is one the grammar allows after the committed tokens."""
    matcher = llguidance.LLMatcher(tokenizer_lt, grammar.definition())
    assert matcher.consume_tokens(committed_after_start) or not committed_after_start
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    for node in range(1, len(tokens)):
        path, at = [], node
        while at > 0:
            path.append(tokens[at])
            at = parents[at]
        path.reverse()
        if matcher.try_consume_tokens(path) != len(path):
            return False
        matcher.rollback(len(path))
    return True


@pytest.mark.parametrize("lookahead", [False, True])
def test_the_drafts_search_proposes_only_what_the_grammar_allows(loaded, lookahead):
    engine = DraftEngine(loaded["truncated"], max_context=512, max_tree=32, lookahead=lookahead)
    lt = loaded["truncated"].grammar_tokenizer()
    grammar = Grammar("regex", "(ab|ba)+![0-9]{2,5}").at(len(PROMPT))
    sid = engine.open_session(PROMPT)
    params = TreeParams(budget=24, max_depth=8, max_branch=4, expand_batch=8)
    free = engine.build_tree(sid, [], params).tree
    assert not paths_follow(free, lt, grammar, [])  # the tiny draft's own top tokens are not the grammar's
    committed: list[int] = []
    for step in range(3):
        tree = engine.build_tree(sid, committed[-1:] if step else [], params, grammar=grammar).tree
        assert tree.size > 1 and paths_follow(tree, lt, grammar, committed)
        committed.append(int(tree.tokens[1]))  # as if the target took the first child
    engine.close()


def test_a_same_weights_draft_under_the_grammar_is_accepted_as_without_one(loaded):
    """With the target's own weights, the draft's masked top child is the target's masked greedy
    draw: whole paths are accepted. Without the grammar at the draft, the same trees mostly miss."""
    params = SamplingParams(max_new_tokens=30, grammar=GRAMMARS["regex"])
    masked = pair(loaded, draft="self", budget=16).generate(PROMPT, params)
    assert masked.stats.tokens_per_step > 3
    unmasked = pair(loaded, draft="self", budget=16)
    unmasked.draft.build_tree = lambda *a, grammar=None, **k: DraftEngine.build_tree(unmasked.draft, *a, **k)
    blind = unmasked.generate(PROMPT, params)
    assert blind.token_ids == masked.token_ids
    assert blind.stats.tokens_per_step < masked.stats.tokens_per_step


def test_the_same_request_again_on_a_kept_sequence_rolls_back_past_its_eos(loaded):
    """llguidance's rollback does not count an EOS it took: the kept sequence's matcher, past the
    first answer's EOS, starts again from the top."""
    gen = pair(loaded)
    gen.use_prompt_cache(4)
    try:
        for grammar in (Grammar.choice(["yes", "no"]), GRAMMARS["regex"]):
            params = SamplingParams(max_new_tokens=30, grammar=grammar)
            answers = [gen.generate(PROMPT, params) for _ in range(3)]
            assert answers[0].finish_reason == "stop"
            assert [a.token_ids for a in answers[1:]] == [answers[0].token_ids] * 2
            assert answers[2].stats.cached_prompt_tokens > 0  # it did run on the kept sequence
    finally:
        gen.close()


def test_a_grammar_that_compiles_but_allows_no_text_is_refused_before_any_draw(loaded):
    with pytest.raises(GrammarError, match=r"grammar \(json_schema\) allows no text"):
        pair(loaded).generate(PROMPT, SamplingParams(grammar=Grammar("json_schema", '{"$ref": "#"}')))


def test_boolean_schemas():
    assert Grammar.json_schema(True).text == "{}"
    check(Grammar.json_schema(True))
    with pytest.raises(GrammarError, match="the schema false, which no text matches"):
        Grammar.json_schema(False)


@pytest.mark.parametrize("regex", ["[a-e]+!", "[^!]*!"])  # few tokens allowed; nearly all
def test_the_drafts_children_under_a_grammar_are_the_masked_rows_best(loaded, regex):
    """`_constrained` works over the allowed ids, or over the row less the forbidden ones: the same
    children and log-probs as masking the whole row and renormalizing it."""
    from draft_node.session import DraftSession

    session = DraftSession(loaded["truncated"].model, PROMPT, max_context=64, max_tree=8)
    session.grammar_tokenizer = loaded["truncated"].grammar_tokenizer
    session._use_grammar(Grammar("regex", regex).at(len(PROMPT)))
    vocab = loaded["truncated"].model.cfg.vocab_size
    logprobs = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)).log_softmax(-1)
    tok = loaded["truncated"].tokenizer
    paths = [[], tok.encode("a"), tok.encode("ab")]
    got_lp, got_tok = session._constrained(paths, logprobs, 4)
    for i, path in enumerate(paths):
        allowed = torch.from_numpy(session.constraint.allowed_after(path))
        assert int(allowed.sum()) > 0 and (int(allowed.sum()) * 2 <= vocab) == (regex == "[a-e]+!")
        masked = logprobs[i].masked_fill(~allowed, -math.inf)
        want_lp, want_tok = (masked - masked.logsumexp(0)).topk(4)
        assert got_tok[i].tolist() == want_tok.tolist()
        torch.testing.assert_close(got_lp[i], want_lp, atol=1e-5, rtol=0)
    nothing = session._constrained([tok.encode("a!!")], logprobs[:1], 4)  # the grammar ended at the first "!"
    assert torch.isinf(nothing[0]).all()


def test_a_draft_node_left_with_a_grammar_it_cannot_read_builds_without_it(loaded):
    """A kind from a newer client (or a vocabulary llguidance cannot read): the draft's trees are
    unconstrained, not refused, and the grammar is not tried again at every step."""
    from common.pb.specexec.v1 import specexec_pb2 as pb
    from draft_node.service import DraftServicer

    assert DraftServicer._grammar(pb.BuildTreeRequest(grammar=pb.Grammar(kind="structural_tag", text="{}"))) is None
    engine = DraftEngine(loaded["truncated"], max_context=256, max_tree=8)
    calls = []

    def unreadable():
        calls.append(1)
        raise ValueError("vocab size too small")

    sid = engine.open_session(PROMPT)
    engine.sessions.get(sid).grammar_tokenizer = unreadable
    params = TreeParams(budget=8)
    for _ in range(3):
        assert engine.build_tree(sid, [], params, grammar=GRAMMARS["regex"].at(len(PROMPT))).tree.size > 1
    assert len(calls) == 1
