"""Oracle demonstrations with recovery: deliberate misses on empty space (hand-built DOMs), the seeded plan,
and whole demos on real MiniWoB (the miss hits no element, the episode still succeeds, the misses are
context only, the same jobs give the same demos, recovery_rate 0 gives the plain oracle episodes)."""

from __future__ import annotations

import functools
import json
import random

import pytest

from arpo_core.actions import parse_response, to_screen
from arpo_core.algorithm.rollout import EpisodeJob
from arpo_core.envs.base import TaskSpec
from arpo_core.envs.miniwob.dom import DomElement
from arpo_core.envs.miniwob.oracles import FRAME_IDS, ORACLES, empty_points, miss_step, model_size
from arpo_core.offline.demonstrations import miss_rng, planned_misses, play_oracle_episodes
from arpo_core.policy.prompt import PromptSpec

MAX_STEPS = 8  # params' baseline.max_steps, the demos' step limit


def el(index, bbox, tag="div", id="", text="", value=None, focused=False, visible=True):
    return DomElement(index, tag, text, text, id, "", bbox, visible, True, value, focused, "", "", 0)


FRAME = [
    el(0, (0.0, 0.0, 500.0, 210.0), tag="body"),
    el(1, (0.0, 0.0, 160.0, 210.0), id="wrap"),
    el(2, (0.0, 0.0, 160.0, 50.0), id="query"),
    el(3, (0.0, 50.0, 160.0, 160.0), id="area"),
]


def inside(point, bbox, margin=0.0):
    x, y = point
    left, top, w, h = bbox
    return left - margin < x < left + w + margin and top - margin < y < top + h + margin


def test_empty_points_avoid_every_element_but_the_frame_and_the_query_bar():
    button = el(4, (10.0, 60.0, 100.0, 100.0), tag="button", id="subbtn")
    hidden = el(5, (0.0, 170.0, 160.0, 40.0), visible=False)
    pts = empty_points([*FRAME, button, hidden])
    assert pts and len(set(pts)) == len(pts)
    for p in pts:
        assert not inside(p, button.bbox, margin=3.0)
        assert p[1] >= 53.0 and 3.0 <= p[0] <= 156.0 and p[1] <= 206.0
    assert any(p[1] > 170 for p in pts)  # invisible elements do not count
    # a page whose widgets cover the whole task area has no empty point
    assert empty_points([*FRAME, el(4, (0.0, 45.0, 160.0, 170.0), id="form")]) == []


def test_miss_step_keeps_the_thought_and_clicks_empty_space():
    dom = [*FRAME, el(4, (7.0, 114.0, 93.0, 93.0), tag="button", id="subbtn", text="Click Me!")]
    thought, _ = ORACLES["click-test"]("Click the button.", dom)
    rng = random.Random(3)
    miss = miss_step("click-test", "Click the button.", dom, rng)
    assert miss is not None and miss[0] == thought
    [a] = miss[1]
    assert a.kind == "click" and a.point in empty_points(dom)
    assert not any(inside(a.point, e.bbox) for e in dom if e.tag != "body" and e.id not in FRAME_IDS)
    assert miss_step("click-test", "Click the button.", dom, random.Random(3)) == miss  # seeded
    # no miss when the oracle's next action is not a click (a focused empty field: type) ...
    field = el(4, (19.0, 53.0, 128.0, 21.0), tag="input_text", id="tt", value="", focused=True)
    submit = el(5, (19.0, 93.0, 101.0, 31.0), tag="button", id="subbtn", text="Submit")
    utt = 'Enter "Ann" into the text field and press Submit.'
    assert miss_step("enter-text", utt, [*FRAME, field, submit], rng) is None
    # ... without an oracle, or without empty space
    assert miss_step("no-such-task", "", dom, rng) is None
    full = [*FRAME, el(4, (0.0, 45.0, 160.0, 170.0), tag="button", id="subbtn", text="Click Me!")]
    assert miss_step("click-test", "Click the button.", full, rng) is None


