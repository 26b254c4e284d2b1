"""The product's promise: output identical to the target alone, whatever the draft and budget."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from client.api import SpecExec
from common.decoding.sampling import SamplingParams
from draft_node.engine import DraftEngine
from draft_node.tree_builder import TreeParams
from target_node.engine import TargetEngine
from tests.helpers import reference_decode

PROMPT = [72, 101, 108, 108, 111, 44, 32]


def pair(loaded, draft: str | None, mode="specexec", budget=64, max_depth=16, target="target") -> SpecExec:
    tree = TreeParams(budget=budget, max_depth=max_depth, max_branch=8, expand_batch=16)
    t = TargetEngine(loaded[target], max_context=512, max_tree=max(budget, 1))
    d = DraftEngine(loaded[draft], max_context=512, max_tree=max(budget, 1)) if draft else None
    return SpecExec(t, d, loaded[target].tokenizer, mode=mode, tree=tree)


@pytest.fixture(scope="module")
def greedy_reference(model_dirs):
    hf = AutoModelForCausalLM.from_pretrained(model_dirs["target"], dtype=torch.float32)
    out = hf.generate(
        torch.tensor([PROMPT]), max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(PROMPT) :].tolist()


@pytest.mark.parametrize("draft", ["self", "truncated", "unrelated"])
@pytest.mark.parametrize("budget", [1, 8, 64, 256])
def test_specexec_greedy_equals_target_alone(loaded, greedy_reference, draft, budget):
    got = pair(loaded, draft, budget=budget).generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    assert got.token_ids == greedy_reference
    assert got.stats.new_tokens == 40


@pytest.mark.parametrize("mode", ["chain", "autoregressive"])
def test_baselines_greedy_equal_target_alone(loaded, greedy_reference, mode):
    got = pair(loaded, "truncated", mode=mode, budget=4).generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    assert got.token_ids == greedy_reference
    if mode == "autoregressive":
        assert got.stats.target_steps == 40


def test_same_weights_draft_accepts_deep_paths(loaded):
    got = pair(loaded, "self", budget=64).generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    assert got.stats.tokens_per_step > 3


@pytest.mark.parametrize(
    "sampling",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=1.3, top_k=20),
        dict(temperature=0.5, top_k=50, top_p=0.8),
    ],
)
@pytest.mark.parametrize("draft", ["self", "truncated"])
def test_seeded_sampling_equals_target_alone(loaded, model_dirs, sampling, draft):
    params = SamplingParams(seed=1234, max_new_tokens=30, ignore_eos=True, **sampling)
    expected = reference_decode(model_dirs["target"], PROMPT, params)
    for mode in ("specexec", "chain", "autoregressive"):
        got = pair(loaded, draft, mode=mode, budget=32).generate(PROMPT, params)
        assert got.token_ids == expected, mode


def test_qwen2_pair_with_eos_stops_where_target_alone_stops(loaded, model_dirs):
    eos = loaded["qwen2"].eos_token_ids
    params = SamplingParams(temperature=1.0, seed=5, max_new_tokens=60)
    expected = reference_decode(model_dirs["qwen2"], PROMPT, params, eos)
    got = pair(loaded, "qwen2", target="qwen2", budget=16).generate(PROMPT, params)
    assert got.token_ids == expected
    assert got.finish_reason == ("stop" if expected[-1] in eos else "length")


def test_an_eos_the_tree_holds_past_max_tokens_ends_with_length(loaded, model_dirs):
    """A walk can accept the draft's EOS beyond the request's last token: the answer is cut at
    max_tokens first, so it ends with "length", as the target alone's does, not "stop"."""
    from common.decoding.tree import TokenTree
    from target_node.torch_session import TorchTargetSession

    own = reference_decode(model_dirs["target"], PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert own[2] not in own[:2]
    session = TorchTargetSession(loaded["target"].model, PROMPT, max_context=64, max_tree=8, max_depth=8,
                                 eos_token_ids=(own[2],))  # fmt: skip
    chain = TokenTree([PROMPT[-1], *own[:3]], [-1, 0, 1, 2], [0.0, 0.0, 0.0, 0.0])
    result = session.verify(chain, SamplingParams(max_new_tokens=2), max_tokens=2)
    assert (result.tokens, result.finish_reason) == (own[:2], "length")


def test_first_two_tokens_follow_the_target_distribution(loaded, model_dirs):
    """Chi-square over many seeds: the tree pass samples from the target's exact joint distribution."""
    hf = AutoModelForCausalLM.from_pretrained(model_dirs["target"], dtype=torch.float32)
    params = dict(temperature=1.0, top_k=3, max_new_tokens=2, ignore_eos=True)
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([PROMPT])).logits[0, -1].topk(3).values, -1)
        first = hf(torch.tensor([PROMPT])).logits[0, -1].topk(3).indices
        expected: dict[tuple[int, int], float] = {}
        for a, pa in zip(first.tolist(), p1.tolist(), strict=True):
            logits = hf(torch.tensor([[*PROMPT, a]])).logits[0, -1]
            top = logits.topk(3)
            for b, pb in zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist(), strict=True):
                expected[(a, b)] = pa * pb
    gen = pair(loaded, "truncated", budget=16)
    n = 600
    counts: dict[tuple[int, int], int] = dict.fromkeys(expected, 0)
    for seed in range(n):
        ids = gen.generate(PROMPT, SamplingParams(seed=seed, **params)).token_ids
        counts[tuple(ids)] += 1
    chi2 = sum((counts[k] - n * p) ** 2 / (n * p) for k, p in expected.items())
    # 8 degrees of freedom: P(chi2 > 26.12) = 0.001 under the null hypothesis.
    assert chi2 < 26.12, (chi2, counts, expected)
    assert math.isclose(sum(expected.values()), 1.0, rel_tol=1e-5)
