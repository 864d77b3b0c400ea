"""Trajectory rewards: task success plus a format penalty, safe checkers, OSWorld scoring rules.

Design decisions:
- **Scalar reward.** A trajectory has one scalar reward, given to every assistant token of it (docs/method.md
  §1): `reward = success + (format_penalty if a reply could not be parsed else 0)`.
- **Format penalty parameter.** The format penalty is a parameter because paper and code disagree: the paper's
  penalty is -1; the reference code computes `success + 0.5 * format_reward` with `format_reward = -1`, i.e.
  -0.5. params' `train.loss.format_penalty` holds the value (default the paper's -1.0), so no default here.
- **Untrusted checkers.** A checker (the environment's success test) is untrusted code that reads files,
  windows and pages of a desktop that may have crashed: any exception scores 0, as in the reference code. Its
  result is also sanitised: NaN and +-inf score 0 (a broken checker must not award success), finite values are
  clamped to [0, 1] (OSWorld checkers may return fractions; nothing outside [0, 1] is a success
  degree). `score_or_error` also returns the error text so a rollout can record it (`env_error`).
- **OSWorld Hard.** "OSWorld Hard" (ARPO paper): a trajectory that runs into the step limit and whose last
  action is FAIL (`call_user`) scores 0. Without this rule an agent on an infeasible task is paid for running
  out of steps, and on any task can learn to answer FAIL late as a hedge.
- **Infeasible tasks.** Infeasible tasks (OSWorld evaluator func `infeasible`) score 1 only when the agent's
  last action is FAIL. FAIL is the parsed action kind `call_user` (arpo_core.actions) or `FAIL`, the name
  OSWorld's own action space and its `action_history` use for the same thing.
- **Pure functions.** Pure functions on Python floats: no tensors, no logging; callers turn lists into
  tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = [
    "FAIL_ACTIONS",
    "infeasible_score",
    "osworld_hard",
    "safe_score",
    "score_or_error",
    "trajectory_reward",
]

FAIL_ACTIONS: frozenset[str] = frozenset({"call_user", "FAIL"})
"""Last-action names that mean "the agent declares the task impossible" (UI-TARS `call_user()`,
OSWorld's `FAIL`)."""


def trajectory_reward(success: float, format_error: bool, format_penalty: float) -> float:
    """Reward of one trajectory: checker success plus the format penalty if a reply failed to parse.

    Args:
        success: checker score in [0, 1] (use `safe_score` to get one).
        format_error: True when some reply could not be parsed (which also ended the episode).
        format_penalty: added on a format error. Paper: -1.0; reference code: -0.5
            (`success + 0.5 * format_reward`, format_reward = -1).

    Returns:
        `success + format_penalty` on a format error, else `success`.
    """
    if not math.isfinite(success):
        raise ValueError(f"success must be finite, got {success!r}; score checkers with safe_score")
    return float(success) + (float(format_penalty) if format_error else 0.0)


def _sanitise(value: float) -> float:
    """NaN / +-inf -> 0 (a broken checker); finite values clamped to [0, 1]."""
    if not math.isfinite(value):
        return 0.0
    return min(1.0, max(0.0, value))


def score_or_error(checker: Callable[[], float]) -> tuple[float, str | None]:
    """Run a success checker; return (score in [0, 1], error text or None).

    Any `Exception` raised by the checker, or a result that is not a number, gives score 0 and the
    error text (`"TypeName: message"`). KeyboardInterrupt / SystemExit are not caught: stopping a run
    must still stop it.
    """
    try:
        raw = checker()
        value = float(raw)
    except Exception as exc:  # any checker failure scores 0 (docs/method.md §1)
        return 0.0, f"{type(exc).__name__}: {exc}"
    return _sanitise(value), None


def safe_score(checker: Callable[[], float]) -> float:
    """Score in [0, 1] from a checker; an exception, NaN or inf scores 0 (see `score_or_error`)."""
    return score_or_error(checker)[0]


def osworld_hard(success: float, hit_step_limit: bool, last_action_kind: str | None) -> float:
    """ "OSWorld Hard" score: 0 when the step limit was hit and the last action is FAIL, else `success`.

    Args:
        success: the checker's score in [0, 1] (for an infeasible task, `infeasible_score(...)`).
        hit_step_limit: the episode reached max_steps instead of ending on its own.
        last_action_kind: kind of the last action taken (`call_user`/`FAIL`, `finished`, ...), or None
            when the episode has no action (e.g. its first reply failed to parse).
    """
    if hit_step_limit and last_action_kind in FAIL_ACTIONS:
        return 0.0
    return float(success)


def infeasible_score(last_action_kind: str | None) -> float:
    """Score of a task whose evaluator func is `infeasible`: 1.0 iff the agent ended with FAIL."""
    return 1.0 if last_action_kind in FAIL_ACTIONS else 0.0
