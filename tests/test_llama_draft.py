"""The draft's best-first search on llama.cpp (draft_node.llama_session): every expansion sees
exactly its node's path through pruning, compaction, re-rooting and salvage; sequence ids go back
to the pool; SpecExec with a llama.cpp draft equals the target alone, in process and through a
real draft node with its lookahead on."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from client.api import SpecExec
from client.remote import connect
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeParams
from tests.helpers import free_port, node_pair
from tests.tiny_models import gguf_model_dir, make_tiny_model, truncate_layers

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[llama]')")

from common.model.llama_cpp import LlamaContext, LlamaCppModel  # noqa: E402
from common.model.llama_search import SEARCH_UBATCH, SearchContext, SearchPool  # noqa: E402
from draft_node.llama_session import LlamaDraftSession  # noqa: E402
from draft_node.lookahead import Interrupted  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]
SETTINGS = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.8, "seed": 5}}


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[str, Path]:
    """A qwen2 target and a one-layer draft cut from it, each as an F32 GGUF directory."""
    root = tmp_path_factory.mktemp("gguf-draft")
    target = make_tiny_model(root / "target", arch="qwen2", layers=3, seed=3)
    dirs = {"target-hf": target, "draft-hf": truncate_layers(target, root / "draft", keep=1)}
    for name in ("target", "draft"):
        dirs[name] = gguf_model_dir(dirs[f"{name}-hf"], root / f"{name}-f32")
    return dirs


def chain_logprobs(model: LlamaCppModel, tokens: list[int]) -> torch.Tensor:
    """Log-probs after the last of `tokens`, run as one plain chain in a fresh context."""
    ctx = model.new_context(len(tokens) + 8, 4)
    try:
        ctx.extend(tokens[:-1])
        return torch.log_softmax(torch.from_numpy(ctx.tree(np.array(tokens[-1:]), np.array([-1]))[0]), -1)
    finally:
        ctx.close()


class CheckedSession(LlamaDraftSession):
    """Checks every expansion against a chain over the node's path (prefix + the tokens at the
    slots it sees), and keeps its own slot -> token map the way the cache must keep KV."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.slot_tokens: dict[int, int] = {}
        self.checked = 0
        self.worst = 0.0

    def expand(self, nodes, tokens, depths, visible, parents):
        prefix = self.committed[: self.cache.length]  # what the batch sees, whoever takes the KV after
        out = super().expand(nodes, tokens, depths, visible, parents)
        for node, token in zip(nodes.tolist(), tokens.tolist(), strict=True):
            self.slot_tokens[node - 1] = token
        for row, seen in enumerate(visible):
            path = [self.slot_tokens[j] for j in seen.nonzero().squeeze(1).tolist()]
            expected = chain_logprobs(self.model, prefix + path)
            # batched kernels move the last bits; a wrong cell moves whole units
            self.worst = max(self.worst, float((out[row] - expected).abs().max()))
            assert self.worst < 1e-3, f"node {int(nodes[row])} saw other cells than its path's"
            self.checked += 1
        return out

    def move(self, src, dst):
        super().move(src, dst)
        moved = {d: self.slot_tokens[s] for s, d in zip(src.tolist(), dst.tolist(), strict=True)}
        self.slot_tokens = moved

    def drop(self, slots):
        super().drop(slots)
        for slot in slots.tolist():
            del self.slot_tokens[slot]

    def _advance(self, count: int) -> None:
        super()._advance(count)
        self.slot_tokens = {s - count: t for s, t in self.slot_tokens.items() if s >= count}

    def ids_in_use(self) -> int:
        return int((self.cache._seq_of >= 0).sum())


def deepest_expanded_path(built) -> list[int]:
    """Tokens from the root's child down to the deepest node of the tree the search expanded."""
    tree = built.tree
    depth = [0] * tree.size
    for i in range(1, tree.size):
        depth[i] = depth[int(tree.parents[i])] + 1
    node = max((i for i in range(1, tree.size) if bool(built.expanded[i])), key=depth.__getitem__, default=0)
    path = []
    while node > 0:
        path.append(int(tree.tokens[node]))
        node = int(tree.parents[node])
    return path[::-1]


