"""MiniWoBEnv against real headless Debian Chromium."""

import os
import signal
import time

import numpy as np
import pytest
from proctools import alive, pids_naming

from arpo_core.actions import Action
from arpo_core.envs.base import TaskSpec
from arpo_core.envs.miniwob.dom import SCREEN_SIZE
from arpo_core.envs.miniwob.miniwob_env import MiniWoBEnv, clamp_point, episode_limit_ms, webdriver_key


def task(name: str) -> TaskSpec:
    return TaskSpec("miniwob", name)


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def el(env: MiniWoBEnv, **kw):
    for e in env.dom_elements():
        if all(getattr(e, k) == v for k, v in kw.items()):
            return e
    raise AssertionError(f"no element {kw}")


@pytest.fixture(scope="module")
def env():
    e = MiniWoBEnv(episode_time_limit_s=60)
    yield e
    e.close()


def test_screen_size_is_miniwobs_task_area():
    from miniwob.constants import TASK_HEIGHT, TASK_WIDTH

    assert SCREEN_SIZE == (TASK_WIDTH, TASK_HEIGHT)


def test_an_episode_does_not_see_the_one_before(env):
    """miniwob_env.py, decision "Parked pointer": a hover left by the previous episode (click-tab's tabs
    change colour under the pointer) and a fresh page load leave no trace in the next episode's first
    screenshot."""
    tab = task("click-tab")
    first = np.asarray(env.reset(tab, seed=0).screenshot)  # the first episode after a page load
    target = [e for e in env.dom_elements() if e.visible and e.topmost and e.tag == "a"][-1]
    hovered = env.step([Action("hover", point=target.center)]).observation.screenshot
    assert (np.asarray(hovered) != first).any()  # the hover is visible while it lasts
    again = np.asarray(env.reset(tab, seed=0).screenshot)
    assert np.array_equal(again, first)


def test_episode_limit_ms():
    assert episode_limit_ms(60) == 60_000
    assert episode_limit_ms(0.0004) == 1
    assert episode_limit_ms(None) == 2**31 - 1
    assert episode_limit_ms(1e9) == 2**31 - 1  # a larger setTimeout delay would fire at once


def test_webdriver_key_and_clamp():
    assert webdriver_key("a") == "a"
    assert webdriver_key("Enter") == "\ue007"
    assert webdriver_key("ctrl") == "\ue009"
    with pytest.raises(KeyError):
        webdriver_key("nokey")
    assert clamp_point(-3.2, 500) == (0, 209)
    assert clamp_point(79.5, 10.4) == (80, 10)  # round half to even
    assert clamp_point(159.6, 0.49) == (159, 0)


def test_reset_shows_task_area_and_utterance(env):
    obs = env.reset(task("click-button"), seed=3)
    assert obs.screen_size == (160, 210) and obs.screenshot.size == (160, 210)
    assert obs.screenshot.mode == "RGB"
    assert obs.instruction.startswith('Click on the "') and obs.instruction.endswith('" button.')
    # the yellow query bar (#FF0) fills the top of the task area
    assert obs.screenshot.getpixel((157, 46)) == (255, 255, 0)
    again = env.reset(task("click-button"), seed=3)  # seeded episodes are reproducible
    assert again.instruction == obs.instruction
    assert np.array_equal(np.asarray(again.screenshot), np.asarray(obs.screenshot))


def test_dom_elements_boxes_in_screen_pixels(env):
    obs = env.reset(task("click-button"), seed=5)
    query = el(env, id="query")
    assert query.text == obs.instruction and query.bbox == (0.0, 0.0, 160.0, 50.0)
    buttons = [e for e in env.dom_elements() if e.tag == "button"]
    assert buttons and all(b.visible and b.topmost for b in buttons)
    for b in buttons:
        left, top, w, h = b.bbox
        assert left >= 0 and left + w <= 160 and top >= 50 and top + h <= 210


