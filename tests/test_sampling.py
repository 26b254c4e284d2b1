from __future__ import annotations

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
