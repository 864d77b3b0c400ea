"""OSWorldEnv: the 369 real task files, suites, oracles on a real Xvfb desktop, resets, scoring rules, and
crash recovery through EnvPool. Every desktop is started and stopped by the test that uses it."""

import functools
import json
import os
import signal
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from proctools import group_pids, wait_until

from arpo_core.actions import Action, parse_response, to_screen
from arpo_core.envs.base import TaskSpec
from arpo_core.envs.miniwob.oracles import model_size
from arpo_core.envs.osworld.desktop_server import LocalDesktop
from arpo_core.envs.osworld.osworld_env import (
    OSWorldEnv,
    claim_slot,
    load_osworld_index,
    load_osworld_suite,
    make_osworld_env,
    osworld_root,
    rel1000_to_screen,
    resolve_task_path,
    support_report,
    task_spec_from_json,
)
from arpo_core.envs.pool import EnvPool

REPO = Path(__file__).resolve().parents[1]
SUITE = REPO / "data" / "suites" / "osworld_local.yaml"
SCREEN = (1280, 800)
FAST = dict(screen_size=SCREEN, settle_s=0.3, setup_settle_s=0.3, wait_s=0.1)


# ------------------------------------------------------------------ the 369 OSWorld task files
def test_osworld_task_folder_is_present():
    # The real task definitions ship with the repository (data/osworld, or ARPO_OSWORLD_ROOT); without
    # them the loading tests below would prove nothing, so their absence is a failure, not a skip.
    assert (osworld_root() / "evaluation_examples" / "test_all.json").is_file(), osworld_root()


def test_default_task_folder_is_the_shipped_copy_with_its_licence(monkeypatch):
    monkeypatch.delenv("ARPO_OSWORLD_ROOT", raising=False)
    assert osworld_root() == REPO / "data" / "osworld"
    shipped = REPO / "data" / "osworld"
    assert "Apache License" in (shipped / "LICENSE").read_text()  # Apache-2.0 requires it beside the files
    notice = (shipped / "NOTICE.md").read_text()
    assert "xlang-ai/OSWorld" in notice and "unmodified" in notice
    assert len(load_osworld_index(shipped)) == 369
    monkeypatch.setenv("ARPO_OSWORLD_ROOT", "/elsewhere/osworld")  # the override still wins
    assert osworld_root() == Path("/elsewhere/osworld")


def test_no_tracked_file_refers_outside_the_repository():
    # The repository stands alone (docs/design.md): no path into a sibling folder, no citation of documents
    # that only existed beside the checkout. The needles are built from parts so this file does not match.
    needles = [".." + "/" + "shared", "REFERENCE" + ".md", "DESIGN" + ".md", "STYLE" + ".md"]
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.decode()
    hits = []
    for rel in filter(None, listed.split("\0")):
        path = REPO / rel
        if rel.startswith("benchmarks/results/") or not path.is_file():
            continue  # recorded results are data written by past runs, left as they were
        text = path.read_bytes().decode("utf-8", errors="ignore")
        hits += [f"{rel}: {n}" for n in needles if n in text]
    assert not hits, hits


def test_all_369_tasks_load_or_are_reported_by_name():
    specs = load_osworld_index()
    assert len(specs) == 369
    assert Counter(s.domain for s in specs) == {
        "chrome": 46,
        "gimp": 26,
        "libreoffice_calc": 47,
        "libreoffice_impress": 47,
        "libreoffice_writer": 23,
        "multi_apps": 101,
        "os": 24,
        "thunderbird": 15,
        "vlc": 17,
        "vs_code": 23,
    }
    assert len({s.key for s in specs}) == 369
    assert sum(not s.feasible for s in specs) == 30  # evaluator func "infeasible"
    for s in specs:
        assert s.backend == "osworld" and s.instruction
        for name in s.config["unsupported"]:
            kind, _, what = name.partition(":")
            assert kind in ("setup", "postconfig", "getter", "metric") and what, name
    report = support_report(specs)
    assert (report["supported"], report["supported_offline"]) == (68, 33)
    assert report["blocked_by"]["metric:compare_table"] == 60
    assert report["blocked_by"]["setup:chrome_open_tabs"] == 53
    assert sum(1 for s in specs if not s.config["unsupported"]) == 68


