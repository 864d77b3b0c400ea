"""The HTML trajectory viewer: pure helpers, then the page in real headless Chromium (elements,
overlay position, filters, no network, hostile model text kept inert, a non-blank screenshot)."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

from arpo_core.analysis.viewer import _json_for_script, split_reply, viewer_data, write_viewer
from arpo_core.envs.miniwob.miniwob_env import CHROMEDRIVER, CHROMIUM_BINARY, CHROMIUM_FLAGS
from arpo_core.trajectory import Step, Trajectory, png_bytes

ROOT = Path(__file__).resolve().parents[1]

EVIL = "</script><script>window.pwned = 1</script><img src=x onerror='window.pwned = 2'>"


def screen(colour=(40, 90, 200)) -> bytes:
    img = Image.new("RGB", (160, 210), (245, 245, 245))
    d = ImageDraw.Draw(img)
    d.rectangle((30, 40, 70, 80), fill=colour)
    d.text((5, 180), "Submit", fill=(0, 0, 0))
    return png_bytes(img)


def click(x, y, kind="click", **kw) -> str:
    return json.dumps([{"kind": kind, "point": [x, y], "end_point": None, **kw}])


def make_trajs() -> list[Trajectory]:
    ok = Trajectory(
        "run1", "train", 0, "miniwob", "click-button", "Click the blue box.",
        [Step(0, screen(), 160, 210, "Thought: The blue box is at the top left.\nAction: click(start_box='(50,60)')",
              click(50.0, 60.0), done=True)],
        success=1.0, reward=1.0,
    )  # fmt: skip
    drag = Trajectory(
        "run1", "train", 1, "miniwob", "drag-box", "Drag it.",
        [
            Step(0, screen((200, 40, 40)), 160, 210, "Thought: first look\nAction: wait()", json.dumps([{"kind": "wait"}])),
            Step(1, screen((200, 40, 40)), 160, 210, "Thought: drag\nAction: drag(...)",
                 json.dumps([{"kind": "drag", "point": [40, 50], "end_point": [120, 150]}]), done=True),
        ],
        success=0.0, reward=0.0, replayed=True,
    )  # fmt: skip
    bad = Trajectory(
        "run1", "train", 1, "miniwob", "click-button", "Click the blue box.",
        [Step(0, screen(), 160, 210, EVIL, json.dumps({"parse_error": "no 'Action:' in reply"}), parse_ok=False, done=True)],
        success=0.0, reward=-1.0,
    )  # fmt: skip
    env = Trajectory(
        "run1", "train", 1, "miniwob", "click-link", "Click the link.",
        [Step(0, screen(), 160, 210, "Thought: t\nAction: click(start_box='(1,1)')", click(1, 1), env_error="browser died")],
        success=0.0, reward=0.0,
    )  # fmt: skip
    return [ok, drag, bad, env]


# ------------------------------------------------------------------------------------------------ helpers


@pytest.mark.parametrize(
    ("text", "thought", "action"),
    [
        ("Thought: look\nAction: click(start_box='(1,2)')", "look", "click(start_box='(1,2)')"),
        ("Reflection: hm\nAction: wait()", "hm", "wait()"),
        ("no action at all", "no action at all", ""),
        ("Thought: a Action: b\nAction: c()", "a Action: b", "c()"),  # split at the LAST Action:
    ],
)
def test_split_reply(text, thought, action):
    assert split_reply(text) == (thought, action)


def test_json_for_script_cannot_close_the_script_block():
    s = _json_for_script({"t": EVIL + " & <!--"})
    assert "<" not in s and ">" not in s and "&" not in s
    assert json.loads(s) == {"t": EVIL + " & <!--"}


def test_viewer_data_dedupes_images_and_keeps_only_numeric_points():
    t = make_trajs()[0]
    twin = t.with_(epoch=5)
    weird = t.with_(
        steps=[
            Step(0, t.steps[0].screenshot_png, 160, 210, "x",
                 json.dumps([{"kind": "click", "point": ["1);alert(1", 2]}, {"kind": "hover", "point": [3, 4]}]))
        ]
    )  # fmt: skip
    data = viewer_data([t, twin, weird])
    assert len(data["images"]) == 1  # three steps, one distinct screenshot
    assert data["episodes"][2]["steps"][0]["actions"] == [
        {"kind": "click"},
        {"kind": "hover", "point": [3.0, 4.0]},
    ]
    assert data["episodes"][0]["steps"][0]["thought"] == "The blue box is at the top left."


# ------------------------------------------------------------------------------------------------ browser


@pytest.fixture(scope="module")
def browser():
    profile = tempfile.mkdtemp(prefix="arpo-viewer-test-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM_BINARY
    for flag in CHROMIUM_FLAGS:
        if not flag.startswith("--window-size"):
            options.add_argument(flag)
    options.add_argument("--window-size=1200,900")
    options.add_argument(f"--user-data-dir={profile}")
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()  # stops chromedriver and the browser it started
        shutil.rmtree(profile, ignore_errors=True)


def open_episode(ep) -> None:
    if ep.get_attribute("open") is None:  # the first visible episode is opened by the page itself
        ep.find_element(By.TAG_NAME, "summary").click()


def visible(driver) -> list:
    return [e for e in driver.find_elements(By.CSS_SELECTOR, "details.episode") if e.is_displayed()]


def test_viewer_in_headless_chromium(browser, tmp_path):
    out = write_viewer(make_trajs(), tmp_path / "view" / "index.html", title="Run <1> viewer")
    page = out.read_text()
    assert "http://" not in page and "https://" not in page  # self-contained: nothing to fetch
    browser.get(out.as_uri())

    assert browser.title == "Run <1> viewer"
    assert browser.find_element(By.ID, "count").text == "4 of 4 episodes"
    assert len(browser.find_elements(By.CSS_SELECTOR, "details.episode")) == 4
    # the first episode is open and rendered: screenshot + overlay ring at the click (50, 60)
    first = browser.find_elements(By.CSS_SELECTOR, "details.episode")[0]
    assert first.get_attribute("open") is not None
    img = first.find_element(By.CSS_SELECTOR, ".shot img")
    assert browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth", img) == 160
    ring = first.find_element(By.CSS_SELECTOR, ".shot svg circle.mark")
    assert (float(ring.get_attribute("cx")), float(ring.get_attribute("cy"))) == (50.0, 60.0)
    assert "click(start_box='(50,60)')" in first.find_element(By.CSS_SELECTOR, ".action").text
    assert "blue box is at the top left" in first.find_element(By.CSS_SELECTOR, ".thought").text
    assert first.find_element(By.CSS_SELECTOR, ".sent").text == "click (50, 60)"
    # collapsed episodes hold no images yet (lazy rendering)
    assert (
        browser.find_elements(By.CSS_SELECTOR, "details.episode")[1].find_elements(By.TAG_NAME, "img") == []
    )

    # the overlay is drawn where the click was: red pixels around (50, 60) * (320 / 160)
    shot = Image.open(io.BytesIO(first.find_element(By.CSS_SELECTOR, ".shot").screenshot_as_png)).convert(
        "RGB"
    )
    px = np.asarray(shot, dtype=np.int32)
    scale = shot.width / 160
    cy, cx = int(60 * scale), int(50 * scale)
    patch = px[cy - 20 : cy + 20, cx - 20 : cx + 20]
    red = (patch[..., 0] > 200) & (patch[..., 1] < 80) & (patch[..., 2] < 110)
    assert red.sum() > 30, "no overlay marker at the click position"
    far = px[: int(20 * scale), -int(30 * scale) :]  # top-right corner: plain background
    assert ((far[..., 0] > 200) & (far[..., 1] < 80)).sum() == 0

    # filters change what is visible
    Select(browser.find_element(By.ID, "f-task")).select_by_visible_text("miniwob/click-button")
    assert browser.find_element(By.ID, "count").text == "2 of 4 episodes" and len(visible(browser)) == 2
    Select(browser.find_element(By.ID, "f-outcome")).select_by_value("success")
    assert browser.find_element(By.ID, "count").text == "1 of 4 episodes"
    Select(browser.find_element(By.ID, "f-task")).select_by_index(0)
    Select(browser.find_element(By.ID, "f-outcome")).select_by_value("replayed")
    (rep,) = visible(browser)
    assert "drag-box" in rep.text and "replayed" in rep.text
    open_episode(rep)
    drag = rep.find_element(By.CSS_SELECTOR, "line.drag")
    assert [float(drag.get_attribute(a)) for a in ("x1", "y1", "x2", "y2")] == [40.0, 50.0, 120.0, 150.0]
    assert "drag (40, 50) -> (120, 150)" in rep.text
    Select(browser.find_element(By.ID, "f-outcome")).select_by_index(0)
    Select(browser.find_element(By.ID, "f-epoch")).select_by_value("1")
    assert browser.find_element(By.ID, "count").text == "3 of 4 episodes"

    # hostile reply text is shown as text, never run; format and env errors are visible
    Select(browser.find_element(By.ID, "f-epoch")).select_by_index(0)
    Select(browser.find_element(By.ID, "f-outcome")).select_by_value("format_error")
    (bad,) = visible(browser)
    open_episode(bad)
    assert "window.pwned = 1" in bad.find_element(By.CSS_SELECTOR, ".thought").text
    assert "format error: no 'Action:' in reply" in bad.find_element(By.CSS_SELECTOR, ".err").text
    assert browser.execute_script("return window.pwned === undefined")
    Select(browser.find_element(By.ID, "f-outcome")).select_by_value("env_error")
    (env,) = visible(browser)
    open_episode(env)
    assert "env error: browser died" in env.text

    # no network: no resource was fetched (data: URIs are not resources)
    assert browser.execute_script("return performance.getEntriesByType('resource').length") == 0

    # a full-page screenshot that is not blank
    Select(browser.find_element(By.ID, "f-outcome")).select_by_index(0)
    png = Path(tmp_path / "viewer.png")
    browser.save_screenshot(str(png))
    full = np.asarray(Image.open(png).convert("RGB"))
    assert full.shape[0] > 300 and full.shape[1] > 600
    colours = len(np.unique(full.reshape(-1, 3), axis=0))
    assert colours > 50, f"screenshot looks blank ({colours} colours)"


# ------------------------------------------------------------------------------------------------ arpo view


def test_arpo_view_command_writes_page_and_filters(tmp_path):
    from typer.testing import CliRunner

    from arpo_core.trajectory import write_trajectories
    from flows.cli import app

    src = tmp_path / "trajs"
    src.mkdir()
    write_trajectories(src / "a.parquet", make_trajs()[:2])
    write_trajectories(src / "b.parquet", make_trajs()[2:])
    runner = CliRunner()
    out = tmp_path / "v.html"
    res = runner.invoke(app, ["view", str(src), "--out", str(out), "--task", "click-button"])
    assert res.exit_code == 0, res.output
    assert "(2 episodes)" in res.output
    page = out.read_text()
    data = json.loads(page.split('<script type="application/json" id="data">')[1].split("</script>")[0])
    assert [e["task"] for e in data["episodes"]] == ["miniwob/click-button", "miniwob/click-button"]
    # combined files: each episode says which file and which policy it came from (viewer.py,
    # decision "Episode provenance")
    assert [e["source"] for e in data["episodes"]] == [str(src / "a.parquet"), str(src / "b.parquet")]
    assert [e["policy"] for e in data["episodes"]] == ["train/run1", "train/run1"]
    assert out.stat().st_mode & 0o777 == 0o644  # readable like any other report (decision "Readable pages")
    res = runner.invoke(app, ["view", str(tmp_path / "missing.parquet"), "--out", str(out)])
    assert res.exit_code == 2 and "missing.parquet" in res.output
    res = runner.invoke(app, ["view", str(src), "--out", str(out), "--task", "nope"])
    assert res.exit_code == 1 and "no episodes" in res.output


def test_episode_labels_policy_and_source(tmp_path):
    from arpo_core.analysis.viewer import policy_label

    trajs = make_trajs()[:2]
    data = viewer_data(trajs, policies=["arpo", ""], sources=["data/eval/arpo.parquet", "x.parquet"])
    assert [(e["policy"], e["source"]) for e in data["episodes"]] == [
        ("arpo", "data/eval/arpo.parquet"),
        ("train/run1", "x.parquet"),  # an empty label falls back to the trajectory's own stage and run
    ]
    t = trajs[0]
    assert policy_label(Trajectory("evaluate-grpo", "evaluate", 0, "m", "t", "i", [])) == "grpo"
    assert policy_label(Trajectory("baseline", "baseline", 0, "m", "t", "i", [])) == "baseline"
    assert policy_label(t) == "train/run1"
    with pytest.raises(ValueError, match="1 labels for 2 trajectories"):
        viewer_data(trajs, sources=["only-one"])
    out = write_viewer(trajs, tmp_path / "p.html", policies=["base", "base"])
    assert out.stat().st_mode & 0o777 == 0o644


def test_stage_viewer_pages_are_replaced_on_rerun(tmp_path, monkeypatch):
    """runner.py, decision "Viewer pages rewritten": a stage that re-runs leaves no page of an earlier
    configuration."""
    from arpo_core.config import load_params
    from arpo_core.trajectory import write_trajectories
    from flows.runner import VIEWER_DIR, StageRun

    p = load_params(ROOT / "params.yaml")  # suite paths resolve in the project
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    write_trajectories(tmp_path / "data/eval/arpo.parquet", make_trajs()[:1])
    stale = tmp_path / VIEWER_DIR / "evaluate" / "grpo.html"
    stale.parent.mkdir(parents=True)
    stale.write_text("an earlier GRPO run's page")
    run = StageRun("evaluate", p=p)
    pages = run._write_viewers()
    assert [p.name for p in pages] == ["arpo.html"] and not stale.exists()
    data = json.loads(pages[0].read_text().split('id="data">')[1].split("</script>")[0])
    assert data["episodes"][0]["policy"] == "arpo"
    assert data["episodes"][0]["source"] == "data/eval/arpo.parquet"


def test_arpo_view_default_title_names_what_the_page_shows(tmp_path):
    """viewer.py, decision "Descriptive title" (issue 32 item 3): training episodes shown from a training
    folder and an evaluation folder are titled as training episodes of that folder, not 'trajectories,
    eval'."""
    from typer.testing import CliRunner

    from arpo_core.trajectory import write_trajectories
    from flows.cli import app

    train, ev = tmp_path / "trajectories", tmp_path / "eval"
    train.mkdir()
    ev.mkdir()
    write_trajectories(train / "epoch-0001.parquet", make_trajs()[:2])
    write_trajectories(
        ev / "base.parquet", [dataclasses.replace(t, stage="evaluate") for t in make_trajs()[2:3]]
    )
    out = tmp_path / "v.html"
    res = CliRunner().invoke(app, ["view", str(train), str(ev), "--out", str(out), "--limit", "2"])
    assert res.exit_code == 0, res.output
    title = out.read_text().split("<title>")[1].split("</title>")[0]
    assert title == f"2 train episodes ({train})", title
    res = CliRunner().invoke(app, ["view", str(train), str(ev), "--out", str(out)])
    title = out.read_text().split("<title>")[1].split("</title>")[0]
    assert title == f"2 train episodes ({train}), 1 evaluate episode ({ev})", title