@pytest.mark.parametrize("padding", [False, True], ids=["", "padded"])
@pytest.mark.parametrize("lookahead", [True, False], ids=["lookahead", "plain"])
def test_every_expansion_sees_exactly_its_path(ggufs, lookahead, padding, request):
    """Also with every pass padded with scratch rows (`LlamaCppModel.pad_passes`)."""
    padded = request.getfixturevalue("padded") if padding else None
    model = LlamaCppModel(ggufs["draft"] / "model.gguf", kv_type="f32", threads=1)
    session = CheckedSession(model, PROMPT, max_context=128, max_tree=12, lookahead=lookahead)
    params = TreeParams(budget=12, max_depth=6, max_branch=3, expand_batch=4)
    rerooted = 0
    for step in range(6):
        built, reused = session.build_tree(params)
        rerooted += reused
        for _ in range(3):
            session.idle_step()
        path = deepest_expanded_path(built)
        # Every other step the target parts from the draft after the first token: a miss.
        tokens = path if step % 2 == 0 else [*path[:1], (path[0] + 7) % 256 if path else 9]
        session.update(tokens)
        expanded = session.ids_in_use()
        assert expanded + len(session.cache.ctx._leaf_free) == session.tree_nodes  # no id leaks
    assert session.checked > 40
    print(f"worst difference from a chain: {session.worst:.2e} over {session.checked} nodes")
    assert rerooted > 0 if lookahead else rerooted == 0
    session.truncate(len(PROMPT) + 2)  # a chat turn rewrites history: every node goes, KV too
    assert session.ids_in_use() == 0 and session.cache.length <= len(PROMPT) + 2
    session.build_tree(params)
    assert padded is None or len(padded) > 10


def test_a_search_holds_at_most_255_nodes(ggufs):
    model = LlamaCppModel(ggufs["draft"] / "model.gguf", kv_type="f32", threads=1)
    with pytest.raises(ValueError, match=r"over the llama\.cpp backend's limit of 255"):
        LlamaDraftSession(model, PROMPT, max_context=64, max_tree=300)
    session = LlamaDraftSession(model, PROMPT, max_context=64, max_tree=100, lookahead=True)
    assert session.search_nodes == 255  # 4x the tree, capped by llama.cpp's sequence ids


@pytest.mark.parametrize("setting", SETTINGS)
def test_specexec_with_a_llama_cpp_draft_equals_the_target_alone(ggufs, setting):
    sampling = SamplingParams(max_new_tokens=40, ignore_eos=True, **SETTINGS[setting])
    alone = SpecExec.local(None, str(ggufs["target"]), mode="autoregressive", kv_type="f32")
    gen = SpecExec.local(str(ggufs["draft"]), str(ggufs["target"]), tree=TreeParams(budget=16), kv_type="f32")
    assert type(gen.draft.loaded.model).__name__ == "LlamaCppModel"  # auto: a GGUF runs on llama.cpp
    out = gen.generate(PROMPT, sampling)
    assert out.token_ids == alone.generate(PROMPT, sampling).token_ids
    assert out.stats.target_steps < 40
    torch_draft = SpecExec.local(str(ggufs["draft-hf"]), str(ggufs["target"]), kv_type="f32")
    assert isinstance(torch_draft.draft.loaded.model, torch.nn.Module)  # no GGUF: our transformer
    assert torch_draft.generate(PROMPT, sampling).token_ids == out.token_ids


