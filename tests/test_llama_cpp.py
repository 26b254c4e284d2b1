"""The llama.cpp target backend on tiny GGUF files written in code (F32 and Q8_0): one tree per
`llama_decode` through sequence ids, the accepted path kept, and SpecExec's output equal to the
same backend's autoregressive output, in process and through a real target node."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from client.api import SpecExec
from client.remote import connect
from common.decoding.grammar import Grammar
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TokenTree, TreeParams
from common.model.profiling import synthetic_parents
from common.ops import hugepages
from common.runtime.sessions import StepCancelled
from tests.helpers import Proc, free_port, node_pair
from tests.tiny_models import gguf_model_dir, make_tiny_model, truncate_layers

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[llama]')")

from common.model.llama_cpp import (  # noqa: E402
    LlamaCppError,
    LlamaCppModel,
    load_gguf,
    model_name,
    resolve_backend,
    run_trees,
)

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]
SETTINGS = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.8, "seed": 5}}
# Every layer on the GPU where this llama.cpp was built with one (scripts/gpu_check.sh builds it with CUDA).
NO_GPU = pytest.mark.skipif(not llama_cpp.llama_supports_gpu_offload(), reason="this llama.cpp has no GPU backend")
LAYERS = [pytest.param(0, id="cpu"), pytest.param(99, id="gpu", marks=NO_GPU)]
# How far an F32 tree pass's logits may be from chains' (the logits' spread here is about 4). On CUDA
# llama.cpp multiplies batches on TF32 tensor cores: up to 0.26 apart on the H100, where a wrong
# mask puts them units apart.
TREE_ERROR = {False: 1e-2, True: 0.5}


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[str, Path]:
    """A qwen2 target as F32 and Q8_0 GGUF directories (tokenizer files beside the file), and a torch
    draft sharing its first layer."""
    root = tmp_path_factory.mktemp("gguf")
    target = make_tiny_model(root / "target", arch="qwen2", layers=4, seed=3)
    dirs = {"hf": target, "draft": truncate_layers(target, root / "draft", keep=1)}
    for qtype in ("F32", "Q8_0"):
        dirs[qtype] = gguf_model_dir(target, root / f"target-{qtype.lower()}", qtype)
    return dirs


def chain_logits(model: LlamaCppModel, prefix: list[int], path: list[int]) -> np.ndarray:
    """Logits after each token of `path` (the first at position len(prefix)), as one chain."""
    ctx = model.new_context(64, 32)
    try:
        ctx.extend(prefix)
        n = len(path)
        return ctx.tree(torch.tensor(path), torch.arange(-1, n - 1))
    finally:
        ctx.close()


@pytest.mark.parametrize("n_gpu_layers", LAYERS)
def test_a_tree_in_one_pass_sees_exactly_its_ancestors(ggufs, n_gpu_layers):
    model = LlamaCppModel(ggufs["F32"] / "model.gguf", kv_type="f32", threads=1, n_gpu_layers=n_gpu_layers)
    parents = synthetic_parents(24, seed=3)
    tokens = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(0))
    ctx = model.new_context(64, 32)
    ctx.extend(PROMPT)
    logits = ctx.tree(tokens, parents)  # [24, vocab]
    assert logits.shape == (24, model.cfg.vocab_size)
    worst = 0.0
    for node in range(24):
        path, k = [], node
        while k >= 0:
            path.append(int(tokens[k]))
            k = int(parents[k])
        expected = chain_logits(model, PROMPT, path[::-1])[-1]
        if n_gpu_layers == 0:
            assert int(logits[node].argmax()) == int(expected.argmax())
        worst = max(worst, float(np.abs(logits[node] - expected).max()))
    assert worst < TREE_ERROR[n_gpu_layers > 0], f"tree logits differ from chains by up to {worst}"


def test_keep_leaves_the_accepted_path_as_committed_kv(ggufs):
    """After keeping a path, the next pass sees the prompt and that path only: as if run as a chain."""
    model = LlamaCppModel(ggufs["F32"] / "model.gguf", kv_type="f32", threads=1)
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3])
    tokens = torch.tensor([10, 20, 21, 30, 31, 32, 40])
    ctx = model.new_context(64, 16)
    ctx.extend(PROMPT)
    ctx.tree(tokens, parents)
    ctx.keep([0, 1, 4])  # root, 20, 31
    assert ctx.length == len(PROMPT) + 3
    after = ctx.tree(torch.tensor([50, 60]), torch.tensor([-1, 0]))
    expected = chain_logits(model, PROMPT, [10, 20, 31, 50, 60])[-2:]
    assert np.allclose(after, expected, atol=1e-2)  # batch shapes change the sums in the last bits
    ctx.drop_tree()
    ctx.truncate(len(PROMPT) + 1)  # back to the prompt and the root
    again = ctx.tree(torch.tensor([21]), torch.tensor([-1]))
    assert np.allclose(again[0], chain_logits(model, PROMPT, [10, 21])[-1], atol=1e-2)


@pytest.mark.parametrize("n_gpu_layers", LAYERS)
def test_a_padded_pass_gives_the_same_logits_and_keeps_no_scratch_cells(ggufs, padded, n_gpu_layers):
    """Scratch rows that buy a cheaper pass size (`LlamaCppModel.pad_passes`) sit in a sequence of
    their own: the tree's logits are as unpadded, nothing of them stays, and the next step sees only
    the kept path. Without the KV cells to spare a pass runs as it is."""
    model = LlamaCppModel(ggufs["F32"] / "model.gguf", kv_type="f32", threads=1, n_gpu_layers=n_gpu_layers)
    parents = synthetic_parents(5, seed=1)
    tokens = torch.randint(0, 256, (5,), generator=torch.Generator().manual_seed(2))
    ctx = model.new_context(64, 16)
    ctx.extend(PROMPT)
    got = ctx.tree(tokens, parents)
    assert padded == [3] and ctx.ctx._batch.n_tokens == 8
    ctx.drop_tree()
    ctx.ctx.padding = False
    torch.testing.assert_close(got, ctx.tree(tokens, parents), rtol=1e-4, atol=1e-4)
    ctx.drop_tree()
    ctx.ctx.padding = True
    ctx.tree(tokens, parents)
    ctx.keep([0, 1])
    lib, mem = model.lib, ctx.ctx._mem
    assert all(lib.llama_memory_seq_pos_max(mem, seq) == -1 for seq in ctx.ctx._leaf_free)
    after = ctx.tree(torch.tensor([50, 60]), torch.tensor([-1, 0]))
    path = [int(tokens[0]), int(tokens[1])]
    # a tree's logits against chains': on a GPU, TF32 tensor cores at other batch shapes
    assert np.allclose(after, chain_logits(model, PROMPT, [*path, 50, 60])[-2:], atol=TREE_ERROR[n_gpu_layers > 0])
    made = len(padded)
    tight = model.new_context(len(PROMPT) + 5, 8)
    tight.extend(PROMPT)
    torch.testing.assert_close(tight.tree(tokens, parents), got, rtol=1e-4, atol=1e-4)
    assert tight.ctx._batch.n_tokens == 5 and len(padded) == made


class NoSlotForScratch:
    """llama.cpp as it is, but finding no KV slot for a pass of 8 rows."""

    def __init__(self, lib: Any) -> None:
        self._lib, self.passes = lib, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)

    def llama_decode(self, ctx: Any, batch: Any) -> int:
        self.passes.append(batch.n_tokens)
        return 1 if batch.n_tokens == 8 else self._lib.llama_decode(ctx, batch)


def test_a_padded_pass_llama_cpp_finds_no_room_for_runs_as_it_is(ggufs, padded):
    model = LlamaCppModel(ggufs["F32"] / "model.gguf", kv_type="f32", threads=1)
    tokens, parents = torch.tensor([10, 20, 21, 30, 31]), torch.tensor([-1, 0, 0, 1, 1])
    plain = model.new_context(64, 16)
    plain.ctx.padding = False
    plain.extend(PROMPT[:6])
    ctx = model.new_context(64, 16)
    ctx.ctx.lib = lib = NoSlotForScratch(model.lib)
    ctx.extend(PROMPT[:6])
    torch.testing.assert_close(ctx.tree(tokens, parents), plain.tree(tokens, parents), rtol=1e-4, atol=1e-4)
    assert lib.passes[-2:] == [8, 5] and padded == [3]
    assert all(model.lib.llama_memory_seq_pos_max(ctx.ctx._mem, seq) == -1 for seq in ctx.ctx._leaf_free)


def test_a_tree_whose_walk_fails_gives_back_its_leaf_ids(ggufs):
    """A walk that raises over the pass's logits leaves no tree held: the step can run again alone."""
    model = LlamaCppModel(ggufs["F32"] / "model.gguf", kv_type="f32", threads=1)
    tokens, parents = torch.tensor([10, 20, 21]), torch.tensor([-1, 0, 0])
    ctx = model.new_context(64, 16)
    ctx.extend(PROMPT)
    free = len(ctx.ctx._leaf_free)

    def broken(i: int, rows: np.ndarray) -> None:
        raise RuntimeError("walk failed (injected)")

    with pytest.raises(RuntimeError, match="injected"):
        run_trees([(ctx, tokens, parents, None)], read=broken)
    assert len(ctx.ctx._leaf_free) == free and ctx.length == len(PROMPT)
    np.testing.assert_allclose(ctx.tree(tokens, parents)[1], chain_logits(model, PROMPT, [10, 20])[-1], atol=1e-2)


