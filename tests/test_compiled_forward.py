"""Compiled forwards: same numbers as the eager pass, padding invisible, exactness kept end to end."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from client.api import SpecExec
from common.decoding.sampling import SamplingParams
from common.model.compiled_forward import compile_model, parse_buckets, use_inductor_cache_dir
from common.model.loading import load_model
from common.model.offload import offload
from common.model.transformer import attention_bias
from draft_node.engine import DraftEngine
from draft_node.tree_builder import TreeParams
from target_node.engine import TargetEngine
from tests.helpers import reference_decode
from tests.tiny_models import make_tiny_model

BUCKETS = (1, 4, 16)
PROMPT = [72, 101, 108, 108, 111, 44, 32]


def run_passes(model, sizes: list[int], prefix: int, seed: int = 0) -> tuple[list[torch.Tensor], object]:
    """A causal prefix, then tree-shaped passes of the given sizes on top of it (each is kept)."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.cfg.vocab_size
    cache = model.new_cache(prefix + sum(sizes) + 8)
    positions = torch.arange(prefix)
    causal = torch.ones(prefix, prefix, dtype=torch.bool).tril()
    outs = [
        model(
            torch.randint(0, vocab, (prefix,), generator=g),
            positions,
            positions,
            attention_bias(causal, 0),
            cache,
        )
    ]
    start = prefix
    for n in sizes:
        parents = (torch.rand(n, generator=g) * torch.arange(n)).long()
        visible = torch.eye(n, dtype=torch.bool)
        depths = torch.zeros(n, dtype=torch.long)
        for i in range(1, n):
            visible[i] |= visible[parents[i]]
            depths[i] = depths[parents[i]] + 1
        slots = torch.arange(start, start + n)
        tokens = torch.randint(0, vocab, (n,), generator=g)
        outs.append(model(tokens, start + depths, slots, attention_bias(visible, start), cache))
        start += n
    cache.length = start
    return outs, cache


@pytest.fixture(scope="module")
def compiled_f32(model_dirs):
    model = load_model(model_dirs["qwen2"]).model
    compile_model(model, BUCKETS, progress=False)
    return model


@pytest.mark.parametrize("prefix", [5, 300])
def test_float32_compiled_equals_eager(loaded, compiled_f32, prefix):
    eager = loaded["qwen2"].model
    sizes = [1, 3, 4, 9, 16, 40]  # padded to 1, 4, 4, 16, 16; 40 runs eagerly
    got, got_cache = run_passes(compiled_f32, sizes, prefix)
    want, want_cache = run_passes(eager, sizes, prefix)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    used = got_cache.length
    for got_layers, want_layers in ((got_cache.k, want_cache.k), (got_cache.v, want_cache.v)):
        for g, w in zip(got_layers, want_layers, strict=True):
            torch.testing.assert_close(g[:, :used], w[:, :used], atol=1e-4, rtol=1e-4)


def test_bfloat16_compiled_within_bf16_error(tmp_path):
    """The compiled bf16 pass is as close to float32 as the eager bf16 pass is."""
    path = make_tiny_model(tmp_path / "m", arch="qwen2", layers=4, init_std=0.02, seed=3)
    reference = load_model(path).model
    eager = load_model(path, dtype="bfloat16").model
    compiled = load_model(path, dtype="bfloat16").model
    assert compiled.repacked == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    compile_model(compiled, (8,), progress=False)
    sizes = [5, 8]
    ref = [reference.logits(h) for h in run_passes(reference, sizes, 20)[0]]

    def error(model) -> float:
        hidden = run_passes(model, sizes, 20)[0]
        return max((model.logits(h) - r).abs().max().item() for h, r in zip(hidden, ref, strict=True))

    assert error(compiled) <= 1.5 * error(eager) + 1e-3


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_draft_compiles_and_padding_keeps_activation_scale(model_dirs, scheme):
    """Padding rows repeat a real row, so a per-pass activation scale (int8 dynamic) is unchanged;
    int4's passes of up to 4 rows (bucket 2) compile too."""
    eager = load_model(model_dirs["qwen2"], quantize=scheme).model
    compiled = load_model(model_dirs["qwen2"], quantize=scheme).model
    compile_model(compiled, (2, 8), progress=False)
    sizes = [3, 8] if scheme == "int8" else [2, 8]  # int4's 3 rows would pad to 8, past its rows: int8
    for g, w in zip(run_passes(compiled, sizes, 10)[0], run_passes(eager, sizes, 10)[0], strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_new_tokens=24, ignore_eos=True),
        SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_compiled_specexec_equals_target_alone(model_dirs, sampling):
    target = load_model(model_dirs["target"])
    draft = load_model(model_dirs["truncated"])
    for m in (target.model, draft.model):
        compile_model(m, BUCKETS, progress=False)
    tree = TreeParams(budget=12, max_depth=8, max_branch=4, expand_batch=4)
    engine = SpecExec(
        TargetEngine(target, max_context=256, max_tree=12),
        DraftEngine(draft, max_context=256, max_tree=12),
        target.tokenizer,
        tree=tree,
    )
    got = engine.generate(PROMPT, sampling)
    assert got.token_ids == reference_decode(model_dirs["target"], PROMPT, sampling)


def test_offloaded_model_refuses_compile(model_dirs):
    model = load_model(model_dirs["qwen2"], repack=False).model
    offload(model, torch.device("cpu"), resident_layers=0, ring=1)
    with pytest.raises(ValueError, match="--offload"):
        compile_model(model, (1,), progress=False)
    assert model.compiled is None


@pytest.mark.parametrize("text", ["", "0,4", "1,x", "8192"])
def test_bad_buckets_are_refused(text):
    with pytest.raises(ValueError, match="compile buckets"):
        parse_buckets(text)


def test_buckets_parse_sorted_and_unique():
    assert parse_buckets("16, 1,4,4") == (1, 4, 16)


def test_no_compilation_after_warm_up(compiled_f32):
    """Requests never wait for a compile: any size within the buckets, any cache, reuses a graph."""
    from torch._dynamo.utils import counters

    before = dict(counters["stats"])
    run_passes(compiled_f32, [1, 2, 4, 7, 16], 300, seed=5)
    run_passes(compiled_f32, [1, 1, 3], 1, seed=7)  # a one-token prompt attends to one slot
    run_passes(compiled_f32, [3, 1, 12], 9, seed=6)
    assert dict(counters["stats"]) == before


def test_inductor_cache_moves_under_specexec_home_unless_chosen(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECEXEC_HOME", str(tmp_path))
    monkeypatch.setenv(
        "TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "torchinductor_someone")
    )
    use_inductor_cache_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "chosen"))
    use_inductor_cache_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "chosen")