def test_miss_plan_is_seeded_per_episode():
    task = TaskSpec("miniwob", "click-test")
    jobs = [EpisodeJob(task, seed=100000 + k) for k in range(400)]
    plans = [planned_misses(miss_rng(j), 0.5, 2) for j in jobs]
    assert plans == [planned_misses(miss_rng(j), 0.5, 2) for j in jobs]
    assert set(plans) == {0, 1, 2}
    assert 0.4 < sum(p > 0 for p in plans) / len(plans) < 0.6
    assert all(planned_misses(miss_rng(j), 0.0, 2) == 0 for j in jobs)
    assert all(planned_misses(miss_rng(j), 1.0, 1) == 1 for j in jobs)
    other = [
        planned_misses(miss_rng(EpisodeJob(TaskSpec("miniwob", "click-tab"), j.seed)), 0.5, 2) for j in jobs
    ]
    assert other != plans  # the task is part of the stream: episode k of every task is not alike


# ---------------------------------------------------------------------------------------------------------
# Real MiniWoB
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool():
    from arpo_core.envs.miniwob.miniwob_env import make_miniwob_env
    from arpo_core.envs.pool import EnvPool

    p = EnvPool(functools.partial(make_miniwob_env), n=2)
    yield p
    p.close()


def jobs_for(tasks, seeds):
    return [
        EpisodeJob(
            TaskSpec("miniwob", t, split="in_domain", backend="miniwob"), seed=s, group_id=g, sample_idx=k
        )
        for g, t in enumerate(tasks)
        for k, s in enumerate(seeds)
    ]


def signature(trajs):
    return [(t.task_id, t.sample_idx, [(s.response_text, s.train_reply) for s in t.steps]) for t in trajs]


def check_recovery_demos(pool, jobs, trajs, max_misses) -> int:
    """Every demo: 1..max_misses untrained misses first, then the trained oracle steps, success; each
    miss clicks a point (screen pixels) outside every element's box but the frame's, below the query bar.
    A demo without a miss is allowed only on a page without empty space. Returns the demos with misses."""
    assert len(trajs) == len(jobs)
    n_recovery = 0
    for job, t in zip(jobs, trajs, strict=True):
        assert t.success > 0 and t.steps[-1].done and not any(s.done for s in t.steps[:-1])
        # the page is unchanged by a miss: the DOM of a fresh reset of the instance is the one missed on
        assert pool.submit_reset(0, job.task, job.seed).result().error is None
        dom = pool.submit_call(0, "dom_elements").result().value
        flags = [s.train_reply for s in t.steps]
        n_miss = flags.index(True)
        assert n_miss <= max_misses and all(flags[n_miss:])
        if n_miss == 0:
            assert empty_points(dom) == [], (t.task_id, job.seed)
            continue
        n_recovery += 1
        assert len(t.steps) >= 2
        query = next(e for e in dom if e.id == "query")
        solid = [e for e in dom if e.visible and e.tag != "body" and e.id not in FRAME_IDS]
        for s in t.steps[:n_miss]:
            [a] = s.actions()
            assert a["kind"] == "click"
            assert a["point"][1] > query.bbox[1] + query.bbox[3]
            assert not any(inside(a["point"], e.bbox) for e in solid), (t.task_id, a, s.response_text)
            # the reply is the oracle's own Thought with another click
            assert (
                s.response_text.split("\nAction:")[0] == t.steps[n_miss].response_text.split("\nAction:")[0]
            )
    return n_recovery


def test_recovery_demos_on_real_miniwob(pool, tmp_path):
    jobs = jobs_for(["click-test-2", "click-checkboxes", "enter-text"], [7, 8])
    res = play_oracle_episodes(pool, jobs, max_steps=MAX_STEPS, recovery_rate=1.0, max_misses=2)
    assert res.errors == [] and res.n_failed == 0
    assert check_recovery_demos(pool, jobs, res.trajectories, max_misses=2) == len(jobs)
    again = play_oracle_episodes(pool, jobs, max_steps=MAX_STEPS, recovery_rate=1.0, max_misses=2)
    assert signature(again.trajectories) == signature(res.trajectories)
    check_bc_sequences(res.trajectories, tmp_path)