def test_reset_refuses_an_unsupported_task_naming_what_is_missing():
    spec = next(s for s in load_osworld_index() if "setup:chrome_open_tabs" in s.config["unsupported"])
    env = OSWorldEnv(**FAST)
    with pytest.raises(ValueError, match="chrome_open_tabs"):
        env.reset(spec)
    assert env.desktop is None  # refused before any desktop was started
    with pytest.raises(ValueError, match="not an OSWorld task"):
        env.reset(TaskSpec("miniwob", "click-test"))


def test_task_spec_from_json_requires_the_core_keys():
    with pytest.raises(ValueError, match="evaluator"):
        task_spec_from_json({"id": "x", "instruction": "y"}, "d")
    spec = task_spec_from_json({"id": 7, "instruction": "y", "evaluator": {"func": "infeasible"}}, "d")
    assert (spec.key, spec.feasible, spec.config["unsupported"]) == (("d", "7"), False, [])


# ------------------------------------------------------------------ suites
def test_local_suite_loads():
    specs = load_osworld_suite(SUITE)
    assert len(specs) == 17
    local = [s for s in specs if s.domain == "local_desktop"]
    assert len(local) == 11
    assert {s.task_id for s in specs if s.domain == "os"} == {
        "e0df059f-28a6-4169-924f-b9623e7184cc",
        "4783cc41-c03c-4e1b-89b4-50658f642bd5",
        "a462a795-fdc7-4b23-b689-e8b6df786b78",
        "b3d4a89c-53f2-4d6b-8b6a-541fb5d205fa",
        "fe41f596-a71b-4c2f-9b2f-9dcd40b568c3",
        "c288e301-e626-4b98-a1ab-159dcb162af5",
    }
    for s in specs:
        assert s.config["unsupported"] == [], s.key
        assert s.feasible == (s.config["task"]["evaluator"]["func"] != "infeasible"), s.key
        oracle = s.config.get("oracle") or s.config["task"]["oracle"]
        assert all(parse_response(r).actions for r in oracle)


def test_suite_errors_name_the_problem(tmp_path):
    bad_id = tmp_path / "s.yaml"
    bad_id.write_text(
        "backend: osworld\ntasks:\n  - {task_id: wrong, config: {path: data/suites/local_desktop/terminal-mkdir.json}}\n"
    )
    with pytest.raises(ValueError, match="wrong"):
        load_osworld_suite(bad_id)
    no_path = tmp_path / "n.yaml"
    no_path.write_text("backend: osworld\ntasks: [x]\n")
    with pytest.raises(ValueError, match=r"config\.path"):
        load_osworld_suite(no_path)


def test_resolve_task_path(monkeypatch, tmp_path):
    monkeypatch.setenv("ARPO_OSWORLD_ROOT", str(tmp_path))
    assert resolve_task_path("osworld:a/b.json") == tmp_path / "a" / "b.json"
    assert resolve_task_path("data/x.json") == REPO / "data" / "x.json"
    assert resolve_task_path("/abs/x.json") == Path("/abs/x.json")


@pytest.mark.parametrize(
    ("p", "want"), [((500, 500), (640.0, 400.0)), ((0, 1000), (0.0, 799.0)), (None, None)]
)
def testrel1000_to_screen(p, want):
    assert rel1000_to_screen(p, 1280, 800) == want


def test_oracle_reply_is_in_the_model_frame_and_maps_back():
    spec = next(s for s in load_osworld_suite(SUITE) if s.task_id == "terminal-mkdir")
    env = OSWorldEnv(**FAST)
    env.task, env.steps = spec, 0
    assert env.oracle_actions()[0].point == (640.0, 400.0)
    reply = env.oracle_reply()
    size = model_size(SCREEN)
    back = to_screen(parse_response(reply).actions, size, SCREEN)[0].point
    assert abs(back[0] - 640) <= 2 and abs(back[1] - 400) <= 2
    env.steps = 3
    assert env.oracle_reply() is None and env.oracle_actions() is None


def test_claim_slot_gives_each_holder_its_own_url(tmp_path):
    urls = ["http://a", "http://b"]
    i, f1 = claim_slot(urls, tmp_path)
    j, f2 = claim_slot(urls, tmp_path)
    assert {i, j} == {0, 1}
    with pytest.raises(RuntimeError, match="claimed"):
        claim_slot(urls, tmp_path)
    f1.close()  # the holder died: its slot is free again
    assert claim_slot(urls, tmp_path)[0] == i
    f2.close()


# ------------------------------------------------------------------ real desktop
def run_oracle(env: OSWorldEnv, max_steps: int = 10) -> int:
    n = 0
    while (acts := env.oracle_actions()) is not None and n < max_steps:
        res = env.step(acts)
        n += 1
        assert "error" not in res.info, res.info
        assert "action_errors" not in res.info, res.info
        if res.done:
            break
    return n


