"""Data-parallel training on CPU with gloo (issue 31 items 1-4, arpo_core/algorithm/distributed.py):
2 ranks give the 1-rank run's trajectories, replay, losses, gradient norms and weights for the torch
engine and DeepSpeed ZeRO-2 and ZeRO-3; a killed rank ends the job at once with a line naming the rank
and its last step, and the run resumes from its checkpoint on another number of ranks; `arpo stage train
--nproc-per-node 2` runs the real train stage (MiniWoB, the tiny policy) as rank 0's tracked run.

The ranks are real processes started by torch's elastic launcher (what `torchrun` runs), each playing
tests/trainer_harness.py's fake pool with seeded replies of the real tiny policy (tests/dist_harness.py).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from arpo_core.algorithm.distributed import (
    SINGLE,
    Heartbeat,
    Ranks,
    assign_units,
    describe_failure,
    launch_ranks,
    split_jobs,
)
from arpo_core.algorithm.engines import free_port
from arpo_core.algorithm.rollout import EpisodeJob, RolloutResult, make_group_jobs, merge_results
from arpo_core.envs.base import TaskSpec
from arpo_core.policy.model import build_tiny_policy, load_policy

sys.path.insert(0, str(Path(__file__).parent))
import orchestration_helpers as oh
import trainer_harness as harness

HERE = Path(__file__).parent
WORKER = str(HERE / "dist_harness.py")


# -- the pieces, without processes ---------------------------------------------------------------------


def test_split_jobs_keeps_groups_whole_with_their_global_indices():
    tasks = [TaskSpec(domain="d", task_id=f"t{i}") for i in range(3)]
    jobs = make_group_jobs(tasks, group_size=2, seed=100, groups_per_task=2)  # 6 groups of 2
    parts = [split_jobs(jobs, 4, r) for r in range(4)]
    assert sorted(i for part in parts for i, _ in part) == list(range(len(jobs)))  # each job once
    for r, part in enumerate(parts):
        groups = {job.group_id for _, job in part}
        assert groups == {g for g in range(6) if g % 4 == r}  # round-robin over groups
        for i, job in part:
            assert jobs[i] is job
    assert split_jobs(jobs, 1, 0) == list(enumerate(jobs))


def test_assign_units_round_robin_and_empty_ranks():
    assert assign_units(5, 2) == [[0, 2, 4], [1, 3]]
    assert assign_units(1, 3) == [[0], [], []]


def _traj(group: int, sample: int, success: float):
    from arpo_core.trajectory import Trajectory

    return Trajectory(
        run_id="r", stage="train", epoch=1, task_domain="d", task_id=f"t{group}", instruction="i",
        steps=[], group_id=group, sample_idx=sample, success=success, reward=success,
    )  # fmt: skip


def test_merge_results_restores_job_order_and_reduces_metrics_by_meaning():
    a = RolloutResult(
        [_traj(0, 0, 1.0), _traj(0, 1, 0.0)],
        [],
        {"time/rollout_s": 3.0, "rollout/env_faults": 1.0, "rollout/generate_calls": 2.0, "rollout/mean_batch": 1.0,
         "rollout/env_utilization": 0.5},
        [0, 1],
    )  # fmt: skip
    job = EpisodeJob(TaskSpec(domain="d", task_id="t1"), seed=5, group_id=1, sample_idx=1)
    b = RolloutResult(
        [_traj(1, 0, 0.0)],
        [(job, "reset timed out")],
        {"time/rollout_s": 5.0, "rollout/env_faults": 2.0, "rollout/generate_calls": 1.0, "rollout/mean_batch": 4.0,
         "rollout/env_utilization": 0.7},
        [2],
    )  # fmt: skip
    m = merge_results([b, a])
    assert [(t.group_id, t.sample_idx) for t in m.trajectories] == [(0, 0), (0, 1), (1, 0)]
    assert m.orders == [0, 1, 2] and m.failed == [(job, "reset timed out")]
    assert m.metrics["time/rollout_s"] == 5.0 and m.metrics["rollout/env_faults"] == 3.0
    assert m.metrics["rollout/episodes"] == 3.0 and m.metrics["rollout/success_rate"] == pytest.approx(1 / 3)
    assert m.metrics["rollout/mean_batch"] == pytest.approx((1 * 2 + 4 * 1) / 3)
    assert m.metrics["rollout/env_utilization"] == pytest.approx(0.6)


def test_one_process_collectives_are_identities():
    assert not SINGLE.distributed and SINGLE.main
    assert SINGLE.gather("x") == ["x"] and SINGLE.scatter(["y"]) == "y" and SINGLE.broadcast(3) == 3
    t = torch.tensor([1.0, 2.0])
    assert torch.equal(SINGLE.all_reduce_sum(t), t) and torch.equal(SINGLE.all_reduce_max(t), t)
    assert Ranks.from_env(timeout_s=60, backend="auto") is SINGLE  # no launcher variables here


def test_a_failure_line_names_the_rank_and_its_last_step(tmp_path):
    Heartbeat(tmp_path, Ranks(0, 2))(2, 1, "update")
    Heartbeat(tmp_path, Ranks(1, 2))(2, 0, "rollout")
    line = describe_failure(tmp_path, {1: "was killed by signal 9"})
    assert line == "rank 1 was killed by signal 9 at epoch 2 iteration 0 (rollout)"
    assert "before its first step" in describe_failure(tmp_path, {3: "exited with code 1"})
    assert describe_failure(tmp_path, {1: "x"}, since=time.time() + 60).endswith("before its first step")


# -- real ranks ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    build_tiny_policy(d, size="xs", seed=0)
    return d


EPOCHS = 2
"""Epoch 1 of the harness has no success (zero advantages); epoch 2 has replay and gradients."""


def _one_rank(
    policy_dir: Path, out: Path, micro: int, mini: int, engine: str = "torch", zero: int = 0
) -> Path:
    torch.set_num_threads(1)
    cfg, pc = harness.configs(
        EPOCHS, micro_batch_size=micro, mini_batch_size=mini, engine=engine, zero_stage=zero
    )
    harness.run(policy_dir, out, cfg, pc)
    return out


@pytest.fixture(scope="module")
def reference(policy_dir, tmp_path_factory):
    """The one-process runs the 2-rank runs are compared with, made once per module when first asked:
    torch with micro 2 / mini 4 (two optimizer steps per iteration, accumulation over micro-batches;
    DeepSpeed ZeRO-2 computes the same, engines.py, decision "No loss rescaling") and ZeRO-3 in one process
    with micro 8 /
    mini 8 (ZeRO-3 accumulates nothing; in one process it differs from torch by ~1e-5 relative in the
    gradient norm, so its 2 ranks are held to its own 1-rank run)."""
    root = tmp_path_factory.mktemp("one")
    made: dict[tuple, Path] = {}

    def get(engine: str, zero: int, micro: int, mini: int) -> Path:
        key = ("torch", 0, micro, mini) if zero < 3 else (engine, zero, micro, mini)
        if key not in made:
            made[key] = _one_rank(policy_dir, root / "-".join(map(str, key)), micro, mini, key[0], key[1])
        return made[key]

    return get


def _ranks(
    policy_dir: Path, out: Path, engine: str, zero: int, micro: int, mini: int, *kill: int | str
) -> str | None:
    argv = [WORKER, str(policy_dir), str(out), str(EPOCHS), engine, str(zero), str(micro), str(mini)]
    return launch_ranks(2, argv + [str(k) for k in kill], out / "ranks", free_port())


def _history(out: Path) -> list[dict]:
    return json.loads((out / "checkpoints" / f"epoch-{EPOCHS:04d}" / "state.json").read_text())["history"]


def _assert_same_run(one: Path, two: Path) -> None:
    """Same episodes (fills included), replay counters, losses, gradient norms and weights."""
    assert harness.episodes(two) == harness.episodes(one)
    h1, h2 = _history(one), _history(two)
    assert any(row["optim/grad_norm"] > 0.1 for row in h1)  # the comparison has gradients to compare
    for r1, r2 in zip(h1, h2, strict=True):
        for key in ("optim/grad_norm", "loss/total", "loss/policy", "update/tokens", "update/trajectories"):
            assert r2[key] == pytest.approx(r1[key], rel=1e-5, abs=1e-7), key
        for key in ("replay/n_items", "replay/groups_filled", "train/replayed", "rollout/success_rate"):
            assert r2[key] == r1[key], key
    ckpt = f"checkpoints/epoch-{EPOCHS:04d}"
    w1 = load_policy(one / ckpt / "policy").model.state_dict()
    w2 = load_policy(two / ckpt / "policy").model.state_dict()
    base = load_policy(one / "checkpoints" / "epoch-0001" / "policy").model.state_dict()
    moved = max(float((w1[k] - base[k]).abs().max()) for k in w1)
    assert moved > 1e-4  # epoch 2 changed the weights
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=2e-5)
    from arpo_core.trajectory import read_trajectories

    def buffer(run: Path) -> tuple[dict, list]:
        manifest = json.loads((run / ckpt / "replay" / "manifest.json").read_text())
        items = read_trajectories(run / ckpt / "replay" / manifest.pop("items_file"))
        return manifest, [
            (t.key, t.group_id, t.sample_idx, t.steps[0].response_text, t.reward) for t in items
        ]

    assert buffer(one) == buffer(two) and buffer(one)[1]  # one buffer, saved once, the same items


@pytest.mark.slow
@pytest.mark.parametrize(
    ("engine", "zero", "micro", "mini"),
    [("torch", 0, 2, 4), ("deepspeed", 2, 2, 4), ("deepspeed", 3, 8, 8)],
    ids=["torch", "zero2", "zero3"],
)
def test_two_ranks_train_what_one_process_trains(policy_dir, reference, tmp_path, engine, zero, micro, mini):
    out = tmp_path / "two"
    assert _ranks(policy_dir, out, engine, zero, micro, mini) is None
    _assert_same_run(reference(engine, zero, micro, mini), out)
    assert {json.loads(p.read_text())["phase"] for p in (out / "ranks").glob("rank-*.json")} == {"done"}


@pytest.mark.slow
def test_a_killed_rank_ends_the_job_naming_it_and_the_run_resumes_on_one_rank(
    policy_dir, reference, tmp_path
):
    out = tmp_path / "killed"
    t0 = time.monotonic()
    failure = _ranks(policy_dir, out, "torch", 0, 2, 4, 1, 2, 0)  # rank 1 dies in epoch 2's first update
    took = time.monotonic() - t0
    assert failure == (
        "rank 1 was killed by signal 9 at epoch 2 iteration 0 (update); "
        "then the launcher stopped rank 0 (last at epoch 2 iteration 0 (update))"
    )
    assert took < 100, took  # the launcher stopped rank 0 at once, not after its 120 s collective timeout
    assert (out / "checkpoints" / "latest").read_text() == "epoch-0001"
    _one_rank(policy_dir, out, 2, 4)  # resume the same run with one rank
    _assert_same_run(reference("torch", 0, 2, 4), out)


@pytest.mark.slow
def test_a_hung_rank_ends_the_job_at_the_collective_timeout(policy_dir, tmp_path):
    """Rank 1 hangs (sleeps) in epoch 2's first update: rank 0's next collective times out after 20 s
    (`train.distributed.timeout_s` in a real run), rank 0 fails and the launcher ends the job; the line
    names the failing rank and where the silent one was."""
    out = tmp_path / "hung"
    t0 = time.monotonic()
    failure = _ranks(policy_dir, out, "torch", 0, 2, 4, 1, 2, 0, "stop")
    took = time.monotonic() - t0
    assert failure is not None, "the job with a hung rank succeeded"
    assert failure.startswith("rank 0 exited with code 1 at epoch 2 iteration 0 (update)"), failure
    assert "then the launcher stopped rank 1 (last at epoch 2 iteration 0 (update))" in failure, failure
    assert took < 100, took  # the 20 s timeout, then the launcher stops the sleeper


@pytest.mark.slow
def test_arpo_stage_train_on_two_ranks_is_rank_0s_tracked_run(tmp_path):
    """The real train stage (2 MiniWoB envs, the tiny policy, the quick preset) through the front door
    `arpo stage train --nproc-per-node 2`: the same trajectories and weights as one process, one MLflow
    run (rank 0's), the stamp written, the outputs swapped in, nothing left in the staging area."""
    from tracking import mlflow_runs

    project = oh.copy_project(tmp_path / "proj")
    oh.write_quick_params(project)
    build_tiny_policy(project / "models" / "base", size="xs", seed=0)
    env = oh.base_env(project) | {"PYTHONPATH": str(project)}
    cmd = ["arpo", "stage", "train", "--force", "-S", "train.use_selection=false"]
    one = oh.run(cmd, project, env, timeout=600)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    shutil.copytree(project / "models" / "arpo", tmp_path / "one")
    two = oh.run([*cmd, "--nproc-per-node", "2"], project, env, timeout=900)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    assert "rank 1 of 2" in two.stdout and "rank 0 of 2" in two.stdout

    from arpo_core.trajectory import read_trajectories

    def rows(d: Path):
        return [
            (t.task_id, t.group_id, t.sample_idx, [s.response_text for s in t.steps], t.reward)
            for t in read_trajectories(d / "trajectories")
        ]

    assert rows(project / "models" / "arpo") == rows(tmp_path / "one") and rows(tmp_path / "one")
    w1 = load_policy(tmp_path / "one" / "policy").model.state_dict()
    w2 = load_policy(project / "models" / "arpo" / "policy").model.state_dict()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=2e-5)
    runs = mlflow_runs.run_rows(mlflow_runs.client(project), "arpo-embedded", "train")
    assert len(runs) == 2 and {r["status"] for r in runs} == {"FINISHED"}  # one per command: rank 0's
    assert not (project / "models" / ".arpo.staging").exists()
    assert json.loads((project / ".arpo" / "stamps" / "train.json").read_text())
    # every other stage refuses ranks
    out = subprocess.run(
        [str(oh.VENV_BIN / "arpo"), "stage", "demos", "--nproc-per-node", "2"],
        cwd=project, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 1 and "only the train stage runs on several ranks" in out.stderr


# -- memory per rank (docs/scale-out.md) ---------------------------------------------------------------

QWEN25VL_7B_PARAMS = 8_292_166_656
"""benchmarks/gpu_bench.py `count_params` of the Qwen2.5-VL-7B shape on the meta device."""


def test_model_state_bytes_by_hand():
    from arpo_core.algorithm.distributed import model_state_bytes

    n = 1000
    assert model_state_bytes(n, 8, "torch") == (4000, 4000, 8000)  # fp32 all, nothing sharded
    assert model_state_bytes(n, 8, "deepspeed", 0) == (2000, 2000, 12000)
    assert model_state_bytes(n, 8, "deepspeed", 1) == (2000, 2000, 1500)
    assert model_state_bytes(n, 8, "deepspeed", 2) == (2000, 250, 1500)
    assert model_state_bytes(n, 8, "deepspeed", 3) == (250, 250, 1500)
    assert model_state_bytes(n, 1, "deepspeed", 3).total == 16 * n  # one GPU: ZeRO shards nothing
    with pytest.raises(ValueError, match="ZeRO stage 4"):
        model_state_bytes(n, 8, "deepspeed", 4)


def test_scale_out_memory_table_is_the_computed_one():
    from arpo_core.algorithm.distributed import model_state_bytes

    gib = 2**30
    cells = [f"{model_state_bytes(QWEN25VL_7B_PARAMS, 1, 'torch').total / gib:.1f}"]
    cells += [
        f"{model_state_bytes(QWEN25VL_7B_PARAMS, w, 'deepspeed', s).total / gib:.1f}"
        for s in (1, 2, 3)
        for w in (8, 16)
    ]
    row = "| Qwen2.5-VL-7B, all 8.29B parameters | " + " | ".join(cells) + " |"
    assert row in (HERE.parent / "docs" / "scale-out.md").read_text()
