"""Log-probabilities of the tokens the target commits: the target's own, at each position, as the
whole sequence recomputed by Hugging Face gives them, whatever trees verified them; asking for them
changes no token. In process, and through real nodes over gRPC."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from client.api import SpecExec, collect
from common.decoding.sampling import SamplingParams, token_logprob
from common.decoding.tree import TreeParams
from draft_node.engine import DraftEngine
from target_node.engine import TargetEngine
from tests.helpers import free_port, start_node

PROMPT = [72, 101, 108, 108, 111, 44, 32]


def reference_logprobs(model_dir, prompt: list[int], tokens: list[int], top: int) -> list:
    """One pass over prompt + tokens, no cache: each token's log-prob where it was drawn."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0].float().numpy()  # [n, V]
    return [token_logprob(logits[len(prompt) - 1 + i], t, top) for i, t in enumerate(tokens)]


def check_close(got: list, want: list, tolerance: float = 1e-4) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.logprob == pytest.approx(w.logprob, abs=tolerance)
        assert [i for i, _ in g.top] == [i for i, _ in w.top]
        assert np.allclose([v for _, v in g.top], [v for _, v in w.top], atol=tolerance)


@pytest.fixture(scope="module")
def gen(loaded) -> SpecExec:
    target = TargetEngine(loaded["target"], max_context=256, max_tree=16)
    draft = DraftEngine(loaded["truncated"], max_context=256, max_tree=16)
    return SpecExec(target, draft, loaded["target"].tokenizer, tree=TreeParams(budget=16))


@pytest.mark.parametrize("top", [0, 3])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9, "seed": 7}], ids=["greedy", "seeded"])
def test_logprobs_are_the_targets_own_and_change_no_token(gen, model_dirs, sampling, top):
    params = SamplingParams(max_new_tokens=40, ignore_eos=True, **sampling)
    plain = gen.generate(PROMPT, params)
    chunks = list(gen.stream(PROMPT, SamplingParams(max_new_tokens=40, ignore_eos=True, logprobs=top, **sampling)))
    out = collect(iter(chunks))
    assert out.token_ids == plain.token_ids
    assert out.stats.tokens_per_step > 1  # verified by trees, several tokens a step
    got = [lp for c in chunks for lp in (c.logprobs or [])]
    assert all(len(c.logprobs or []) == len(c.token_ids) for c in chunks)
    assert all(len(lp.top) == top for lp in got)
    check_close(got, reference_logprobs(model_dirs["target"], PROMPT, out.token_ids, top))


def test_no_logprobs_unless_asked(gen):
    assert all(c.logprobs is None for c in gen.stream(PROMPT, SamplingParams(max_new_tokens=8)))


@pytest.mark.parametrize("bad", [-1, 21, 2.5, True])
def test_a_logprobs_count_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match=r"logprobs must be a whole number in \[0, 20\]"):
        SamplingParams(logprobs=bad)


@pytest.fixture(scope="module")
def nodes(model_dirs):
    addrs = {"target": f"127.0.0.1:{free_port()}", "draft": f"127.0.0.1:{free_port()}"}
    procs = [start_node("target", model_dirs["target"], addrs["target"]),
             start_node("draft", model_dirs["truncated"], addrs["draft"])]  # fmt: skip
    yield addrs
    for proc in procs:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("mode", ["specexec", "autoregressive"])
def test_logprobs_through_the_nodes(nodes, model_dirs, mode):
    """Over the wire, from tree steps (Verify) and from runs on the target alone (Decode)."""
    from client.remote import connect

    gen = connect(nodes["draft"] if mode == "specexec" else None, nodes["target"], mode=mode,
                  tree=TreeParams(budget=16))  # fmt: skip
    params = SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=0.8, seed=3, logprobs=2)
    try:
        chunks = list(gen.stream(PROMPT, params))
    finally:
        gen.close()
    out = collect(iter(chunks))
    got = [lp for c in chunks for lp in (c.logprobs or [])]
    check_close(got, reference_logprobs(model_dirs["target"], PROMPT, out.token_ids, 2))