SUITE_SPECS = {s.task_id: s for s in load_osworld_suite(SUITE)}
# One terminal+file task, one window task and one official infeasible `os` task run by default; the rest
# are slow (each task needs a fresh desktop and a few seconds of real GUI time).
FAST_TASKS = {"file-rename", "window-close-scratch", "b3d4a89c-53f2-4d6b-8b6a-541fb5d205fa"}


@pytest.fixture(scope="module")
def env():
    e = OSWorldEnv(**FAST)
    yield e
    e.close()


@pytest.mark.parametrize(
    "task_id", [t if t in FAST_TASKS else pytest.param(t, marks=pytest.mark.slow) for t in SUITE_SPECS]
)
def test_local_task_scores_0_before_and_1_after_its_oracle(env, task_id):
    spec = SUITE_SPECS[task_id]
    obs = env.reset(spec)
    assert obs.screenshot.size == SCREEN and obs.instruction == spec.instruction
    assert env.evaluate() == 0.0
    assert run_oracle(env) >= 1
    assert env.evaluate() == 1.0, env.last_eval_error


def test_reset_restores_a_clean_desktop(env):
    spec = SUITE_SPECS["terminal-mkdir"]
    env.reset(spec)
    home1, pid1 = env.home_dir(), env.desktop_pid()
    env.client.execute("mkdir ~/projects && echo x > ~/leftover.txt", shell=True)
    env.client.post_json("/setup/launch", {"command": "sleep 300", "shell": True})
    assert wait_until(lambda: len(group_pids(pid1)) >= 5)  # server, Xvfb, openbox, terminal, sleep
    assert env.evaluate() == 1.0  # the state really changed ...
    env.reset(spec)
    assert env.evaluate() == 0.0  # ... and the reset undid it
    assert env.home_dir() != home1 and not os.path.exists(home1)
    assert not os.path.exists(os.path.join(env.home_dir(), "leftover.txt"))
    assert wait_until(lambda: not group_pids(pid1), 5)  # no process of the old episode is left
    assert env.desktop_pid() != pid1


def test_fail_on_a_feasible_task_scores_0_and_osworld_hard(env):
    env.reset(SUITE_SPECS["window-open-terminal"])
    env.step(env.oracle_actions())  # Ctrl+Alt+T: the task is actually done ...
    assert wait_until(lambda: env.evaluate() == 1.0, 5)
    res = env.step([Action("call_user")])  # ... but the agent answers FAIL
    assert res.done and res.info["last_action_kind"] == "call_user"
    assert env.evaluate() == 0.0
    # infeasible task, FAIL within the limit: 1; the same FAIL as the step-limit step under OSWorld Hard: 0
    inf = SUITE_SPECS["infeasible-bluetooth"]
    hard = OSWorldEnv(**FAST, max_steps=2, osworld_hard_scoring=True)
    try:
        hard.reset(inf)
        hard.step([Action("call_user")])
        assert hard.evaluate() == 1.0
        hard.reset(inf)
        hard.step([Action("wait")])
        hard.step([Action("call_user")])
        assert hard.evaluate() == 0.0
        hard.reset(inf)
        hard.step([Action("finished", content="done")])
        assert hard.evaluate() == 0.0  # infeasible answered DONE
    finally:
        hard.close()


@pytest.mark.slow
def test_remote_provider_drives_a_running_server(tmp_path):
    desk = LocalDesktop(screen_size=SCREEN)
    info = desk.start()
    env = OSWorldEnv(
        provider="remote", base_urls=[info.base_url], token=info.token, claim_dir=str(tmp_path), **FAST
    )
    other = OSWorldEnv(
        provider="remote", base_urls=[info.base_url], token=info.token, claim_dir=str(tmp_path), **FAST
    )
    try:
        env.reset(SUITE_SPECS["file-append-line"])
        assert env.evaluate() == 0.0
        run_oracle(env)
        assert env.evaluate() == 1.0
        with pytest.raises(RuntimeError, match="claimed"):
            other.reset(SUITE_SPECS["file-append-line"])
    finally:
        env.close()
        other.close()
        desk.stop()


