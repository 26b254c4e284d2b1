"""The streamed target computes exactly what the resident model computes, for every ring layout.

Without a GPU the ring runs with synchronous copies on the CPU, which still exercises the weight
binding, the slot reuse and the prefetch of the next pass's first layers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.model.loading import load_model
from common.model.offload import OffloadPlan, StreamedLayers, offload
from common.options import offload_plan
from tests.helpers import SAMPLE_TREE, prefix_then_tree

ROOT = Path(__file__).resolve().parents[1]
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def _two_steps(model) -> list[torch.Tensor]:
    """A prefix pass then a tree pass: the second forward reuses slots prefetched by the first."""
    hidden = prefix_then_tree(model, torch.tensor([5, 17, 99, 3, 42]), SAMPLE_TREE)
    return [model.logits(h).cpu() for h in hidden]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("resident", "ring"), [(0, 1), (0, 2), (0, 3), (1, 2), (2, 8), (4, 2)])
def test_offloaded_logits_equal_resident_model(device, resident, ring, model_dirs, loaded):
    """Against the model resident on the same device: CUDA's float32 kernels differ from the CPU's
    by up to 6e-5 in these logits (H200, 26 Nov), whatever the layout."""
    if device == "cuda":
        reference = _two_steps(load_model(model_dirs["target"], repack=False, device="cuda").model)
    else:
        reference = _two_steps(loaded["target"].model)
    model = offload(
        load_model(model_dirs["target"], repack=False).model, device, resident_layers=resident, ring=ring
    )
    layers = model.model.layers
    assert isinstance(layers, StreamedLayers) and len(layers) == 4
    assert len(layers.host) == 4 - resident
    for _ in range(2):  # twice: the second run starts from slots the first left prefetched
        for ours, ref in zip(_two_steps(model), reference, strict=True):
            torch.testing.assert_close(
                ours, ref, atol=1e-5, rtol=1e-5
            ) if device == "cuda" else torch.testing.assert_close(ours, ref, atol=0, rtol=0)


def test_weights_are_held_once(model_dirs):
    model = load_model(model_dirs["target"], repack=False).model
    per_layer = sum(p.numel() for p in model.model.layers[0].parameters())
    model = offload(model, "cpu", resident_layers=1, ring=2)
    layers = model.model.layers
    assert [h.numel() for h in layers.host] == [per_layer] * 3
    assert sum(p.numel() for p in layers.resident.parameters()) == per_layer
    assert len(layers.slots) == 2


def test_bad_layouts_are_refused(model_dirs):
    model = load_model(model_dirs["target"], repack=False).model
    with pytest.raises(ValueError, match="resident_layers must be in \\[0, 4\\], got 5"):
        offload(model, "cpu", resident_layers=5)
    with pytest.raises(ValueError, match="at least 1 layer"):
        offload(load_model(model_dirs["target"], repack=False).model, "cpu", ring=0)


@pytest.mark.parametrize("device", DEVICES)
def test_generation_with_an_offloaded_target_is_unchanged(device, model_dirs):
    """The whole loop (tree passes, acceptance, cache pruning) over a streamed target: same tokens."""
    from client.api import SpecExec
    from common.decoding.sampling import SamplingParams
    from common.decoding.tree import TreeParams

    def run(plan: OffloadPlan | None, device: str) -> list[int]:
        gen = SpecExec.local(
            str(model_dirs["truncated"]),
            str(model_dirs["target"]),
            device=device,
            offload=plan,
            tree=TreeParams(budget=8),
            max_context=256,
        )
        params = SamplingParams(max_new_tokens=24, temperature=0.8, seed=3, ignore_eos=True)
        return gen.generate([5, 17, 99, 3], params).token_ids

    assert run(OffloadPlan(resident_layers=1, prefetch_layers=2), device) == run(None, "cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_an_offloaded_target_node_serves_the_target_alone_tokens(device, model_dirs, tmp_path):
    """Through real nodes over gRPC, as a home lab runs it: the target node streams its layers
    (`--offload`, one resident) to `device`, the draft runs on the CPU, and the text, greedy and
    seeded, is the target alone's (Hugging Face reference)."""
    import os

    from client.remote import connect
    from common.decoding.sampling import SamplingParams
    from common.decoding.tree import TreeParams
    from tests.helpers import node_pair, reference_decode

    env = {**os.environ, "SPECEXEC_HOME": str(tmp_path / "home")}  # its forward-time curve cache
    target = ["--model", str(model_dirs["target"]), "--device", device, "--offload", "--resident-layers", "1",
              "--max-tree", "32"]  # fmt: skip
    with node_pair(target, ["--model", str(model_dirs["truncated"]), "--max-tree", "32"], env, tmp_path) as addrs:
        # A fixed tree: `--budget auto` may leave the draft out where its timings say trees do not pay
        # (on tiny models, noise), and this test is about the offloaded pass, not the planner.
        gen = connect(addrs["draft"], addrs["target"], tree=TreeParams(budget=16))
        assert gen.target.info().device.startswith(device)
        for sampling in (dict(temperature=0.0), dict(temperature=0.8, seed=7)):
            params = SamplingParams(max_new_tokens=24, ignore_eos=True, **sampling)
            out = gen.generate([5, 17, 99, 3], params)
            assert out.token_ids == reference_decode(model_dirs["target"], [5, 17, 99, 3], params)
            assert out.stats.target_steps < 24  # trees were accepted, not only the target's own tokens


def test_target_command_accepts_offload_flags():
    from client.cli.main import build_parser

    args = build_parser().parse_args(
        ["target", "--model", "m", "--offload", "--resident-layers", "3", "--prefetch-layers", "4"]
    )
    assert offload_plan(args) == OffloadPlan(resident_layers=3, prefetch_layers=4)
    assert offload_plan(build_parser().parse_args(["target", "--model", "m"])) is None


def test_offload_timing_script_runs_and_reports_every_layout(tmp_path):
    out = tmp_path / "offload.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_offload", "--shape", "tiny", "--device", "cpu",
           "--ks", "1", "8", "--resident-layers", "0", "2", "--seconds", "0.05", "--out", str(out)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [r["resident_layers"] for r in result["rows"]] == [0, 2]
    assert all(set(r["seconds"]) == {"1", "8"} and min(r["seconds"].values()) > 0 for r in result["rows"])
    all_streamed, half = (r["streamed_gb"] for r in result["rows"])  # the tiny model has 4 layers
    assert half == pytest.approx(all_streamed / 2) and half > 0
    assert "| resident layers |" in run.stdout
