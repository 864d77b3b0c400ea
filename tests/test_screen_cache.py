"""Real MiniWoB screens kept on disk (envs/miniwob/screens.py, decision "Screen cache"): a stand-in env for
the cache's rules (hits, misses, damaged files, a folder that cannot be written), and real Chromium for
its contract: the examples a ground stage trains on are the same from the disk as from a browser."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import fields
from pathlib import Path

import pytest
from PIL import Image

from arpo_core.envs.base import Observation, TaskSpec
from arpo_core.envs.miniwob.dom import SCREEN_SIZE, DomElement
from arpo_core.envs.miniwob.screens import ScreenCache, render_key

ROOT = Path(__file__).resolve().parents[1]
LINK = TaskSpec("miniwob", "click-link")


class FakeEnv:
    """A browser stand-in: seed s draws a screen whose pixels and one element depend on s."""

    def __init__(self, log: list):
        self.log = log
        self.seed: int | None = None
        log.append("start")

    def reset(self, task: TaskSpec, seed: int | None = None) -> Observation:
        self.log.append((task.task_id, seed))
        self.seed = seed
        image = Image.new("RGB", SCREEN_SIZE, (seed or 0) % 256)
        return Observation(screenshot=image, instruction=f"Click {seed}.", screen_size=SCREEN_SIZE)

    def dom_elements(self) -> list[DomElement]:
        box = (float(self.seed or 0), 60.0, 30.0, 12.5)
        return [
            DomElement(
                0, "body", "", "all", "", "", (0.0, 0.0, 160.0, 210.0), True, True, None, True, "a", "b", -1
            ),
            DomElement(
                1,
                "a",
                f"w{self.seed}",
                f"w{self.seed}",
                "",
                "alink",
                box,
                True,
                False,
                None,
                False,
                "",
                "",
                0,
            ),
        ]

    def close(self) -> None:
        self.log.append("close")


def _read(cache: ScreenCache, seeds, task: TaskSpec = LINK) -> list[tuple]:
    out = []
    for s in seeds:
        obs = cache.reset(task, seed=s)
        assert obs.screen_size == SCREEN_SIZE and cache.screenshot() is obs.screenshot
        out.append((obs.screenshot.mode, obs.screenshot.tobytes(), obs.instruction, cache.dom_elements()))
    return out


def test_a_screen_read_once_comes_from_the_disk_after(tmp_path):
    log: list = []
    first = ScreenCache(tmp_path, lambda: FakeEnv(log))
    fresh = _read(first, [3, 7, 3])
    first.close()
    assert log == ["start", ("click-link", 3), ("click-link", 7), "close"]  # seed 3 again: from the disk
    assert (first.hits, first.misses) == (1, 2)
    assert sorted(p.name for p in (tmp_path / "click-link").iterdir()) == ["train-3.json", "train-7.json"]

    def no_browser():
        raise AssertionError("a browser was started")

    again = ScreenCache(tmp_path, no_browser)
    assert _read(again, [3, 7, 3]) == fresh and (again.hits, again.misses) == (3, 0)
    again.close()  # nothing to close: no browser was started
    assert fresh[1][3][1].bbox == (7.0, 60.0, 30.0, 12.5) and isinstance(fresh[1][3][1].bbox, tuple)


def test_the_file_names_the_data_mode_a_pinned_instance_plays_its_seed_and_no_seed_is_not_kept(tmp_path):
    log: list = []
    cache = ScreenCache(tmp_path, lambda: FakeEnv(log))
    cache.reset(TaskSpec("miniwob", "click-link", config={"data_mode": "test"}), seed=4)
    pinned = TaskSpec("miniwob", "click-link@2", seed=11)
    assert pinned.pinned and pinned.family == "click-link"
    cache.reset(pinned, seed=999)
    cache.reset(LINK, seed=None)
    cache.reset(LINK, seed=None)
    names = sorted(p.name for p in (tmp_path / "click-link").iterdir())
    assert names == ["test-4.json", "train-11.json"]
    assert log[1:] == [("click-link", 4), ("click-link@2", 11), ("click-link", None), ("click-link", None)]
    assert (cache.hits, cache.misses) == (0, 4)


@pytest.mark.parametrize("damage", ["truncated", "not json", "another format", "bad png"])
def test_a_damaged_file_is_read_again_from_the_browser_and_rewritten(tmp_path, caplog, damage):
    log: list = []
    cache = ScreenCache(tmp_path, lambda: FakeEnv(log))
    want = _read(cache, [5])
    path = tmp_path / "click-link" / "train-5.json"
    text = path.read_text()
    broken = {
        "truncated": text[: len(text) // 2],
        "not json": "\0\0\0",
        "another format": text.replace('"format": 1', '"format": 0'),
        "bad png": text.replace('"png": "', '"png": "AAAA'),
    }[damage]
    path.write_text(broken)
    log.clear()
    again = ScreenCache(tmp_path, lambda: FakeEnv(log))
    with caplog.at_level(logging.WARNING, logger="arpo.envs"):
        assert _read(again, [5]) == want
    assert log == ["start", ("click-link", 5)]
    assert any("train-5.json is damaged" in r.getMessage() for r in caplog.records), caplog.text
    assert path.read_text() == text  # rewritten whole
    assert _read(ScreenCache(tmp_path, lambda: FakeEnv([])), [5]) == want


def test_past_five_damaged_files_the_rest_are_counted_not_named(tmp_path, caplog):
    _read(ScreenCache(tmp_path, lambda: FakeEnv([])), range(8))
    for f in (tmp_path / "click-link").iterdir():
        f.write_text("{")
    cache = ScreenCache(tmp_path, lambda: FakeEnv([]))
    with caplog.at_level(logging.WARNING, logger="arpo.envs"):
        _read(cache, range(8))
    said = [r.getMessage() for r in caplog.records]
    assert cache.damaged == 8 and sum("is damaged" in m for m in said) == 5, said
    assert len(said) == 6 and "more damaged files" in said[-1]


def test_a_folder_that_cannot_be_written_is_given_up_with_one_warning(tmp_path, caplog):
    """A full disk or a read-only folder: the screens still come, from the browser; one warning."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    log: list = []
    cache = ScreenCache(blocker / "screens", lambda: FakeEnv(log))
    with caplog.at_level(logging.WARNING, logger="arpo.envs"):
        got = _read(cache, [1, 2, 1])
    assert [g[2] for g in got] == ["Click 1.", "Click 2.", "Click 1."]
    assert log == ["start", ("click-link", 1), ("click-link", 2), ("click-link", 1)]
    warnings = [r.getMessage() for r in caplog.records if "screen cache" in r.getMessage()]
    assert len(warnings) == 1 and "not writing to" in warnings[0], warnings


