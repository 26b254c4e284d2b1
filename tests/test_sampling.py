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
