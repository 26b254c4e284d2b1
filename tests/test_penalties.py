"""Penalties and biases (OpenAI's presence/frequency penalties and logit_bias, vLLM's repetition
penalty and min_tokens, llama.cpp's windowed repeat_penalty) and min_p: the target applies them at
each draw, following the walk, so the output is exactly the target alone's with the same settings,
greedy and seeded."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from common.decoding.penalties import Dry, DryState, Penalties
from common.decoding.sampling import SamplingParams, sample_rows
from common.pb.specexec.v1 import specexec_pb2 as pb
from common.rpc.wire import sampling_from_proto, sampling_to_proto
from tests.test_grammar import PROMPT, pair

SETTINGS = {
    "presence": Penalties(presence=1.5),
    "frequency": Penalties(frequency=0.8, presence=-0.3),
    "repetition": Penalties(repetition=1.6),
    "all": Penalties(presence=0.4, frequency=0.6, repetition=1.3, logit_bias=((65, 2.0), (66, -5.0))),
    "repeat_last_n": Penalties(repetition=1.8, repetition_window=3),  # llama.cpp's window
    "allowed_token_ids": Penalties(allowed_token_ids=(*range(60, 75), 3, 200)),  # vLLM's
    "bad_words": Penalties(bad_words=((200, 241), (203, 98, 39), (237,))),  # vLLM's, as token sequences
    "dry": Penalties(dry=Dry(3.0, 1.75, 0, 0, breakers=((10,), (20, 21)))),  # llama.cpp's; 0: every follower
}


def dry_reference(context: list[int], dry: Dry) -> dict[int, float]:
    """DRY written apart, from its definition: the nearest breaker (a sequence wholly in the window;
    of those starting at one place, the longest) bounds how far back a repetition may reach; for
    each earlier place j, the longest run before j equal to the window's end, within that reach;
    token c[j] is penalized for the longest run, unless it is a breaker by itself."""
    c = context[-dry.last_n :] if dry.last_n else list(context)
    n = len(c)
    if n <= dry.allowed_length:
        return {}
    starts = {}  # head position: the longest breaker there
    for seq in dry.breakers:
        for a in range(n - len(seq) + 1):
            if tuple(c[a : a + len(seq)]) == seq:
                starts[a] = max(starts.get(a, 0), len(seq))
    reach = n - 1 - (max(starts) + starts[max(starts)] - 1) if starts else n
    if reach < dry.allowed_length:
        return {}
    singles = {s[0] for s in dry.breakers if len(s) == 1}
    longest: dict[int, int] = {}
    for j in range(1, n):
        run = 0
        while run < min(reach, j) and c[j - 1 - run] == c[n - 1 - run]:
            run += 1
        if run >= dry.allowed_length and c[j] not in singles:
            longest[c[j]] = max(longest.get(c[j], 0), run)
    cap = int(88.7228391 / math.log(dry.base)) if dry.base > 1.000001 else None
    return {t: dry.multiplier * dry.base ** (min(r - dry.allowed_length, cap) if cap else r - dry.allowed_length)
            for t, r in longest.items()}  # fmt: skip


def reference(model_dir, penalties: Penalties, params: SamplingParams, eos: int | None = None,
              prompt: list[int] = PROMPT, stops: tuple[int, ...] = ()) -> list[int]:  # fmt: skip
    """The target alone with vLLM's formulas, written apart: no KV cache, none of our session code."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    seq, out = list(prompt), []
    with torch.no_grad():
        for _ in range(params.max_new_tokens):
            logits = hf(torch.tensor([seq])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel())[: logits.numel()]
            seen = counts > 0
            seen[torch.tensor(prompt)] = True
            if penalties.repetition_window:  # llama.cpp's: the context's last n tokens only
                seen = torch.zeros_like(seen)
                seen[torch.tensor(seq[-penalties.repetition_window:])] = True
            logits = torch.where(seen, torch.where(logits > 0, logits / penalties.repetition,
                                                   logits * penalties.repetition), logits)  # fmt: skip
            logits = logits - penalties.frequency * counts - penalties.presence * (counts > 0)
            for token, bias in penalties.logit_bias:
                logits[token] += bias
            if len(out) < penalties.min_tokens:  # EOS and the stop tokens held back, as vLLM holds them
                for barred in ([eos] if eos is not None else []) + list(stops):
                    logits[barred] = -torch.inf
            if penalties.allowed_token_ids:
                keep = torch.full_like(logits, -torch.inf)
                keep[list(penalties.allowed_token_ids)] = 0
                logits = logits + keep
            if penalties.dry is not None:
                for token, amount in dry_reference(seq, penalties.dry).items():
                    logits[token] -= amount
            for word in penalties.bad_words:  # its last token, where the output ends with the rest of it
                if len(word) == 1 or (len(out) >= len(word) - 1 and out[len(out) - len(word) + 1 :] == list(word[:-1])):
                    logits[word[-1]] = -torch.inf
            token = int(sample_rows(logits[None].numpy(), params, [len(seq)])[0])
            seq.append(token)
            out.append(token)
            if token == eos or token in stops:
                break
    return out