def test_draft_node_on_llama_cpp_with_lookahead_serves_the_same_tokens(ggufs, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEXEC_HOME", str(tmp_path / "home"))
    env = dict(os.environ)
    sampling = SamplingParams(max_new_tokens=40, ignore_eos=True, temperature=0.8, seed=2)
    alone = SpecExec.local(None, str(ggufs["target"]), mode="autoregressive", kv_type="f32")
    expected = alone.generate(PROMPT, sampling).token_ids
    target = ["--model", str(ggufs["target"]), "--kv-type", "f32", "--no-profile"]
    with node_pair(target, ["--model", str(ggufs["draft"]), "--kv-type", "f32"], env, tmp_path) as addrs:
        gen = connect(addrs["draft"], addrs["target"], tree=TreeParams(budget=16))
        info = gen.draft.info()
        assert info.dtype == "gguf (f32 KV)" and info.max_tree_nodes == 256  # 255 besides the root
        assert len(info.forward_curve) > 1  # profiled through llama.cpp
        out = gen.generate(PROMPT, sampling)
        assert out.token_ids == expected
        assert out.stats.reused_trees > 0  # the lookahead search re-rooted on llama.cpp


def test_draft_node_refuses_what_llama_cpp_cannot_do(ggufs):
    for args, needle in ((["--max-tree", "300"], "over the llama.cpp backend's limit of 255"),
                         (["--quantize", "int8"], "drop --quantize"),
                         (["--kv-cache-tokens", "100"], "--kv-cache-tokens 100 cannot hold one session's")):  # fmt: skip
        cmd = [sys.executable, "-m", "draft_node", "--model", str(ggufs["draft"]), "--listen",
               f"127.0.0.1:{free_port()}", "--backend", "llama.cpp", "--no-profile", *args]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert run.returncode == 2 and needle in run.stderr, run.stderr[-2000:]


def test_an_interrupted_idle_expansion_leaves_the_search_as_it_was(ggufs):
    """A request cuts the lookahead's llama.cpp pass short (draft_node.lookahead): the search, its KV
    and its sequence ids stay as they were before the batch, so the trees that follow equal those of
    a twin never cut, every expansion still sees exactly its path; and a request's own passes run
    whatever interrupt came before them."""
    model = LlamaCppModel(ggufs["draft"] / "model.gguf", kv_type="f32", threads=1)
    params = TreeParams(budget=12, max_depth=6, max_branch=3, expand_batch=4)
    cut, twin = (CheckedSession(model, PROMPT, max_context=128, max_tree=12, lookahead=True) for _ in range(2))
    for step in range(3):
        built = [s.build_tree(params)[0] for s in (cut, twin)]
        free = len(cut.cache.ctx._leaf_free)
        cut.interrupt()  # no pass in flight: the next interruptible one stops at its first graph node
        with pytest.raises(Interrupted):
            cut.idle_step()
        assert len(cut.cache.ctx._leaf_free) == free and cut.ids_in_use() == twin.ids_in_use()
        for s in (cut, twin):
            for _ in range(2):
                s.idle_step()
        cut.interrupt()  # stale by the time the next request runs
        path = deepest_expanded_path(built[1])
        for s in (cut, twin):
            s.update(path if step % 2 == 0 else [*path[:1], (path[0] + 7) % 256 if path else 9])
        got, want = (s.build_tree(params)[0].tree for s in (cut, twin))
        assert np.array_equal(got.tokens, want.tokens) and np.array_equal(got.parents, want.parents)
        assert np.allclose(got.logprobs, want.logprobs, atol=1e-5)
        assert cut.ids_in_use() + len(cut.cache.ctx._leaf_free) == cut.tree_nodes
    assert cut.checked > 20 and cut.worst < 1e-3


def test_ids_go_back_when_an_expansion_fails(ggufs, monkeypatch):
    model = LlamaCppModel(ggufs["draft"] / "model.gguf", kv_type="f32", threads=1)
    session = LlamaDraftSession(model, PROMPT, max_context=64, max_tree=8)
    free = len(session.cache.ctx._leaf_free)
    from common.model import llama_cpp as lc

    def refuse(self, n, at, interruptible=False, room=0):
        raise lc.LlamaCppError("llama_decode failed (1)")

    session.cache.extend(PROMPT)  # the prompt's KV, before decoding starts failing
    monkeypatch.setattr(lc.LlamaContext, "_decode", refuse)
    with pytest.raises(lc.LlamaCppError):
        session.cache.expand(np.array([0, 1]), np.array([-1, -1]), np.array([5, 6]), np.array([8, 8]))
    assert len(session.cache.ctx._leaf_free) == free and (session.cache._seq_of < 0).all()


def three_trees(engine: Any, sid: str, prompt: list[int]) -> list[tuple[list[int], list[int]]]:
    """Three trees of one session: over its prompt, then after each of its next two tokens."""
    params = TreeParams(budget=12, max_branch=3, expand_batch=4)
    trees = []
    for step in range(3):
        tree = engine.build_tree(sid, [] if step == 0 else [prompt[step]], params).tree
        trees.append((tree.tokens.tolist(), tree.parents.tolist()))
    return trees


@pytest.mark.parametrize(("lookahead", "shared_fails"), [(True, False), (False, False), (False, True)],
                         ids=["lookahead", "plain", "shared-pass-fails"])  # fmt: skip
def test_sessions_drafting_at_once_get_the_trees_each_gets_alone(ggufs, monkeypatch, lookahead, shared_fails):
    """A llama.cpp draft node's sessions build trees from several threads at once, on the one
    context they share, their expansions and chains in shared passes: each tree is the one it gets
    alone, in a context of its own. Where a shared pass fails, each session's work runs alone."""
    from common.model import llama_cpp as lc
    from common.model.llama_cpp import load_gguf
    from draft_node import engine as engine_module
    from draft_node.engine import DraftEngine
    from tests.test_batching import at_once

    sizes: list[int] = []
    real = engine_module.run_batch

    def counting(works):
        sizes.append(len(works))
        if shared_fails and len(works) > 1:
            raise lc.LlamaCppError("llama_decode failed (-3) (injected)")
        return real(works)

    monkeypatch.setattr(engine_module, "run_batch", counting)
    loaded = load_gguf(ggufs["draft"], kv_type="f32")
    prompts_ = [PROMPT, PROMPT[::-1], [5, 9, 13, 17, 21]]

    alone = []
    for prompt in prompts_:
        engine = DraftEngine(loaded, max_context=64, max_tree=12, lookahead=lookahead, max_sessions=1)
        assert engine.pool is None
        sid = engine.open_session(prompt)
        alone.append(three_trees(engine, sid, prompt))
        engine.close_session(sid)  # the lookahead thread lets go of it, and of its context
    sizes.clear()
    engine = DraftEngine(loaded, max_context=64, max_tree=12, lookahead=lookahead)
    assert engine.pool is not None
    sids = [engine.open_session(p) for p in prompts_]
    together = at_once([lambda s=s, p=p: three_trees(engine, s, p) for s, p in zip(sids, prompts_, strict=True)])
    for sid in sids:
        engine.close_session(sid)
    assert together == alone
    assert max(sizes) > 1  # several sessions' work shared passes
    assert len(engine.pool.ctx._leaf_free) == engine.pool.leaf_ids  # every id back


def test_a_long_prompt_catches_up_in_chunks_beside_another_sessions_build(ggufs, monkeypatch):
    """A llama.cpp draft session catching up on a long prompt runs it in chunks of --prefill-chunk
    rows, which the other session's expansions share; both get the trees each gets alone."""
    from common.model.llama_cpp import load_gguf
    from draft_node import engine as engine_module
    from draft_node.engine import DraftEngine
    from tests.test_batching import at_once

    passes: list[list[tuple[str, int]]] = []
    real = engine_module.run_batch

    def recording(works):
        passes.append([(type(w).__name__, w.rows) for w in works])
        return real(works)

    monkeypatch.setattr(engine_module, "run_batch", recording)
    loaded = load_gguf(ggufs["draft"], kv_type="f32")
    long = [(7 * i + 3) % 200 + 20 for i in range(41)]
    prompts_ = [long, [5, 9, 13, 17, 21]]

    alone = []
    for prompt in prompts_:
        engine = DraftEngine(loaded, max_context=64, max_tree=12, max_sessions=1)
        sid = engine.open_session(prompt)
        alone.append(three_trees(engine, sid, prompt))
        engine.close_session(sid)
    passes.clear()
    engine = DraftEngine(loaded, max_context=64, max_tree=12, prefill_chunk=8)
    sids = [engine.open_session(p) for p in prompts_]
    assert at_once([lambda s=s, p=p: three_trees(engine, s, p) for s, p in zip(sids, prompts_, strict=True)]) == alone
    chunks = [w for p in passes for w in p if w == ("Chain", 8)]
    assert len(chunks) == 5  # 41 tokens to catch up: 5 chunks of 8, then the root
    assert any(("Chain", 8) in p and len(p) > 1 for p in passes)  # the other session's work shared one


def shared_pool(model: LlamaCppModel, lanes: int, ids: int, cells: int) -> SearchPool:
    """A pool with few ids, so that small trees press on it."""
    return SearchPool(LlamaContext(model, cells, lanes=lanes, max_rows=ids + 1, ubatch=SEARCH_UBATCH))


PLAIN = TreeParams(budget=12, max_depth=6, max_branch=3, expand_batch=4)


def steps_alone(model: LlamaCppModel, prompt: list[int], rounds: int) -> list[tuple[list[int], list[int]]]:
    """The trees a session alone builds, each round committing the deepest expanded path's first token."""
    session = LlamaDraftSession(model, prompt, max_context=128, max_tree=12)
    trees = []
    for _ in range(rounds):
        built = session.build_tree(PLAIN)[0]
        trees.append((built.tree.tokens.tolist(), built.tree.parents.tolist()))
        session.update(deepest_expanded_path(built)[:2] or [3])
    return trees


def test_sessions_taking_turns_on_a_small_pool_lose_nodes_and_kv_but_not_trees(ggufs, monkeypatch):
    """Three sessions on a pool with ids for one tree and cells for about two sessions, building in
    turn: each build takes the ids, then the cells, of the sessions between builds (their salvage
    goes, and then their KV). Every tree is the one each session builds alone, every expansion sees
    exactly its path, and no id or cell leaks."""
    model = LlamaCppModel(ggufs["draft"] / "model.gguf", kv_type="f32", threads=1)
    prompts_ = [PROMPT, PROMPT[::-1], [5, 9, 13, 17, 21, 25]]
    expected = [steps_alone(model, p, 4) for p in prompts_]
    pool = shared_pool(model, lanes=3, ids=12, cells=48)
    kv_lost: list[int] = []
    real_evict = SearchContext.evict
    monkeypatch.setattr(SearchContext, "evict", lambda self: kv_lost.append(self.length) or real_evict(self))
    sessions = [CheckedSession(model, p, max_context=128, max_tree=12, pool=pool) for p in prompts_]
    got: list[list[tuple[list[int], list[int]]]] = [[] for _ in sessions]
    for _ in range(4):
        built = [session.build_tree(PLAIN)[0] for session in sessions]  # each holds its tree's nodes
        for trees, session, b in zip(got, sessions, built, strict=True):
            trees.append((b.tree.tokens.tolist(), b.tree.parents.tolist()))
            session.update(deepest_expanded_path(b)[:2] or [3])
    assert got == expected
    assert pool.evictions > len(kv_lost) > 0 and all(s.checked > 10 for s in sessions)
    held = sum(s.ids_in_use() for s in sessions)
    assert held + len(pool.ctx._leaf_free) == pool.leaf_ids
    assert sum(s.cache.cells for s in sessions) <= pool.ctx.n_ctx
    for session in sessions:
        session.cache.close()
    assert len(pool.ctx._leaf_free) == pool.leaf_ids and sorted(pool.ctx._free) == [0, 1, 2]


def test_a_build_beside_others_gets_its_fair_share_of_ids(ggufs):
    """Builds that hold the pool's ids leave a new one its fair share of the rest, maybe none: past
    it a build expands only on spare ids, and with none its tree is the root's children, at once.
    A build takes the ids of searches between builds; an idle step takes no id a build reserved."""
    model = LlamaCppModel(ggufs["draft"] / "model.gguf", kv_type="f32", threads=1)
    pool = shared_pool(model, lanes=3, ids=12, cells=200)
    a = CheckedSession(model, PROMPT, max_context=64, max_tree=12, pool=pool, lookahead=True)
    b, c = (CheckedSession(model, p, max_context=64, max_tree=12, pool=pool) for p in (PROMPT[::-1], [5, 9, 13]))
    a.build_tree(TreeParams(budget=4, max_depth=6, max_branch=3, expand_batch=4))
    held = a.ids_in_use()
    assert 0 < held < 12
    with pool.working(b.cache):
        assert pool.reserve(b.cache, 12) == 12  # a is between builds: its ids count as free
        assert not a.idle_step() and a.ids_in_use() == held  # every spare id is b's
        bush = c.build_tree(PLAIN)[0]  # nothing left for c: the root's 3 children, unexpanded
        assert bush.tree.size == 4 and not bush.expanded[1:].any() and c.ids_in_use() == 0
        assert pool.reserve(b.cache, 8) == 8
        small = c.build_tree(PLAIN)[0]  # fair: 12 // 2 = 6; left: 12 - 8 = 4
        assert 1 <= c.ids_in_use() <= 4 and small.expanded[1:].sum() == c.ids_in_use() and small.tree.size > 4
    assert a.cache.lost or a.ids_in_use() == held
    whole = c.build_tree(PLAIN)[0]  # alone again: the whole tree, a's nodes taken if need be
    assert whole.tree.size == 13 and c.checked > 0
    assert a.build_tree(PLAIN)[0].tree.size == 13  # a starts again from its committed tokens if it lost them
    assert a.worst < 1e-3 and c.worst < 1e-3


def test_concurrent_generations_with_a_llama_cpp_draft_equal_the_target_alone(ggufs, monkeypatch):
    """8 generations at once, started at different times, of different lengths, greedy and seeded,
    on llama.cpp target and draft (F32 files), the draft's sessions on one shared context: each
    equals the target alone on its own prompt and seed, and draft passes were shared."""
    from concurrent.futures import ThreadPoolExecutor

    from draft_node import engine as engine_module

    sizes: list[int] = []
    real = engine_module.run_batch
    monkeypatch.setattr(engine_module, "run_batch", lambda works: sizes.append(len(works)) or real(works))
    alone = SpecExec.local(None, str(ggufs["target"]), mode="autoregressive", kv_type="f32")
    gen = SpecExec.local(str(ggufs["draft"]), str(ggufs["target"]), tree=TreeParams(budget=16), kv_type="f32")
    assert gen.draft.pool is not None
    jobs = [([(7 * i + j) % 250 + 3 for j in range(5 + i)],
             SamplingParams(max_new_tokens=6 + 3 * i, ignore_eos=True,
                            **({"temperature": 0.8, "seed": 100 + i} if i % 2 else {})))
            for i in range(8)]  # fmt: skip

    def run(i: int) -> list[int]:
        time.sleep(0.05 * i)
        return gen.generate(*jobs[i]).token_ids

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, range(len(jobs))))
    for (prompt, sampling), got in zip(jobs, results, strict=True):
        assert got == alone.generate(prompt, sampling).token_ids
    assert max(sizes) > 1