def test_the_key_changes_with_what_draws_the_screen():
    from arpo_core.envs.miniwob.miniwob_env import CHROMIUM_BINARY, CHROMIUM_FLAGS

    key = render_key(CHROMIUM_BINARY, CHROMIUM_FLAGS)
    assert len(key) == 16 and key == render_key(CHROMIUM_BINARY, CHROMIUM_FLAGS)
    assert render_key(CHROMIUM_BINARY, (*CHROMIUM_FLAGS, "--force-device-scale-factor=2")) != key
    assert render_key("/nonexistent/chromium", CHROMIUM_FLAGS) != key  # another browser (no version)


def _digest(examples) -> str:
    rows = [
        (
            e.image.mode,
            e.image.size,
            e.image.tobytes(),
            [(f.name, getattr(e, f.name)) for f in fields(e) if f.name != "image"],
        )
        for e in examples
    ]
    return hashlib.sha256(repr(rows).encode()).hexdigest()


def test_a_ground_stage_reads_the_same_examples_from_the_disk_as_from_a_browser(tmp_path, monkeypatch):
    """Real Chromium (~10 s): the quick suite's real screens (training seeds 0-2 for two phases that
    share them, held-out seed 1000) read with the cache, read again with no browser allowed, and read
    by a browser with the cache off are the same examples, to the byte."""
    from arpo_core.config import load_params
    from arpo_core.envs.miniwob import miniwob_env
    from arpo_core.pipeline import ground

    def params(cache):
        phases = "ground.phases=[{steps: 1, miniwob_seeds: 2}, {steps: 1, miniwob_seeds: 3}]"
        over = [phases, "ground.eval_miniwob_seeds=1", f"ground.screen_cache={cache}"]
        return load_params(ROOT / "params.yaml", over, preset=ROOT / "presets" / "quick.yaml")

    size = (168, 224)
    train, held = ground.real_screens(params(tmp_path / "screens"), size)
    assert set(train) == {2, 3} and len(train[3]) > len(train[2]) > 0 and held
    tasks = ground._miniwob_task_ids(params("null"))
    key = render_key(miniwob_env.CHROMIUM_BINARY, miniwob_env.CHROMIUM_FLAGS)
    kept = sorted(
        p.relative_to(tmp_path / "screens" / key).as_posix() for p in (tmp_path / "screens").rglob("*.json")
    )
    assert kept == sorted(f"{t}/train-{s}.json" for t in tasks for s in (0, 1, 2, 1000))  # seeds 0-1 once

    def no_browser(*_, **__):
        raise AssertionError("a browser was started")

    with monkeypatch.context() as m:
        m.setattr(miniwob_env.MiniWoBEnv, "__init__", no_browser)
        train2, held2 = ground.real_screens(params(tmp_path / "screens"), size)
    browser_train, browser_held = ground.real_screens(params("null"), size)
    for n in (2, 3):
        assert _digest(train2[n]) == _digest(train[n]) == _digest(browser_train[n])
    assert _digest(held2) == _digest(held) == _digest(browser_held)
