from __future__ import annotations

import numpy as np
import pytest
import torch

from common.decoding.sampling import SamplingParams, position_uniform, sample_rows


def test_uniforms_depend_only_on_seed_and_position():
    assert position_uniform(1, 10) == position_uniform(1, 10)
    assert position_uniform(1, 10) != position_uniform(2, 10)
    values = [position_uniform(0, p) for p in range(20000)]
    assert all(0 <= v < 1 for v in values)
    assert abs(sum(values) / len(values) - 0.5) < 0.01


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    assert sample_rows(logits, SamplingParams(), [0, 1]).tolist() == [1, 0]


def test_top_p_always_keeps_the_most_likely_token():
    # One token holds 90% of the mass; with top_p=0.5 it alone must be drawn, for every seed.
    logits = torch.log(torch.tensor([[0.05, 0.9, 0.05]]))
    for seed in range(50):
        params = SamplingParams(temperature=1.0, top_p=0.5, seed=seed)
        assert int(sample_rows(logits, params, [7])[0]) == 1


def test_top_k_restricts_to_the_k_best():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]])
    seen = {
        int(sample_rows(logits, SamplingParams(temperature=5.0, top_k=2, seed=s), [0])[0]) for s in range(200)
    }
    assert seen == {3, 4}


def test_empirical_frequencies_follow_probabilities():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log()[None]
    counts = torch.zeros(4)
    for pos in range(4000):
        counts[int(sample_rows(logits, SamplingParams(temperature=1.0, seed=9), [pos])[0])] += 1
    assert torch.allclose(counts / 4000, probs, atol=0.03)


def test_nucleus_over_a_large_vocabulary_takes_the_full_sort_path():
    torch.manual_seed(0)
    logits = torch.randn(1, 5000) * 0.01  # nearly flat: the top-256 probe cannot reach top_p
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1)
    tokens = {int(sample_rows(logits, params, [p])[0]) for p in range(300)}
    assert len(tokens) > 200


def _min_p_reference(logits: np.ndarray, temperature: float, min_p: float) -> np.ndarray:
    """vLLM's min_p written apart, in probabilities: after temperature, a token less than min_p
    times as probable as the row's most probable one is out."""
    scaled = logits.astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.where(probs < min_p * probs.max(-1, keepdims=True), -np.inf, logits).astype(np.float32)


@pytest.mark.parametrize("filters", [dict(), dict(top_p=0.95), dict(top_k=60)])
def test_min_p_draws_as_the_filtered_row_does(filters):
    """A min_p draw equals a plain draw from the row with the tokens below the floor taken out
    first (vLLM's order: before top_k and top_p), for every seed and position."""
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2.0, size=(4, 300)).astype(np.float32)  # [r, V]
    floor = _min_p_reference(logits, 0.7, 0.05)
    assert 0 < np.isinf(floor).mean() < 0.99  # the floor takes some tokens out, not all
    kept, positions = set(), [3, 4, 5, 6]
    for seed in range(200):
        got = sample_rows(logits, SamplingParams(temperature=0.7, min_p=0.05, seed=seed, **filters), positions)
        assert got.tolist() == sample_rows(floor, SamplingParams(temperature=0.7, seed=seed, **filters), positions).tolist()
        kept.update((r, int(t)) for r, t in enumerate(got))
    assert all(np.isfinite(floor[r, t]) for r, t in kept)
    plain = {(r, int(t)) for seed in range(200)
             for r, t in enumerate(sample_rows(logits, SamplingParams(temperature=0.7, seed=seed, **filters), positions))}  # fmt: skip
    assert plain - kept  # without the floor, tokens below it are drawn


def test_min_p_one_keeps_only_the_top_and_greedy_ignores_it():
    logits = np.array([[0.0, 2.0, 1.9, -1.0]], dtype=np.float32)
    assert {int(sample_rows(logits, SamplingParams(temperature=2.0, min_p=1.0, seed=s), [0])[0]) for s in range(50)} == {1}
    assert int(sample_rows(logits, SamplingParams(min_p=0.5), [0])[0]) == 1


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), "0.1", True])
def test_a_bad_min_p_is_named(value):
    with pytest.raises(ValueError, match="min_p must be"):
        SamplingParams(min_p=value)


def _typical_reference(probs: np.ndarray, mass: float) -> np.ndarray:
    """Locally typical sampling written apart (Hugging Face's TypicalLogitsWarper with llama.cpp's
    strict `>`): a full stable sort by |surprise - entropy|, the fewest tokens whose mass exceeds
    `mass`. Returns the kept mask [V] of one row of probabilities."""
    p = probs.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        logp = np.log(p)
        entropy = -np.nansum(np.where(p > 0, p * logp, 0.0))
        distance = np.where(p > 0, np.abs(-logp - entropy), np.inf)
    order = np.argsort(distance, kind="stable")
    cum = np.cumsum(p[order])
    last = next((i for i, c in enumerate(cum) if c > mass), len(order) - 1)
    keep = np.zeros(p.size, dtype=bool)
    keep[order[: last + 1]] = True
    return keep


@pytest.mark.parametrize("shape", ["small", "peaked", "flat"])
@pytest.mark.parametrize("mass", [0.2, 0.7, 0.95])
def test_typical_keeps_the_fewest_typical_tokens_over_the_mass(shape, mass):
    """The kept set equals a full sort's, whether the 256-token probe settles the row (peaked) or
    the whole row is sorted (flat, or a small vocabulary)."""
    from common.decoding.sampling import _softmax, _typical

    rng = np.random.default_rng(7)
    size, scale = {"small": (300, 2.0), "peaked": (20000, 4.0), "flat": (20000, 0.05)}[shape]
    probs = _softmax(rng.normal(0, scale, size=(3, size)).astype(np.float32))  # [r, V]
    kept = _typical(probs, mass) > 0
    for row, got in zip(probs, kept, strict=True):
        expected = _typical_reference(row, mass)
        assert got.tolist() == expected.tolist()
        assert 0 < expected.sum() < size
    assert not (_typical(probs, mass) > probs).any()  # kept tokens keep their probability