@pytest.mark.parametrize("name", sorted(SETTINGS))
@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.9, seed=5)])
def test_penalised_output_equals_the_target_alone_with_them(loaded, model_dirs, name, sampling):
    penalties = SETTINGS[name]
    params = SamplingParams(max_new_tokens=32, ignore_eos=True, penalties=penalties, **sampling)
    expected = reference(model_dirs["target"], penalties, params)
    plain = pair(loaded).generate(PROMPT, SamplingParams(max_new_tokens=32, ignore_eos=True, **sampling))
    assert expected != plain.token_ids  # they change the text
    if penalties.repetition_window:  # and the window changes what the repetition penalty sees
        assert expected != reference(model_dirs["target"], replace(penalties, repetition_window=0), params)
    for mode in ("specexec", "autoregressive"):
        got = pair(loaded, mode).generate(PROMPT, params)
        assert got.token_ids == expected, mode


def test_min_p_output_equals_the_target_alone_with_it(loaded, model_dirs):
    """min_p is one more filter in `sample_rows`, the draw every path shares; the walk's draws meet
    the floor exactly where the target alone's do."""
    params = SamplingParams(max_new_tokens=32, ignore_eos=True, temperature=1.5, seed=3, min_p=0.3)
    expected = reference(model_dirs["target"], Penalties(), params)
    plain = pair(loaded).generate(PROMPT, replace(params, min_p=0.0))
    assert expected != plain.token_ids
    for mode in ("specexec", "autoregressive"):
        assert pair(loaded, mode).generate(PROMPT, params).token_ids == expected, mode


@pytest.mark.parametrize("filters", [dict(typical_p=0.4), dict(top_n_sigma=0.8),
                                     dict(xtc_probability=0.6, xtc_threshold=0.05)])  # fmt: skip
def test_llama_cpps_filters_give_the_target_alones_output(loaded, model_dirs, filters):
    """typical_p, top_n_sigma and XTC are filters in `sample_rows` too, XTC's coin a function of
    (seed, position): the walk's draws are the target alone's."""
    plain = SamplingParams(max_new_tokens=32, ignore_eos=True, temperature=1.3, seed=4)
    params = replace(plain, **filters)
    expected = reference(model_dirs["target"], Penalties(), params)
    assert expected != pair(loaded).generate(PROMPT, plain).token_ids  # they change the text
    for mode in ("specexec", "autoregressive"):
        assert pair(loaded, mode).generate(PROMPT, params).token_ids == expected, mode


def test_a_bias_bans_or_forces_a_token_and_min_tokens_holds_eos_back(loaded, model_dirs):
    eos = loaded["target"].tokenizer.eos_token_id
    gen = pair(loaded)
    forced = gen.generate(PROMPT, SamplingParams(max_new_tokens=8, ignore_eos=True,
                                                 penalties=Penalties(logit_bias=((70, 100.0),))))  # fmt: skip
    assert forced.token_ids == [70] * 8
    held = Penalties(logit_bias=((eos, 100.0),), min_tokens=5)
    params = SamplingParams(max_new_tokens=20, penalties=held)
    got = gen.generate(PROMPT, params)
    assert got.token_ids == reference(model_dirs["target"], held, params, eos)
    assert len(got.token_ids) == 6 and got.token_ids[-1] == eos and eos not in got.token_ids[:5]
    assert got.finish_reason == "stop"


