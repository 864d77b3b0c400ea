"""arpo_core.analysis.probe: target choice, the image-blind ceiling and click alignment on hand-made records;
determinism of MiniWoB reset(seed) targets in a real browser."""

from __future__ import annotations

import json
import math

import pytest

from arpo_core.analysis.evaluation import Scorer
from arpo_core.analysis.probe import (
    TargetRecord,
    blind_ceiling,
    click_alignment,
    cv_ceiling,
    paired_difference,
    target_element,
    within_corr,
)
from arpo_core.envs.base import TaskSpec
from arpo_core.envs.miniwob.dom import DomElement
from arpo_core.trajectory import Step, Trajectory

STANDARD = Scorer("standard", 3)
"""Checker success as it is: the scoring of every MiniWoB evaluation here."""


def el(index: int, tag: str, bbox: tuple[float, float, float, float], visible: bool = True) -> DomElement:
    return DomElement(index, tag, "", "", "", "", bbox, visible, True, None, False, "", "", 0)


def rec(task: str, seed: int, box: tuple[float, float, float, float], utt: str = "u") -> TargetRecord:
    centre = ((box[0] + box[2]) / 2, (box[1] + box[3]) / 2)
    return TargetRecord("miniwob", task, seed, utt, box, centre, centre, "button")


def traj(task: str, k: int, click: tuple[float, float] | None, utt: str = "u") -> Trajectory:
    actions = [] if click is None else [{"kind": "click", "point": list(click)}]
    step = Step(0, b"", 160, 210, actions_json=json.dumps(actions), parse_ok=click is not None)
    return Trajectory("r", "evaluate", 0, "miniwob", task, utt, [step], sample_idx=k)


def scored(task: str, k: int, success: float, utt: str = "u") -> Trajectory:
    t = traj(task, k, (1.0, 1.0), utt)
    t.success = success
    return t


def test_paired_difference_hand_computed():
    before = [scored("a", k, s) for k, s in enumerate([1, 0, 0, 0, 1])] + [scored("b", 0, 0.0)]
    after = [scored("a", k, s) for k, s in enumerate([1, 1, 1, 0, 0])] + [scored("b", 0, 1.0, utt="other")]
    after.append(scored("c", 0, 1.0))  # only in `after`
    d = paired_difference(before, after, STANDARD)
    # paired: a/0..4 (b/0's utterance differs, c/0 unmatched); differences [0, 1, 1, 0, -1]
    assert d["n"] == 5 and d["unpaired"] == 2
    assert d["before"] == pytest.approx(0.4) and d["after"] == pytest.approx(0.6)
    assert d["delta"] == pytest.approx(0.2) and (d["wins"], d["losses"]) == (2, 1)
    sd = math.sqrt(sum((v - 0.2) ** 2 for v in [0, 1, 1, 0, -1]) / 4)
    assert d["ci95"] == pytest.approx([0.2 - 1.96 * sd / math.sqrt(5), 0.2 + 1.96 * sd / math.sqrt(5)])
    assert d["sign_test_p"] == pytest.approx(1.0)  # 2 vs 1 of 3: 2 * P(X <= 1) = 2 * 4/8 -> 1
    # 12 wins, 0 losses: 2 / 2**12
    many = paired_difference(
        [scored("a", k, 0.0) for k in range(12)], [scored("a", k, 1.0) for k in range(12)], STANDARD
    )
    assert many["sign_test_p"] == pytest.approx(2 / 4096) and many["delta"] == 1.0


def test_paired_difference_rejects_duplicate_episodes_and_handles_no_pairs():
    with pytest.raises(ValueError, match="share"):
        paired_difference([scored("a", 0, 1.0), scored("a", 0, 0.0)], [], STANDARD)
    d = paired_difference([scored("a", 0, 1.0)], [scored("b", 0, 1.0)], STANDARD)
    assert d["n"] == 0 and d["delta"] is None and d["unpaired"] == 2


def test_target_element_prefers_the_largest_centred_then_the_smallest_containing():
    body = el(0, "body", (0, 0, 160, 210))  # too large: never a target
    button = el(1, "button", (10, 10, 40, 20))  # centre (30, 20)
    icon = el(2, "span", (25, 15, 10, 10))  # centre (30, 20) too, inside the button
    hidden = el(3, "div", (0, 0, 100, 100), visible=False)
    dom = [body, button, icon, hidden]
    assert target_element(dom, (30, 20)) is button
    assert target_element(dom, (27, 17)) is icon  # off-centre (free_point): the smallest containing
    assert target_element(dom, (12, 12)) is button
    with pytest.raises(ValueError):
        target_element(dom, (150, 200))  # only <body> contains it


def test_blind_ceiling_hand_computed():
    recs = [
        rec("a", 0, (0, 0, 10, 10)),
        rec("a", 1, (5, 5, 15, 15)),
        rec("a", 2, (20, 20, 30, 30)),
        rec("b", 0, (0, 0, 4, 4)),
    ]
    c = blind_ceiling(recs)
    assert c["a"]["hit_rate"] == pytest.approx(2 / 3)  # a point in the overlap of the first two
    assert 5 <= c["a"]["point"][0] <= 10 and 5 <= c["a"]["point"][1] <= 10
    assert c["b"]["hit_rate"] == 1.0 and c["b"]["n"] == 1
    assert c["_mean"]["hit_rate"] == pytest.approx((2 / 3 + 1) / 2)
    assert c["_mean"]["n"] == 4
    assert c["b"]["cv_hit_rate"] is None and c["_mean"]["cv_hit_rate"] is None  # one box: no folds


