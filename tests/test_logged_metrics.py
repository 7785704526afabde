"""What the logged numbers mean (issue 48): the logged reward is the weighted total advantages see (reward_weights
applied, unlike TRL's trl#5352), each function's own mean stays unweighted, and a round's per-token metrics over
micro-batches of uneven size are means over tokens, not over micro-batches."""

import math

import torch

from dsgrpo.algorithms import compute_advantages
from dsgrpo.metrics import MetricAccumulator, round_metrics


def test_the_logged_reward_applies_reward_weights_and_each_functions_mean_does_not():
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])  # two groups of 2, two functions
    _, stats = compute_advantages(rewards, 2, reward_weights=[1.0, 0.25])
    lengths, flags = torch.tensor([3.0, 5.0, 7.0, 1.0]), torch.zeros(4)
    m = round_metrics(stats, rewards, ["a", "b"], lengths, flags, torch.ones(4))
    assert m["reward"] == (1.0 + 0.25 + 1.25 + 0.0) / 4  # weighted totals, averaged
    assert m["rewards/a/mean"] == 0.5 and m["rewards/b/mean"] == 0.5  # the functions' own values
    unweighted = round_metrics(compute_advantages(rewards, 2)[1], rewards, ["a", "b"], lengths, flags, torch.ones(4))
    assert unweighted["reward"] == 1.0 and m["reward"] != unweighted["reward"]
    assert m["completions/mean_length"] == 4.0 and m["_completion_tokens"] == 16.0


def test_a_declined_reward_leaves_the_mean_of_the_others():
    rewards = torch.tensor([[1.0], [float("nan")], [0.0], [0.5]])
    _, stats = compute_advantages(rewards, 2)
    m = round_metrics(stats, rewards, ["a"], torch.ones(4), torch.zeros(4), torch.ones(4))
    assert math.isclose(m["reward"], 0.5) and math.isclose(m["rewards/a/mean"], 0.5)


def test_per_token_metrics_over_uneven_micro_batches_are_token_weighted():
    acc = MetricAccumulator()
    acc.add("entropy", 1.0, 10.0)  # a micro-batch of 10 tokens
    acc.add("entropy", 3.0, 30.0)  # and one of 30 (an accumulation window of uneven micro-batches)
    acc.add("sampling/importance_sampling_ratio/max", 0.1)
    acc.add("sampling/importance_sampling_ratio/max", 0.4)
    out = acc.reduce()  # a world of one: the local values
    assert out["entropy"] == (1.0 * 10 + 3.0 * 30) / 40 != (1.0 + 3.0) / 2
    assert out["sampling/importance_sampling_ratio/max"] == 0.4
