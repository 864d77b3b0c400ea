"""Valuable task selection: counting, rules and their reasons, the cap, JSON round trip."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from arpo_core.algorithm.selection import (
    Outcome,
    SelectConfig,
    Selection,
    TaskCount,
    count_outcomes,
    read_selection,
    select_tasks,
    write_selection,
)
from arpo_core.trajectory import Step, Trajectory, png_bytes


def records(domain: str, task: str, scores: list[float]) -> list[tuple[str, str, float]]:
    return [(domain, task, s) for s in scores]


# Hand-built baseline, 4 rollouts per task.
BASELINE = (
    records("web", "never", [0, 0, 0, 0])
    + records("web", "once", [0, 1, 0, 0])
    + records("web", "half", [1, 0, 1, 0])
    + records("web", "always", [1, 1, 1, 1])
    + records("os", "once", [0, 0, 0.1, 0.5])  # 0.1 is not a success (strict), 0.5 is
    + records("os", "partial", [0.1, 0.05, 0.1, 0.0])  # no score above 0.1
    + records("os", "infeasible-task", [1, 1, 0, 0])
)


def test_count_outcomes_hand_values():
    counts = count_outcomes(BASELINE, 0.1)
    assert counts == {
        ("web", "never"): (4, 0),
        ("web", "once"): (4, 1),
        ("web", "half"): (4, 2),
        ("web", "always"): (4, 4),
        ("os", "once"): (4, 1),
        ("os", "partial"): (4, 0),
        ("os", "infeasible-task"): (4, 2),
    }


@pytest.mark.parametrize(
    ("threshold", "expected"), [(0.1, (4, 1)), (0.0, (4, 2)), (0.5, (4, 0)), (0.49, (4, 1))]
)
def test_count_threshold_is_strict(threshold, expected):
    assert count_outcomes(records("os", "once", [0, 0, 0.1, 0.5]), threshold)[("os", "once")] == expected


def tiny_traj(domain: str, task: str, success: float, reward: float, sample: int) -> Trajectory:
    step = Step(step_idx=0, screenshot_png=png_bytes(Image.new("RGB", (2, 2))), screen_w=2, screen_h=2)
    return Trajectory(
        run_id="base",
        stage="baseline",
        epoch=0,
        task_domain=domain,
        task_id=task,
        instruction="x",
        steps=[step],
        sample_idx=sample,
        success=success,
        reward=reward,
    )


def test_trajectories_count_by_success_not_reward():
    trajs = [
        tiny_traj("web", "a", success=1.0, reward=0.5, sample=0),  # success with a format penalty
        tiny_traj("web", "a", success=0.0, reward=0.5, sample=1),  # reward without success
        tiny_traj("web", "a", success=0.0, reward=-1.0, sample=2),
    ]
    assert count_outcomes(trajs, 0.1) == {("web", "a"): (3, 1)}
    mixed = [*trajs, Outcome("web", "a", 1.0), ("web", "b", 0.0)]
    assert count_outcomes(mixed, 0.1) == {("web", "a"): (4, 2), ("web", "b"): (1, 0)}


def test_default_selection_keeps_tasks_with_a_success():
    sel = select_tasks(BASELINE, infeasible={("os", "infeasible-task")}, success_threshold=0.1)
    assert sel.kept == (("os", "once"), ("web", "always"), ("web", "half"), ("web", "once"))
    assert sel.counts[("web", "half")] == TaskCount(n=4, successes=2, rate=0.5, reason="kept")
    assert sel.counts[("web", "never")].reason == "too_few_successes"
    assert sel.counts[("os", "partial")] == TaskCount(4, 0, 0.0, "too_few_successes")
    assert sel.counts[("os", "infeasible-task")] == TaskCount(4, 2, 0.5, "infeasible")
    assert sel.reasons() == {"kept": 4, "too_few_successes": 2, "infeasible": 1}


def test_same_id_in_two_domains_is_two_tasks():
    sel = select_tasks(BASELINE, SelectConfig(min_successes=1), success_threshold=0.1)
    assert ("os", "once") in sel.kept and ("web", "once") in sel.kept
    assert sel.counts[("os", "once")].n == 4


@pytest.mark.parametrize(
    ("min_successes", "kept"),
    [
        (0, {"never", "once", "half", "always", "os/once", "os/partial"}),
        (1, {"once", "half", "always", "os/once"}),
        (2, {"half", "always"}),
        (4, {"always"}),
        (5, set()),
    ],
)
def test_min_successes(min_successes, kept):
    sel = select_tasks(
        BASELINE,
        SelectConfig(min_successes=min_successes),
        infeasible={("os", "infeasible-task")},
        success_threshold=0.1,
    )
    names = {i if d == "web" else f"os/{i}" for d, i in sel.kept}
    assert names == kept


def test_excluded_and_unseen_infeasible_keys_are_reported():
    sel = select_tasks(
        BASELINE,
        exclude={("web", "half")},
        infeasible={("os", "infeasible-task"), ("gimp", "never-run")},
        success_threshold=0.1,
    )
    assert sel.counts[("web", "half")].reason == "excluded"
    # A key named infeasible but absent from the baseline still gets a line.
    assert sel.counts[("gimp", "never-run")] == TaskCount(0, 0, 0.0, "infeasible")
    assert ("web", "half") not in sel.kept


def test_exclusion_wins_over_infeasible():
    sel = select_tasks(
        BASELINE, exclude={("web", "once")}, infeasible={("web", "once")}, success_threshold=0.1
    )
    assert sel.counts[("web", "once")].reason == "excluded"


def test_max_success_rate_drops_always_solved():
    sel = select_tasks(
        BASELINE,
        SelectConfig(max_success_rate=0.99),
        infeasible={("os", "infeasible-task")},
        success_threshold=0.1,
    )
    assert sel.counts[("web", "always")].reason == "always_solved"
    assert ("web", "half") in sel.kept


def many_tasks(n: int) -> list[tuple[str, str, float]]:
    """Task i has i % 5 successes out of 4... capped at 4: successes = min(i % 5, 4)."""
    out: list[tuple[str, str, float]] = []
    for i in range(n):
        s = i % 5
        out += records("d", f"t{i:02d}", [1.0] * s + [0.0] * (4 - s))
    return out


def test_cap_top_keeps_highest_success_counts_ties_by_key():
    data = many_tasks(20)  # successes: t00 0, t01 1, t02 2, t03 3, t04 4, t05 0, ...
    sel = select_tasks(data, SelectConfig(max_tasks=5, cap_mode="top"), success_threshold=0.1)
    # Four tasks have 4 successes (t04, t09, t14, t19), then the first 3-success task by key: t03.
    assert sel.kept == tuple(("d", t) for t in ["t03", "t04", "t09", "t14", "t19"])
    assert sel.counts[("d", "t08")].reason == "over_cap"
    assert sel.counts[("d", "t00")].reason == "too_few_successes"
    assert sel.reasons() == {"kept": 5, "over_cap": 11, "too_few_successes": 4}


def test_cap_random_is_seeded_and_deterministic():
    data = many_tasks(40)
    params = SelectConfig(max_tasks=8, seed=11)
    a = select_tasks(data, params, success_threshold=0.1)
    b = select_tasks(list(reversed(data)), params, success_threshold=0.1)  # input order does not matter
    c = select_tasks(data, SelectConfig(max_tasks=8, seed=12), success_threshold=0.1)
    assert a.kept == b.kept
    assert a.kept != c.kept
    assert len(a.kept) == 8 and list(a.kept) == sorted(a.kept)
    assert all(a.counts[k].successes >= 1 for k in a.kept)
    assert sum(c.reason == "over_cap" for c in a.counts.values()) == 32 - 8


def test_cap_not_reached_keeps_all():
    sel = select_tasks(many_tasks(10), SelectConfig(max_tasks=100), success_threshold=0.1)
    assert len(sel.kept) == 8 and "over_cap" not in sel.reasons()


def test_params_validation():
    with pytest.raises(ValueError, match="cap_mode"):
        SelectConfig(cap_mode="best")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_tasks"):
        SelectConfig(max_tasks=-1)


def test_write_read_round_trip(tmp_path):
    sel = select_tasks(
        BASELINE,
        SelectConfig(max_tasks=2, seed=3),
        infeasible={("os", "infeasible-task")},
        success_threshold=0.1,
    )
    path = write_selection(tmp_path / "sub" / "selected_tasks.json", sel)
    back = read_selection(path)
    assert isinstance(back, Selection)
    assert back == sel
    doc = json.loads(path.read_text())
    assert doc["summary"] == sel.reasons()
    assert [list(k.values()) for k in doc["kept"]] == [list(k) for k in sel.kept]
    assert not [p for p in path.parent.iterdir() if p.name != path.name]  # no temp file left


def test_read_rejects_unknown_format(tmp_path):
    p = tmp_path / "s.json"
    p.write_text(json.dumps({"format_version": 99}))
    with pytest.raises(ValueError, match="format_version"):
        read_selection(p)