def check_bc_sequences(trajs, tmp_path):
    """Every reply of a demo is in its behaviour-cloning sequence, in order, after its own screenshot and
    the earlier steps (history); the assistant mask covers exactly the replies with train_reply set."""
    import torch

    from arpo_core.policy.model import build_tiny_policy
    from arpo_core.policy.sequences import encode_trajectory

    policy = build_tiny_policy(tmp_path / "tiny", size="xs", seed=0)
    tok = policy.tokenizer
    for t in trajs:
        seq = encode_trajectory(policy, t, spec=PromptSpec("compact", None))
        ids, mask = torch.tensor(seq.input_ids), torch.tensor(seq.assistant_mask)
        trained = [s.response_text for s in t.steps if s.train_reply]
        assert tok.decode(ids[mask]) == "".join(r + "<|im_end|>" for r in trained)
        assert len(seq.image_grid_thw) == len(t.steps)
        text = tok.decode(ids)
        pos = [text.index(s.response_text + "<|im_end|>") for s in t.steps]
        assert pos == sorted(pos)
        # reply k follows screenshot k: k + 1 images before it
        for k, p in enumerate(pos):
            assert text[:p].count("<|vision_start|>") == k + 1


class FaultyPool:
    """The real pool, except that the calls named in `faults` (method -> how many) fail once each with an
    env error, as a killed worker or browser makes them fail."""

    def __init__(self, pool, faults: dict[str, int]):
        self._pool, self.faults = pool, dict(faults)

    def __getattr__(self, name):
        real = getattr(self._pool, name)
        if not name.startswith("submit_") or not self.faults.get(name):
            return real

        def failing(env_idx, *args):
            from concurrent.futures import Future

            from arpo_core.envs.pool import EnvResult

            self.faults[name] -= 1
            real(env_idx, *args).result()  # the env really moves on: the retry must start from scratch
            f = Future()
            f.set_result(EnvResult(env_idx, done=True, error=f"injected fault in {name}"))
            return f

        return failing


@pytest.mark.parametrize("method", ["submit_reset", "submit_step", "submit_call", "submit_evaluate"])
def test_a_demo_hit_by_an_env_fault_is_played_again_identically(pool, method):
    """demonstrations.py, decision "Fault replays": no demo is lost to an env fault, and the one played again
    is the undisturbed one."""
    jobs = jobs_for(["click-test-2", "enter-text"], [7])
    clean = play_oracle_episodes(pool, jobs, max_steps=MAX_STEPS, recovery_rate=1.0, max_misses=2)
    faulty = FaultyPool(pool, {method: 2})
    hit = play_oracle_episodes(faulty, jobs, max_steps=MAX_STEPS, recovery_rate=1.0, max_misses=2)
    assert faulty.faults[method] == 0  # both faults happened
    assert hit.errors == [] and hit.n_failed == 0
    assert signature(hit.trajectories) == signature(clean.trajectories)
    given_up = play_oracle_episodes(
        FaultyPool(pool, {"submit_reset": 99}), jobs[:1], max_steps=MAX_STEPS, recovery_rate=0.0, max_misses=1
    )
    assert given_up.trajectories == [] and len(given_up.errors) == 1 and "injected" in given_up.errors[0]


def test_misses_do_not_count_against_the_step_limit(pool):
    """demonstrations.py, decision "Misses beyond limit": a long task (login-user: 5 oracle steps) still
    succeeds after many misses; the demo then has more than max_steps steps, max_steps of them the
    oracle's."""
    jobs = jobs_for(["login-user"], [7, 8, 9])
    res = play_oracle_episodes(pool, jobs, max_steps=6, recovery_rate=1.0, max_misses=7)
    assert res.errors == [] and res.n_failed == 0 and len(res.trajectories) == len(jobs)
    for t in res.trajectories:
        n_miss = sum(not s.train_reply for s in t.steps)
        assert n_miss >= 1 and len(t.steps) - n_miss == 5 and t.success > 0
    assert max(len(t.steps) for t in res.trajectories) > 6


def plain_oracle_replies(pool, job) -> list[str]:
    """Today's demo of one job: the oracle's replies from reset to the end of the episode."""
    pool.submit_reset(0, job.task, job.seed).result()
    replies = []
    for _ in range(MAX_STEPS):
        text = pool.submit_call(0, "oracle_reply").result().value
        replies.append(text)
        actions = to_screen(parse_response(text).actions, model_size(), (160, 210))
        if pool.submit_step(0, actions).result().done:
            break
    return replies