def test_crashed_desktop_is_restarted_by_the_pool():
    factory = functools.partial(make_osworld_env, screen_size=(640, 480), settle_s=0.1, setup_settle_s=0.1)
    spec = SUITE_SPECS["terminal-mkdir"]
    with EnvPool(factory, n=1, step_timeout_s=30, reset_timeout_s=60) as pool:
        first = pool.reset([(0, spec, None)])[0]
        assert first.error is None and first.observation.screen_size == (640, 480)
        pgid = pool.submit_call(0, "desktop_pid").result().value
        xvfb = [p for p in group_pids(pgid) if Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"Xvfb")]
        assert len(xvfb) == 1
        os.kill(xvfb[0], signal.SIGKILL)  # the X server crashes mid-episode
        res = pool.step({0: [Action("click", point=(100.0, 100.0))]})[0]
        assert res.done and res.error and "desktop fault" in res.error
        assert res.info.get("fatal") is True
        again = pool.reset([(0, spec, None)])[0]
        assert again.error is None and again.observation.screenshot.size == (640, 480)
        assert pool.restarts() == [1]  # the worker (and with it the desktop) was replaced
        assert wait_until(lambda: not group_pids(pgid), 5)  # the crashed desktop's leftovers are gone
        new_pgid = pool.submit_call(0, "desktop_pid").result().value
        assert new_pgid != pgid and group_pids(new_pgid)
        # the recovered env plays its oracle the way the rollout code does: reply in the model frame,
        # parsed, mapped to the screen, stepped, evaluated
        screen = again.observation.screen_size
        for _ in range(5):
            reply = pool.submit_call(0, "oracle_reply").result().value
            actions = to_screen(parse_response(reply).actions, model_size(screen), screen)
            out = pool.step({0: actions})[0]
            assert out.error is None
            if out.done:
                break
        assert pool.evaluate([0])[0].score == 1.0
    assert wait_until(lambda: not group_pids(new_pgid), 5)  # closing the pool ends its desktops


def test_task_json_files_are_valid_osworld_format():
    for f in sorted((REPO / "data" / "suites" / "local_desktop").glob("*.json")):
        task = json.loads(f.read_text())
        assert {"id", "snapshot", "instruction", "source", "config", "related_apps", "evaluator"} <= set(
            task
        ), f
        assert task["id"] == f.stem


def test_invalid_action_is_a_policy_error_not_an_env_fault(env):
    env.reset(SUITE_SPECS["infeasible-bluetooth"])
    res = env.step([Action("click"), Action("wait")])  # a click without a point cannot be rendered
    assert not res.done and "error" not in res.info
    assert res.info["action_errors"][0].startswith("click: click needs start_box")
    assert res.info["last_action_kind"] == "wait"
    assert env.step([Action("call_user")]).done
    assert env.evaluate() == 1.0


# ------------------------------------------------------------------ the pipeline's front doors (env.kind)
OSWORLD_PARAMS = (
    "env.kind=osworld",
    "env.in_domain_suite=data/suites/osworld_local.yaml",
    "env.out_of_domain_suite=data/suites/osworld_local.yaml",
    "ground.eval_miniwob_seeds=0",
)


def _params(*overrides: str):
    from arpo_core.config import load_params

    return load_params(REPO / "params.yaml", list(overrides))


@pytest.fixture
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # suite paths are relative to the working directory, as in the stages


def test_health_check_names_each_desktop_that_does_not_answer():
    from orchestration_helpers import free_port

    from arpo_core.envs.osworld.osworld_env import DesktopError, check_desktops

    desk = LocalDesktop(screen_size=(320, 200))
    info = desk.start()
    dead = f"http://127.0.0.1:{free_port()}"
    try:
        check_desktops([info.base_url], info.token, timeout_s=5)  # answers: no error
        with pytest.raises(DesktopError) as err:
            check_desktops([info.base_url, dead], info.token, timeout_s=2)
        msg = str(err.value)
        assert "env.osworld.base_urls" in msg and f"{dead} did not answer within 2 s" in msg
        assert info.base_url not in msg.split(": ", 1)[1]  # the live one is not blamed
        with pytest.raises(DesktopError, match=r"refused the token \(HTTP 401\)"):
            check_desktops([info.base_url], "wrong-token", timeout_s=5)
    finally:
        desk.stop()