def test_pending_tokens_in_the_tree_pass_are_as_if_run_first(ggufs):
    """Committed tokens without KV ride in the tree's own llama_decode (their lane's id and every
    leaf's): the nodes see them, and they become committed cells, as if extended first."""
    model = LlamaCppModel(ggufs["F32"] / "model.gguf", kv_type="f32", threads=1)
    parents = synthetic_parents(10, seed=2)
    tokens = torch.randint(0, 256, (10,), generator=torch.Generator().manual_seed(5))
    merged, plain = model.new_context(64, 16), model.new_context(64, 16)
    for ctx in (merged, plain):
        ctx.extend(PROMPT[:3])
    plain.extend(PROMPT[3:])
    got = run_trees([(merged, tokens, parents, None)], [PROMPT[3:]])[0]
    torch.testing.assert_close(got, plain.tree(tokens, parents), rtol=1e-4, atol=1e-4)
    assert merged.length == plain.length == len(PROMPT)
    for ctx in (merged, plain):
        ctx.keep([0, 1])
    after = [ctx.tree(torch.tensor([3, 4]), torch.tensor([-1, 0])) for ctx in (merged, plain)]
    torch.testing.assert_close(after[0], after[1], rtol=1e-4, atol=1e-4)


def test_a_prompt_longer_than_a_pass_gives_the_one_token_loops_tokens(ggufs):
    """A prompt over the shared pass's rows: its head runs first, its tail in the first tree's pass."""
    model = LlamaCppModel(ggufs["F32"] / "model.gguf", kv_type="f32", threads=1)
    prompt = [(i * 37) % 250 for i in range(300)]
    ctx = model.new_context(400, 4)
    ctx.extend(prompt[:-1])
    last, expected = prompt[-1], []
    for _ in range(12):  # the plain loop: one token a pass
        last = int(ctx.tree(torch.tensor([last]), torch.tensor([-1]))[0].argmax())
        ctx.keep([0])
        expected.append(last)
    sampling = SamplingParams(max_new_tokens=12, ignore_eos=True)
    gen = SpecExec.local(str(ggufs["draft"]), str(ggufs["F32"]), tree=TreeParams(budget=16), kv_type="f32")
    assert gen.target.shared is not None and gen.target.shared.n_batch < len(prompt)
    assert gen.generate(prompt, sampling).token_ids == expected


def test_a_closed_sessions_context_is_reused_clean(ggufs):
    """A context of one session's own outlives its session for the next of its size (one-shot runs
    made one per generation): the next session sees none of the last one's cells."""
    model = LlamaCppModel(ggufs["F32"] / "model.gguf", kv_type="f32", threads=1)
    tokens, parents = torch.tensor([3, 4, 5, 6]), torch.tensor([-1, 0, 1, 1])
    first = model.new_context(64, 16)
    first.extend(PROMPT)
    first.tree(tokens, parents)
    first.keep([0, 1, 2])
    first.close()
    again, fresh = model.new_context(64, 16), model.new_context(64, 16)
    assert again.ctx is first.ctx and fresh.ctx is not first.ctx
    for ctx in (again, fresh):
        ctx.extend([9, 8, 7])
    torch.testing.assert_close(again.tree(tokens, parents), fresh.tree(tokens, parents), rtol=1e-5, atol=1e-5)
    again.close()
    assert model.new_context(32, 16).ctx is not first.ctx  # another size gets a context of its own


def test_timing_a_pass_keeps_no_context_behind(ggufs):
    """A profiling pass's context has a shape no session asks for: kept as the spare, the largest
    size's buffers held 0.3 GiB of the 1.5B target node for good after a cold start."""
    model = LlamaCppModel(ggufs["F32"] / "model.gguf", kv_type="f32", threads=1)
    session = model.new_context(64, 16)
    session.close()
    spare = model._spare
    assert spare is not None
    assert model.time_tree(8, 4, np.array([-1, 0, 0, 1, 1, 2, 3, 3])) > 0
    assert model._spare is None and spare._ctx is None  # the session's spare was closed, not reshaped


def test_too_many_leaves_or_nodes_are_refused_clearly(ggufs):
    model = LlamaCppModel(ggufs["F32"] / "model.gguf", threads=1)
    ctx = model.new_context(64, 8)
    ctx.extend(PROMPT)
    with pytest.raises(ValueError, match="tree has 10 nodes, over this context's limit of 9"):
        ctx.tree(torch.zeros(10, dtype=torch.long), torch.tensor([-1] + [0] * 9))


def test_a_build_with_amx_kernels_loads_without_repacked_weights(ggufs, monkeypatch, caplog):
    """ggml's AMX kernels segfaulted in llama_decode on the Q8_0 file on a Sapphire Rapids CPU, and
    they are an extra buffer type: such a build must not put weights in them."""
    import common.model.llama_cpp as backend

    monkeypatch.setattr(backend, "has_amx", lambda lib: True)
    model = LlamaCppModel(ggufs["Q8_0"] / "model.gguf", threads=1)
    assert model.repack is False
    assert "AMX" in caplog.text


def test_a_gpu_build_streams_trees_from_two_rows_unless_told_otherwise(monkeypatch):
    """llama.cpp reads GGML_OP_OFFLOAD_MIN_BATCH once, as its GPU backend starts: ours (2 rows, not
    llama.cpp's 32) is set before that, and a user's own value is kept."""
    import common.model.llama_cpp as backend

    monkeypatch.delenv("GGML_OP_OFFLOAD_MIN_BATCH", raising=False)
    backend._init_backend(True)
    assert os.environ["GGML_OP_OFFLOAD_MIN_BATCH"] == str(backend.OP_OFFLOAD_MIN_BATCH) == "2"
    monkeypatch.setenv("GGML_OP_OFFLOAD_MIN_BATCH", "8")
    backend._init_backend(True)
    assert os.environ["GGML_OP_OFFLOAD_MIN_BATCH"] == "8"


def test_a_file_llama_cpp_cannot_load_gets_a_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(LlamaCppError, match="could not load"):
        LlamaCppModel(bad)