def test_min_tokens_holds_back_stop_tokens_and_strings_too(loaded, model_dirs):
    """vLLM's min_tokens: no stop token is drawn, and no stop string ends the text, before it."""
    eos = loaded["target"].tokenizer.eos_token_id
    plain = pair(loaded).generate(PROMPT, SamplingParams(max_new_tokens=12, ignore_eos=True)).token_ids
    stop = plain[1]  # what the target draws second: a stop token there would end the text at once
    held = Penalties(min_tokens=5)
    params = SamplingParams(max_new_tokens=12, stop_token_ids=(stop,), penalties=held)
    expected = reference(model_dirs["target"], held, params, eos, stops=(stop,))
    assert stop not in expected[:5] and expected != plain[:2]
    for mode in ("specexec", "autoregressive"):
        got = pair(loaded, mode).generate(PROMPT, params)
        assert got.token_ids == expected, mode
    text = loaded["target"].tokenizer.decode(plain[:2])  # a stop string the text reaches at once
    strung = pair(loaded).generate(PROMPT, SamplingParams(max_new_tokens=12, ignore_eos=True, stop=(text,),
                                                          penalties=Penalties(min_tokens=4)))  # fmt: skip
    assert strung.token_ids == plain[: len(strung.token_ids)] and len(strung.token_ids) > 4


def test_a_kept_sequences_next_request_counts_only_its_own_output(loaded):
    gen = pair(loaded)
    gen.use_prompt_cache(2)
    try:
        params = SamplingParams(max_new_tokens=16, ignore_eos=True, penalties=SETTINGS["all"])
        first = gen.generate(PROMPT, params)
        second = gen.generate(PROMPT + first.token_ids, params)
        assert second.stats.cached_prompt_tokens > 0
        assert second.token_ids == pair(loaded, "autoregressive").generate(PROMPT + first.token_ids, params).token_ids
    finally:
        gen.close()


def test_wire_and_defaults():
    for params in (SamplingParams(penalties=SETTINGS["all"].at(9)),
                   SamplingParams(temperature=0.5, min_p=0.25, penalties=SETTINGS["repeat_last_n"].at(4))):  # fmt: skip
        assert sampling_from_proto(sampling_to_proto(params)) == params
    assert not sampling_to_proto(SamplingParams()).HasField("min_p")  # an older node reads nothing new
    assert SamplingParams(penalties=Penalties()).penalties is None  # nothing to apply: any target serves it


def test_dry_breakers_are_converted_once_per_set():
    """Qwen's default breakers are about 3,800 token sequences riding every step: each side builds
    or validates them once per distinct set, not at every step (7 ms a step on each side)."""
    breakers = (*((t,) for t in range(0, 4000, 2)), (5, 7), (9, 11, 13))
    params = SamplingParams(penalties=Penalties(dry=Dry(0.8, breakers=breakers)).at(3))
    first, second = sampling_to_proto(params), sampling_to_proto(replace(params, stop=()))
    assert first == second and len(first.penalties.dry.breakers) == len(breakers)
    got = [sampling_from_proto(pb.SamplingParams.FromString(m.SerializeToString())) for m in (first, second)]
    assert got[0] == got[1] == replace(params, stop=())
    assert got[0].penalties.dry is got[1].penalties.dry  # one parse for the set
    other = sampling_to_proto(SamplingParams(penalties=Penalties(dry=Dry(0.8, breakers=((4,),)))))
    assert sampling_from_proto(other).penalties.dry.breakers == ((4,),)
    bad = pb.SamplingParams.FromString(other.SerializeToString())
    bad.penalties.dry.breakers[0].ids[:] = list(range(17))
    for _ in range(2):  # a refused set stays refused
        with pytest.raises(ValueError, match="dry_sequence_breakers"):
            sampling_from_proto(bad)


