"""The official desktop-env package end to end through the bridge (opt-in: it needs its own 7 GB venv).

Enable with `scripts/setup_desktop_env.sh` (creates ~/.cache/arpo/desktop-env-venv) or point
ARPO_DESKTOP_ENV_PYTHON at a desktop-env interpreter. The official DesktopEnv (its SetupController,
PythonController, getters and metrics) drives the project's local desktop server through the `arpo_url`
provider, so this checks the server's protocol against the official client as well as the bridge.
"""

import os
from pathlib import Path

import pytest

from arpo_core.actions import Action, parse_response
from arpo_core.envs.osworld.desktop_env_bridge import DEFAULT_VENV, URL_TOKEN_ENV, DesktopEnvBridgeEnv
from arpo_core.envs.osworld.desktop_server import LocalDesktop
from arpo_core.envs.osworld.osworld_env import load_osworld_suite, rel1000_to_screen

REPO = Path(__file__).resolve().parents[1]
PYTHON = os.environ.get("ARPO_DESKTOP_ENV_PYTHON", str(DEFAULT_VENV / "bin" / "python"))
SCREEN = (1280, 800)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not os.path.exists(PYTHON),
        reason=f"opt-in: no desktop-env interpreter at {PYTHON} (run scripts/setup_desktop_env.sh)",
    ),
]


def oracle_actions(spec, step: int) -> list[Action] | None:
    replies = spec.config.get("oracle") or spec.config["task"]["oracle"]
    if step >= len(replies):
        return None
    acts = parse_response(replies[step]).actions
    w, h = SCREEN
    return [
        Action(a.kind, rel1000_to_screen(a.point, w, h), None, a.key, a.content, a.direction) for a in acts
    ]


@pytest.fixture(scope="module")
def bridged():
    # The desktop's `python` must have pyperclip (the official client imports it in every action): run the
    # desktop server itself with the desktop-env interpreter.
    desk = LocalDesktop(screen_size=SCREEN, python_executable=PYTHON)
    info = desk.start()
    env = DesktopEnvBridgeEnv(
        python=PYTHON,
        serve_args=["--provider-name", "arpo_url", "--url", info.base_url, "--screen", "1280x800"],
        env={URL_TOKEN_ENV: info.token},
        pause_s=0.3,
        start_timeout_s=180,
        call_timeout_s=180,
    )
    yield env
    env.close()
    desk.stop()


SPECS = {s.task_id: s for s in load_osworld_suite(REPO / "data" / "suites" / "osworld_local.yaml")}


@pytest.mark.parametrize(
    "task_id",
    ["file-rename", "file-write-greeting", "infeasible-bluetooth", "e0df059f-28a6-4169-924f-b9623e7184cc"],
)
def test_official_desktop_env_scores_local_tasks_0_then_1(bridged, task_id):
    spec = SPECS[task_id]
    obs = bridged.reset(spec)
    assert obs.screenshot.size == SCREEN
    assert bridged.evaluate() == 0.0, bridged.last_eval_error
    step = 0
    while (acts := oracle_actions(spec, step)) is not None:
        res = bridged.step(acts)
        assert "error" not in res.info, res.info
        step += 1
        if res.done:
            break
    assert bridged.evaluate() == 1.0, bridged.last_eval_error