def test_a_file_that_is_no_whole_gguf_is_named_as_given_on_either_backend(ggufs, tmp_path, monkeypatch, capsys):
    """A truncated, empty or foreign file named `.gguf` ended in a struct error's traceback, or named
    a link in the cache; a failed read left a half-built directory there that the next start took
    as built. Now one line names the user's file, for a node (tokenizer read in a child) too."""
    from client.cli.main import main
    from common.model.store import BadModelFileError, convert_gguf

    monkeypatch.setenv("SPECEXEC_HOME", str(tmp_path / "home"))
    whole = (ggufs["F32"] / "model.gguf").read_bytes()
    files = {"empty": b"", "text": b"not a model\n", "truncated": whole[: len(whole) // 2]}
    said = {"empty": "is empty", "text": "does not start with the GGUF magic", "truncated": "damaged or truncated"}
    for name, data in files.items():
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(data)
        for tokenizer in (True, False):
            with pytest.raises(BadModelFileError, match=said[name]) as err:
                load_gguf(bad, tokenizer=tokenizer)
            assert str(bad) in str(err.value) and "gguf-beside" not in str(err.value)
        with pytest.raises(BadModelFileError, match=said[name]):
            convert_gguf(bad, progress=False)
        assert main(["generate", "--target-model", str(bad), "--mode", "autoregressive", "--prompt", "hi"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(bad) in err and "Traceback" not in err
    assert not any((tmp_path / "home" / "gguf-beside").glob("*"))
    assert not any((tmp_path / "home" / "models").glob("*"))


@pytest.mark.skipif(llama_cpp.llama_supports_gpu_offload(), reason="this llama.cpp has a GPU backend")
def test_gpu_layers_a_cpu_build_ignores_are_not_reported_as_on_the_gpu(ggufs, capsys):
    """The ready line said "10 layers on the GPU" right after warning that they were ignored, and
    a negative count was taken."""
    from client.cli.main import main
    from common.rpc.bootstrap import NodeConfig, describe_weights

    loaded = load_gguf(ggufs["F32"], n_gpu_layers=10, tokenizer=False)
    assert loaded.model.n_gpu_layers == 0
    # a bare model.gguf is named by its directory, not "model" (its tokenizer is read beside it)
    assert model_name(Path("/m/qwen-gguf/model.gguf"), Path("/cache/gguf-beside/model-1-2")) == "qwen-gguf"
    assert model_name(Path("/m/qwen-q4.gguf"), Path("/cache/gguf-beside/qwen-q4-1-2")) == "qwen-q4"
    assert model_name(ggufs["F32"] / "model.gguf", ggufs["F32"]) == loaded.name == ggufs["F32"].name
    assert "0 layers on the GPU" in describe_weights(NodeConfig(model="m", listen=":0", n_gpu_layers=10), loaded)
    for argv in (["target", "--model", "m", "--n-gpu-layers", "-3"], ["local", "--draft-n-gpu-layers", "-1"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2 and "n-gpu-layers: must be >= 0, got" in capsys.readouterr().err


def test_a_budget_over_the_llama_cpp_limit_or_a_missing_draft_is_refused_before_loading(ggufs, monkeypatch):
    """It was found by the target at the first tree, after the draft had built all 301 nodes."""
    import client.api

    monkeypatch.setattr(client.api, "load_gguf", lambda *a, **k: pytest.fail("loaded before the check"))
    with pytest.raises(ValueError, match=r"budget 300 is over the llama\.cpp target's limit of 255"):
        SpecExec.local(str(ggufs["draft"]), str(ggufs["F32"]), tree=TreeParams(budget=300), backend="llama.cpp")
    # A draft that is not there was found after the target's load (27 s and 7.5 GB for the 1.5B)
    missing = str(ggufs["F32"].parent / "nonexistent")
    from common.model.store import ModelStoreError

    for draft_backend in ("torch", "llama.cpp"):
        with pytest.raises((FileNotFoundError, ModelStoreError), match="nonexistent"):
            SpecExec.local(missing, str(ggufs["F32"]), backend="llama.cpp", draft_backend=draft_backend)
    # llama.cpp's options for a torch target were ignored
    monkeypatch.setattr(client.api, "load_target", lambda *a, **k: pytest.fail("loaded before the check"))
    for options in ({"n_gpu_layers": 5}, {"kv_type": "f32"}):
        with pytest.raises(ValueError, match=r"are for a model on llama\.cpp; the target .* runs on torch"):
            SpecExec.local(None, str(ggufs["hf"]), mode="autoregressive", **options)


def generate_both(
    ggufs, qtype: str, sampling: SamplingParams, budget: int = 16, n_gpu_layers: int = 0
) -> dict[str, Any]:
    kv = "f32" if qtype == "F32" else "f16"
    runs = {}
    for mode in ("autoregressive", "specexec"):
        gen = SpecExec.local(str(ggufs["draft"]), str(ggufs[qtype]), mode=mode, tree=TreeParams(budget=budget),
                             backend="llama.cpp", kv_type=kv, n_gpu_layers=n_gpu_layers)  # fmt: skip
        runs[mode] = gen.generate(PROMPT, sampling)
    return runs


@pytest.mark.parametrize("setting", SETTINGS)
def test_specexec_on_llama_cpp_f32_equals_its_autoregressive_output(ggufs, setting):
    """On the CPU. On CUDA the tree passes' TF32 kernels part the text at near ties (next test)."""
    sampling = SamplingParams(max_new_tokens=40, ignore_eos=True, **SETTINGS[setting])
    runs = generate_both(ggufs, "F32", sampling)
    assert runs["specexec"].token_ids == runs["autoregressive"].token_ids
    assert runs["specexec"].stats.target_steps < runs["autoregressive"].stats.target_steps


def test_logprobs_on_llama_cpp_are_its_own_logits(ggufs):
    """Tree steps and one-token steps give each token's log-probs from llama.cpp's own logits: the
    F32 file's, within float rounding of the Hugging Face model it was converted from."""
    from tests.test_logprobs import check_close, reference_logprobs

    sampling = SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.8, seed=5, logprobs=2)
    for mode in ("autoregressive", "specexec"):
        gen = SpecExec.local(str(ggufs["draft"]), str(ggufs["F32"]), mode=mode, tree=TreeParams(budget=16),
                             backend="llama.cpp", kv_type="f32")  # fmt: skip
        chunks = list(gen.stream(PROMPT, sampling))
        ids = [t for c in chunks for t in c.token_ids]
        got = [lp for c in chunks for lp in (c.logprobs or [])]
        check_close(got, reference_logprobs(ggufs["hf"], PROMPT, ids, 2), tolerance=2e-3)


def test_a_kept_sequences_next_turn_on_llama_cpp_equals_its_autoregressive_output(ggufs):
    """The prompt cache on llama.cpp: a chat's next turn on the kept sessions (both nodes rolled back
    to the shared prefix) equals the target alone on the whole turn."""
    sampling = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.8, top_p=0.9, seed=5)
    gen = SpecExec.local(str(ggufs["draft"]), str(ggufs["F32"]), tree=TreeParams(budget=16), backend="llama.cpp",
                         kv_type="f32", max_sessions=2)  # fmt: skip
    alone = SpecExec.local(None, str(ggufs["F32"]), mode="autoregressive", backend="llama.cpp", kv_type="f32")
    gen.use_prompt_cache(1)
    first = gen.generate(PROMPT, sampling)
    turn = [*PROMPT, *first.token_ids, 40, 41, 42]
    second = gen.generate(turn, sampling)
    assert second.stats.cached_prompt_tokens == len(PROMPT) + len(first.token_ids)
    assert second.token_ids == alone.generate(turn, sampling).token_ids
    gen.close()
    assert len(gen.target.sessions) == 0


@pytest.mark.parametrize(("qtype", "n_gpu_layers", "tie"), [
    pytest.param("Q8_0", 0, 0.05, id="q8_0-cpu"), pytest.param("F32", 99, 0.2, id="f32-gpu", marks=NO_GPU)])  # fmt: skip
def test_tree_passes_differ_from_one_token_passes_only_at_near_ties(ggufs, qtype, n_gpu_layers, tie):
    """llama.cpp multiplies a batch of 16+ rows with other kernels than one row (on CUDA, TF32 tensor
    cores even for F32 weights), so a tree's logits differ from one-token logits and greedy text can
    part at a near tie (docs/benchmarks.md measures how often on the real pair). Where it parts, the
    two tokens' one-token logits must be within `tie` of each other, a fraction of the logits'
    spread: a wrong mask would part at a clear winner."""
    sampling = SamplingParams(max_new_tokens=40, ignore_eos=True)
    runs = generate_both(ggufs, qtype, sampling, n_gpu_layers=n_gpu_layers)
    ours, alone = runs["specexec"].token_ids, runs["autoregressive"].token_ids
    assert_parts_only_at_a_near_tie(ggufs[qtype], n_gpu_layers, ours, alone, tie)


def assert_parts_only_at_a_near_tie(model_dir: Path, n_gpu_layers: int, ours: list[int], alone: list[int],
                                    tie: float) -> None:  # fmt: skip
    """Greedy `ours` may leave the one-token loop's `alone` only where the two tokens' logits are
    within `tie` of the logits' spread."""
    assert len(ours) == len(alone)
    first = next((i for i, (a, b) in enumerate(zip(ours, alone, strict=True)) if a != b), None)
    if first is None:
        return
    kv = "f16" if "q8_0" in model_dir.name else "f32"
    model = LlamaCppModel(model_dir / "model.gguf", threads=1, kv_type=kv, n_gpu_layers=n_gpu_layers)
    history = PROMPT + alone[:first]
    logits = chain_logits(model, history[:-1], history[-1:])[-1]
    model.close()
    if not n_gpu_layers:  # on CUDA this reference, a batched pass, has the batched kernels' error too
        assert int(logits.argmax()) == alone[first]
    gap = abs(float(logits[alone[first]] - logits[ours[first]]))
    assert gap < tie * float(logits.std()), f"parted at position {first} with a logit gap of {gap}"


@NO_GPU
def test_both_nodes_on_the_gpu_generate_the_target_alones_text(ggufs, tmp_path):
    """A whole generation on a GPU through real nodes: `specexec target` (torch-free) and `specexec
    draft` on llama.cpp with every layer on the GPU, the draft's lookahead on. TF32 tree passes may
    part the text from the one-token loop's only at a near tie."""
    models = {"target": ggufs["F32"], "draft": gguf_model_dir(ggufs["draft"], tmp_path / "draft-gguf")}
    env = {**os.environ, "SPECEXEC_HOME": str(tmp_path / "home")}
    addrs = {role: f"127.0.0.1:{free_port()}" for role in models}
    nodes = {role: Proc(role, ["-m", "client.cli.main", role, "--model", str(models[role]), "--kv-type", "f32",
                               "--n-gpu-layers", "99", "--listen", addrs[role]], env, tmp_path)
             for role in models}  # fmt: skip
    sampling = SamplingParams(max_new_tokens=40, ignore_eos=True)
    try:
        for role, node in nodes.items():
            node.wait_serving(addrs[role])
        gen = connect(addrs["draft"], addrs["target"], tree=TreeParams(budget=16))
        assert gen.target.info().device == gen.draft.info().device == "cuda"
        out = gen.generate(PROMPT, sampling)
        maps = Path(f"/proc/{nodes['target'].popen.pid}/maps").read_text()
        assert "libggml-cuda" in maps and "libtorch" not in maps, nodes["target"].output()
    finally:
        for node in nodes.values():
            node.stop()
    assert out.stats.target_steps < 40 and out.stats.reused_trees > 0
    alone = SpecExec.local(None, str(ggufs["F32"]), mode="autoregressive", kv_type="f32", n_gpu_layers=99)
    assert_parts_only_at_a_near_tie(ggufs["F32"], 99, out.token_ids, alone.generate(PROMPT, sampling).token_ids, 0.2)


@NO_GPU
def test_a_draft_on_the_gpu_beside_a_target_streamed_from_ram(ggufs, tmp_path):
    """The paper's one-machine setup in one process: the target's layers stay in RAM and stream to the
    GPU for each tree (one-token passes run on the CPU), the draft runs whole on the GPU."""
    draft = gguf_model_dir(ggufs["draft"], tmp_path / "draft-gguf")
    sampling = SamplingParams(max_new_tokens=40, ignore_eos=True)
    gen = SpecExec.local(str(draft), str(ggufs["F32"]), tree=TreeParams(budget=16), kv_type="f32",
                         draft_n_gpu_layers=99)  # fmt: skip
    assert gen.draft.loaded.model.device == "cuda" and gen.target.loaded.model.device == "cpu"
    out = gen.generate(PROMPT, sampling)
    assert out.stats.target_steps < 40
    alone = SpecExec.local(None, str(ggufs["F32"]), mode="autoregressive", kv_type="f32")
    assert_parts_only_at_a_near_tie(ggufs["F32"], 0, out.token_ids, alone.generate(PROMPT, sampling).token_ids, 0.2)


def test_draft_gpu_layers_need_a_llama_cpp_draft_and_a_gpu_build(ggufs, tmp_path, caplog):
    with pytest.raises(ValueError, match=r"needs a GGUF draft on llama\.cpp"):
        SpecExec.local(str(ggufs["draft"]), str(ggufs["F32"]), draft_n_gpu_layers=99)
    if llama_cpp.llama_supports_gpu_offload():
        return
    draft = gguf_model_dir(ggufs["draft"], tmp_path / "draft-gguf")
    with caplog.at_level("WARNING"):
        gen = SpecExec.local(str(draft), str(ggufs["F32"]), tree=TreeParams(budget=8), draft_n_gpu_layers=99)
    assert gen.draft.loaded.model.device == "cpu" and gen.draft.loaded.model.n_gpu_layers == 0
    assert "no GPU backend, so --n-gpu-layers 99 is ignored" in caplog.text


def test_auto_picks_llama_cpp_for_a_gguf_target(ggufs):
    gen = SpecExec.local(str(ggufs["draft"]), str(ggufs["F32"]), tree=TreeParams(budget=8))
    assert type(gen.target.loaded.model).__name__ == "LlamaCppModel"
    torch_gen = SpecExec.local(str(ggufs["draft"]), str(ggufs["hf"]), tree=TreeParams(budget=8))
    assert isinstance(torch_gen.target.loaded.model, torch.nn.Module)  # safetensors, no GGUF
    assert resolve_backend("torch", str(ggufs["F32"])) == "torch"
    assert resolve_backend("auto", str(ggufs["F32"]), plain=False) == "torch"  # int8, offload, compile, GPU


def test_load_gguf_reads_identity_from_the_directory(ggufs):
    loaded = load_gguf(ggufs["Q8_0"])
    assert loaded.model.cfg.vocab_size == 260
    assert loaded.eos_token_ids == (256,)
    hf = SpecExec.local(None, str(ggufs["hf"]), mode="autoregressive", backend="torch")
    assert loaded.tokenizer_fingerprint == hf.target.loaded.tokenizer_fingerprint


def test_a_nodes_tokenizer_identity_is_read_apart_and_cached(ggufs, tmp_path, monkeypatch):
    """A node reads its tokenizer's identity in a child process (transformers would load torch)
    and caches it: the same EOS ids and fingerprint as the tokenizer itself, once."""
    import subprocess as sp

    monkeypatch.setenv("SPECEXEC_HOME", str(tmp_path / "home"))
    model = ggufs["Q8_0"]
    full = load_gguf(model)
    node = load_gguf(model, tokenizer=False)
    assert node.tokenizer is None and full.tokenizer is not None
    assert (node.eos_token_ids, node.tokenizer_fingerprint, node.path, node.name) == (
        full.eos_token_ids, full.tokenizer_fingerprint, full.path, full.name)  # fmt: skip
    monkeypatch.setattr(sp, "run", lambda *a, **k: pytest.fail("the cached identity was read again"))
    assert load_gguf(model, tokenizer=False).tokenizer_fingerprint == full.tokenizer_fingerprint


def test_target_node_on_llama_cpp_serves_the_same_tokens(ggufs, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEXEC_HOME", str(tmp_path / "home"))  # profiles and fetched tokenizers
    env = dict(os.environ)
    sampling = SamplingParams(max_new_tokens=32, ignore_eos=True, temperature=0.8, seed=2)
    alone = SpecExec.local(None, str(ggufs["F32"]), mode="autoregressive", backend="llama.cpp", kv_type="f32")
    expected = alone.generate(PROMPT, sampling).token_ids
    target = ["--model", str(ggufs["F32"]), "--backend", "llama.cpp", "--kv-type", "f32"]
    with node_pair(target, ["--model", str(ggufs["draft"]), "--max-tree", "16"], env, tmp_path) as addrs:
        gen = connect(addrs["draft"], addrs["target"], tree=TreeParams(budget=16))
        assert gen.target.info().dtype == "gguf (f32 KV)"
        assert len(gen.target.info().forward_curve) > 1  # profiled through llama.cpp
        out = gen.generate(PROMPT, sampling)
        assert out.token_ids == expected
        # llama.cpp's default limit: 256 sequence ids, one per session (8) and one per leaf
        assert gen.target.info().max_tree_nodes == 256 - 8 + 1
        auto = connect(addrs["draft"], addrs["target"], tree=TreeParams(budget=1024), auto_budget=True)
        assert auto.tree is not None and auto.tree.budget == 16  # fitted to the smaller node
        assert auto.generate(PROMPT, sampling).token_ids == expected


def test_a_target_node_on_llama_cpp_runs_without_torch(ggufs, tmp_path):
    """`specexec target` on llama.cpp loads neither torch nor the client: about 180 MiB less RSS, and on
    a GPU a CUDA build of llama.cpp crashed at load in a process holding PyTorch's CUDA build
    (docs/benchmarks.md, "On a GPU"). The node still profiles, verifies and samples."""
    from client.remote import RemoteTarget

    addr = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "SPECEXEC_HOME": str(tmp_path / "home")}
    args = ["-m", "client.cli.main", "target", "--model", str(ggufs["F32"]), "--backend", "llama.cpp",
            "--kv-type", "f32", "--listen", addr]  # fmt: skip
    node = Proc("target", args, env, tmp_path)
    try:
        node.wait_serving(addr)
        target = RemoteTarget(addr)
        assert len(target.info().forward_curve) > 1
        sid = target.open_session(PROMPT)
        tree = TokenTree(np.array([PROMPT[-1], 7, 9, 11]), np.array([-1, 0, 1, 0]))
        result = target.verify(sid, tree, SamplingParams(temperature=0.8, seed=3), 4)
        assert result.tokens and result.accepted <= 2
        maps = Path(f"/proc/{node.popen.pid}/maps").read_text()
        assert "libllama" in maps and "libtorch" not in maps, node.output()
        # The node restarted itself with glibc's huge-page tunable (common.ops.hugepages), same pid.
        environ = Path(f"/proc/{node.popen.pid}/environ").read_bytes().split(b"\0")
        tuned = any(hugepages.TUNABLE.encode() in e for e in environ if e.startswith(b"GLIBC_TUNABLES="))
        assert tuned == (hugepages.wanted(env) or hugepages.active(env)), node.output()
        target.close()
    finally:
        node.stop()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--max-tree", "300"], "over the llama.cpp backend's limit of 255"),
        (["--offload"], "drop --offload"),
        (["--kv-cache-tokens", "1000"], "--kv-cache-tokens 1000 cannot hold one session's"),
    ],
)
def test_target_node_refuses_what_llama_cpp_cannot_do(ggufs, args, needle):
    cmd = [sys.executable, "-m", "target_node", "--model", str(ggufs["F32"]), "--listen",
           f"127.0.0.1:{free_port()}", "--backend", "llama.cpp", "--no-profile", *args]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 2 and needle in run.stderr, run.stderr[-2000:]


def llama_engine(loaded: Any, **kwargs: Any) -> Any:
    from target_node.engine import TargetEngine

    return TargetEngine(loaded, **{"max_context": 64, "max_tree": 24, "max_sessions": 6, **kwargs})


def test_lanes_of_one_context_see_only_their_own_cells(ggufs):
    """Two sessions' trees in one llama_decode on a shared context: each gets the logits it gets in
    a context of its own, before and after the other keeps a path; a closed lane's id comes back clean."""
    model = LlamaCppModel(ggufs["F32"] / "model.gguf", kv_type="f32", threads=1)
    shared = model.shared_context(3, 64, 16, 64)
    gen = torch.Generator().manual_seed(4)
    prompts_ = [PROMPT, [9, 8, 7]]
    lanes = [shared.lane(64, 16) for _ in prompts_]
    alone = [model.new_context(64, 16) for _ in prompts_]
    for ctx, prompt in zip([*lanes, *alone], prompts_ * 2, strict=True):
        ctx.extend(prompt)
    for step in range(2):
        trees = [(torch.randint(0, 256, (n,), generator=gen), synthetic_parents(n, seed=step + n)) for n in (9, 5)]
        got = run_trees([(lane, tokens, parents, None) for lane, (tokens, parents) in zip(lanes, trees, strict=True)])
        for ctx, (tokens, parents), logits in zip(alone, trees, got, strict=True):
            torch.testing.assert_close(logits, ctx.tree(tokens, parents), rtol=1e-4, atol=1e-4)
        for ctx in [*lanes, *alone]:
            ctx.keep([0, 1])
    lanes[0].close()
    fresh, again = shared.lane(64, 16), model.new_context(64, 16)
    for ctx in (fresh, again):
        ctx.extend([5, 6])
    tokens, parents = torch.tensor([1, 2, 3]), torch.tensor([-1, 0, 0])
    torch.testing.assert_close(fresh.tree(tokens, parents), again.tree(tokens, parents), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="context is closed"):
        lanes[0].tree(tokens, parents)


@pytest.mark.parametrize("n_gpu_layers", LAYERS)
@pytest.mark.parametrize("setting", SETTINGS)
def test_llama_sessions_verified_in_one_pass_equal_each_alone(ggufs, setting, n_gpu_layers):
    from tests.test_batching import at_once, prompts, random_tree

    loaded = load_gguf(ggufs["F32"], kv_type="f32", n_gpu_layers=n_gpu_layers)
    sampling = SamplingParams(max_new_tokens=8, **SETTINGS[setting])
    ps = prompts(loaded.model.cfg.vocab_size, 5)
    gen = torch.Generator().manual_seed(3)
    alone = llama_engine(loaded, max_batch_tokens=1)
    together = llama_engine(loaded, batch_window=2.0)
    assert alone.shared is None and together.shared is not None
    sids = {name: [e.open_session(p) for p in ps] for name, e in (("alone", alone), ("together", together))}
    for step in range(2):
        trees = [random_tree(0, 1 + 4 * i, loaded.model.cfg.vocab_size, gen) for i in range(len(ps))]
        expected = []
        for sid, tree in zip(sids["alone"], trees, strict=True):
            root = alone.sessions.get(sid).committed[-1]
            expected.append(alone.verify(sid, replace_root(tree, root), sampling, 8))
        calls = [lambda s=s, t=t: together.verify(s, replace_root(t, together.sessions.get(s).committed[-1]),
                                                  sampling, 8) for s, t in zip(sids["together"], trees, strict=True)]  # fmt: skip
        got = at_once(calls)
        assert [(r.tokens, r.accepted) for r in got] == [(r.tokens, r.accepted) for r in expected], step
        assert {r.pass_sessions for r in got} == {len(ps)}


def replace_root(tree: Any, root: int) -> Any:
    from common.decoding.tree import TokenTree

    tokens = tree.tokens.copy()
    tokens[0] = root
    return TokenTree(tokens, tree.parents)


@pytest.mark.parametrize("n_gpu_layers", LAYERS)
@pytest.mark.parametrize("setting", SETTINGS)
def test_a_long_prompt_in_chunks_beside_another_session_equals_it_alone(ggufs, setting, n_gpu_layers):
    """Chunked prefill on a shared context: the long prompt's chunks run while the other session
    verifies its trees, and both get what they get with contexts and passes of their own."""
    from tests.test_batching import at_once, random_tree
    from tests.test_chunked_prefill import chunks

    loaded = load_gguf(ggufs["F32"], kv_type="f32", n_gpu_layers=n_gpu_layers)
    sampling = SamplingParams(max_new_tokens=8, **SETTINGS[setting])
    vocab = loaded.model.cfg.vocab_size
    gen = torch.Generator().manual_seed(13)
    long, short = torch.randint(0, vocab, (41,), generator=gen).tolist(), [9, 8, 7]
    trees = [random_tree(0, 5, vocab, gen) for _ in range(4)]
    alone = llama_engine(loaded, max_batch_tokens=1)
    together = llama_engine(loaded, prefill_chunk=8)
    assert together.shared is not None

    def steps(engine: Any, sid: str) -> list[list[int]]:
        return [engine.verify(sid, replace_root(t, engine.sessions.get(sid).committed[-1]), sampling, 4).tokens
                for t in trees]  # fmt: skip

    expected = [steps(alone, alone.open_session(p)) for p in (long, short)]
    sids = [together.open_session(p) for p in (long, short)]
    before = chunks()
    got = at_once([lambda s=s: steps(together, s) for s in sids])
    assert got == expected
    assert chunks()[0] - before[0] == 4  # 40 pending rows: 4 chunks of 8, then 8 with the tree


def test_a_failed_shared_pass_after_its_chunks_ran_keeps_the_prompt_exact(ggufs, monkeypatch):
    """A prompt's chunks ride in passes beside another session's trees; when the pass with its tree
    then fails, each step is laid out again and runs alone, and no chunk runs past the prompt's
    last token."""
    import target_node.llama_session as backend
    from target_node.engine import VerifyJob
    from tests.test_batching import random_tree

    loaded = load_gguf(ggufs["F32"], kv_type="f32")
    vocab, greedy = loaded.model.cfg.vocab_size, SamplingParams(max_new_tokens=8)
    gen = torch.Generator().manual_seed(13)
    long = torch.randint(0, vocab, (45,), generator=gen).tolist()
    tree = random_tree(long[-1], 5, vocab, gen)
    alone = llama_engine(loaded, max_batch_tokens=1)
    expected = alone.verify(alone.open_session(long), tree, greedy, 4)
    engine = llama_engine(loaded, prefill_chunk=8)
    long_sid, short_sid = engine.open_session(long), engine.open_session([9, 8, 7])
    session, other = engine.sessions.get(long_sid), engine.sessions.get(short_sid)
    real, failed, shared = backend.run_trees, [], []

    def fails_once(trees, pending=None, read=None):
        shared.append(len(trees))
        if session.ctx.length == 40 and len(trees) > 1 and not failed:  # the last chunk ran beside the other's tree
            failed.append(1)
            raise LlamaCppError("llama_decode failed (injected)")
        return real(trees, pending, read)

    monkeypatch.setattr(backend, "run_trees", fails_once)
    job, beside = VerifyJob(long_sid, session, tree, greedy, 4, [], None, None), None
    with engine._lock:
        while not job.done:
            if beside is None or beside.done:
                tree_b = replace_root(random_tree(0, 3, vocab, gen), other.committed[-1])
                beside = VerifyJob(short_sid, other, tree_b, greedy, 4, [], None, None)
            engine._run_pass([job, beside])
    assert failed and job.error is None and job.result.tokens == expected.tokens
    assert shared.count(2) >= 5  # the five chunks each shared a pass


def test_a_regenerate_cancelled_between_chunks_keeps_only_its_own_kv(ggufs):
    from tests.test_batching import random_tree

    loaded = load_gguf(ggufs["F32"], kv_type="f32")
    vocab, greedy = loaded.model.cfg.vocab_size, SamplingParams(max_new_tokens=8)
    gen = torch.Generator().manual_seed(3)
    prompt, turn = (torch.randint(0, vocab, (30,), generator=gen).tolist() for _ in range(2))
    tree = random_tree(prompt[-1], 5, vocab, gen)
    reference = llama_engine(loaded, max_batch_tokens=1)
    rsid = reference.open_session(prompt)
    expected = reference.verify(rsid, tree, greedy, 4)
    engine = llama_engine(loaded, prefill_chunk=8)
    engine.open_session([1, 2, 3])
    sid = engine.open_session(prompt)
    assert engine.verify(sid, tree, greedy, 4).tokens == expected.tokens
    asked: list[int] = []
    with pytest.raises(StepCancelled):
        engine.verify(sid, random_tree(turn[-1], 3, vocab, gen), greedy, 4, truncate_to=5, append=turn,
                      cancelled=lambda: asked.append(1) or len(asked) >= 3)  # fmt: skip
    session = engine.sessions.get(sid)
    assert session.cached_length == 4 and not session.ctx.held
    again = replace_root(random_tree(0, 5, vocab, gen), session.committed[-1])
    assert engine.verify(sid, again, greedy, 4).tokens == reference.verify(rsid, again, greedy, 4).tokens


def test_a_prompt_half_run_in_chunks_loses_its_kv_last(ggufs):
    loaded = load_gguf(ggufs["F32"], kv_type="f32")
    shared = loaded.model.shared_context(3, 64, 8, 64, cells=100)
    lanes = [shared.lane(64, 8) for _ in range(3)]
    for lane, n in zip(lanes, (40, 20, 20), strict=True):
        lane.extend(list(range(1, n + 1)))
    lanes[0].held = True  # the oldest, but half its prompt's chunks have run
    shared.make_room(30, [lanes[2]])
    assert [lane.length for lane in lanes] == [40, 0, 20]
    shared.make_room(70, [lanes[2]])  # nothing else left to take
    assert [lane.length for lane in lanes] == [0, 0, 20]


def test_trees_too_large_to_share_get_contexts_of_their_own(ggufs):
    loaded = load_gguf(ggufs["F32"], kv_type="f32")
    from target_node.engine import TargetEngine

    assert TargetEngine(loaded, max_context=64, max_tree=255, max_sessions=8).shared is None
    assert TargetEngine(loaded, max_context=64, max_tree=248, max_sessions=8).shared is not None


def together_equals_alone(ggufs, count: int, seed: int, size: Callable[[int], int],
                          between: Callable[[], None] | None = None, n_gpu_layers: int = 0) -> list[Any]:  # fmt: skip
    """`count` sessions' trees verified at once on a shared-context engine must give what each gets
    on an engine whose sessions have contexts (and passes) of their own; returns the shared results.
    `between`: called after the sessions alone ran."""
    from tests.test_batching import at_once, prompts, random_tree

    loaded = load_gguf(ggufs["F32"], kv_type="f32", n_gpu_layers=n_gpu_layers)
    sampling, vocab = SamplingParams(max_new_tokens=8), loaded.model.cfg.vocab_size
    ps = prompts(vocab, count, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    trees = [random_tree(p[-1], size(i), vocab, gen) for i, p in enumerate(ps)]
    alone = llama_engine(loaded, max_batch_tokens=1)
    expected = [alone.verify(alone.open_session(p), t, sampling, 8) for p, t in zip(ps, trees, strict=True)]
    if between is not None:
        between()
    together = llama_engine(loaded, batch_window=2.0)
    sids = [together.open_session(p) for p in ps]
    got = at_once([lambda s=s, t=t: together.verify(s, t, sampling, 8) for s, t in zip(sids, trees, strict=True)])
    assert [(r.tokens, r.accepted) for r in got] == [(r.tokens, r.accepted) for r in expected]
    return got


def test_a_llama_cpp_node_pads_to_its_curves_cheap_sizes_and_publishes_their_cost(ggufs, loaded, monkeypatch):
    from target_node.engine import TargetEngine

    curve = [(1, 0.04), (8, 0.26), (15, 0.35), (16, 0.26)]
    engine = llama_engine(load_gguf(ggufs["F32"], kv_type="f32"))
    engine.use_curve(curve)
    assert engine.forward_curve == ((1, 0.04), (8, 0.26), (15, 0.26), (16, 0.26))
    assert engine.loaded.model.pad_rows[15] == 16 and engine.loaded.model.pad_rows[8] == 8
    monkeypatch.setenv("SPECEXEC_PAD_PASSES", "0")
    engine.use_curve(curve)
    assert engine.forward_curve == tuple(curve) and engine.loaded.model.pad_rows is None
    ours = TargetEngine(loaded["target"], max_tree=8)  # our transformer's passes are never padded
    ours.use_curve(curve)
    assert ours.forward_curve == tuple(curve)


@pytest.mark.parametrize("n_gpu_layers", LAYERS)
def test_shared_passes_padded_to_cheaper_sizes_equal_each_alone_unpadded(ggufs, padded, n_gpu_layers):
    padded.on = False

    def pad_from_now() -> None:
        padded.on = True

    got = together_equals_alone(ggufs, 4, seed=5, size=lambda i: 2 + 3 * i, between=pad_from_now,
                                n_gpu_layers=n_gpu_layers)  # fmt: skip
    assert max(r.pass_sessions for r in got) > 1 and padded == [6]  # 26 rows in one pass, run as 32


def test_a_failed_shared_llama_pass_runs_each_tree_alone(ggufs, monkeypatch):
    from target_node.llama_session import LlamaTargetSession

    real = LlamaTargetSession.run_together

    def broken(steps):
        if len(steps) > 1:
            raise LlamaCppError("llama_decode failed (1) on a batch (injected)")
        return real(steps)

    monkeypatch.setattr(LlamaTargetSession, "run_together", staticmethod(broken))
    got = together_equals_alone(ggufs, 3, seed=9, size=lambda i: 3 + 2 * i)
    assert {r.pass_sessions for r in got} == {1}


def test_trees_that_do_not_fit_one_llama_pass_go_in_several(ggufs, monkeypatch):
    """A pass bounded by its batch and its leaf ids: the waiting trees go into several passes, each
    walked before the next runs, and every session gets what it gets alone."""
    import common.model.llama_cpp as backend

    monkeypatch.setattr(backend, "MAX_SHARED_ROWS", 20)  # 64 rows (llama.cpp's least) and 19 leaf ids a pass
    got = together_equals_alone(ggufs, 5, seed=12, size=lambda i: 1 + 4 * i)
    assert 1 < max(r.pass_sessions for r in got) < 5


def test_one_shot_cli_runs_allocate_one_sessions_kv(ggufs):
    """`generate`/`chat`/`profile` in process run one generation at a time: a llama.cpp target
    then has one context of its own, not the KV cache of 8 sessions (1.63 against 2.53 GiB peak RSS
    for the 1.5B GGUF)."""
    from client.cli.args import generator_from
    from client.cli.main import build_parser

    args = build_parser().parse_args(
        ["generate", "--target-model", str(ggufs["F32"]), "--mode", "autoregressive", "--prompt", "x"]
    )
    gen = generator_from(args)
    assert gen.target.shared is None and gen.target.sessions.max_sessions == 1
    assert SpecExec.local(None, str(ggufs["F32"]), mode="autoregressive").target.shared is not None


@pytest.mark.parametrize("setting", SETTINGS)
def test_a_full_kv_pool_recomputes_the_least_recent_session(ggufs, setting):
    """Three sessions on a pool of one session's cells (100 + 16 + 1): each step that lacks room takes
    the KV of the session used least recently, which runs its history again at its next step; every
    step (a new chat turn among them) equals a target whose sessions have contexts of their own."""
    from tests.test_batching import at_once, random_tree

    loaded = load_gguf(ggufs["F32"], kv_type="f32")
    vocab, sampling = loaded.model.cfg.vocab_size, SamplingParams(max_new_tokens=8, **SETTINGS[setting])
    gen = torch.Generator().manual_seed(21)
    ps = [torch.randint(0, vocab, (40,), generator=gen).tolist() for _ in range(3)]
    limits = {"max_context": 100, "max_tree": 16}
    engines = {"alone": llama_engine(loaded, max_batch_tokens=1, **limits),
               "pooled": llama_engine(loaded, kv_cache_tokens=117, **limits)}  # fmt: skip
    pool = engines["pooled"].shared
    assert pool is not None and pool.n_ctx == 117
    sids = {name: [e.open_session(p) for p in ps] for name, e in engines.items()}
    results: dict[str, list[Any]] = {name: [] for name in engines}
    for step in range(6):
        trees = [random_tree(0, 2 + (step + i) % 5, vocab, gen) for i in range(len(ps))]
        append = [int(torch.randint(0, vocab, (1,), generator=gen))] if step == 3 else []
        for name, engine in engines.items():
            for sid, tree in zip(sids[name], trees, strict=True):
                root = append[-1] if append else engine.sessions.get(sid).committed[-1]
                r = engine.verify(sid, replace_root(tree, root), sampling, 8, append=append)
                results[name].append((r.tokens, r.accepted))
    assert results["pooled"] == results["alone"]
    assert pool.evictions > 0 and metric("specexec:num_preemptions_total") >= pool.evictions
    # Trees arriving together that the pool cannot hold at once go in several passes.
    trees = [random_tree(engines["pooled"].sessions.get(s).committed[-1], 9, vocab, gen) for s in sids["pooled"]]
    got = at_once([lambda s=s, t=t: engines["pooled"].verify(s, t, sampling, 8)
                   for s, t in zip(sids["pooled"], trees, strict=True)])  # fmt: skip
    for sid, tree, r in zip(sids["alone"], trees, got, strict=True):
        assert not isinstance(r, Exception), r
        expected = engines["alone"].verify(sid, tree, sampling, 8)
        assert (r.tokens, r.accepted) == (expected.tokens, expected.accepted)


def metric(name: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name) or 0.0


def test_a_kv_pool_too_small_for_one_session_is_refused(ggufs):
    loaded = load_gguf(ggufs["F32"], kv_type="f32")
    with pytest.raises(ValueError, match="cannot hold one session's 117 tokens"):
        llama_engine(loaded, max_context=100, max_tree=16, kv_cache_tokens=116)
    with pytest.raises(ValueError, match="smaller than a pass of 107 rows"):
        llama_engine(loaded, max_context=40, max_tree=16, kv_cache_tokens=60)


def test_closed_sessions_give_their_lanes_back(ggufs):
    """A shared context's lanes come back when their sessions close: more sessions than lanes, one
    after another, all verify."""
    loaded = load_gguf(ggufs["F32"], kv_type="f32")
    engine = llama_engine(loaded, max_sessions=2, max_tree=16)
    assert engine.shared is not None
    for i in range(5):
        sid = engine.open_session(PROMPT[: 3 + i])
        tree = TokenTree(torch.tensor([PROMPT[2 + i], 1, 2]), torch.tensor([-1, 0, 1]))
        assert engine.verify(sid, tree, SamplingParams(max_new_tokens=4), 4).tokens
        assert engine.close_session(sid)


def test_llama_cpp_itself_runs_in_a_process_of_its_own(ggufs):
    """The benches' llama.cpp contestant holds its model in a process of its own (a model loaded
    second in a process decoded faster), with the tokens of llama-cpp-python's own loop."""
    from client.bench.llama_cpp import LlamaItself, llama_itself

    gguf = ggufs["F32"] / "model.gguf"
    itself = LlamaItself(gguf, 1)
    try:
        tokens, seconds = itself(PROMPT, 6)
    finally:
        itself.close()
    assert itself.proc.poll() is not None
    assert tokens == llama_itself(gguf, 1)(PROMPT, 6)[0] and len(tokens) == 6 and seconds > 0


def test_llama_cpp_pass_times_are_measured_without_torch(ggufs, tmp_path):
    """benchmarks/llama_pass_time.py must not import torch: on the H200 a llama.cpp built there
    crashed at load in a process holding PyTorch's CUDA build (docs/benchmarks.md, "On a GPU")."""
    import json

    out = tmp_path / "times.json"
    cmd = [sys.executable, "-m", "benchmarks.llama_pass_time", "--gguf", str(ggufs["Q8_0"] / "model.gguf"),
           "--layers", "0", "--ks", "1", "8", "--seconds", "0.02", "--threads", "1", "--out", str(out)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["torch_loaded"] is False
    (row,) = result["llama_cpp"]
    assert row["n_gpu_layers"] == 0 and set(row["seconds"]) == {"1", "8"} and min(row["seconds"].values()) > 0
    assert "| n_gpu_layers |" in run.stdout


@pytest.mark.parametrize("hidden", [64, 256], ids=["q8_0 rows", "q4_k rows"])
def test_a_random_gguf_of_a_real_shape_runs_with_finite_logits(tmp_path, hidden):
    """benchmarks/bench_offload.py --write-gguf: the GPU check times llama.cpp on such a file, so its
    blocks must be ones llama.cpp computes with, whatever the row length."""
    from benchmarks.bench_offload import random_gguf
    from common.model.transformer import ModelConfig

    cfg = ModelConfig("qwen2", 1024, hidden, 2 * hidden, 2, 4, 2, hidden // 4, 1e-6, True, False, False, 512)
    model = LlamaCppModel(random_gguf(cfg, tmp_path / "random.gguf"), threads=1)
    try:
        logits = chain_logits(model, PROMPT, [1, 2, 3])
    finally:
        model.close()
    assert logits.shape == (3, 1024) and bool(np.isfinite(logits).all())


def test_the_gpu_machines_generation_and_load_scripts_run_on_a_tiny_random_gguf(tmp_path):
    """benchmarks/gpu_generation.py and gpu_load.py run only where a GPU is lent, minutes a session:
    here they run through, on a CPU, so that a change in what they call shows before that."""
    import json

    from benchmarks.bench_offload import SHAPES, random_gguf

    model = random_gguf(SHAPES["tiny"], tmp_path / "random.gguf")
    common = ["--target", str(model), "--draft", str(model), "--draft-layers", "0"]
    scripts = {"gpu_generation": ["--budgets", "4", "--tokens", "4"],
               "gpu_load": ["--clients", "1", "2", "--trees", "4", "--steps", "2"]}  # fmt: skip
    for name, args in scripts.items():
        out = tmp_path / f"{name}.json"
        run = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *common, *args, "--out", str(out)],
                             capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
        assert run.returncode == 0, run.stderr[-2000:]
        assert json.loads(out.read_text())
    runs = json.loads((tmp_path / "gpu_load.json").read_text())
    assert {(r["contestant"], r["tree"], r["clients"]) for r in runs} == {
        ("batched", 0, 1), ("batched", 0, 2), ("batched", 4, 1), ("batched", 4, 2),
        ("batched, waiting for none away", 0, 2), ("batched, waiting for none away", 4, 2),
        ("one session per pass", 0, 2), ("one session per pass", 4, 2)}  # fmt: skip
    assert all(r["steps"] == 2 * r["clients"] and r["passes"] >= 2 for r in runs)


@pytest.mark.parametrize("setting", SETTINGS)
def test_llama_sessions_sharing_a_prefix_give_what_they_get_alone(ggufs, setting):
    """On one shared context a prefix is shared by sequence copy, no data copied: the sessions'
    cells stay apart as the session they shared with rolls back into the prefix, goes on and closes."""
    from tests.test_prefix_sharing import check_sharing

    loaded = load_gguf(ggufs["F32"], kv_type="f32")
    sampling = SamplingParams(max_new_tokens=8, **SETTINGS[setting])
    check_sharing(lambda **kw: llama_engine(loaded, batch_window=1.0, **kw), sampling)


def test_a_llama_burst_on_one_long_prefix_computes_it_once(ggufs):
    from tests.test_prefix_sharing import check_burst

    loaded = load_gguf(ggufs["F32"], kv_type="f32")
    check_burst(lambda **kw: llama_engine(loaded, max_context=128, batch_window=1.0, prefill_chunk=16,
                                          kv_cache_tokens=1024, **kw), SamplingParams(max_new_tokens=8))  # fmt: skip


def test_the_pools_books_count_a_shared_prefix_once():
    """Cells lanes share by sequence copy count once, also after the lane they came from rolls back
    into them and writes new ones, and after it gives its KV up."""
    from common.model.llama_cpp import CommittedCells, committed_cells

    a, b, c = CommittedCells(), CommittedCells(), CommittedCells()
    for lane in (a, b, c):
        lane._start_cells()
    a.length = 100
    b._share_cells(a, 80)
    b.length = 90  # b's own cells after the shared ones
    assert committed_cells([a, b]) == 110
    a.length = 50
    a.length = 120  # [50, 120) are new cells; b still holds the old [50, 80)
    assert committed_cells([a, b]) == 50 + 30 + 10 + 70
    c._share_cells(a, 100)
    assert committed_cells([a, b, c]) == 160
    a.length = 0  # evicted: what b and c hold stays
    assert committed_cells([a, b, c]) == 50 + 30 + 10 + 50


def test_llama_sessions_sharing_a_prefix_fit_a_pool_their_lengths_overfill(ggufs):
    """Three sessions on a 100-token prefix in a pool of 200 cells: their lengths add up to over
    300, the cells they take to about 110, so no session gives its KV up; the answers are the
    unshared ones'."""
    loaded = load_gguf(ggufs["F32"], kv_type="f32")
    vocab = loaded.model.cfg.vocab_size
    system = torch.randint(0, vocab, (100,), generator=torch.Generator().manual_seed(9)).tolist()
    sampling = SamplingParams(max_new_tokens=8)

    def run(**kwargs: Any) -> tuple[list[list[int]], Any]:
        engine = llama_engine(loaded, max_context=128, **kwargs)
        out = []
        for i in range(3):
            sid = engine.open_session([*system, 1 + i, 2 + i])
            for _ in range(2):
                root = engine.sessions.get(sid).committed[-1]
                out.append(engine.verify(sid, TokenTree.root_only(root), sampling, 4).tokens)
        return out, engine.shared

    shared, pool = run(kv_cache_tokens=200)
    alone, _ = run(kv_cache_tokens=1024, share_prefixes=False)
    assert shared == alone and pool.evictions == 0


def test_a_llama_lane_evicted_at_the_session_limit_serves_the_new_session(ggufs):
    """On a shared context a session is a lane: the evicted session's lane and cells go to the new
    one, whose tokens are what they are on a context nobody used before."""
    from common.runtime.sessions import SessionNotFound

    loaded = load_gguf(ggufs["F32"], kv_type="f32")
    params = SamplingParams(max_new_tokens=8, **SETTINGS["seeded"])

    def run(engine: Any, sid: str, last: int) -> list[int]:
        out: list[int] = []
        for _ in range(3):
            out += engine.verify(sid, TokenTree.root_only(last), params, 8).tokens
            last = out[-1]
        return out

    engine = llama_engine(loaded, max_sessions=2, evict_after=0.0)
    assert engine.shared is not None
    first = engine.open_session(PROMPT)
    run(engine, first, PROMPT[-1])
    second = engine.open_session([9, 8, 7])
    run(engine, second, 7)
    third = engine.open_session([5, 6, 7, 8])  # the first's place
    with pytest.raises(SessionNotFound, match="evicted"):
        run(engine, first, 3)
    got = run(engine, third, 8)
    fresh = llama_engine(loaded, max_sessions=2)
    assert got == run(fresh, fresh.open_session([5, 6, 7, 8]), 8)


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.9, seed=4)])
def test_a_grammar_on_llama_cpp_reads_the_ggufs_own_vocabulary(ggufs, sampling):
    """The llama.cpp node builds llguidance's tokenizer from the GGUF (it holds no Hugging Face
    tokenizer); SpecExec under the grammar equals its autoregressive output, and follows it."""
    grammar = Grammar("regex", r"(ab|ba)+![0-9]{2,5}")
    runs = generate_both(ggufs, "F32", SamplingParams(max_new_tokens=30, grammar=grammar, **sampling))
    assert runs["specexec"].token_ids == runs["autoregressive"].token_ids
    assert runs["specexec"].finish_reason == "stop"
    assert re.fullmatch(r"(ab|ba)+![0-9]{2,5}", runs["specexec"].text)


def test_a_shared_pass_that_fails_after_one_walk_walks_that_tree_again_from_its_root(ggufs):
    """llama.cpp draws during the pass: a pass that fails after one session's walk (here another
    session's draw) leaves that session's matcher and penalty counts ahead; the engine runs each
    tree again alone, rewound to its root, and the walked one gets the target alone's token."""
    from common.decoding.penalties import Penalties
    from common.decoding.tree import TokenTree
    from target_node.engine import TargetEngine, VerifyJob

    loaded = load_gguf(ggufs["F32"], kv_type="f32")
    engine = TargetEngine(loaded, max_context=200, max_tree=8)
    params = SamplingParams(max_new_tokens=20, grammar=Grammar("regex", r"(ab|ba)+![0-9]{2,5}").at(len(PROMPT)),
                            penalties=Penalties(presence=1.0).at(len(PROMPT)))  # fmt: skip
    root = TokenTree.root_only(PROMPT[-1])
    alone = engine.sessions.get(engine.open_session(list(PROMPT)))
    ticket = alone.prepare(root, params, 10)
    expected = alone.finish(ticket, alone.run_alone(ticket)).tokens

    steps = []
    for _ in range(2):
        sid = engine.open_session(list(PROMPT))
        session = engine.sessions.get(sid)
        ticket = session.prepare(root, params, 10)
        job = VerifyJob(sid, session, root, params, 10, [], None, None)
        job.ticket = ticket
        steps.append((job, ticket))
    (ja, _), (jb, tb) = steps

    def fails(logits):
        raise RuntimeError("this draw fails")

    tb.constraint.mask = fails
    engine._run_group(steps, engine.chain_limit())
    assert isinstance(jb.error, RuntimeError)  # the failing tree fails alone
    assert ja.result is not None and ja.result.tokens == expected


@pytest.mark.parametrize("window, filters", [(0, {}), (5, dict(min_p=0.15)),
                                             (0, dict(typical_p=0.6, top_n_sigma=1.5, xtc_probability=0.5, xtc_threshold=0.05))])  # fmt: skip
def test_penalties_on_llama_cpp_equal_its_autoregressive_output(ggufs, window, filters):
    from common.decoding.penalties import Penalties

    penalties = Penalties(presence=0.9, frequency=0.3, repetition=1.5, logit_bias=((70, 2.0),), repetition_window=window)
    runs = generate_both(ggufs, "F32", SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=0.8, seed=3,
                                                      penalties=penalties, **filters))  # fmt: skip
    assert runs["specexec"].token_ids == runs["autoregressive"].token_ids