@pytest.mark.parametrize("kwargs, message", [
    (dict(presence=2.5), r"presence_penalty must be in \[-2, 2\]"),
    (dict(frequency=-3), r"frequency_penalty must be in \[-2, 2\]"),
    (dict(repetition=0), r"repetition_penalty must be in \(0, 10\]"),
    (dict(logit_bias=((1, 101.0),)), r"biases in \[-100, 100\]"),
    (dict(logit_bias=tuple((i, 1.0) for i in range(301))), "at most 300 tokens"),
    (dict(min_tokens=-1), "min_tokens must be a whole number >= 0"),
    (dict(presence=float("nan")), "presence_penalty must be a number"),
    (dict(repetition_window=-1), "repetition_window must be a whole number >= 0"),
    (dict(allowed_token_ids=(1, -2)), "allowed_token_ids must be token ids"),
    (dict(bad_words=((),)), "bad_words holds token sequences of 1 to 32 ids"),
    (dict(bad_words=((1,),) * 257), "bad_words takes at most 256 token sequences"),
])  # fmt: skip
def test_bad_penalties_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Penalties(**kwargs)


@pytest.mark.parametrize("feature, params", [
    ("penalties", SamplingParams(penalties=Penalties(presence=1.0))),
    ("min_p", SamplingParams(temperature=1.0, min_p=0.1)),
    ("repetition_window", SamplingParams(penalties=Penalties(repetition=1.1, repetition_window=64))),
    ("min_tokens_stops", SamplingParams(stop_token_ids=(5,), penalties=Penalties(min_tokens=3))),
    ("allowed_token_ids", SamplingParams(penalties=Penalties(allowed_token_ids=(5, 6)))),
    ("bad_words", SamplingParams(penalties=Penalties(bad_words=((5, 6),)))),
    ("dry", SamplingParams(penalties=Penalties(dry=Dry(0.8)))),
    ("typical_p", SamplingParams(temperature=1.0, typical_p=0.5)),
    ("top_n_sigma", SamplingParams(temperature=1.0, top_n_sigma=1.0)),
    ("xtc", SamplingParams(temperature=1.0, xtc_probability=0.5)),
])  # fmt: skip
def test_a_target_without_a_feature_is_refused(loaded, feature, params):
    """A node from before a setting would ignore its field and draw other text."""
    gen = pair(loaded)
    info = gen.target.info()
    assert feature in info.features
    gen.target.info = lambda: type(info)(**{**info.__dict__, "features": tuple(set(info.features) - {feature})})
    with pytest.raises(ValueError, match=f"{feature}: the target node does not apply {feature}"):
        gen.stream(PROMPT, params)


@pytest.mark.parametrize("seed", range(6))
def test_dry_penalizes_as_its_definition_says(seed):
    """`DryState` (vectorized, from the end) against DRY written from its definition, on random
    contexts over a small alphabet, so that repetitions and breakers both occur."""
    rng = np.random.default_rng(seed)
    for _ in range(60):
        context = rng.integers(0, 6, size=int(rng.integers(1, 60))).tolist()
        breakers = {(int(rng.integers(0, 8)),) for _ in range(int(rng.integers(0, 2)))}
        breakers |= {tuple(rng.integers(0, 6, size=int(rng.integers(2, 4))).tolist()) for _ in range(int(rng.integers(0, 3)))}
        dry = Dry(float(rng.uniform(0.1, 2)), float(rng.uniform(1, 3)), int(rng.integers(0, 4)),
                  int(rng.choice([0, 0, 10, 25])), tuple(breakers))  # fmt: skip
        state = DryState(dry, 8)
        state.follow(context[:-3])
        for token in context[-3:]:  # the walk's takes, as the target's
            state.take(token)
        tokens, amounts = state.penalties()
        got = dict(zip(tokens.tolist(), amounts.tolist(), strict=True))
        expected = dry_reference(context, dry)
        assert got.keys() == expected.keys(), (context, dry)
        assert [got[t] for t in expected] == pytest.approx([expected[t] for t in expected], rel=1e-6)


def test_dry_breakers_are_read_as_llama_cpp_reads_them(loaded):
    from client.dry import breaker_sequences

    tok = loaded["target"].tokenizer
    ids = {c: tok.convert_tokens_to_ids(tok.tokenize(c))[0] for c in ("\n", "a", "b", ":")}
    got = breaker_sequences(tok, ("\n", "ab"))
    assert (ids["\n"],) in got and (ids["a"], ids["b"]) in got  # a byte-level vocabulary: "ab" is two tokens
    assert (ids[":"],) not in got and (ids[":"],) in breaker_sequences(tok, (":",))
    with pytest.raises(ValueError, match="at most 16 strings of 1 to 40 characters"):
        breaker_sequences(tok, ("",))