def test_typical_draws_only_kept_tokens_and_all_of_them():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 1.0, size=(1, 40)).astype(np.float32)
    params = SamplingParams(temperature=0.8, typical_p=0.5)
    from common.decoding.sampling import _softmax

    expected = set(np.flatnonzero(_typical_reference(_softmax(logits / np.float32(0.8))[0], 0.5)).tolist())
    drawn = {int(sample_rows(logits, SamplingParams(**{**params.__dict__, "seed": s}), [0])[0]) for s in range(600)}
    assert drawn == expected and 1 < len(expected) < 40


@pytest.mark.parametrize("filters", [dict(), dict(top_k=50), dict(top_p=0.8, min_p=0.02)])
def test_top_n_sigma_draws_as_the_row_cut_at_n_sigmas(filters):
    """llama.cpp's top-n-sigma: tokens below max - n * std of the row's finite logits are out,
    before any other filter (so a temperature leaves the set alone)."""
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 2.0, size=(4, 300)).astype(np.float32)  # [r, V]
    logits[0, :10] = -np.inf  # out already (a grammar, a bias): not counted in the deviation
    finite = np.where(np.isfinite(logits), logits, np.nan).astype(np.float64)
    floor = np.nanmax(finite, -1, keepdims=True) - 1.5 * np.nanstd(finite, -1, keepdims=True)
    cut = np.where(logits >= floor, logits, -np.inf).astype(np.float32)
    assert 0.5 < np.isinf(cut).mean() < 0.99
    positions = [0, 1, 2, 3]
    for seed in range(100):
        got = sample_rows(logits, SamplingParams(temperature=1.7, top_n_sigma=1.5, seed=seed, **filters), positions)
        assert got.tolist() == sample_rows(cut, SamplingParams(temperature=1.7, seed=seed, **filters), positions).tolist()


def test_xtc_takes_out_the_top_choices_at_its_coin():
    """Of the tokens at least xtc_threshold probable only the least probable stays, at a share
    xtc_probability of positions; below two such tokens XTC changes nothing."""
    logits = np.log(np.array([[0.55, 0.3, 0.1, 0.05]], dtype=np.float32))
    def share(params: SamplingParams) -> np.ndarray:
        drawn = [int(sample_rows(logits, params, [p])[0]) for p in range(4000)]
        return np.bincount(drawn, minlength=4) / 4000
    always = share(SamplingParams(temperature=1.0, seed=2, xtc_probability=1.0, xtc_threshold=0.2))
    assert always[0] == 0 and always[1] > 0.6 and always[2] > 0  # 0.55 and 0.3 are above: 0.3 stays
    half = share(SamplingParams(temperature=1.0, seed=2, xtc_probability=0.5, xtc_threshold=0.2))
    assert half[0] == pytest.approx(0.5 * 0.55, abs=0.03)
    high = share(SamplingParams(temperature=1.0, seed=2, xtc_probability=1.0, xtc_threshold=0.4))
    assert high.tolist() == share(SamplingParams(temperature=1.0, seed=2)).tolist()  # only 0.55 is above
    coins = [sample_rows(logits, SamplingParams(temperature=1.0, seed=s, xtc_probability=1.0), [5]) for s in range(3)]
    assert coins == [sample_rows(logits, SamplingParams(temperature=1.0, seed=s, xtc_probability=1.0), [5])
                     for s in range(3)]  # fmt: skip


def test_greedy_ignores_llama_cpps_filters():
    logits = np.array([[0.0, 2.0, 1.9, -1.0]], dtype=np.float32)
    for kwargs in (dict(typical_p=0.1), dict(top_n_sigma=0.1), dict(xtc_probability=1.0, xtc_threshold=0.0)):
        assert int(sample_rows(logits, SamplingParams(**kwargs), [0])[0]) == 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(typical_p=0.0), r"typical_p must be in \(0, 1\]"),
    (dict(typical_p=1.2), r"typical_p must be in \(0, 1\]"),
    (dict(top_n_sigma=-1.0), r"top_n_sigma must be in \[0, 100\]"),
    (dict(top_n_sigma=float("inf")), r"top_n_sigma must be in \[0, 100\]"),
    (dict(xtc_probability=1.5), r"xtc_probability must be in \[0, 1\]"),
    (dict(xtc_threshold=float("nan")), r"xtc_threshold must be in \[0, 1\]"),
    (dict(xtc_threshold="0.1"), "xtc_threshold must be a number"),
])  # fmt: skip
def test_bad_llama_cpp_filters_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_llama_cpp_filters_on_the_wire_and_as_features():
    from common.rpc.wire import sampling_from_proto, sampling_to_proto

    on = SamplingParams(temperature=0.9, typical_p=0.6, top_n_sigma=2.0, xtc_probability=0.4, xtc_threshold=0.2)
    assert sampling_from_proto(sampling_to_proto(on)) == on
    assert set(on.features()) == {"typical_p", "top_n_sigma", "xtc"}
    off = sampling_to_proto(SamplingParams(temperature=0.9))
    assert not any(off.HasField(f) for f in ("typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold"))
    assert SamplingParams(xtc_probability=0.5, xtc_threshold=0.6).features() == ()  # no two tokens reach 0.6