@pytest.mark.parametrize("seed", [0, 1])
def test_random_work_of_many_sessions_on_a_small_pool_keeps_every_path_exact(ggufs, seed, padded):
    """Four sessions, lookahead and plain, on a pool with ids for one tree and cells for about two,
    in a random order of builds, idle steps, hits, misses and rewrites of history: every expansion
    sees exactly its path, and after every operation the ids and cells add up. Passes are padded
    with scratch rows where the pool has the cells."""
    import random

    rng = random.Random(seed)
    model = LlamaCppModel(ggufs["draft"] / "model.gguf", kv_type="f32", threads=1)
    pool = shared_pool(model, lanes=4, ids=12, cells=56)
    prompts_ = [PROMPT, PROMPT[::-1], [5, 9, 13, 17, 21, 25], [40, 41, 42]]
    sessions = [CheckedSession(model, p, max_context=96, max_tree=12, pool=pool, lookahead=i % 2 == 0)
                for i, p in enumerate(prompts_)]  # fmt: skip
    last: dict[int, object] = {}
    for _ in range(40):
        i = rng.randrange(len(sessions))
        s = sessions[i]
        op = rng.choice(["build", "build", "idle", "update", "truncate"])
        if op == "build":
            budget = rng.choice([4, 8, 12])
            last[i] = s.build_tree(TreeParams(budget=budget, max_depth=6, max_branch=3, expand_batch=4))[0]
        elif op == "idle":
            s.idle_step()
        elif op == "update" and i in last:
            path = deepest_expanded_path(last.pop(i))
            s.update(path[: rng.randint(1, 3)] if path and rng.random() < 0.7 else [rng.randrange(3, 250)])
        elif op == "truncate" and len(s.committed) > 3:
            s.update([rng.randrange(3, 250)], truncate_to=rng.randint(2, len(s.committed) - 1))
            last.pop(i, None)
        assert sum(x.ids_in_use() for x in sessions) + len(pool.ctx._leaf_free) == pool.leaf_ids
        assert sum(x.cache.cells for x in sessions) <= pool.ctx.n_ctx
        assert all(x.cache.length <= len(x.committed) for x in sessions)
    assert sum(x.checked for x in sessions) > 40 and max(x.worst for x in sessions) < 1e-3
    assert pool.evictions > 0 and len(padded) > 5


