"""Group-relative advantages: hand values, constant groups, normalization, layout errors."""

import math

import pytest
import torch

from megatron_gspo.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    dr_grpo_advantages,
    get_advantage_estimator,
    group_advantages,
    grpo_advantages,
)


def test_grpo_hand_computed():
    # One group of 4: rewards 1, 0, 1, 0 -> mean 0.5, unbiased std = sqrt(4 * 0.25 / 3) = sqrt(1/3).
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), group_size=4)
    std = math.sqrt(1 / 3)
    expected = torch.tensor([0.5, -0.5, 0.5, -0.5]) / (std + 1e-6)
    torch.testing.assert_close(adv, expected, rtol=1e-6, atol=0)


def test_two_groups_are_independent_and_2d_layout_matches_flat():
    # Group 0: 3, 1 -> mean 2, std (unbiased, n=2) = sqrt(((1)^2 + (1)^2) / 1) = sqrt(2).
    # Group 1: 10, 10 -> constant -> 0.
    flat = torch.tensor([3.0, 1.0, 10.0, 10.0])
    adv = group_advantages(flat, group_size=2, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1 / math.sqrt(2), -1 / math.sqrt(2), 0.0, 0.0]))
    adv2d = group_advantages(flat.reshape(2, 2), group_size=2, eps=0.0)
    assert adv2d.shape == (4,)
    assert torch.equal(adv, adv2d)


def test_mean_only_estimators():
    r = torch.tensor([1.0, 2.0, 6.0, 0.0, 0.0, 3.0])  # groups of 3: means 3 and 1
    expected = torch.tensor([-2.0, -1.0, 3.0, -1.0, -1.0, 2.0])
    assert torch.equal(group_advantages(r, 3, normalize_std=False), expected)
    assert torch.equal(dr_grpo_advantages(r, 3), expected)
    assert torch.equal(get_advantage_estimator("mean_only")(r, 3), expected)
    assert torch.equal(get_advantage_estimator("dr_grpo")(r, 3), expected)


@pytest.mark.parametrize("normalize_std", [True, False])
def test_all_equal_groups_give_exact_zeros(normalize_std):
    # 0.1 * 3 / 3 is not exactly 0.1 in floating point: the zeros must not come from the subtraction.
    r = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.5, 7.0, 7.0, 7.0], dtype=torch.float32)
    adv = group_advantages(r, 3, normalize_std=normalize_std)
    assert torch.isfinite(adv).all()
    assert torch.equal(adv[:3], torch.zeros(3))
    assert torch.equal(adv[6:], torch.zeros(3))
    assert adv[3:6].abs().sum() > 0


def test_group_size_one_gives_zeros():
    adv = group_advantages(torch.tensor([1.0, -3.0, 2.5]), group_size=1)
    assert torch.equal(adv, torch.zeros(3))


@pytest.mark.parametrize("seed", range(4))
def test_mean_zero_std_one_per_group(seed):
    g = torch.Generator().manual_seed(seed)
    P, G = 5, 8
    r = torch.randn(P, G, generator=g) * 3 + 2
    adv = grpo_advantages(r.reshape(-1), G).reshape(P, G)
    torch.testing.assert_close(adv.mean(dim=1), torch.zeros(P), atol=1e-6, rtol=0)
    # The documented convention is the unbiased std, so the unbiased std of the result is 1 (up to eps).
    torch.testing.assert_close(adv.std(dim=1, correction=1), torch.ones(P), atol=1e-5, rtol=0)
    # Ordering within each group is preserved.
    assert torch.equal(adv.argsort(dim=1), r.argsort(dim=1))


def test_dtype_and_device_follow_rewards():
    assert group_advantages(torch.tensor([1, 0, 1, 1]), 2).dtype == torch.float32
    assert group_advantages(torch.tensor([True, False]), 2).dtype == torch.float32
    assert group_advantages(torch.tensor([1.0, 0.0], dtype=torch.float64), 2).dtype == torch.float64


def test_length_not_divisible_names_both_numbers():
    with pytest.raises(ValueError, match=r"length 7 .*group_size 4"):
        group_advantages(torch.zeros(7), group_size=4)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="group_size=4"):
        group_advantages(torch.zeros(3, 5), group_size=4)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 2, 2), group_size=2)
    with pytest.raises(ValueError, match="positive integer"):
        group_advantages(torch.zeros(4), group_size=0)


def test_non_finite_rewards_name_the_indices():
    r = torch.tensor([0.0, 1.0, float("nan"), 0.0, 1.0, float("inf")])
    with pytest.raises(ValueError, match=r"\[2, 5\]"):
        group_advantages(r, group_size=3)


def test_registry():
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "dr_grpo", "mean_only", "maxrl"}
    assert get_advantage_estimator("grpo") is grpo_advantages
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'.*dr_grpo.*grpo.*mean_only"):
        get_advantage_estimator("ppo")