def test_env_factories_come_from_params(in_repo):
    from arpo_core.envs.miniwob.miniwob_env import make_miniwob_env
    from arpo_core.envs.osworld.desktop_env_bridge import make_desktop_env_bridge_env
    from arpo_core.pipeline.rollouts import ENV_FACTORIES

    mw = ENV_FACTORIES["miniwob"](_params())  # exactly the factory make_pool always built for MiniWoB
    assert mw.func is make_miniwob_env and mw.args == () and mw.keywords == {"episode_time_limit_s": 60.0}
    local = ENV_FACTORIES["osworld"](_params(*OSWORLD_PARAMS, "env.osworld.settle_s=0.2"))
    assert local.func is make_osworld_env
    assert local.keywords["provider"] == "local" and local.keywords["screen_size"] == (1024, 640)
    assert local.keywords["settle_s"] == 0.2 and local.keywords["setup_settle_s"] == 1.0
    bridge = ENV_FACTORIES["osworld"](
        _params(*OSWORLD_PARAMS, "env.osworld.provider=desktop_env", "env.osworld.desktop_env_args=[-x, y]")
    )
    assert bridge.func is make_desktop_env_bridge_env and bridge.keywords["serve_args"] == ["-x", "y"]
    assert bridge.keywords["pause_s"] == 0.5 and bridge.keywords["call_timeout_s"] == 600.0


def test_remote_pool_does_not_start_when_a_url_is_dead(in_repo, tmp_path):
    from orchestration_helpers import free_port

    from arpo_core.envs.osworld.osworld_env import DesktopError
    from arpo_core.pipeline.rollouts import make_pool

    dead = f"http://127.0.0.1:{free_port()}"
    p = _params(
        *OSWORLD_PARAMS,
        "env.osworld.provider=remote",
        f"env.osworld.base_urls=[{dead}]",
        "env.n_envs=1",
        "env.osworld.health_timeout_s=1",
    )
    with pytest.raises(DesktopError, match=f"{dead} did not answer"), make_pool(p):
        pytest.fail("the pool must not start")


def test_make_pool_plays_local_desktops_from_params(in_repo):
    """kind osworld: the pool's envs are local desktops of the params' size; the demos' calls work there
    (the oracle's reply, and no DOM: `dom_elements` is None without breaking the worker)."""
    from arpo_core.pipeline.common import suite_tasks
    from arpo_core.pipeline.rollouts import make_pool

    p = _params(*OSWORLD_PARAMS, "env.osworld.screen_width=640", "env.osworld.screen_height=400")
    spec = next(t for t in suite_tasks(p, "in_domain") if t.task_id == "window-open-terminal")
    with make_pool(p, n=1) as pool:
        first = pool.reset([(0, spec, None)])[0]
        assert first.error is None and first.observation.screenshot.size == (640, 400)
        dom = pool.submit_call(0, "dom_elements").result()
        assert dom.error is None and dom.value is None
        reply = pool.submit_call(0, "oracle_reply").result()
        assert reply.error is None and "hotkey" in reply.value
        assert pool.restarts() == [0]


def test_one_suite_named_twice_is_divided_by_split(in_repo):
    from arpo_core.pipeline.common import suite_tasks

    p = _params(*OSWORLD_PARAMS)
    ind, ood = suite_tasks(p, "in_domain"), suite_tasks(p, "out_of_domain")
    assert [t.task_id for t in ind] == [t.task_id for t in SUITE_SPECS.values() if t.split == "in_domain"]
    assert {t.task_id for t in ood} == {t.task_id for t in SUITE_SPECS.values() if t.split == "osworld_os"}
    assert {t.split for t in ood} == {"out_of_domain"}
    same = _params(
        "env.in_domain_suite=data/suites/miniwob_quick.yaml",
        "env.out_of_domain_suite=data/suites/miniwob_quick.yaml",
    )
    assert suite_tasks(same, "in_domain") == suite_tasks(
        _params("env.in_domain_suite=data/suites/miniwob_quick.yaml"), "in_domain"
    )
    with pytest.raises(ValueError, match="none is left for out_of_domain"):
        suite_tasks(same, "out_of_domain")


def test_miniwob_only_settings_fail_naming_the_setting(in_repo, tmp_path):
    import dataclasses

    from arpo_core.pipeline import demos, ground

    with pytest.raises(ValueError, match=r"env\.osworld\.provider desktop_env .* serves no oracle replies"):
        demos.run(_params(*OSWORLD_PARAMS, "env.osworld.provider=desktop_env"), tmp_path / "demos")
    p = _params(*OSWORLD_PARAMS)  # built in code past the loader's rule: the stage names it too
    p = dataclasses.replace(p, ground=dataclasses.replace(p.ground, eval_miniwob_seeds=1))
    with pytest.raises(ValueError, match=r"env\.kind is osworld .* set ground\.eval_miniwob_seeds"):
        ground.real_screens(p, (56, 56))