def test_screenshot_click_changes_page(env):
    env.reset(task("click-checkboxes"), seed=11)
    box = next(e for e in env.dom_elements() if e.tag == "input_checkbox")
    assert box.value == "false"
    before = np.asarray(env.screenshot()).astype(int)
    res = env.step([Action("click", point=box.center)])
    assert not res.done and res.info["action_errors"] == []
    after = np.asarray(res.observation.screenshot).astype(int)
    left, top, w, h = (round(v) for v in box.bbox)
    assert np.abs(after - before)[top : top + h, left : left + w].sum() > 1000  # the tick is drawn
    assert el(env, index=box.index).value == "true"


def test_right_click_target_scores_one_wrong_scores_zero(env):
    obs = env.reset(task("click-button"), seed=2)
    name = obs.instruction.split('"')[1]
    right = el(env, tag="button", text=name)
    res = env.step([Action("click", point=right.center)])
    assert res.done and res.info["raw_reward"] == 1.0 and env.evaluate() == 1.0

    for seed in range(20):  # a seed whose page has a button with another label
        obs = env.reset(task("click-button"), seed=seed)
        name = obs.instruction.split('"')[1]
        wrong = [e for e in env.dom_elements() if e.tag == "button" and e.text != name]
        if wrong:
            break
    res = env.step([Action("click", point=wrong[0].center)])
    assert res.done and res.info["raw_reward"] == -1.0 and env.evaluate() == 0.0


class ScriptCounter:
    """Counts the driver's execute_script calls (miniwob_env.py, decision "Few round trips": round trips per
    step)."""

    def __init__(self, driver):
        self.driver, self.calls = driver, 0
        self.inner = driver.execute_script

    def __call__(self, *a, **kw):
        self.calls += 1
        return self.inner(*a, **kw)

    def __enter__(self):
        self.driver.execute_script = self
        return self

    def __exit__(self, *exc):
        del self.driver.execute_script  # back to the class's method


def test_a_click_step_asks_the_page_once_and_stops_at_the_action_that_ends_the_episode(env):
    env.reset(task("click-test"), seed=1)
    with ScriptCounter(env.instance.driver) as counter:
        res = env.step([Action("click", point=(150, 205))])  # empty space: no animation, no end
    assert not res.done and counter.calls == 1  # one state script: busy check + metadata together

    button = el(env, tag="button")
    with ScriptCounter(env.instance.driver) as counter:
        res = env.step([Action("click", point=button.center), Action("type", content="never typed")])
    assert res.done and res.info["raw_reward"] == 1.0 and env.evaluate() == 1.0
    assert counter.calls == 2  # "done?" between the two actions, then the state after the first


def test_step_pause_sleeps_after_actions_only(env):
    with pytest.raises(ValueError, match="step_pause_s"):
        MiniWoBEnv(step_pause_s=-1.0)
    env.step_pause_s = 0.4
    try:
        env.reset(task("click-button"), seed=2)
        t0 = time.monotonic()
        res = env.step([Action("click", point=(150, 205))])
        assert time.monotonic() - t0 >= 0.4 and not res.done
        t0 = time.monotonic()
        res = env.step([Action("finished", content="")])  # no action ran: nothing to wait for
        assert time.monotonic() - t0 < 0.4 and res.done
    finally:
        env.step_pause_s = 0.0


def test_click_on_empty_space_keeps_episode_open_and_finished_ends_it(env):
    env.reset(task("click-button"), seed=2)
    res = env.step([Action("click", point=(150, 205))])
    assert not res.done and env.evaluate() == 0.0
    res = env.step([Action("finished", content="done")])
    assert res.done and res.info["agent_end"] == "finished" and not res.info["miniwob_done"]
    assert env.evaluate() == 0.0  # the agent quit; MiniWoB never rewarded anything
    assert env.step([Action("wait")]).info["error"]  # stepping a finished episode is refused


def test_a_focused_text_field_looks_the_same_whenever_it_is_captured(env):
    """miniwob_env.py, decision "Hidden caret": the text caret blinks (about 0.5 s on, 0.5 s off), so a
    screenshot of a focused field depended on when it was taken; the caret is hidden and every capture is the
    same."""
    env.reset(task("enter-text"), seed=4)
    shots = [np.asarray(env.step([Action("click", point=el(env, id="tt").center)]).observation.screenshot)]
    for _ in range(6):  # 6 captures 0.3 s apart span both phases of the blink
        time.sleep(0.3)
        shots.append(np.asarray(env.screenshot()))
    assert all(np.array_equal(s, shots[0]) for s in shots[1:])