def test_sessions_building_at_once_on_a_tiny_pool_keep_every_path_exact(ggufs):
    """Four threads, each a session (lookahead and plain) building, growing idle, committing hits
    and misses and rewriting history at once on a pool too small for their KV and ids: builds take
    each other's cells mid-build and nodes past reservations. Every expansion still sees exactly its
    path, none fails, and the ids add up."""
    import random

    model = LlamaCppModel(ggufs["draft"] / "model.gguf", kv_type="f32", threads=1)
    taken: list[int] = []
    for seed in range(4):
        pool = shared_pool(model, lanes=4, ids=12, cells=40)
        sessions = [CheckedSession(model, [(5 * i + 3 * j) % 250 + 3 for j in range(4 + i)], max_context=64,
                                   max_tree=12, pool=pool, lookahead=i % 2 == 0) for i in range(4)]  # fmt: skip

        def work(s: CheckedSession, rng: random.Random) -> None:
            for _ in range(8):
                built = s.build_tree(TreeParams(budget=rng.choice([4, 8, 12]), max_depth=6, max_branch=3,
                                                expand_batch=4))[0]  # fmt: skip
                if rng.random() < 0.5:
                    s.idle_step()
                path = deepest_expanded_path(built)
                s.update(path[: rng.randint(1, 3)] if path and rng.random() < 0.7 else [rng.randrange(3, 250)])
                if len(s.committed) > 20:
                    s.update([7], truncate_to=6)

        from tests.test_batching import at_once

        rngs = [random.Random(10 * seed + i) for i in range(len(sessions))]
        errors = at_once([lambda s=s, r=r: work(s, r) for s, r in zip(sessions, rngs, strict=True)])
        assert errors == [None] * 4
        assert sum(s.ids_in_use() for s in sessions) + len(pool.ctx._leaf_free) == pool.leaf_ids
        assert max(s.worst for s in sessions) < 1e-3 and sum(s.checked for s in sessions) > 20
        taken.append(pool.evictions)
    assert sum(taken) > 0


