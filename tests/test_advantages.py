"""Group-relative advantages and group statistics: hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from arpo_core.algorithm.advantages import ADVANTAGE_SCALES, group_advantages, group_stats
from arpo_core.config import LossSection

EPS = LossSection().advantage_eps  # 1e-6, the reference code's

EPS = 1e-6


def test_one_success_in_four() -> None:
    # mean 0.25; unbiased var = (0.75^2 + 3 * 0.25^2) / 3 = 0.25 -> std 0.5
    a = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4, scale="group", eps=EPS)
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25]) / (0.5 + EPS)
    torch.testing.assert_close(a, expected)
    torch.testing.assert_close(a, torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-5, rtol=0)


def test_two_groups_group_scale() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    a = group_advantages(rewards, group_size=4, scale="group", eps=EPS)
    # group 2: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 1/sqrt(3)
    s1, s2 = 0.5 + EPS, 1 / math.sqrt(3) + EPS
    expected = torch.tensor(
        [0.75 / s1, -0.25 / s1, -0.25 / s1, -0.25 / s1, 0.5 / s2, 0.5 / s2, -0.5 / s2, -0.5 / s2]
    )
    torch.testing.assert_close(a, expected)


def test_batch_scale_divides_by_whole_batch_std() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    # centring stays per group; batch mean 3/8, unbiased var = (3 * (5/8)^2 + 5 * (3/8)^2) / 7 = 15/56
    s = math.sqrt(15 / 56) + EPS
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]) / s
    torch.testing.assert_close(group_advantages(rewards, 4, scale="batch", eps=EPS), expected)


def test_none_scale_is_mean_centring_only() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, -1.0, 0.0, 0.5])
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.5, -1.0, 0.0, 0.5])  # group 2 mean 0
    torch.testing.assert_close(group_advantages(rewards, 4, scale="none", eps=EPS), expected)


@pytest.mark.parametrize("scale", sorted(ADVANTAGE_SCALES))
@pytest.mark.parametrize("value", [0.0, 1.0, 0.7, 0.3, 0.1, -0.5])
@pytest.mark.parametrize("group_size", [2, 7, 8, 16])
def test_constant_group_gives_exactly_zero(scale: str, value: float, group_size: int) -> None:
    # float32 mean of eight 0.7s is off by ~6e-8; / (0 + 1e-6) that would be +-0.056 (verl's result).
    other = torch.linspace(0, 1, group_size)  # a varied group beside it, so "batch" std is nonzero
    rewards = torch.cat([torch.full((group_size,), value), other])
    a = group_advantages(rewards, group_size, scale=scale, eps=EPS)
    assert torch.equal(a[:group_size], torch.zeros(group_size))
    assert a[group_size:].abs().sum() > 0


@pytest.mark.parametrize("scale", sorted(ADVANTAGE_SCALES))
def test_group_of_one_gets_zero(scale: str) -> None:
    a = group_advantages(torch.tensor([1.0, 0.0, 0.3]), group_size=1, scale=scale, eps=EPS)
    assert torch.equal(a, torch.zeros(3))


@pytest.mark.parametrize("scale", sorted(ADVANTAGE_SCALES))
def test_advantages_sum_to_zero_per_group(scale: str) -> None:
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(6 * 8, generator=g)
    a = group_advantages(rewards, 8, scale=scale, eps=EPS).view(6, 8)
    torch.testing.assert_close(a.sum(dim=1), torch.zeros(6), atol=1e-5, rtol=0)


def test_matches_per_group_loop_and_has_no_grad() -> None:
    g = torch.Generator().manual_seed(1)
    rewards = torch.rand(5 * 4, generator=g, requires_grad=True)
    a = group_advantages(rewards, 4, scale="group", eps=EPS)
    assert not a.requires_grad
    for k in range(5):
        grp = rewards.detach()[4 * k : 4 * k + 4]
        torch.testing.assert_close(a[4 * k : 4 * k + 4], (grp - grp.mean()) / (grp.std() + EPS))


def test_integer_rewards_and_eps() -> None:
    a = group_advantages(torch.tensor([1, 0]), group_size=2, scale="group", eps=0.5)
    # mean .5, unbiased std sqrt(0.5) = 0.7071
    expected = torch.tensor([0.5, -0.5]) / (math.sqrt(0.5) + 0.5)
    torch.testing.assert_close(a, expected)
    assert a.dtype == torch.float32


def test_float64_kept() -> None:
    a = group_advantages(torch.tensor([1.0, 0.0], dtype=torch.float64), 2, scale="group", eps=EPS)
    assert a.dtype == torch.float64


@pytest.mark.parametrize(
    ("n", "group_size", "match"),
    [(6, 4, "multiple of group_size=4"), (0, 4, "multiple"), (4, 0, "group_size must be >= 1")],
)
def test_bad_layout_errors(n: int, group_size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        group_advantages(torch.zeros(n), group_size, scale="group", eps=EPS)


def test_2d_rewards_rejected() -> None:
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 4), 4, scale="group", eps=EPS)


def test_unknown_scale_lists_valid_names() -> None:
    with pytest.raises(ValueError, match=r"\['batch', 'group', 'none'\]"):
        group_advantages(torch.zeros(4), 4, scale="std", eps=EPS)


def test_group_stats() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.1, 0.1, 0.0, 0.0])
    mean, std = group_stats(rewards, 4)
    torch.testing.assert_close(mean, torch.tensor([0.25, 0.0, 0.05]))
    # group 3: deviations +-0.05 -> unbiased var 4 * 0.0025 / 3
    torch.testing.assert_close(std, torch.tensor([0.5, 0.0, math.sqrt(0.01 / 3)]))
    # the replay rule "failed = std < 0.05 and mean < 0.2" (docs/method.md §1)
    failed = (std < 0.05) & (mean < 0.2)
    assert failed.tolist() == [False, True, False]  # std of group 3 is 0.0577


def test_group_stats_size_one_has_zero_std() -> None:
    mean, std = group_stats(torch.tensor([1.0, 0.0]), 1)
    assert torch.equal(mean, torch.tensor([1.0, 0.0]))
    assert torch.equal(std, torch.zeros(2))