def test_recovery_rate_zero_gives_the_plain_oracle_demos(pool, tmp_path):
    jobs = jobs_for(["click-test-2", "enter-text"], [7, 8])
    res = play_oracle_episodes(pool, jobs, max_steps=MAX_STEPS, recovery_rate=0.0, max_misses=2)
    assert res.errors == [] and len(res.trajectories) == len(jobs)
    for job, t in zip(jobs, res.trajectories, strict=True):
        assert all(s.train_reply for s in t.steps)
        assert [s.response_text for s in t.steps] == plain_oracle_replies(pool, job)
    assert {len(t.steps) for t in res.trajectories} == {1, 3}  # click-test-2: 1 step; enter-text: 3
    check_bc_sequences(res.trajectories, tmp_path)  # multi-step demos: every step's reply, with history


@pytest.mark.slow
def test_every_oracle_task_recovers_from_misses(pool):
    """Every in-domain task: misses on empty space never end the episode and the oracle still succeeds."""
    jobs = jobs_for(sorted(ORACLES), [11, 12, 13])
    res = play_oracle_episodes(pool, jobs, max_steps=MAX_STEPS, recovery_rate=1.0, max_misses=2)
    assert res.errors == [] and res.n_failed == 0, (res.errors, res.n_failed)
    n_recovery = check_recovery_demos(pool, jobs, res.trajectories, max_misses=2)
    assert n_recovery >= 0.9 * len(jobs)  # click-tab's long tab texts can fill the whole task area
    assert {t.task_id for t in res.trajectories if not t.steps[0].train_reply} == set(ORACLES)
    print("steps per task:", json.dumps({t.task_id: len(t.steps) for t in res.trajectories}))


def test_brief_thoughts_keep_the_oracles_actions(pool, tmp_path):
    """demonstrations.py, decision "Brief thoughts": with thoughts="brief" every reply, misses included, is
    the fixed Thought with exactly the actions (and misses) of the oracle's own demo of the same job; a bad
    style is refused."""
    from arpo_core.offline.demonstrations import BRIEF_THOUGHT

    jobs = jobs_for(["click-test-2", "enter-text"], [7, 8])
    kw = {"max_steps": MAX_STEPS, "recovery_rate": 0.5, "max_misses": 2}
    own = play_oracle_episodes(pool, jobs, **kw)
    brief = play_oracle_episodes(pool, jobs, thoughts="brief", **kw)
    assert brief.errors == [] and len(brief.trajectories) == len(own.trajectories) == len(jobs)
    for a, b in zip(own.trajectories, brief.trajectories, strict=True):
        assert [s.train_reply for s in a.steps] == [s.train_reply for s in b.steps]
        for sa, sb in zip(a.steps, b.steps, strict=True):
            assert sb.response_text.startswith(f"Thought: {BRIEF_THOUGHT}\nAction: ")
            assert parse_response(sb.response_text).actions == parse_response(sa.response_text).actions
            assert sb.actions_json == sa.actions_json and sa.response_text != sb.response_text
    assert any(len(t.steps) > 1 for t in brief.trajectories)
    check_bc_sequences(brief.trajectories, tmp_path)
    with pytest.raises(ValueError, match="thoughts must be one of oracle, brief"):
        play_oracle_episodes(pool, jobs, thoughts="long", **kw)


