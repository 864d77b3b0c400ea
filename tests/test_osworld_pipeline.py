"""The paper's setting through the front doors: `arpo run --preset osworld-local` plays every env stage on
the project's own Xvfb desktops (env.kind osworld, provider local), end to end in a project copy, at CI
size (a few tasks of the local desktop suite, one or two episodes, one epoch)."""

from __future__ import annotations

import json
import time

import orchestration_helpers as oh
import pytest
import yaml

from arpo_core.config import load_params
from arpo_core.pipeline.common import suite_tasks
from arpo_core.pipeline.table import STAGES
from arpo_core.trajectory import read_trajectories

PRESET = oh.ROOT / "presets" / "osworld-local.yaml"
SUITE = "data/suites/osworld_local.yaml"
CI_SUITE = "data/suites/osworld_ci.yaml"
# Two own tasks (one infeasible) in-domain, two OSWorld `os` tasks out-of-domain (one infeasible): one
# file named as both suites, divided by the tasks' split (pipeline/common.py `suite_tasks`).
CI_TASKS = (
    "terminal-mkdir",
    "window-open-terminal",
    "infeasible-bluetooth",
    "e0df059f-28a6-4169-924f-b9623e7184cc",
    "b3d4a89c-53f2-4d6b-8b6a-541fb5d205fa",
)
CI_OVERRIDES = (
    f"env.in_domain_suite={CI_SUITE}",
    f"env.out_of_domain_suite={CI_SUITE}",
    "env.osworld.settle_s=0.2",
    "env.osworld.setup_settle_s=0.3",
    "env.osworld.wait_s=0.2",
    "ground.eval_levels=[box4]",
    "ground.eval_per_level=4",
    "demos.episodes_per_task=1",
    "sft.steps=10",
    "sft.batch_size=4",
    "baseline.episodes_per_task=2",
    "baseline.max_steps=3",
    "select.min_successes=0",
    "train.epochs=1",
    "train.tasks_per_iteration=2",
    "train.group_size=2",
    "train.max_steps=3",
    "train.micro_batch_size=4",
    "train.mini_batch_size=4",
    "evaluate.episodes_per_task=1",
    "evaluate.max_steps=2",
    "rft.sft.steps=5",
    "dpo.steps=5",
    "kto.steps=5",
    "policy.max_new_tokens=24",
)


def write_ci_suite(project) -> None:
    """The repo's local desktop suite cut down to CI_TASKS (entries copied, so they stay in step)."""
    doc = yaml.safe_load((oh.ROOT / SUITE).read_text())
    doc["tasks"] = [t for t in doc["tasks"] if (t if isinstance(t, str) else t["task_id"]) in CI_TASKS]
    assert len(doc["tasks"]) == len(CI_TASKS)
    (project / CI_SUITE).write_text(yaml.safe_dump(doc, sort_keys=False))


def test_osworld_local_preset_is_valid_and_splits_the_suite(monkeypatch):
    monkeypatch.chdir(oh.ROOT)
    p = load_params(oh.ROOT / "params.yaml", preset="osworld-local")
    assert p.env.kind == "osworld" and p.env.osworld.provider == "local"
    assert (p.env.osworld.screen_width, p.env.osworld.screen_height) == (1024, 640)
    assert p.ground.eval_miniwob_seeds == 0 and p.compare.image_blind is False
    # the paper's protocol: the 17 tasks are trained on and evaluated, no held-out suite
    assert p.env.out_of_domain_suite is None
    ind, ood = suite_tasks(p, "in_domain"), suite_tasks(p, "out_of_domain")
    assert len(ind) == 17 and {t.split for t in ind} == {"in_domain"} and ood == []
    assert {t.domain for t in ind} == {"local_desktop", "os"}
    # named as both suites, the file is divided by its tasks' own split (the CI test below runs that way)
    p = load_params(oh.ROOT / "params.yaml", [f"env.out_of_domain_suite={SUITE}"], preset="osworld-local")
    ind, ood = suite_tasks(p, "in_domain"), suite_tasks(p, "out_of_domain")
    assert len(ind) == 11 and {t.split for t in ind} == {"in_domain"}
    assert len(ood) == 6 and {t.split for t in ood} == {"out_of_domain"} and {t.domain for t in ood} == {"os"}
    assert all(t.backend == "osworld" and "task" in t.config for t in ind + ood)
    # the CI overrides are valid params too
    load_params(
        oh.ROOT / "params.yaml", [o for o in CI_OVERRIDES if "suite" not in o], preset="osworld-local"
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_osworld_pipeline_runs_every_stage_on_local_desktops(tmp_path):
    project = oh.copy_project(tmp_path / "proj")
    write_ci_suite(project)
    env = oh.base_env(project)
    cmd = [str(oh.VENV_BIN / "arpo"), "run", "--preset", "osworld-local"]
    for o in CI_OVERRIDES:
        cmd += ["-S", o]
    t0 = time.monotonic()
    res = oh.run(cmd, project, env, timeout=780)
    wall = time.monotonic() - t0
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    print(f"arpo run --preset osworld-local (CI size): {wall:.0f} s")

    for i, s in enumerate(STAGES, 1):
        assert f"{i}/{len(STAGES)} {s.name}: done in" in out, f"stage {s.name} did not run:\n{out[-4000:]}"
        assert (project / s.metrics).is_file(), s.metrics
        for path in s.outs:
            assert (project / path).exists(), f"{s.name}: no output {path}"

    demos = read_trajectories(project / "data" / "demos")
    assert demos and all(t.success == 1.0 for t in demos)  # the scripted oracles solve their tasks
    assert {(st.screen_w, st.screen_h) for t in demos for st in t.steps} == {(1024, 640)}
    assert {t.task_id for t in demos} == set(CI_TASKS[:3])  # one demo per in-domain task

    metrics = json.loads((project / "metrics" / "evaluate.json").read_text())
    for policy in ("base", "trained"):
        # metric names by role (evaluate.py, decision "Trajectory files and keys")
        for split in ("in_domain", "out_of_domain"):
            assert f"eval/{policy}/greedy/{split}/success_rate" in metrics, sorted(metrics)[:20]
    episodes = read_trajectories(project / "data" / "eval" / "base.parquet")
    assert {t.task_id for t in episodes} == set(CI_TASKS)
    comparison = json.loads((project / "reports" / "comparison" / "comparison.json").read_text())
    assert {"base", "arpo"} <= set(comparison["methods"])
    assert comparison["methods"]["base"]["out_of_domain"]["episodes"] == 2