def test_typing_and_keys(env):
    env.reset(task("enter-text"), seed=4)
    field = el(env, id="tt")
    env.step([Action("click", point=field.center), Action("type", content="abc")])
    assert el(env, id="tt").value == "abc"
    res = env.step([Action("hotkey", key="ctrl a"), Action("type", content="Xy z")])
    assert el(env, id="tt").value == "Xy z"
    res = env.step([Action("press", key="backspace"), Action("press", key="nokey")])
    assert el(env, id="tt").value == "Xy "
    assert len(res.info["action_errors"]) == 1 and "nokey" in res.info["action_errors"][0]
    assert not res.done


def test_held_keys_double_click_right_click_and_hover(env):
    env.reset(task("enter-text"), seed=4)
    field = el(env, id="tt")
    env.step(
        [
            Action("click", point=field.center),
            Action("keydown", key="shift"),
            Action("type", content="ab"),
            Action("keyup", key="shift"),
            Action("type", content="c"),
        ]
    )
    assert el(env, id="tt").value == "ABc"
    env.step([Action("left_double", point=(field.bbox[0] + 6, field.center[1])), Action("type", content="Z")])
    assert el(env, id="tt").value == "Z"  # the double click selected the word, typing replaced it
    res = env.step([Action("right_single", point=field.center), Action("hover", point=(100, 200))])
    assert res.info["action_errors"] == [] and not res.done


def test_scroll_moves_scrollable_text(env):
    env.reset(task("scroll-text"), seed=1)
    area = el(env, tag="textarea")
    before = np.asarray(env.screenshot()).astype(int)
    res = env.step([Action("scroll", point=area.center, direction="down")])
    after = np.asarray(res.observation.screenshot).astype(int)
    left, top, w, h = (round(v) for v in area.bbox)
    assert np.abs(after - before)[top : top + h, left : left + w].sum() > 1000


def test_drag_moves_a_jquery_draggable(env):
    env.reset(task("drag-box"), seed=3)
    small, large = el(env, id="draggableSmall"), el(env, id="draggableLarge")
    res = env.step([Action("drag", point=small.center, end_point=large.center)])
    assert not res.done
    moved = el(env, id="draggableSmall")
    assert abs(moved.center[0] - large.center[0]) <= 1 and abs(moved.center[1] - large.center[1]) <= 1
    res = env.step([Action("click", point=el(env, id="subbtn").center)])
    assert res.done and env.evaluate() == 1.0


def test_episode_time_limit_is_a_parameter():
    short = MiniWoBEnv(episode_time_limit_s=0.5)
    try:
        short.reset(task("click-test"), seed=0)
        time.sleep(0.8)
        res = short.step([Action("wait")])
        assert res.done and res.info["raw_reward"] == -1.0 and res.info["reason"] == "timed out"
        assert short.evaluate() == 0.0
        short.episode_time_limit_s = None  # applies from the next reset
        short.reset(task("click-test"), seed=0)
        limit = short.instance.driver.execute_script("return core.EPISODE_MAX_TIME;")
        assert limit == 2**31 - 1
    finally:
        short.close()


def test_killed_browser_is_an_env_error_and_reset_replaces_it(env):
    env.reset(task("click-test"), seed=0)
    old = env.browser_pids()
    assert len(old) >= 2  # chromedriver + chromium processes
    for p in old:
        os.kill(p, signal.SIGKILL)
    res = env.step([Action("click", point=(80, 120))])
    assert res.done and "browser failure" in res.info["error"]
    obs = env.reset(task("click-test"), seed=0)
    assert obs.instruction == "Click the button."
    assert not set(env.browser_pids()) & set(old)


def test_close_leaves_no_browser_process():
    e = MiniWoBEnv()
    e.reset(task("click-test"), seed=0)
    pids, profile = e.browser_pids(), e.profile_dir()
    assert pids_naming(profile)  # chromium processes name their profile dir
    e.close()
    assert wait_gone(pids) == []
    assert wait_gone(pids_naming(profile)) == []
    assert not os.path.exists(profile)