def test_tool_call_demos_are_the_oracles_actions_in_the_policys_grammar(pool):
    """demonstrations.py, decision "Demos in the policy's grammar": with the Qwen3-VL grammar every demo reply (misses included) is an
    `Action:` line and tool calls in 0-1000 units that map to the oracle's screen actions (within the
    0-1000 frame's rounding); with the UI-TARS grammar in a factor-32 frame the replies are UI-TARS calls
    in that frame; the default grammar keeps the oracle's text."""
    from arpo_core.actions import parse_tool_call_response
    from arpo_core.offline.demonstrations import BRIEF_THOUGHT, DemoGrammar

    jobs = jobs_for(["click-test-2", "enter-text"], [7])
    kw = {"max_steps": MAX_STEPS, "recovery_rate": 1.0, "max_misses": 1, "thoughts": "brief"}
    own = play_oracle_episodes(pool, jobs, **kw)
    tool = play_oracle_episodes(
        pool, jobs, grammar=DemoGrammar("qwen3vl_tool_call", "relative1000", 32), **kw
    )
    wide = play_oracle_episodes(pool, jobs, grammar=DemoGrammar("uitars", "absolute", 32), **kw)
    assert tool.errors == [] == wide.errors and len(tool.trajectories) == len(own.trajectories) == len(jobs)
    assert DemoGrammar().is_oracles and not DemoGrammar("uitars", "absolute", 32).is_oracles
    for a, b, c in zip(own.trajectories, tool.trajectories, wide.trajectories, strict=True):
        assert b.success == a.success == c.success == 1.0
        assert (
            [s.train_reply for s in a.steps]
            == [s.train_reply for s in b.steps]
            == [s.train_reply for s in c.steps]
        )
        for sa, sb, sc in zip(a.steps, b.steps, c.steps, strict=True):
            parsed = parse_tool_call_response(sb.response_text)
            assert parsed.thought == BRIEF_THOUGHT and sb.response_text.startswith(
                f"Action: {BRIEF_THOUGHT}\n<tool_call>"
            )
            assert [x.kind for x in parsed.actions] == [
                x.kind for x in parse_response(sa.response_text).actions
            ]
            for x, y in zip(sa.actions(), sb.actions(), strict=True):
                for key in ("point", "end_point"):
                    if x[key] is not None:  # 160 px / 1000 units: half a unit is < 0.1 px
                        assert max(abs(u - v) for u, v in zip(x[key], y[key], strict=True)) < 0.2
            assert sc.response_text.startswith(f"Thought: {BRIEF_THOUGHT}\nAction: ")
            assert [x["kind"] for x in sc.actions()] == [x["kind"] for x in sa.actions()]


def test_the_demos_stage_writes_clicks_in_the_grounded_policys_frame(tmp_path):
    """arpo_core/pipeline/demos.py, decision "Demos in the policy's frame": the stage reads the grounded
    policy, and the same demo jobs for a policy at 1x and one at 2x visual resolution click the same screen
    points (to within a 1x model pixel), written in each one's model pixels (336/168 and 420/224 times as
    large at 2x)."""
    from pathlib import Path

    from arpo_core.config import load_params
    from arpo_core.pipeline import demos, init_policy
    from arpo_core.policy.model import load_policy
    from arpo_core.trajectory import read_trajectories

    assert demos.STAGE.inputs["policy_dir"] == "models/grounded"
    root = Path(__file__).resolve().parents[1]
    over = ["demos.episodes_per_task=1", "demos.recovery_rate=0", "env.n_envs=1"]
    p = load_params(root / "params.yaml", over, preset=root / "presets" / "quick.yaml")
    one, two = tmp_path / "1x", tmp_path / "2x"
    init_policy.run(p, one)
    load_policy(one, min_pixels=134400).save(two)
    steps = {}
    for d in (one, two):
        demos.run(p, tmp_path / f"demos-{d.name}", policy_dir=d)
        trajs = read_trajectories(tmp_path / f"demos-{d.name}" / "demos.parquet")
        steps[d.name] = [s for t in trajs for s in t.steps]
    assert len(steps["1x"]) == len(steps["2x"]) >= 2
    clicks = 0
    for a, b in zip(steps["1x"], steps["2x"], strict=True):
        for u, v in zip(a.actions(), b.actions(), strict=True):  # the same screen actions, to the model pixel
            assert u["kind"] == v["kind"] and (u["point"] is None) == (v["point"] is None)
            if u["point"] is not None:
                assert max(abs(i - j) for i, j in zip(u["point"], v["point"], strict=True)) <= 1.0
        xs, ys = parse_response(a.response_text).actions, parse_response(b.response_text).actions
        for x, y in zip(xs, ys, strict=True):
            assert x.kind == y.kind
            if x.kind == "click":
                clicks += 1
                assert abs(y.point[0] - x.point[0] * 336 / 168) <= 2.5, (a.response_text, b.response_text)
                assert abs(y.point[1] - x.point[1] * 420 / 224) <= 2.5, (a.response_text, b.response_text)
    assert clicks >= 2
