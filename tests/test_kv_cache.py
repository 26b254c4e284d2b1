"""After pruning to the accepted path, both caches equal caches recomputed from scratch."""

from __future__ import annotations

import gc

import pytest
import torch

from client.api import SpecExec
from common.decoding.sampling import SamplingParams
from common.model.kv_cache import KVCache, KVCachePool
from common.model.transformer import attention_bias
from draft_node.engine import DraftEngine
from draft_node.tree_builder import TreeParams
from target_node.engine import TargetEngine
from tests.helpers import reference_decode
from tests.test_exactness import PROMPT


def recomputed(model, tokens: list[int]):
    cache = model.new_cache(len(tokens) + 1)
    t = len(tokens)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    model(torch.tensor(tokens), torch.arange(t), torch.arange(t), attention_bias(causal, 0), cache)
    return cache


def assert_cache_prefix_equal(cache, ref, length):
    assert cache.length == length
    torch.testing.assert_close(
        torch.stack(cache.k)[:, :, :length], torch.stack(ref.k)[:, :, :length], atol=1e-4, rtol=1e-4
    )
    torch.testing.assert_close(
        torch.stack(cache.v)[:, :, :length], torch.stack(ref.v)[:, :, :length], atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize("draft", ["truncated", "self"])
def test_caches_after_pruning_equal_recomputed_caches(loaded, draft):
    target = TargetEngine(loaded["target"], max_context=256, max_tree=64)
    drafter = DraftEngine(loaded[draft], max_context=256, max_tree=64)
    sampling = SamplingParams(temperature=0.8, seed=3, ignore_eos=True)
    params = TreeParams(budget=64, max_depth=8, max_branch=4, expand_batch=8)
    tid, did = target.open_session(PROMPT), drafter.open_session(PROMPT)
    new: list[int] = []
    accepted_total = salvaged = 0
    for _ in range(6):
        tree = drafter.build_tree(did, new, params).tree
        result = target.verify(tid, tree, sampling, max_tokens=100)
        new = result.tokens
        accepted_total += result.accepted
        t_session = target.sessions.get(tid)
        # The target holds KV for every committed token but the last (the next root).
        seq = t_session.committed
        assert_cache_prefix_equal(t_session.cache, recomputed(loaded["target"].model, seq[:-1]), len(seq) - 1)
        d_session = drafter.sessions.get(did)
        before = d_session.cache.length
        d_session.commit(new)
        salvaged += d_session.cache.length - before
        ref = recomputed(loaded[draft].model, d_session.committed[: d_session.cache.length])
        assert_cache_prefix_equal(d_session.cache, ref, d_session.cache.length)
        new = []
    assert accepted_total > 0, "the test needs accepted tokens to exercise pruning"
    if draft == "self":
        assert salvaged > 0, "accepted tree nodes' draft KV should be reused, not recomputed"


def test_truncate_rolls_back_both_nodes(loaded):
    target = TargetEngine(loaded["target"], max_context=256, max_tree=16)
    tid = target.open_session(PROMPT)
    from common.decoding.tree import TokenTree

    greedy = SamplingParams()
    r1 = target.verify(tid, TokenTree.root_only(PROMPT[-1]), greedy, 1)
    target.verify(tid, TokenTree.root_only(r1.tokens[-1]), greedy, 1)
    again = target.verify(tid, TokenTree.root_only(PROMPT[-1]), greedy, 1, truncate_to=len(PROMPT))
    assert again.tokens == r1.tokens


class _Owner:
    """A stand-in session: the pool takes a cache back once its owner is garbage."""


def test_the_pool_lends_a_cache_again_only_once_its_session_is_gone():
    made = []
    pool = KVCachePool(lambda n: made.append(KVCache(1, 1, 2, n, torch.float32, "cpu")) or made[-1], keep=2)
    owners = [_Owner() for _ in range(4)]
    caches = [pool.lend(o, 8) for o in owners]
    assert len({id(c) for c in caches}) == 4 and len(made) == 4
    caches[0].length = 5
    del owners[:3], caches
    gc.collect()
    assert pool.free(8) == 2  # the third goes back to the allocator
    later = _Owner()
    again = pool.lend(later, 8)
    assert any(again is m for m in made[:3]) and again.length == 0 and len(made) == 4
    assert pool.lend(_Owner(), 16) is made[-1] and len(made) == 5  # another capacity: a new one


def test_sessions_on_caches_that_others_left_decode_exactly(loaded, model_dirs, monkeypatch):
    """Sessions take the caches of sessions that ended, old slots and all: the output is the
    target alone's, and the second request allocates no cache on either node."""
    import common.model.transformer as transformer

    made = []

    class Counted(KVCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(transformer, "KVCache", Counted)
    target, draft = TargetEngine(loaded["target"], max_context=512, max_tree=64), None
    draft = DraftEngine(loaded["truncated"], max_context=512, max_tree=64)
    spec = SpecExec(target, draft, loaded["target"].tokenizer, tree=TreeParams(budget=16, max_depth=8, max_branch=4))
    spec.generate(list(reversed(PROMPT)) * 3, max_new_tokens=24, ignore_eos=True)
    gc.collect()
    before = len(made)
    got = spec.generate(PROMPT, max_new_tokens=24, ignore_eos=True)
    assert len(made) == before
    assert got.token_ids == reference_decode(model_dirs["target"], PROMPT, SamplingParams(max_new_tokens=24))