@pytest.fixture(scope="module")
def wide_ggufs(tmp_path_factory) -> dict[str, Path]:
    """A target with heads of 32 dimensions, as quantized KV caches need (the tiny ones have 16)."""
    root = tmp_path_factory.mktemp("wide")
    target = make_tiny_model(root / "target", arch="qwen2", layers=2, hidden=128, heads=4, kv_heads=2, seed=3)
    return {"F32": gguf_model_dir(target, root / "target-f32", "F32"), "draft": truncate_layers(target, root / "draft", keep=1)}


def test_a_quantized_kv_cache_holds_a_context_in_less_memory(wide_ggufs, ggufs):
    """--kv-type q8_0 / q4_0, as llama.cpp's -ctk/-ctv: the cache of 100 tokens in about half and a
    quarter of f16's bytes, and trees still run through it."""
    sizes = {}
    for kv in ("f16", "q8_0", "q4_0"):
        model = LlamaCppModel(wide_ggufs["F32"] / "model.gguf", kv_type=kv, threads=1)
        ctx = model.context(256, max_rows=17)
        try:
            lane = ctx.lane(256, 16)
            lane.extend(list(range(5, 105)))
            sizes[kv] = model.lib.llama_state_get_size(ctx._ctx)
        finally:
            ctx.close()
    assert sizes["q8_0"] < 0.6 * sizes["f16"] and sizes["q4_0"] < 0.35 * sizes["f16"], sizes
    gen = SpecExec.local(str(wide_ggufs["draft"]), str(wide_ggufs["F32"]), tree=TreeParams(budget=16),
                         backend="llama.cpp", kv_type="q8_0")  # fmt: skip
    out = gen.generate(PROMPT, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert len(out.token_ids) == 24 and out.stats.target_steps < 24
    with pytest.raises(LlamaCppError, match=r"heads of a multiple of 32 dimensions \(this model's have 16\)"):
        LlamaCppModel(ggufs["F32"] / "model.gguf", kv_type="q8_0", threads=1).context(64, max_rows=9)
    node = subprocess.run([sys.executable, "-m", "client.cli.main", "target", "--model", str(ggufs["F32"]), "--backend",
                           "llama.cpp", "--kv-type", "q8_0", "--listen", "127.0.0.1:0"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert node.returncode == 2 and "Traceback" not in node.stderr, node.stderr[-2000:]
    assert "specexec: error: llama.cpp could not make a context" in node.stderr
