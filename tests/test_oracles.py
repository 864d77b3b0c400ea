"""Scripted oracles: pure helpers with hand-computed values, and every oracle task on real Chromium."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from arpo_core.actions import parse_response, to_screen
from arpo_core.envs.base import TaskSpec
from arpo_core.envs.miniwob.dom import DomElement
from arpo_core.envs.miniwob.miniwob_env import MiniWoBEnv
from arpo_core.envs.miniwob.oracles import (
    ORACLES,
    fill_fields,
    free_point,
    model_size,
    oracle_reply,
    quoted,
)

MAX_STEPS = 15  # the reference's episode limit


def box(index, bbox, tag="button", text="", id="", value=None, focused=False):
    return DomElement(index, tag, text, text, id, "", bbox, True, True, value, focused, "", "", 0)


def test_model_size_of_miniwob_screen():
    # 160x210: round to multiples of 28 -> 168x224 (= 37,632 px, within [3136, 1,003,520])
    assert model_size() == (168, 224)
    assert model_size((1920, 1080), max_pixels=2_116_800) == (1932, 1092)  # docs/method.md §2


def test_quoted():
    assert quoted('Enter "a b" and "c".') == ["a b", "c"]
    assert quoted("no quotes") == []


def test_free_point_centre_when_unoccluded_else_farthest_free_point():
    target = box(1, (10.0, 10.0, 20.0, 10.0))
    assert free_point(target, []) == (20.0, 15.0)
    assert free_point(target, [box(2, (100.0, 100.0, 5.0, 5.0))]) == (20.0, 15.0)
    # an occluder over the right 3/4: the free strip is x in [12, 15), the farthest point from the
    # occluder's edge (x = 15) inside the 2-px margin is x = 12; y is the first best row (12)
    x, y = free_point(target, [box(2, (15.0, 0.0, 40.0, 40.0))])
    assert (x, y) == (12.0, 12.0)


def test_fill_fields_clicks_types_then_submits():
    submit = box(3, (10.0, 100.0, 40.0, 20.0), text="Submit")
    empty = box(1, (10.0, 60.0, 100.0, 20.0), tag="input_text", id="tt", value="")
    thought, acts = fill_fields([], [(empty, "Ann")], submit)
    assert "Ann" in thought and acts[0].kind == "click" and acts[0].point == (60.0, 70.0)
    focused = box(1, (10.0, 60.0, 100.0, 20.0), tag="input_text", id="tt", value="", focused=True)
    _, acts = fill_fields([], [(focused, "Ann")], submit)
    assert [(a.kind, a.content) for a in acts] == [("type", "Ann")]
    wrong = box(1, (10.0, 60.0, 100.0, 20.0), tag="input_text", id="tt", value="x", focused=True)
    _, acts = fill_fields([], [(wrong, "Ann")], submit)
    assert [(a.kind, a.key, a.content) for a in acts] == [("hotkey", "ctrl a", None), ("type", None, "Ann")]
    done = box(1, (10.0, 60.0, 100.0, 20.0), tag="input_text", id="tt", value="Ann")
    _, acts = fill_fields([], [(done, "Ann")], submit)
    assert acts[0].point == (30.0, 110.0)


def test_reply_is_ui_tars_text_in_model_pixels():
    dom = [box(0, (0.0, 50.0, 160.0, 160.0), tag="div"), box(1, (60.0, 100.0, 40.0, 20.0), id="subbtn")]
    reply = oracle_reply("click-test", "Click the button.", dom)
    assert reply.startswith("Thought: ") and "\nAction: click(start_box='(" in reply
    parsed = parse_response(reply)
    # centre (80, 110) in screen pixels -> (80 * 168/160, 110 * 224/210) = (84, 117.33) -> (84, 117)
    assert parsed.actions[0].point == (84.0, 117.0)
    assert oracle_reply("no-such-task", "", dom) is None


def run_oracle_episode(env: MiniWoBEnv, task_id: str, seed: int) -> tuple[float, int]:
    env.reset(TaskSpec("miniwob", task_id), seed=seed)
    for step in range(1, MAX_STEPS + 1):
        reply = env.oracle_reply()
        actions = to_screen(parse_response(reply).actions, model_size(), (160, 210))
        if env.step(actions).done:
            return env.evaluate(), step
    return env.evaluate(), MAX_STEPS


@pytest.fixture(scope="module")
def env():
    e = MiniWoBEnv()
    yield e
    e.close()


FAST = {"click-test-2", "click-checkboxes", "enter-password", "use-autocomplete"}


@pytest.mark.parametrize(
    "task_id", [t if t in FAST else pytest.param(t, marks=pytest.mark.slow) for t in sorted(ORACLES)]
)
def test_oracle_solves_one_episode(env, task_id):
    score, _ = run_oracle_episode(env, task_id, seed=1234)
    assert score == 1.0


@pytest.mark.slow
def test_every_oracle_succeeds_on_20_seeds(env):
    second = MiniWoBEnv()  # two browsers driven from two threads: Selenium waits on HTTP, not the GIL
    try:
        tasks = sorted(ORACLES)

        def run(e: MiniWoBEnv, mine: list[str]) -> dict[str, float]:
            return {t: sum(run_oracle_episode(e, t, s)[0] for s in range(100, 120)) / 20 for t in mine}

        with ThreadPoolExecutor(2) as ex:
            halves = [ex.submit(run, env, tasks[0::2]), ex.submit(run, second, tasks[1::2])]
            rates = {**halves[0].result(), **halves[1].result()}
    finally:
        second.close()
    print("oracle success rates:", rates)
    assert len(rates) >= 15
    assert {t: r for t, r in rates.items() if r < 0.95} == {}