def test_an_engines_shared_passes_on_a_tiny_pool_keep_every_path_exact(ggufs, monkeypatch):
    """The same through a draft engine: four clients' builds share passes on a pool too small for
    them, where the pool refuses some expansions of a pass and runs the rest. Every expansion sees
    exactly its path and no build fails."""
    import random

    from common.model.llama_cpp import load_gguf
    from draft_node import engine as engine_module
    from draft_node.engine import DraftEngine
    from tests.test_batching import at_once

    monkeypatch.setattr(engine_module, "LlamaDraftSession", CheckedSession)
    sizes: list[int] = []
    real = engine_module.run_batch
    monkeypatch.setattr(engine_module, "run_batch", lambda works: sizes.append(len(works)) or real(works))
    loaded = load_gguf(ggufs["draft"], kv_type="f32")
    engine = DraftEngine(loaded, max_context=24, max_tree=12, max_sessions=4)
    engine.pool = shared_pool(loaded.model, lanes=4, ids=12, cells=48)
    sids = [engine.open_session([(5 * i + 3 * j) % 250 + 3 for j in range(4 + i)]) for i in range(4)]
    sessions = [engine.sessions.get(sid) for sid in sids]

    def client(sid: str, rng: random.Random) -> None:
        new: list[int] = []
        for _ in range(8):
            params = TreeParams(budget=rng.choice([4, 8, 12]), max_depth=6, max_branch=3, expand_batch=4)
            session = engine.sessions.get(sid)
            truncate = 4 if len(session.committed) > 16 else None
            tree = engine.build_tree(sid, new, params, truncate_to=truncate).tree
            new = [int(tree.tokens[1]) if tree.size > 1 and rng.random() < 0.7 else rng.randrange(3, 250)]

    rngs = [random.Random(i) for i in range(4)]
    assert at_once([lambda s=s, r=r: client(s, r) for s, r in zip(sids, rngs, strict=True)]) == [None] * 4
    assert max(sizes) > 1 and engine.pool.evictions > 0
    assert max(s.worst for s in sessions) < 1e-3 and sum(s.checked for s in sessions) > 20


