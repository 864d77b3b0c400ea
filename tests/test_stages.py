"""Stage functions on small fabricated inputs (the full chain runs in the flow/DVC tests): select,
the offline baselines, pointer-following for pretrained checkpoints, pixel budgets of both layouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from arpo_core.algorithm.selection import read_selection
from arpo_core.config import ConfigError, load_params
from arpo_core.pipeline import demos, init_policy, offline_baselines, policies, select, sft
from arpo_core.policy.model import load_policy
from arpo_core.trajectory import Step, Trajectory, png_bytes, write_trajectories

ROOT = Path(__file__).resolve().parents[1]


def params(*overrides):
    return load_params(ROOT / "params.yaml", list(overrides), preset=ROOT / "presets" / "quick.yaml")


def traj(task, k, success, x):
    img = Image.new("RGB", (160, 210), (k * 40 % 255, 90, 90))
    reply = f"Thought: go.\nAction: click(start_box='({x},50)')"
    step = Step(0, png_bytes(img), 160, 210, reply, done=True)
    return Trajectory(
        "b",
        "baseline",
        0,
        "miniwob",
        task,
        "Click it.",
        [step],
        group_id=0,
        sample_idx=k,
        success=success,
        reward=success,
    )


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("stages")
    p = params()
    init_policy.run(p, d / "init")
    trajs = [traj("click-test", k, float(k % 2), 20 + 30 * (k % 2)) for k in range(4)]
    trajs += [traj("click-button", k, 0.0, 100) for k in range(4)]
    write_trajectories(d / "baseline" / "in_domain.parquet", trajs)
    return d


def test_select_keeps_tasks_with_a_success(workdir):
    m = select.run(params("select.min_successes=1"), workdir / "baseline", workdir / "sel.json")
    # click-test: 2 successes of 4 (kept, rate 0.5); click-button: none (dropped)
    assert m == {
        "select/kept": 1.0,
        "select/tasks": 2.0,
        "select/kept_rate_mean": 0.5,
        "select/kept_rate_p25": 0.5,
        "select/kept_rate_p50": 0.5,
        "select/kept_rate_p75": 0.5,
        "select/kept_rare_frac": 0.0,
        "select/kept_with/02": 1.0,
        "select/reason/kept": 1.0,
        "select/reason/too_few_successes": 1.0,
    }
    assert read_selection(workdir / "sel.json").kept == (("miniwob", "click-test"),)


@pytest.mark.parametrize("method", ["rft", "dpo", "kto"])
def test_offline_baselines_train_and_save_a_loadable_policy(workdir, method):
    p = params("rft.sft.steps=2", "dpo.steps=2", "kto.steps=2", "dpo.batch_size=2", "kto.batch_size=4")
    before = load_policy(workdir / "init").model.state_dict()
    m = offline_baselines.train_offline(p, method, workdir / "init", workdir / "baseline", workdir / method)
    after = load_policy(workdir / method).model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(k.startswith(f"{method}/") for k in m)
    assert not any(k.startswith(f"{method}/{method}/") for k in m)
    if method == "dpo":
        assert m["dpo/examples"] == 2.0  # click-test: 2 successes x 2 failures -> max(2, 2) pairs


def test_offline_stage_without_usable_data_records_why_and_trains_nothing(workdir, tmp_path):
    """offline_baselines.py, decision "Skipped baselines": RFT on rollouts without a success writes
    skipped.json, no policy."""
    fails = [traj("click-button", k, 0.0, 100) for k in range(3)]
    write_trajectories(tmp_path / "baseline" / "in_domain.parquet", fails)
    m = offline_baselines.train_offline(
        params(), "rft", workdir / "init", tmp_path / "baseline", tmp_path / "rft"
    )
    assert m == {"rft/skipped": 1.0}
    assert not (tmp_path / "rft" / "config.json").exists()
    reason = json.loads((tmp_path / "rft" / offline_baselines.SKIPPED).read_text())
    assert reason["method"] == "rft" and "no baseline rollout with success" in reason["reason"]


def test_unknown_offline_method(workdir):
    with pytest.raises(ValueError, match="unknown offline method 'ppo'"):
        offline_baselines.train_offline(
            params(), "ppo", workdir / "init", workdir / "baseline", workdir / "x"
        )


def test_pretrained_pointer_is_followed(workdir, tmp_path):
    p = params(f"init_policy.pretrained={workdir / 'init'}")
    m = init_policy.run(p, tmp_path / "init")
    assert m == {"init_policy/pretrained": 1.0}
    assert policies.resolve_policy(tmp_path / "init") == (workdir / "init").resolve()
    with pytest.raises(ConfigError, match=r"init_policy\.pretrained = .* is not a checkpoint"):
        params(f"init_policy.pretrained={tmp_path / 'nothing'}")


def test_no_demos_means_no_behaviour_cloning_the_grounded_policy_passes_through(
    workdir, tmp_path, monkeypatch
):
    """demos.episodes_per_task = 0: demos starts no env and writes an empty file; sft passes its start
    through (a pretrained pointer as a pointer, a tiny checkpoint bit for bit)."""
    p = params("demos.episodes_per_task=0")

    def no_pool(_p):
        raise AssertionError("demos started an env pool with episodes_per_task = 0")

    monkeypatch.setattr(demos, "make_pool", no_pool)
    assert demos.run(p, tmp_path / "demos") == {"demos/episodes": 0.0}
    assert (tmp_path / "demos" / "demos.parquet").exists()

    assert sft.run(p, workdir / "init", tmp_path / "demos", tmp_path / "base") == {"sft/steps": 0.0}
    for f in (workdir / "init").iterdir():
        if f.is_file():
            assert (tmp_path / "base" / f.name).read_bytes() == f.read_bytes(), f.name

    init_policy.run(params(f"init_policy.pretrained={workdir / 'init'}"), tmp_path / "pointer")
    sft.run(p, tmp_path / "pointer", tmp_path / "demos", tmp_path / "base2")
    assert policies.resolve_policy(tmp_path / "base2") == (workdir / "init").resolve()

    write_trajectories(tmp_path / "some" / "demos.parquet", [traj("click-test", 0, 1.0, 20)])
    with pytest.raises(ValueError, match=r"episodes_per_task is 0 but .* holds 1 demos"):
        sft.run(p, workdir / "init", tmp_path / "some", tmp_path / "base3")


def test_demos_stage_reports_the_env_faults_of_its_pool(tmp_path, monkeypatch):
    """Faults while the oracles play become demos/faults/<kind> (as rollouts' rollout/faults/<kind>), the
    ones the pool finds when it closes included (rollouts.py, decision "Pool-life faults")."""
    from arpo_core.offline.demonstrations import DemoResult

    class Pool:
        closed = False

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.closed = True  # a browser that died after its last call: found by the close
            return False

        def fault_counts(self):
            return {"browser_crashes": 1 + self.closed, "timeouts": 0}

    monkeypatch.setattr(demos, "make_pool", lambda _p: Pool())
    monkeypatch.setattr(
        demos, "play_oracle_episodes", lambda *a, **k: DemoResult([traj("click-test", 0, 1.0, 20)], 0, [])
    )
    m = demos.run(params(), tmp_path / "demos")
    assert m["demos/episodes"] == 1.0
    assert m["demos/faults/browser_crashes"] == 2.0 and m["demos/faults/timeouts"] == 0.0


def test_a_worker_that_dies_after_its_last_call_is_in_the_stage_faults():
    """rollouts.py, decision "Pool-life faults" on a real pool: a worker killed between calls is found only by
    the close, and `pool_faults` read after the `with make_pool(...)` block counts it."""
    import os
    import signal

    from arpo_core.envs.base import TaskSpec
    from arpo_core.pipeline.rollouts import make_pool, pool_faults

    with make_pool(params("env.n_envs=1")) as pool:
        pool.reset([(0, TaskSpec("miniwob", "click-test"), 0)])
        inside = pool_faults(pool, "x")
        os.kill(pool.worker_pids()[0], signal.SIGKILL)
    assert inside["x/worker_crashes"] == 0.0
    assert pool_faults(pool, "x")["x/worker_crashes"] == 1.0


def test_sft_grows_the_policy_before_cloning_and_rft_refuses_to(workdir, tmp_path):
    """sft.grow_after: the base has a layer more per index and was trained; rft.sft.grow_after is an error."""
    write_trajectories(
        tmp_path / "demos" / "demos.parquet", [traj("click-test", k, 1.0, 20) for k in range(2)]
    )
    p = params("sft.grow_after=[0]", "sft.steps=2", "sft.batch_size=2")
    m = sft.run(p, workdir / "init", tmp_path / "demos", tmp_path / "base")
    assert m["sft/layers"] == 3.0 and m["sft/steps"] == 2.0
    assert load_policy(tmp_path / "base").model.config.text_config.num_hidden_layers == 3
    with pytest.raises(ConfigError, match=r"rft\.sft\.grow_after = \[0\] .*must be null"):
        params("rft.sft.grow_after=[0]")


def test_pixel_budget_reads_both_layouts(workdir, tmp_path):
    assert policies.pixel_budget(workdir / "init") == (3136, 200704)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 256, "max_pixels": 2116800}))
    assert policies.pixel_budget(tmp_path) == (256, 2116800)
    with pytest.raises(FileNotFoundError, match="no image processor config"):
        policies.pixel_budget(tmp_path / "missing")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_stage_evaluates_during_training_on_the_same_instances(workdir, tmp_path):
    """pipeline/train.py, decision "Learning curves": every epoch (during_training=1) the policy is evaluated
    on the evaluate stage's first instances; metrics land in the checkpointed history, episodes on disk."""
    from arpo_core.pipeline import train
    from arpo_core.trajectory import read_trajectories

    p = params(
        "train.epochs=2",
        "train.use_selection=false",
        "train.max_steps=1",
        "evaluate.during_training=1",
        "evaluate.during_training_episodes=2",
        "evaluate.max_steps=1",
    )
    out = tmp_path / "arpo"
    m = train.run(p, workdir / "init", None, out)
    assert m["train/epochs"] == 2.0
    rows = train.epoch_history(out)
    assert [r["epoch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["eval/in_domain/episodes"] == 4.0  # 2 tasks x 2 episodes
        assert "eval/task/miniwob/click-test/success_rate" in r
    first, second = (read_trajectories(out / "eval" / f"epoch-{e:04d}.parquet") for e in (1, 2))
    assert [(t.task_id, t.sample_idx, t.instruction) for t in first] == [
        (t.task_id, t.sample_idx, t.instruction) for t in second
    ]
    assert "evaluations" in {d for _, d in train.artifacts(out)}
