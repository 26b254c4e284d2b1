"""An int8 or int4 draft changes the draft's numbers, never the output: the target still decides every token."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeParams
from common.model import quantized_linear
from common.model.loading import load_model
from common.model.quantized_linear import Int4Linear, Int8DynamicLinear, check_quantize, quantize
from tests.helpers import SAMPLE_TREE, prefix_then_tree

pytestmark = pytest.mark.skipif(
    not torch.backends.quantized.supported_engines, reason="needs PyTorch's quantized CPU backend"
)


def test_fused_int8_product_is_close_to_the_float_products():
    torch.manual_seed(0)
    linears = [nn.Linear(64, n, bias=True) for n in (48, 16, 16)]
    fused = Int8DynamicLinear(linears)
    assert fused.split_sizes == [48, 16, 16]
    for rows in (1, 5, 33):
        x = torch.randn(rows, 64)
        ref = torch.cat([lin(x) for lin in linears], dim=-1).detach()
        out = fused(x)
        assert out.shape == ref.shape and out.dtype == torch.float32
        assert (out - ref).abs().max() < 0.05 * ref.abs().max()
        assert fused(x.bfloat16()).dtype == torch.bfloat16


def test_int4_product_is_close_to_the_float_products_and_int8_past_its_rows(monkeypatch):
    monkeypatch.setattr(quantized_linear, "QUANTIZE_ROWS", 32)  # packed in pieces, as the LM head is
    torch.manual_seed(0)
    linears = [nn.Linear(128, n, bias=True) for n in (48, 16, 64)]
    fused, int8 = Int4Linear(linears), Int8DynamicLinear(linears)
    assert fused.int4 and fused.split_sizes == [48, 16, 64]
    for rows in range(1, quantized_linear.INT4_MAX_ROWS + 1):
        x = torch.randn(rows, 128)
        ref = torch.cat([lin(x) for lin in linears], dim=-1).detach()
        out = fused(x)
        assert out.shape == ref.shape and out.dtype == torch.float32
        assert (out - ref).abs().max() < 0.1 * ref.abs().max()
        assert not torch.equal(out, int8(x))
    wide = torch.randn(quantized_linear.INT4_MAX_ROWS + 1, 128)
    assert torch.equal(fused(wide), int8(wide))
    odd = Int4Linear([nn.Linear(96, 16)])  # 96 columns: no whole groups of 64, so int8 throughout
    assert not odd.int4 and torch.equal(odd(wide[:1, :96]), odd.int8(wide[:1, :96]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizing_rows_in_pieces_gives_the_whole_weights_int8(monkeypatch, dtype):
    """A piece of rows at a time (so the 0.5B's LM head needs no float32 copy at load) is the same
    int8 and the same scales as one quantize_per_channel over the whole weight."""
    monkeypatch.setattr(quantized_linear, "QUANTIZE_ROWS", 7)
    torch.manual_seed(1)
    linears = [nn.Linear(24, 37, bias=False).to(dtype), nn.Linear(24, 5, bias=False).to(dtype)]
    linears[1].weight.data[2] = 0  # a row of zeros takes the smallest scale
    weight = torch.cat([lin.weight.detach().float() for lin in linears])
    scales = (weight.abs().amax(1) / 127).clamp(min=1e-8).double()
    want = torch.quantize_per_channel(weight, scales, torch.zeros(42, dtype=torch.long), 0, torch.qint8)
    got, _ = torch.ops.quantized.linear_unpack(Int8DynamicLinear(linears).packed)
    assert torch.equal(got.int_repr(), want.int_repr())
    assert torch.equal(got.q_per_channel_scales(), want.q_per_channel_scales())


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("name", ["target", "qwen2", "qwen3"])
def test_quantized_model_stays_close_to_the_float_model(name, scheme, model_dirs):
    ref = load_model(model_dirs[name]).model
    q = load_model(model_dirs[name], quantize=scheme).model
    assert q.quantized == scheme and not q.repacked
    linear = Int4Linear if scheme == "int4" else Int8DynamicLinear
    assert isinstance(q.model.layers[0].self_attn.qkv_proj, linear)
    assert isinstance(q.lm_head, linear)
    prefix = torch.tensor([5, 17, 99, 3, 42])
    ours = q.logits(prefix_then_tree(q, prefix, SAMPLE_TREE)[1])
    theirs = ref.logits(prefix_then_tree(ref, prefix, SAMPLE_TREE)[1])
    cosine = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1)
    assert cosine.min() > 0.9, cosine  # random tiny weights: garbage (a wrong scale or layout) is near 0


def test_a_tied_head_gets_its_own_int8_copy(model_dirs):
    model = load_model(model_dirs["target"]).model
    model.cfg = type(model.cfg)(**{**model.cfg.__dict__, "tie_word_embeddings": True})
    table = model.model.embed_tokens.weight.clone()
    quantize(model, "int8")
    assert isinstance(model.lm_head, Int8DynamicLinear)
    assert torch.equal(model.model.embed_tokens.weight, table)  # lookups still read the float table


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="quantize must be one of none, int8, int4, got 'int2'"):
        check_quantize("int2", "cpu")
    with pytest.raises(ValueError, match="CPU nodes only, not on device 'cuda'"):
        check_quantize("int8", "cuda")
    check_quantize("none", "cuda")


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("mode", ["specexec", "chain"])
def test_quantized_draft_output_is_the_target_alone(mode, scheme, model_dirs):
    """Greedy and seeded samples through an int8 or int4 draft equal the float32 target decoding alone."""
    from client.api import SpecExec

    def run(draft_quantize: str, mode: str, sampling: SamplingParams) -> list[int]:
        gen = SpecExec.local(
            str(model_dirs["truncated"]),
            str(model_dirs["target"]),
            draft_quantize=draft_quantize,
            mode=mode,
            tree=TreeParams(budget=8) if mode == "specexec" else TreeParams.chain(4),
            max_context=256,
        )
        if draft_quantize != "none":
            assert gen.draft is not None and gen.draft.loaded.model.quantized == draft_quantize
            # status and node_info said "float32" for an int8 draft
            assert gen.draft.info().dtype == f"{draft_quantize} linears, float32 elsewhere"
        return gen.generate([5, 17, 99, 3], sampling).token_ids

    for sampling in (
        SamplingParams(max_new_tokens=24, ignore_eos=True),
        SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
    ):
        assert run(scheme, mode, sampling) == run("none", "autoregressive", sampling)


def test_commands_accept_quantize_flags():
    from client.cli.main import build_parser

    parse = build_parser().parse_args
    assert parse(["draft", "--model", "m", "--quantize", "int8"]).quantize == "int8"
    assert parse(["draft", "--model", "m"]).quantize == "none"
    assert not hasattr(
        parse(["target", "--model", "m"]), "quantize"
    )  # see test_quantized_rows_depend_on_the_batch
    assert (
        parse(["generate", "--target-model", "t", "--prompt", "x", "--draft-quantize", "int8"]).draft_quantize
        == "int8"
    )
    local = ["local", "--draft-model", "d", "--target-model", "t", "--draft-quantize", "int8"]
    assert parse(local).draft_quantize == "int8"
    assert parse(["bench", "--draft-quantize", "int8"]).draft_quantize == "int8"
    assert parse(["draft", "--model", "m", "--quantize", "int4"]).quantize == "int4"
    with pytest.raises(SystemExit):
        parse(["draft", "--model", "m", "--quantize", "int2"])


def test_quantized_rows_depend_on_the_batch():
    """Why the target is never quantized: one activation scale per pass makes a row's output depend
    on its batch-mates, so a tree pass would not reproduce the one-token pass the output is defined by."""
    torch.manual_seed(0)
    linear = Int8DynamicLinear([nn.Linear(64, 32)])
    x, loud = torch.randn(1, 64), 10 * torch.randn(1, 64)
    assert not torch.equal(linear(x), linear(torch.cat([x, loud]))[:1])


def test_int8_load_from_bf16_weights_casts_only_what_stays_float(model_dirs, tmp_path):
    """The real pair is stored in bf16: linears quantize from it, norms become --dtype, and the
    embedding table stays bf16 (lookups only; its rows cast exactly), saving a float32 copy."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = model_dirs["target"]
    shutil.copytree(src, tmp_path / "bf16")
    weights = next((tmp_path / "bf16").glob("*.safetensors"))
    save_file({k: v.bfloat16() for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})
    model = load_model(tmp_path / "bf16", dtype="float32", quantize="int8").model
    table = model.model.embed_tokens.weight
    assert table.dtype == torch.bfloat16 and model.dtype == torch.float32
    assert {p.dtype for p in model.parameters() if p is not table} == {torch.float32}
    assert model.inv_freq.dtype == torch.float32
    prefix = torch.tensor([5, 17, 99, 3, 42])
    ours = model.logits(prefix_then_tree(model, prefix, SAMPLE_TREE)[1])
    widened = load_model(tmp_path / "bf16", dtype="float32", quantize="int8").model
    widened.model.embed_tokens.weight.data = widened.model.embed_tokens.weight.data.float()
    # the bf16 table gives the float32 table's numbers, bit for bit
    assert torch.equal(ours, widened.logits(prefix_then_tree(widened, prefix, SAMPLE_TREE)[1]))
    ref = load_model(src).model
    theirs = ref.logits(prefix_then_tree(ref, prefix, SAMPLE_TREE)[1])
    assert torch.nn.functional.cosine_similarity(ours, theirs, dim=-1).min() > 0.9


def test_local_starts_nodes_with_flags_they_accept():
    from common.options import node_command
    from draft_node.server import build_parser as draft_parser
    from target_node.server import build_parser as target_parser

    for scheme, dtype in (("none", "bfloat16"), ("int8", "float32")):
        cmd = node_command("draft", "m", 1, "bfloat16", 8, quantize=scheme)
        args = draft_parser().parse_args(cmd[3:])
        assert (args.quantize, args.dtype) == (scheme, dtype)
    assert target_parser().parse_args(node_command("target", "m", 1, "bfloat16", 8)[3:]).dtype == "bfloat16"
    with pytest.raises(ValueError, match="only a draft node"):
        node_command("target", "m", 1, "bfloat16", 8, quantize="int8")


def test_local_gives_a_llama_cpp_target_trees_its_sessions_can_share():
    """`specexec local` once gave a llama.cpp target --max-tree 255, which leaves no sequence ids for
    its 8 sessions to share passes: the main job warned about its own flags at start."""
    from client.cli.local import node_commands
    from client.cli.main import build_parser
    from common.model.llama_cpp import tree_limit
    from common.runtime.sessions import DEFAULT_MAX_SESSIONS

    for backend, want in (("llama.cpp", tree_limit(DEFAULT_MAX_SESSIONS)), ("torch", 1024)):
        args = build_parser().parse_args(["local", "--draft-model", "d", "--target-model", "t", "--budget", "auto",
                                          "--max-budget", "1024", "--target-backend", backend])  # fmt: skip
        target, _ = node_commands(args, [])
        assert target[target.index("--max-tree") + 1] == str(want)
        assert "--n-gpu-layers" not in target
    args = build_parser().parse_args(["local", "--draft-model", "d", "--target-model", "t", "--target-n-gpu-layers",
                                      "14", "--draft-n-gpu-layers", "99"])  # fmt: skip
    target, draft = node_commands(args, [])
    assert target[target.index("--n-gpu-layers") + 1] == "14" and draft[draft.index("--n-gpu-layers") + 1] == "99"
    assert tree_limit(DEFAULT_MAX_SESSIONS) <= 256 - DEFAULT_MAX_SESSIONS