def test_cv_ceiling_fits_on_one_half_and_scores_on_the_other():
    near, far = (0, 0, 10, 10), (50, 50, 60, 60)
    # even = [near, far], odd = [near, near]: the odd fold's point (in near) hits 1 of the even fold;
    # the even fold's best point is in near (first candidate to reach 1 hit) and hits both odd boxes
    assert cv_ceiling([near, near, far, near]) == pytest.approx(3 / 4)
    assert cv_ceiling([near, far]) == 0.0  # each half's point misses the other half
    assert cv_ceiling([near]) is None


def test_within_corr_removes_between_task_offsets():
    # two tasks, each click constant at its task's mean target: raw pooled correlation is high, within 0
    groups = [([10.0, 10.0], [8.0, 12.0]), ([50.0, 50.0], [48.0, 52.0])]
    assert within_corr(groups) == 0.0
    assert within_corr([([0, 1], [5, 6]), ([10, 11], [0, 1])]) == pytest.approx(1.0)
    assert within_corr([([1.0], [2.0])]) is None


def test_click_alignment_hand_computed():
    seed = 100
    recs = [
        rec("a", 100, (0, 0, 10, 10)),  # centre (5, 5)
        rec("a", 101, (20, 0, 30, 10)),  # centre (25, 5)
        rec("a", 102, (40, 20, 50, 30)),  # centre (45, 25)
        rec("b", 100, (0, 0, 20, 20)),  # centre (10, 10)
        rec("b", 101, (60, 60, 80, 80)),  # centre (70, 70)
        rec("b", 102, (0, 0, 20, 20), utt="other"),
    ]
    trajs = [
        traj("a", 0, (5, 5)),  # hit
        traj("a", 1, (25, 5)),  # hit
        traj("a", 2, (45, 5)),  # x right, y outside the box: miss
        traj("b", 0, (10, 10)),  # hit, but b's clicks are constant
        traj("b", 1, (10, 10)),  # miss
        traj("b", 2, (10, 10)),  # utterance differs from the record: unpaired
        traj("b", 3, (10, 10)),  # no record for seed 103: unpaired
        traj("c", 0, (1, 1)),  # task without records: ignored
        traj("a", 3, None),  # no record either
    ]
    out = click_alignment(trajs, recs, seed)
    a, b, pooled = out["tasks"]["a"], out["tasks"]["b"], out["pooled"]
    assert (a["episodes"], a["clicks"]) == (3, 3)
    assert a["hit_rate"] == pytest.approx(2 / 3)
    assert a["corr_x"] == pytest.approx(1.0)  # clicks x == targets x
    assert a["corr_y"] == 0.0  # constant clicks y (5, 5, 5)
    assert a["spread_px"] == pytest.approx(math.sqrt((400 + 0 + 400) / 3))
    assert b["hit_rate"] == 0.5 and b["corr_x"] == 0.0 and b["spread_px"] == 0.0
    assert pooled["episodes"] == 5 and pooled["unpaired"] == 3
    assert pooled["hit_rate"] == pytest.approx(3 / 5)
    # within-task pooling: a's centred x pairs (-20,-20) (0,0) (20,20); b's centred clicks are 0 while
    # its targets are (-30, 30): sum ab = 800, sum a^2 = 800, sum b^2 = 800 + 1800
    assert pooled["corr_x"] == pytest.approx(800 / math.sqrt(800 * 2600))
    assert pooled["corr_y"] == 0.0  # every task's y clicks are constant
    assert pooled["click_target_corr"] == pytest.approx((800 / math.sqrt(800 * 2600)) / 2)
    assert pooled["spread_px"] == pytest.approx(math.sqrt(800 / 3) / 2)


def test_click_alignment_without_clicks_gives_none_correlations():
    out = click_alignment([traj("a", 0, None)], [rec("a", 7, (0, 0, 1, 1))], 7)
    assert out["tasks"]["a"]["hit_rate"] == 0.0 and out["tasks"]["a"]["clicks"] == 0
    assert out["pooled"]["click_target_corr"] is None


def test_target_record_json_round_trip():
    r = rec("a", 3, (1.5, 2, 3, 4))
    assert TargetRecord.from_dict(json.loads(json.dumps(r.as_dict()))) == r


def test_first_step_targets_are_deterministic_given_the_seed():
    """MiniWoB single-step tasks: reset(seed) fixes the instance (the pairing of probe.py,
    decision "Episode pairing")."""
    from arpo_core.analysis.probe import first_step_targets
    from arpo_core.envs.miniwob.miniwob_env import MiniWoBEnv

    tasks = [TaskSpec(domain="miniwob", task_id=t) for t in ("click-test-2", "click-button")]
    env = MiniWoBEnv()
    try:
        first = first_step_targets(env, tasks, [5, 6, 7])
        again = first_step_targets(env, tasks[::-1], [7, 6, 5])
    finally:
        env.close()
    assert {r.key: r for r in first} == {r.key: r for r in again}
    for task in ("click-test-2", "click-button"):
        boxes = [r.box for r in first if r.task_id == task]
        assert len(set(boxes)) > 1  # different seeds, different instances: the check is not vacuous
        for r in first:
            assert r.box[0] <= r.oracle_point[0] <= r.box[2] and r.box[1] <= r.oracle_point[1] <= r.box[3]
    assert {r.tag for r in first} == {"button"}