def test_an_interrupt_cuts_only_an_idle_pass_on_a_shared_context(ggufs):
    """On one context a request for one session interrupts another's idle step: a pass that is not
    idle, whosever it is, runs whole; the next idle one stops."""
    model = LlamaCppModel(ggufs["draft"] / "model.gguf", kv_type="f32", threads=1)
    pool = SearchPool.shared(model, sessions=2, cells=512)
    a = LlamaDraftSession(model, PROMPT, max_context=64, max_tree=12, lookahead=True, pool=pool)
    b = LlamaDraftSession(model, PROMPT[::-1], max_context=64, max_tree=12, pool=pool)
    a.build_tree(PLAIN)
    done = threading.Event()
    sizes: list[int] = []

    def requests() -> None:
        try:
            for step in range(20):
                b.update([PROMPT[step % len(PROMPT)]])
                sizes.append(b.build_tree(PLAIN)[0].tree.size)
        finally:
            done.set()

    worker = threading.Thread(target=requests)
    worker.start()
    while not done.is_set():  # interrupts meant for a's idle step, while b's passes run
        a.interrupt()
        time.sleep(0.0005)
    worker.join()
    assert sizes == [13] * 20
    a.interrupt()
    with pytest.raises(Interrupted):
        a.idle_step()


def test_a_session_finding_every_shared_lane_held_gets_a_context_of_its_own(ggufs):
    """Lanes go back when a session is collected; one opened before that still opens."""
    model = LlamaCppModel(ggufs["draft"] / "model.gguf", kv_type="f32", threads=1)
    pool = SearchPool.shared(model, sessions=2, cells=512)
    held = [LlamaDraftSession(model, PROMPT, max_context=64, max_tree=12, pool=pool) for _ in range(2)]
    extra = LlamaDraftSession(model, PROMPT, max_context=64, max_tree=12, pool=pool)
    assert extra.cache.pool is not pool and all(s.cache.pool is pool for s in held)
    assert extra.build_tree(PLAIN)[0].tree.size == 13
    del held[0]
    assert LlamaDraftSession(model, PROMPT, max_context=64, max_tree=12, pool=pool).cache.pool is pool


