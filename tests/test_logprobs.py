"""Log-probabilities of the tokens the target commits: the target's own, at each position, as the
whole sequence recomputed by Hugging Face gives them, whatever trees verified them; asking for them
changes no token. In process, and through real nodes over gRPC."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from client.api import SpecExec, collect
from common.decoding.sampling import LOGPROB_FLOOR, SamplingParams, token_logprob
from common.decoding.tree import TreeParams
from common.decoding.types import TokenLogprob
from draft_node.engine import DraftEngine
from target_node.engine import TargetEngine
from tests.helpers import free_port, gateway_answers, start_node

PROMPT = [72, 101, 108, 108, 111, 44, 32]


def reference_logprobs(model_dir, prompt: list[int], tokens: list[int], top: int) -> list[TokenLogprob]:
    """One pass over prompt + tokens, no cache, and torch's own log-softmax in float64: each token's
    log-prob where it was drawn, and the top ones."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0]  # [n, V]
    rows = torch.log_softmax(logits.double(), -1)[len(prompt) - 1 :]  # [len(tokens) + 1, V]
    out = []
    for row, token in zip(rows, tokens, strict=False):
        values, ids = row.topk(top) if top else (torch.zeros(0), torch.zeros(0, dtype=torch.long))
        out.append(TokenLogprob(float(row[token]), tuple(zip(ids.tolist(), values.tolist(), strict=True))))
    return out


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


def test_every_cut_keeps_logprobs_and_tokens_together(gen, loaded, model_dirs):
    """An EOS inside a step's accepted path, a stop string, max_new_tokens inside a step: the
    log-probs are cut where the tokens are, and `generate` keeps them too."""
    sampling = {"temperature": 0.8, "seed": 3, "logprobs": 2}
    full = gen.generate(PROMPT, SamplingParams(max_new_tokens=40, ignore_eos=True, **sampling))
    cases = [("max_new_tokens", gen, SamplingParams(max_new_tokens=13, ignore_eos=True, **sampling))]
    stop = next(full.text[i : i + 2] for i in range(10, len(full.text) - 2) if full.text[i : i + 2].strip())
    cases.append(("stop", gen, SamplingParams(max_new_tokens=40, ignore_eos=True, stop=(stop,), **sampling)))
    eos = replace(loaded["target"], eos_token_ids=(full.token_ids[9],))  # the 10th token ends it
    with_eos = SpecExec(TargetEngine(eos, max_context=256, max_tree=16),
                        DraftEngine(loaded["truncated"], max_context=256, max_tree=16),
                        eos.tokenizer, tree=TreeParams(budget=16))  # fmt: skip
    cases.append(("eos", with_eos, SamplingParams(max_new_tokens=40, **sampling)))
    for name, generator, params in cases:
        out = generator.generate(PROMPT, params)
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids), name
        assert out.token_ids == full.token_ids[: len(out.token_ids)], name
        check_close(out.logprobs, full.logprobs[: len(out.token_ids)])
    assert [c[0] for c in cases] == ["max_new_tokens", "stop", "eos"]
    check_close(full.logprobs, reference_logprobs(model_dirs["target"], PROMPT, full.token_ids, 2))


def test_sessions_sharing_a_pass_each_get_their_own(gen, model_dirs):
    """Four sessions in shared passes, asking for none, 0, 2 and 5 alternatives."""
    import threading

    runs: dict[tuple[int, int | None], list] = {}

    def run(k: int, top: int | None) -> None:
        params = SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=0.8, seed=k, logprobs=top)
        runs[(k, top)] = list(gen.stream(PROMPT[:k], params))

    threads = [threading.Thread(target=run, args=case) for case in [(7, 2), (6, None), (5, 0), (4, 5)]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for (k, top), chunks in runs.items():
        if top is None:
            assert all(c.logprobs is None for c in chunks)
            continue
        out = collect(iter(chunks))
        check_close(out.logprobs, reference_logprobs(model_dirs["target"], PROMPT[:k], out.token_ids, top))


def test_a_logprob_that_is_not_finite_reads_as_the_floor():
    """JSON has no infinities: vLLM's -9999."""
    row = np.zeros(8, dtype=np.float32)
    row[3] = -np.inf
    assert token_logprob(row, 3, 0).logprob == LOGPROB_FLOOR
    row[5] = np.inf
    assert all(v == LOGPROB_FLOOR for v in [token_logprob(row, 3, 2).logprob, *(v for _, v in token_logprob(row, 3, 2).top)])


def test_a_target_whose_logprobs_do_not_match_its_tokens_is_refused():
    from client.remote import _verify_result
    from common.pb.specexec.v1 import specexec_pb2 as pb

    with pytest.raises(ValueError, match="sent 1 log-probabilities for 2 tokens"):
        _verify_result(pb.VerifyResponse(tokens=[5, 6], logprobs=[pb.TokenLogprob(logprob=-1.0)]))


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


def test_logprobs_through_the_grpc_gateway(gen):
    """GenerateChunk carries one per token id."""
    from common.pb.specexec.v1 import specexec_pb2 as pb

    sampling = pb.SamplingParams(temperature=0.8, seed=4, max_new_tokens=16, ignore_eos=True, logprobs=1)
    answers = gateway_answers(gen, pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), sampling=sampling))
    chunks = [a.chunk for a in answers if a.HasField("chunk") and a.chunk.token_ids]
    want = gen.generate(PROMPT, SamplingParams(temperature=0.8, seed=4, max_new_tokens=16, ignore_eos=True, logprobs=1))
    assert [t for c in chunks for t in c.token_ids] == want.token_ids
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    got = [lp.logprob for c in chunks for lp in c.logprobs]
    assert got == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-6)
    assert all(len(lp.top_ids) == 1 for c in chunks for lp in c.logprobs)
