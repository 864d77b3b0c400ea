"""The ARPO epoch loop: replay fills all-failed groups (and not when disabled), per-task metrics and
the epoch summary (counts summed, rates per episode, buffer state at the epoch's end), several groups
per task on distinct instances, checkpoints every epoch, a SIGKILLed run resumes to the same buffer and
epoch count as an uninterrupted one, and ARPO and GRPO play the same first epoch on real MiniWoB."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from arpo_core.algorithm.replay import ReplayBuffer, ReplayConfig
from arpo_core.algorithm.trainer import epoch_summary, latest_checkpoint, prepare_batch, task_metrics, train
from arpo_core.envs.base import TaskSpec
from arpo_core.policy.model import build_tiny_policy
from arpo_core.trajectory import Step, Trajectory, read_trajectories

sys.path.insert(0, str(Path(__file__).parent))
import trainer_harness as harness

ROOT = Path(__file__).resolve().parents[1]


def traj(task, group, k, success, reward=None, replayed=False, epoch=1):
    step = Step(step_idx=0, screenshot_png=b"png", screen_w=160, screen_h=210, response_text=f"r{group}{k}")
    return Trajectory(
        "r",
        "train",
        epoch,
        "fake",
        task,
        "i",
        [step],
        group_id=group,
        sample_idx=k,
        success=success,
        reward=success if reward is None else reward,
        replayed=replayed,
    )


@pytest.mark.parametrize("enabled", [True, False])
def test_all_failed_group_is_filled_from_buffer_only_when_enabled(enabled):
    buf = ReplayBuffer(ReplayConfig(enabled=enabled, seed=0), success_threshold=0.1)
    buf.add([traj("a", 0, 0, 1.0)])  # a stored success of task a from an earlier iteration
    fresh = [traj("a", 5, k, 0.0) for k in range(4)] + [traj("b", 6, k, float(k == 1)) for k in range(4)]
    batch = prepare_batch(fresh, buf, group_size=4, scale="group", eps=1e-6)
    adv_a = batch.advantages[:4]
    if enabled:
        assert (
            batch.n_replayed == 1 and batch.trajectories[0].replayed and batch.trajectories[0].group_id == 5
        )
        # rewards [1, 0, 0, 0]: mean .25, unbiased std .5 -> [1.5, -.5, -.5, -.5]
        torch.testing.assert_close(adv_a, torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-5, rtol=0)
    else:
        assert batch.n_replayed == 0 and not any(t.replayed for t in batch.trajectories)
        assert torch.count_nonzero(adv_a) == 0
    # the mixed group b is never touched and has non-zero advantages either way
    assert [t.replayed for t in batch.trajectories[4:]] == [False] * 4
    assert torch.count_nonzero(batch.advantages[4:]) == 4


def test_group_with_missing_rollout_is_dropped():
    buf = ReplayBuffer(ReplayConfig(), success_threshold=0.1)
    fresh = [traj("a", 0, k, float(k == 0)) for k in range(3)] + [
        traj("b", 1, k, float(k == 0)) for k in range(4)
    ]
    batch = prepare_batch(fresh, buf, group_size=4, scale="group", eps=1e-6)
    assert batch.n_groups == 1 and {t.task_id for t in batch.trajectories} == {"b"}


def test_task_metrics_on_a_crafted_batch():
    """trainer.py, decision "Per-task metrics" by hand. Task a: two all-failed groups (groups_per_task=2) and
    a stored success -> both filled (each on its own, trainer.py, decision "ARPO order of operations"). Task
    b: a mixed group (1 success of 4) and an all-failed one, nothing stored before -> triggered, not filled;
    its success is stored after the update. Task "click:odd?": a group with an env-failed job (3 episodes, 1
    success) -> dropped from the update, its success still stored. Task d: every job env-failed -> no
    episodes, no success rate."""
    buf = ReplayBuffer(ReplayConfig(seed=0), success_threshold=0.1)
    buf.add([traj("a", 9, 0, 1.0, epoch=0)])  # an earlier iteration's success of a
    fresh = (
        [traj("a", g, k, 0.0) for g in (0, 1) for k in range(4)]
        + [traj("b", 2, k, float(k == 1)) for k in range(4)]
        + [traj("b", 3, k, 0.0) for k in range(4)]
        + [traj("click:odd?", 4, k, float(k == 2)) for k in range(3)]
    )
    batch = prepare_batch(fresh, buf, group_size=4, scale="group", eps=1e-6)
    assert [f.reason for f in batch.fills] == ["filled", "filled", "not_failed", "no_stored_success"]
    assert batch.n_groups == 4 and batch.n_replayed == 2
    assert [(t.group_id, t.replayed) for t in batch.trajectories[::4]] == [
        (0, True),
        (1, True),
        (2, False),
        (3, False),
    ]
    buf.add(fresh)  # after the update (trainer.py, decision "ARPO order of operations")
    tasks = [TaskSpec("fake", t) for t in ("a", "b", "click:odd?", "d")]
    m = task_metrics(tasks, fresh, batch.fills, buf.sizes())
    assert m == {
        "task/fake/a/episodes": 8.0,
        "task/fake/a/success_rate": 0.0,
        "task/fake/a/all_fail_groups": 2.0,
        "task/fake/a/replay_fills": 2.0,
        "task/fake/a/buffer_size": 1.0,  # the stored success; the fresh rollouts added none
        "task/fake/b/episodes": 8.0,
        "task/fake/b/success_rate": 0.125,
        "task/fake/b/all_fail_groups": 1.0,
        "task/fake/b/replay_fills": 0.0,
        "task/fake/b/buffer_size": 1.0,
        "task/fake/click_odd_/episodes": 3.0,  # the key cleaned like evaluate.py's
        "task/fake/click_odd_/success_rate": pytest.approx(1 / 3),
        "task/fake/click_odd_/all_fail_groups": 0.0,
        "task/fake/click_odd_/replay_fills": 0.0,
        "task/fake/click_odd_/buffer_size": 1.0,
        "task/fake/d/episodes": 0.0,
        "task/fake/d/all_fail_groups": 0.0,
        "task/fake/d/replay_fills": 0.0,
        "task/fake/d/buffer_size": 0.0,
    }
    assert all(type(v) is float for v in m.values())


def test_epoch_summary_sums_counts_weights_rates_by_episodes_and_keeps_the_buffer_at_the_end():
    """trainer.py, decision "Epoch summary reduction" by hand on two iteration rows (8 then 4 episodes; task a
    in both, b in the second)."""
    rows = [
        {
            "rollout/episodes": 8.0,
            "rollout/success_rate": 0.5,
            "train/groups": 2.0,
            "train/replayed": 1.0,
            "replay/groups_filled": 1.0,  # running totals of the buffer
            "replay/n_items": 3.0,
            "loss/policy": 1.0,
            "task/fake/a/episodes": 8.0,
            "task/fake/a/success_rate": 0.5,
            "task/fake/a/all_fail_groups": 1.0,
            "task/fake/a/replay_fills": 1.0,
            "task/fake/a/buffer_size": 2.0,
        },
        {
            "rollout/episodes": 4.0,
            "rollout/success_rate": 0.25,
            "train/groups": 1.0,
            "train/replayed": 1.0,
            "replay/groups_filled": 2.0,
            "replay/n_items": 5.0,
            "loss/policy": 3.0,
            "task/fake/a/episodes": 4.0,
            "task/fake/a/success_rate": 0.25,
            "task/fake/a/all_fail_groups": 2.0,
            "task/fake/a/replay_fills": 1.0,
            "task/fake/a/buffer_size": 3.0,
            "task/fake/b/episodes": 0.0,  # every job env-failed: no success rate
            "task/fake/b/all_fail_groups": 0.0,
            "task/fake/b/replay_fills": 0.0,
            "task/fake/b/buffer_size": 1.0,
        },
    ]
    assert epoch_summary(rows) == {
        "rollout/episodes": 12.0,  # summed
        "rollout/success_rate": pytest.approx(5 / 12),  # (8 * .5 + 4 * .25) / 12, not (.5 + .25) / 2
        "train/groups": 3.0,
        "train/replayed": 2.0,
        "replay/groups_filled": 2.0,  # the running total at the epoch's end, not 1.5 or 3
        "replay/n_items": 5.0,
        "loss/policy": 2.0,  # mean over iterations
        "task/fake/a/episodes": 12.0,
        "task/fake/a/success_rate": pytest.approx(5 / 12),
        "task/fake/a/all_fail_groups": 3.0,
        "task/fake/a/replay_fills": 2.0,
        "task/fake/a/buffer_size": 3.0,
        "task/fake/b/episodes": 0.0,
        "task/fake/b/all_fail_groups": 0.0,
        "task/fake/b/replay_fills": 0.0,
        "task/fake/b/buffer_size": 1.0,
    }


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    build_tiny_policy(d, size="xs", seed=0)
    return d


def test_train_loop_checkpoints_every_epoch_and_fills_groups(policy_dir, tmp_path):
    torch.set_num_threads(1)
    seen = []
    state = harness.run(
        policy_dir,
        tmp_path,
        *harness.configs(2),
        on_iteration=lambda e, i, m: seen.append((e, i, m)),
        on_epoch=lambda e, p: {"eval/marker": float(e)},
    )
    assert state.epoch == 2 and [h["epoch"] for h in state.history] == [1, 2]
    assert [h["eval/marker"] for h in state.history] == [1.0, 2.0]
    assert len(seen) == 4  # 3 tasks / 2 per iteration -> 2 iterations per epoch
    assert all(
        "loss/policy" in m and "rollout/success_rate" in m and "replay/groups_filled" in m for *_, m in seen
    )
    ck = latest_checkpoint(tmp_path)
    assert ck is not None and ck.name == "epoch-0002"
    assert json.loads((ck / "state.json").read_text())["policy_version"] == 4
    assert (
        sorted(p.name for p in (tmp_path / "trajectories").glob("*.parquet"))[0]
        == "epoch-0001-iter-000.parquet"
    )
    # 'never' fails always and 'hard' mostly: by epoch 2 at least one all-failed 'hard' group can be
    # filled; the stats must account for every failed group either way
    last = seen[-1][2]
    assert last["replay/groups_failed"] >= last["replay/groups_filled"]

    # Per-task metrics (trainer.py, decision "Per-task metrics") of the run pinned in
    # test_groups_per_task_1_plays_the_pinned_episodes: epoch 1 every group fails; epoch 2 'easy' succeeds 3
    # times of 4 (its buffer keeps all 3), nothing was stored before, so nothing is filled
    for _, it, m in seen:
        tasks = {k.split("/")[2] for k in m if k.startswith("task/")}
        assert len(tasks) == (2 if it == 0 else 1) and m["train/groups"] == len(tasks)
    per_task = [{k: v for k, v in h.items() if k.startswith("task/")} for h in state.history]
    assert per_task[0] == {
        f"task/fake/{t}/{name}": value
        for t in ("easy", "hard", "never")
        for name, value in (
            ("episodes", 4.0),
            ("success_rate", 0.0),
            ("all_fail_groups", 1.0),
            ("replay_fills", 0.0),
            ("buffer_size", 0.0),
        )
    }
    easy = {
        "episodes": 4.0,
        "success_rate": 0.75,
        "all_fail_groups": 0.0,
        "replay_fills": 0.0,
        "buffer_size": 3.0,
    }
    assert {k: v for k, v in per_task[1].items() if "/easy/" in k} == {
        f"task/fake/easy/{n}": v for n, v in easy.items()
    }
    assert (
        per_task[1]["task/fake/hard/all_fail_groups"] == per_task[1]["task/fake/never/all_fail_groups"] == 1.0
    )
    # the epoch summary sums counts over its 2 iterations and weights the success rate by episodes
    for epoch, h in zip((1, 2), state.history, strict=True):
        rows = [m for e, _, m in seen if e == epoch]
        assert (
            h["rollout/episodes"] == 12.0 and h["train/groups"] == sum(m["train/groups"] for m in rows) == 3.0
        )
        assert h["rollout/success_rate"] == pytest.approx(
            sum(m["rollout/success_rate"] * m["rollout/episodes"] for m in rows) / 12
        )
        assert h["replay/groups_failed"] == rows[-1]["replay/groups_failed"]  # running total at the end
    assert state.history[1]["rollout/success_rate"] == pytest.approx(3 / 12)
    assert ReplayBuffer.load(ck / "replay").sizes() == {("fake", "easy"): 3}
    # what reaches MLflow (on_iteration rows, history rows at step=epoch): flat float metrics, valid keys
    for row in [m for *_, m in seen] + state.history:
        for k, v in row.items():
            assert re.fullmatch(r"[A-Za-z0-9_\-. /]+", k), k
            assert type(v) is float or (k in ("epoch", "policy_version") and type(v) is int), (k, v)


PINNED = {
    "epoch-0001-iter-000.parquet": [
        ("never", 0, k, 59, x, 0.0, False) for k, x in enumerate((120, 50, 150, 120))
    ]
    + [("easy", 1, k, 60, 150, 0.0, False) for k in range(4)],
    "epoch-0001-iter-001.parquet": [
        ("hard", 0, k, 66, x, 0.0, False) for k, x in enumerate((150, 50, 150, 120))
    ],
    "epoch-0002-iter-000.parquet": [
        ("easy", 0, k, 41, x, float(x < 80), False) for k, x in enumerate((10, 120, 10, 50))
    ]
    + [("hard", 1, k, 42, x, 0.0, False) for k, x in enumerate((150, 150, 50, 120))],
    "epoch-0002-iter-001.parquet": [
        ("never", 0, k, 241, x, 0.0, False) for k, x in enumerate((150, 50, 50, 10))
    ],
}
"""The harness's 2-epoch run before groups_per_task existed: (task, group, sample, env seed % 255, click x,
success, replayed) per trajectory (harness.episodes)."""


def test_groups_per_task_1_plays_the_pinned_episodes(policy_dir, tmp_path):
    """groups_per_task=1 (the default) keeps the jobs, env instances, sampling seeds and so the
    trajectories of one group per task exactly as they were (trainer.py, decision "Derived randomness")."""
    torch.set_num_threads(1)
    harness.run(policy_dir, tmp_path, *harness.configs(2, groups_per_task=1))
    assert harness.episodes(tmp_path) == PINNED


def test_groups_per_task_plays_each_group_on_its_own_instance(policy_dir, tmp_path):
    """groups_per_task=2: each task has two groups of G=4 per iteration, on two instances, under group
    ids unique in the iteration; the update sees all of them and the per-task counts follow the
    trajectories (with these seeds epoch 3 fills one all-failed 'hard' group from epoch 2's successes)."""
    torch.set_num_threads(1)
    seen = []
    state = harness.run(
        policy_dir,
        tmp_path,
        *harness.configs(3, groups_per_task=2),
        on_iteration=lambda e, i, m: seen.append(m),
    )
    files = harness.episodes(tmp_path)
    assert len(files) == 6  # 3 epochs x 2 iterations
    for rows in files.values():
        # (a replayed item shows the instance it was played on, not its group's)
        groups = {(task, group, seed) for task, group, _, seed, _, _, replayed in rows if not replayed}
        assert len(rows) == 4 * len(groups)
        assert len({g for _, g, _ in groups}) == len(groups)  # group ids unique in the iteration
        for task in {t for t, *_ in groups}:
            assert len({seed for t, _, seed in groups if t == task}) == 2  # two instances per task
    assert [m["train/groups"] for m in seen] == [4.0, 2.0] * 3
    for epoch, h in enumerate(state.history, start=1):
        for t in ("easy", "hard", "never"):
            assert h[f"task/fake/{t}/episodes"] == 8.0
            replayed = sum(
                r[6]
                for name, rows in files.items()
                if f"epoch-{epoch:04d}" in name
                for r in rows
                if r[0] == t
            )
            assert h[f"task/fake/{t}/replay_fills"] == replayed
        assert h["train/replayed"] == sum(h[f"task/fake/{t}/replay_fills"] for t in ("easy", "hard", "never"))
    assert state.history[2]["task/fake/hard/replay_fills"] == 1.0
    assert [h["task/fake/never/all_fail_groups"] for h in state.history] == [2.0, 2.0, 2.0]


def test_kl_coef_trains_against_the_frozen_starting_policy_also_after_resume(policy_dir, tmp_path):
    """kl_coef > 0 loads the starting policy as a frozen reference: the first update (policy == reference)
    measures KL 0, and a resumed run keeps the ORIGINAL reference: its first update already measures
    the drift of the earlier epoch instead of restarting from 0."""
    torch.set_num_threads(1)
    # every task in one iteration per epoch, one on-policy step per iteration
    cfg, policy_cfg = harness.configs(2, mini_batch_size=64, tasks_per_iteration=3)
    cfg = replace(cfg, loss=replace(cfg.loss, kl_coef=0.5))
    seen = []

    def run(epochs):
        harness.run(
            policy_dir,
            tmp_path,
            replace(cfg, epochs=epochs),
            policy_cfg,
            on_iteration=lambda e, i, m: seen.append(m),
        )

    run(1)
    assert len(seen) == 1 and "loss/ref_kl" in seen[0]
    assert seen[0]["loss/ref_kl"] == pytest.approx(0.0, abs=1e-6)
    assert seen[0]["train/nonzero_adv_frac"] > 0  # (the harness seed gives a mixed group: the policy moves)
    run(2)  # resumes from epoch 1's checkpoint
    assert len(seen) == 2 and seen[1]["loss/ref_kl"] > 1e-6
    assert all(m["loss/ref_kl"] == m["loss/ref_kl"] for m in seen)  # finite, never NaN


def test_no_reference_forward_without_kl(policy_dir, tmp_path):
    torch.set_num_threads(1)
    seen = []
    harness.run(policy_dir, tmp_path, *harness.configs(1), on_iteration=lambda e, i, m: seen.append(m))
    assert seen and not any("loss/ref_kl" in m for m in seen)


def _buffer_signature(ckpt: Path):
    buf = ReplayBuffer.load(ckpt / "replay")
    return {
        k: [(t.epoch, t.group_id, t.sample_idx, t.steps[0].response_text) for t in v]
        for k, v in buf._items.items()
    }


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_matches_uninterrupted(policy_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    script = [sys.executable, str(ROOT / "tests" / "trainer_harness.py"), str(policy_dir)]

    ref = tmp_path / "ref"
    subprocess.run([*script, str(ref), "3"], env=env, check=True, timeout=600, capture_output=True)

    run = tmp_path / "run"
    proc = subprocess.Popen(
        [*script, str(run), "3"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 300
        # kill once epoch 1 is checkpointed and epoch 2 has started writing trajectories
        while time.monotonic() < deadline:
            if (
                latest_checkpoint(run) is not None
                and (run / "trajectories" / "epoch-0002-iter-000.parquet").exists()
            ):
                break
            assert proc.poll() is None, "trainer exited before it could be killed"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    ck = latest_checkpoint(run)
    assert ck is not None and json.loads((ck / "state.json").read_text())["epoch"] in (1, 2)

    subprocess.run([*script, str(run), "3"], env=env, check=True, timeout=600, capture_output=True)
    a, b = latest_checkpoint(ref), latest_checkpoint(run)
    sa, sb = json.loads((a / "state.json").read_text()), json.loads((b / "state.json").read_text())
    assert sa["epoch"] == sb["epoch"] == 3
    assert sa["policy_version"] == sb["policy_version"]
    assert _buffer_signature(a) == _buffer_signature(b)
    ra = [h["rollout/success_rate"] for h in sa["history"]]
    rb = [h["rollout/success_rate"] for h in sb["history"]]
    assert ra == rb
    # no half-written checkpoint directories or temp files are left behind
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]


def test_task_order_and_update_seeds_are_derived_from_the_run_seed(policy_dir, tmp_path):
    """trainer.py, decision "Derived randomness": the same run seed gives the same trajectories, another seed
    other ones."""
    torch.set_num_threads(1)
    cfg, policy_cfg = harness.configs(1)
    harness.run(policy_dir, tmp_path / "a", cfg, policy_cfg)
    harness.run(policy_dir, tmp_path / "b", cfg, policy_cfg)

    def replies(d):
        return [
            (t.task_id, t.group_id, t.steps[0].response_text)
            for f in sorted((d / "trajectories").glob("*.parquet"))
            for t in read_trajectories(f)
        ]

    assert replies(tmp_path / "a") == replies(tmp_path / "b")
    other = tmp_path / "c"
    train(
        policy_dir,
        harness.TASKS,
        other,
        cfg,
        policy_cfg,
        harness.FakePool(),
        seed=4,
        rollout=harness.rollout_config(cfg, policy_cfg, seed=4),
        generator_factory=harness.RandomReplies,
        success_threshold=0.1,
    )
    assert replies(other) != replies(tmp_path / "a")


@pytest.mark.slow
def test_arpo_and_grpo_share_their_first_epoch_on_real_miniwob(tmp_path):
    """train.replay.enabled true (ARPO) and false (GRPO) differ only in what replay does to later
    groups: their first epoch's rollouts (the grounded tiny policy sampling on real MiniWoB) are the
    same, episode for episode (trainer.py, decision "Derived randomness")."""
    import functools

    from arpo_core.envs.base import load_suite
    from arpo_core.envs.miniwob.miniwob_env import make_miniwob_env
    from arpo_core.envs.pool import EnvPool
    from arpo_core.policy.model import load_policy

    torch.set_num_threads(1)
    grounded = ROOT / "assets" / "checkpoints" / "grounded-xs"
    pixels = load_policy(grounded)
    tasks = load_suite(ROOT / "data" / "suites" / "miniwob_quick.yaml")  # click-test, click-button
    outs = {}
    for enabled in (True, False):
        cfg, policy_cfg = harness.configs(1, tasks_per_iteration=1, group_size=3, max_steps=2)
        cfg = replace(cfg, replay=replace(cfg.replay, enabled=enabled))
        rollout = harness.rollout_config(
            cfg, policy_cfg, min_pixels=pixels.min_pixels, max_pixels=pixels.max_pixels
        )
        outs[enabled] = tmp_path / ("arpo" if enabled else "grpo")
        with EnvPool(functools.partial(make_miniwob_env), n=2) as pool:
            train(
                grounded,
                tasks,
                outs[enabled],
                cfg,
                policy_cfg,
                pool,
                seed=harness.SEED,
                rollout=rollout,
                success_threshold=0.1,
            )

    def episodes(d, name):
        return [
            (
                (t.task_id, t.group_id, t.sample_idx, t.reward, t.replayed, t.policy_version),
                [(s.response_text, s.actions_json, s.response_token_ids) for s in t.steps],
            )
            for t in read_trajectories(d / "trajectories" / name)
        ]

    def logps(d, name):
        return [s.gen_logprob_sum for t in read_trajectories(d / "trajectories" / name) for s in t.steps]

    for name in ("epoch-0001-iter-000.parquet", "epoch-0001-iter-001.parquet"):
        # the first iteration, and the rest of the first epoch: every task is visited once in it, so
        # replay has nothing to fill yet and the two updates are the same too
        arpo, grpo = episodes(outs[True], name), episodes(outs[False], name)
        assert len(arpo) == 3 and arpo == grpo, name
        assert not any(e[0][4] for e in arpo)  # nothing replayed
        # batching (which episodes share a generation call) moves float sums in the last bits only
        assert logps(outs[True], name) == pytest.approx(logps(outs[False], name), abs=1e-3)


def _tensors(x, path=""):
    """Every tensor inside a nested checkpoint dict/list, by its key path."""
    if isinstance(x, dict):
        return {p: t for k, v in x.items() for p, t in _tensors(v, f"{path}/{k}").items()}
    if isinstance(x, list | tuple):
        return {p: t for i, v in enumerate(x) for p, t in _tensors(v, f"{path}[{i}]").items()}
    return {path: x} if isinstance(x, torch.Tensor) else {}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_engine_checkpoints_and_resumes_like_an_uninterrupted_run(policy_dir, tmp_path, stage):
    """Issue 16: with train.engine=deepspeed (ZeRO-2 and ZeRO-3, CPU, gloo) the first epoch checkpoint is
    written (before: IsADirectoryError on DeepSpeed's `latest` file), and a run resumed from it continues
    at epoch 2 and ends where an uninterrupted 2-epoch run ends: the same history, policy weights (the
    ZeRO-3 checkpoint policy holds full weights), Adam moments and step count."""
    from arpo_core.policy.model import load_policy

    torch.set_num_threads(1)
    kw = {"engine": "deepspeed", "zero_stage": stage, "micro_batch_size": 8}  # ZeRO-3: no accumulation
    ref = harness.run(policy_dir, tmp_path / "ref", *harness.configs(2, **kw))

    first = harness.run(policy_dir, tmp_path / "run", *harness.configs(1, **kw))
    ck = latest_checkpoint(tmp_path / "run")
    assert ck is not None and ck.name == "epoch-0001" and first.epoch == 1
    assert (ck / "deepspeed" / "state").is_dir() and not (ck / "deepspeed" / "latest").exists()
    assert not [p for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith(".")]

    seen = []
    resumed = harness.run(
        policy_dir,
        tmp_path / "run",
        *harness.configs(2, **kw),
        on_iteration=lambda e, i, m: seen.append(e),
    )
    assert seen == [2, 2]  # only epoch 2's iterations ran: it continued from epoch 1's checkpoint
    assert resumed.epoch == 2 and len(resumed.history) == 2
    assert resumed.history[0] == first.history[0]
    assert resumed.policy_version == ref.policy_version == 4

    def same_metrics(a, b):
        keys = {k for k in a if not k.startswith("time/")}
        assert keys == {k for k in b if not k.startswith("time/")}
        return {k: a[k] for k in keys} == pytest.approx({k: b[k] for k in keys}, rel=1e-5, abs=1e-7)

    assert all(same_metrics(a, b) for a, b in zip(resumed.history, ref.history, strict=True))
    a, b = latest_checkpoint(tmp_path / "ref"), latest_checkpoint(tmp_path / "run")
    wa, wb = (load_policy(c / "policy").model.state_dict() for c in (a, b))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert wa[k].numel() > 0
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-7)
    [oa], [ob] = ((c / "deepspeed" / "state").glob("*optim_states.pt") for c in (a, b))
    ta, tb = (_tensors(torch.load(f, weights_only=False)["optimizer_state_dict"]) for f in (oa, ob))
    assert ta.keys() == tb.keys() and any(k.endswith("/exp_avg_sq") for k in ta)
    assert [float(v) for k, v in ta.items() if k.endswith("/step")] == [4.0]
    for k in ta:
        torch.testing.assert_close(ta[k], tb[k], rtol=1e-5, atol=1e-7)


def test_gradient_checkpointing_trains_the_same_weights(policy_dir, tmp_path, monkeypatch):
    """train.gradient_checkpointing recomputes activations in the backward (policy/model.py, decision
    "Gradient checkpointing"): the same episodes and, up to float rounding, the same weights."""
    from arpo_core.policy.model import Policy, load_policy

    torch.set_num_threads(1)
    cfg, pc = harness.configs(2)
    harness.run(policy_dir, tmp_path / "plain", cfg, pc)
    switched = []
    original = Policy.set_gradient_checkpointing

    def spy(self, enabled):
        original(self, enabled)
        switched.append(self.gradient_checkpointing)

    monkeypatch.setattr(Policy, "set_gradient_checkpointing", spy)
    harness.run(policy_dir, tmp_path / "ckpt", replace(cfg, gradient_checkpointing=True), pc)
    assert switched == [True]  # the trained policy checkpoints its blocks
    assert harness.episodes(tmp_path / "ckpt") == harness.episodes(tmp_path / "plain")
    last = "checkpoints/epoch-0002/policy"
    a = load_policy(tmp_path / "plain" / last).model.state_dict()
    b = load_policy(tmp_path / "ckpt" / last).model.state_dict()
    base = load_policy(policy_dir).model.state_dict()
    assert max(float((a[k] - base[k]).abs().max()) for k in a) > 1e-4  # the runs trained
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5)