@pytest.mark.parametrize("lookahead", [False, True], ids=["plain", "lookahead"])
def test_llama_draft_sessions_sharing_a_prefix_build_the_trees_they_build_alone(ggufs, lookahead):
    """On one shared pool a prefix is shared by sequence copy: the sessions' searches stay apart as
    the session they shared with rolls back into the prefix, goes on and closes."""
    from common.model.llama_cpp import load_gguf
    from draft_node.engine import DraftEngine
    from tests.test_prefix_sharing import check_draft_sharing

    loaded = load_gguf(ggufs["draft"], kv_type="f32")
    check_draft_sharing(lambda **kw: DraftEngine(loaded, max_context=64, max_tree=12, lookahead=lookahead, **kw))


@pytest.mark.parametrize("lookahead", [False, True])
def test_a_llama_cpp_drafts_search_proposes_only_what_the_grammar_allows(ggufs, lookahead):
    """The GGUF's own vocabulary as llguidance reads it masks the search on llama.cpp too."""
    from common.decoding.grammar import Grammar
    from common.model.llama_cpp import load_gguf
    from draft_node.engine import DraftEngine
    from tests.test_grammar import paths_follow

    loaded = load_gguf(ggufs["draft"], kv_type="f32")
    engine = DraftEngine(loaded, max_context=64, max_tree=12, lookahead=lookahead)
    grammar = Grammar("regex", "(ab|ba)+![0-9]{2,5}").at(len(PROMPT))
    sid = engine.open_session(PROMPT)
    params = TreeParams(budget=12, max_depth=6, max_branch=4, expand_batch=4)
    committed: list[int] = []
    for step in range(3):
        tree = engine.build_tree(sid, committed[-1:] if step else [], params, grammar=grammar).tree
        assert tree.size > 1 and paths_follow(tree, loaded.grammar_tokenizer(), grammar, committed)
        committed.append(int(tree.tokens[1]))
    engine.close_session(sid)
    engine.close()
