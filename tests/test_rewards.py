"""Trajectory reward, safe checker scoring and OSWorld rules: hand-computed values."""

from __future__ import annotations

import math

import pytest

from arpo_core.rewards import (
    FAIL_ACTIONS,
    infeasible_score,
    osworld_hard,
    safe_score,
    score_or_error,
    trajectory_reward,
)


@pytest.mark.parametrize(
    ("success", "format_error", "penalty", "expected"),
    [
        (1.0, False, -1.0, 1.0),
        (0.0, False, -1.0, 0.0),
        (0.0, True, -1.0, -1.0),  # paper: a parse error costs 1
        (0.0, True, -0.5, -0.5),  # reference code: success + 0.5 * (-1)
        (0.5, True, -0.5, 0.0),  # partial OSWorld success, then a bad reply
        (1.0, True, -1.0, 0.0),
        (0.25, False, -0.5, 0.25),  # the penalty only applies on a format error
    ],
)
def test_trajectory_reward(success: float, format_error: bool, penalty: float, expected: float) -> None:
    assert trajectory_reward(success, format_error, penalty) == pytest.approx(expected)


def test_params_penalty_is_papers() -> None:
    from arpo_core.config import LossSection

    assert trajectory_reward(0.0, True, LossSection().format_penalty) == -1.0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_trajectory_reward_rejects_non_finite_success(bad: float) -> None:
    with pytest.raises(ValueError, match="finite"):
        trajectory_reward(bad, False, -1.0)


def _raise_key_error() -> float:
    return {}["missing"]


@pytest.mark.parametrize(
    ("checker", "expected"),
    [
        (lambda: 1.0, 1.0),
        (lambda: 0.0, 0.0),
        (lambda: 0.4, 0.4),  # OSWorld fractions pass through
        (lambda: True, 1.0),  # bool checkers
        (lambda: 3, 1.0),  # clamp above
        (lambda: -0.5, 0.0),  # clamp below
        (lambda: math.nan, 0.0),
        (lambda: math.inf, 0.0),  # a broken checker must not award success
        (lambda: -math.inf, 0.0),
        (lambda: None, 0.0),  # not a number
        (lambda: "0.7", 0.7),  # float() accepts numeric strings
        (lambda: "yes", 0.0),
        (lambda: 1 / 0, 0.0),
        (_raise_key_error, 0.0),
    ],
)
def test_safe_score(checker, expected: float) -> None:
    assert safe_score(checker) == pytest.approx(expected)


def test_score_or_error_reports_the_exception() -> None:
    def checker() -> float:
        raise FileNotFoundError("/home/user/out.xlsx")

    score, err = score_or_error(checker)
    assert score == 0.0
    assert err == "FileNotFoundError: /home/user/out.xlsx"
    assert score_or_error(lambda: 0.5) == (0.5, None)


def test_safe_score_lets_keyboard_interrupt_through() -> None:
    def checker() -> float:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        safe_score(checker)


@pytest.mark.parametrize(
    ("success", "hit_limit", "last", "expected"),
    [
        (1.0, True, "call_user", 0.0),  # the rule: step limit + FAIL scores 0 ...
        (1.0, True, "FAIL", 0.0),  # ... with OSWorld's name for FAIL too
        (1.0, False, "call_user", 1.0),  # FAIL before the limit keeps the checker's score
        (1.0, True, "click", 1.0),  # limit hit with another action keeps it
        (0.5, True, "finished", 0.5),
        (0.0, False, None, 0.0),
        (1.0, True, None, 1.0),
    ],
)
def test_osworld_hard(success: float, hit_limit: bool, last: str | None, expected: float) -> None:
    assert osworld_hard(success, hit_limit, last) == expected


@pytest.mark.parametrize(
    ("last", "expected"),
    [("call_user", 1.0), ("FAIL", 1.0), ("finished", 0.0), ("click", 0.0), (None, 0.0), ("fail", 0.0)],
)
def test_infeasible_score(last: str | None, expected: float) -> None:
    assert infeasible_score(last) == expected


def test_infeasible_task_that_times_out_on_fail_scores_zero_under_osworld_hard() -> None:
    # The reward hack the Hard rule closes: FAIL at the step limit on an infeasible task.
    assert osworld_hard(infeasible_score("call_user"), True, "call_user") == 0.0
    assert osworld_hard(infeasible_score("call_user"), False, "call_user") == 1.0
    assert set(FAIL_ACTIONS) == {"call_user", "FAIL"}
