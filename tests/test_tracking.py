"""MLflow helpers on a real sqlite store: experiments, batched metrics and params, tags, the comparison
table; and the MLflow UI script serving those runs on a loopback port (slow)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import orchestration_helpers as oh
import pytest
import transformers
from typer.testing import CliRunner

from arpo_core.envs.miniwob import miniwob_env
from flows.cli import app
from tracking import mlflow_runs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def empty_db(tmp_path_factory):
    """An initialised (migrated) empty sqlite store, made once: creating one costs ~7 s here."""
    root = tmp_path_factory.mktemp("template")
    mlflow_runs.client(root).search_experiments()
    return root / "mlflow.db"


@pytest.fixture
def store(tmp_path, monkeypatch, empty_db):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    shutil.copy(empty_db, tmp_path / "mlflow.db")
    return mlflow_runs.client(tmp_path)


def test_tracking_uri_default_and_override(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert mlflow_runs.tracking_uri(tmp_path) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert mlflow_runs.tracking_uri(tmp_path) == "http://127.0.0.1:5999"


def test_experiment_created_once_with_local_artifacts(store, tmp_path):
    a = mlflow_runs.ensure_experiment(store, "exp-a", tmp_path)
    assert mlflow_runs.ensure_experiment(store, "exp-a", tmp_path) == a
    assert store.get_experiment(a).artifact_location == (tmp_path / "mlruns" / "exp-a").resolve().as_uri()


def test_metrics_batched_past_mlflow_limit_with_steps(store, tmp_path):
    exp = mlflow_runs.ensure_experiment(store, "e", tmp_path)
    run_id = mlflow_runs.start_run(store, exp, "evaluate", {"arpo.stage": "evaluate"})
    many = {f"eval/task/t{i:04d}/success_rate": i / 1500 for i in range(1500)}
    many["flag"] = True  # bools are not metrics
    many["name"] = "text"
    assert mlflow_runs.log_metrics(store, run_id, many, step=0) == 1500
    mlflow_runs.log_metrics(store, run_id, {"loss/policy": 0.5}, step=1)
    mlflow_runs.log_metrics(store, run_id, {"loss/policy": 0.25}, step=2)
    run = store.get_run(run_id)
    assert len(run.data.metrics) == 1501
    assert run.data.metrics["eval/task/t0003/success_rate"] == pytest.approx(0.002)
    hist = store.get_metric_history(run_id, "loss/policy")
    assert [(m.step, m.value) for m in hist] == [(1, 0.5), (2, 0.25)]
    assert run.info.run_name == "evaluate"


def test_params_batched_and_stringified(store, tmp_path):
    exp = mlflow_runs.ensure_experiment(store, "e", tmp_path)
    run_id = mlflow_runs.start_run(store, exp, "train")
    params = {f"train.k{i:03d}": i for i in range(150)} | {
        "train.sum_norm": None,
        "train.optimizer.bf16": False,
    }
    mlflow_runs.log_params(store, run_id, params)
    got = store.get_run(run_id).data.params
    assert len(got) == 152
    assert (
        got["train.k042"] == "42"
        and got["train.sum_norm"] == "null"
        and got["train.optimizer.bf16"] == "False"
    )


def test_finish_run_sets_status(store, tmp_path):
    exp = mlflow_runs.ensure_experiment(store, "e", tmp_path)
    ok, bad = mlflow_runs.start_run(store, exp, "sft"), mlflow_runs.start_run(store, exp, "demos")
    mlflow_runs.finish_run(store, ok, True)
    mlflow_runs.finish_run(store, bad, False)
    assert store.get_run(ok).info.status == "FINISHED" and store.get_run(bad).info.status == "FAILED"


def test_run_tags_link_git_and_dvc(tmp_path, monkeypatch):
    monkeypatch.setenv("DVC_EXP_NAME", "puffy-walk")
    monkeypatch.delenv("DVC_EXP_BASELINE_REV", raising=False)
    tags = mlflow_runs.run_tags("train", ROOT, {"arpo.key": "abc", "arpo.pipeline_id": None})
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    assert tags == {
        "arpo.stage": "train",
        "mlflow.source.git.commit": head,
        "dvc.exp_name": "puffy-walk",
        "arpo.key": "abc",
        **mlflow_runs.environment_tags(),
    }
    assert mlflow_runs.git_commit(tmp_path) is None  # not a git repository


def test_runs_carry_the_environment_they_ran_on():
    """mlflow_runs.py, decision "Environment tags": the packages and the browser, as installed."""
    env = mlflow_runs.environment_tags()
    assert env["arpo.env.python"] == platform.python_version()
    assert env["arpo.env.torch"] == importlib.metadata.version("torch")
    assert env["arpo.env.transformers"] == transformers.__version__
    browser = subprocess.run(
        [miniwob_env.CHROMIUM_BINARY, "--version"], capture_output=True, text=True
    ).stdout
    assert env["arpo.env.chromium"] == browser.strip() and env["arpo.env.chromium"].startswith("Chromium ")
    assert mlflow_runs.run_tags("train", ROOT).items() >= env.items()


@pytest.mark.parametrize(
    ("key", "short"),
    [
        ("eval/trained/greedy/in_domain/success_rate", "trained/in_domain/success"),
        ("eval/base/sampled/all/success_rate", "base/sampled/all/success"),
        ("rollout/success_rate", "rollout/success"),
        ("loss/policy", "loss/policy"),
    ],
)
def test_short_name(key, short):
    assert mlflow_runs.short_name(key) == short


def test_comparison_table_layout():
    rows = [
        {"run": "0123456789abcdef", "stage": "train", "variant": "grpo", "status": "FINISHED", "minutes": 2.5,
         "loss/policy": 0.123456},
        {"run": "fedcba9876543210", "stage": "train", "variant": "default", "status": "RUNNING", "minutes": None},
    ]  # fmt: skip
    assert mlflow_runs.comparison_table(rows, ["loss/policy"]).splitlines() == [
        "run       name   variant  status    min  loss/policy",
        "--------  -----  -------  --------  ---  -----------",
        "01234567  train  grpo     FINISHED  2.5  0.123",
        "fedcba98  train  default  RUNNING   -    -",
    ]


def test_differing_params_compare_runs_of_the_same_stage():
    rows = [
        {"stage": "evaluate", "params": {"method": "arpo", "train.replay.enabled": "True", "seed": "0"}},
        {"stage": "evaluate", "params": {"method": "grpo", "train.replay.enabled": "False", "seed": "0"}},
        {"stage": "sft", "params": {"sft.optimizer.lr": "1"}},
    ]
    assert mlflow_runs.differing_params(rows) == ["method", "train.replay.enabled"]
    assert mlflow_runs.differing_params(rows[:1]) == []
    table = mlflow_runs.comparison_table(rows[:2], [], ["method"]).splitlines()
    assert table[0].split() == ["run", "name", "variant", "status", "min", "method"]
    assert table[2].split()[-1] == "arpo" and table[3].split()[-1] == "grpo"


def test_experiment_is_tagged_for_model_training(store, tmp_path):
    """mlflow_runs.py, decision "Experiment kind", also for an experiment made before the tag existed."""
    old = store.create_experiment("old", artifact_location=(tmp_path / "old").as_uri())
    assert mlflow_runs.ensure_experiment(store, "old", tmp_path) == old
    new = mlflow_runs.ensure_experiment(store, "new", tmp_path)
    for exp_id in (old, new):
        assert store.get_experiment(exp_id).tags["mlflow.experimentKind"] == "custom_model_development"


def test_default_columns_fall_back_to_stage_metrics():
    rows = [{"init_policy/parameters": 1.0, "time/init_policy_s": 0.1, "run": "x"}]
    assert mlflow_runs.default_columns(rows) == ["init_policy/parameters"]
    assert mlflow_runs.default_columns([{"rollout/success_rate": 0.5}]) == ["rollout/success_rate"]


def _two_train_runs(store, tmp_path):
    """Two pipeline runs (default, grpo), each a parent with its train run nested; one sft run."""
    exp = mlflow_runs.ensure_experiment(store, "arpo-embedded", tmp_path)
    for variant, sr in (("default", 0.5), ("grpo", 0.25)):
        parent = mlflow_runs.start_run(
            store, exp, variant, {"arpo.variant": variant, "arpo.stage": "pipeline"}
        )
        rid = mlflow_runs.start_run(
            store, exp, "train", {"arpo.variant": variant, "arpo.stage": "train"}, parent
        )
        mlflow_runs.log_params(
            store, rid, {"train.replay.enabled": variant == "default", "train.optimizer.lr": 1e-5}
        )
        mlflow_runs.log_metrics(store, rid, {"rollout/success_rate": sr})
        mlflow_runs.finish_run(store, rid, True)
        mlflow_runs.finish_run(store, parent, True)
    rid = mlflow_runs.start_run(store, exp, "sft", {"arpo.variant": "default", "arpo.stage": "sft"})
    mlflow_runs.finish_run(store, rid, True)


def test_run_rows_filter_by_stage_newest_first(store, tmp_path):
    _two_train_runs(store, tmp_path)
    rows = mlflow_runs.run_rows(store, "arpo-embedded", "train")
    assert [r["variant"] for r in rows] == ["grpo", "default"]
    assert [r["rollout/success_rate"] for r in rows] == [0.25, 0.5]
    assert len(mlflow_runs.run_rows(store, "arpo-embedded")) == 5
    assert mlflow_runs.run_rows(store, "no-such-experiment") == []
    parents = mlflow_runs.run_rows(store, "arpo-embedded", "pipeline")
    assert [r["variant"] for r in parents] == ["grpo", "default"]
    # stage runs nest (mlflow_runs.py, decision "Nested runs")
    assert [r["parent"] for r in rows] == [p["run"] for p in parents]
    assert store.get_run(parents[0]["run"]).info.run_name == "grpo"  # the parent is named by variant


def test_arpo_runs_prints_comparison(store, tmp_path):
    _two_train_runs(store, tmp_path)
    res = CliRunner().invoke(app, ["runs", "-e", "arpo-embedded", "-s", "train"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert "rollout/success" in lines[0]
    assert (
        "train.replay.enabled" in lines[0] and "train.optimizer.lr" not in lines[0]
    )  # what the variants changed
    assert "False" in lines[2] and "True" in lines[3]
    assert "grpo" in lines[2] and "0.25" in lines[2] and "default" in lines[3] and "0.5" in lines[3]
    missing = CliRunner().invoke(app, ["runs", "-e", "nothing-here"])
    assert missing.exit_code == 1 and "no runs" in missing.output


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_mlflow_ui_script_serves_the_runs(store, tmp_path):
    _two_train_runs(store, tmp_path)
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "mlflow_ui.sh").write_bytes((ROOT / "scripts" / "mlflow_ui.sh").read_bytes())
    (tmp_path / ".venv").symlink_to(oh.VENV_BIN.parent)  # the script runs .venv/bin/mlflow
    port = oh.free_port()
    env = {**oh.base_env(tmp_path), "MLFLOW_PORT": str(port)}
    log = tmp_path / "mlflow.log"
    proc = oh.start(["bash", "scripts/mlflow_ui.sh"], tmp_path, env, log)
    try:
        base = f"http://127.0.0.1:{port}"
        oh.wait_http(f"{base}/health", 120, proc, log)
        q = urllib.parse.urlencode({"experiment_name": "arpo-embedded"})
        with urllib.request.urlopen(f"{base}/api/2.0/mlflow/experiments/get-by-name?{q}", timeout=10) as r:
            exp_id = json.loads(r.read())["experiment"]["experiment_id"]
        body = json.dumps({"experiment_ids": [exp_id], "filter": "attributes.run_name = 'train'"}).encode()
        req = urllib.request.Request(
            f"{base}/api/2.0/mlflow/runs/search", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            runs = json.loads(r.read())["runs"]
        assert len(runs) == 2
        # one worker and no GenAI job runner: a handful of processes, not 10 (issue 17)
        group = _process_group(proc.pid)
        rss_mb = sum(_rss_kb(pid) for pid in group) / 1024
        print(f"mlflow ui: {len(group)} processes, {rss_mb:.0f} MB RSS")
        assert len(group) <= 4, group
    finally:
        oh.stop(proc)
    assert proc.poll() is not None


def _process_group(pgid: int) -> list[int]:
    """Live pids whose process group is `pgid` (the session a test started)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def _rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def test_queued_dvc_experiments_use_the_projects_store(tmp_path, monkeypatch):
    """mlflow_runs.py, decision "One store per project": a temporary DVC experiment workspace logs into its
    project's mlflow.db."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    exp = tmp_path / "proj" / ".dvc" / "tmp" / "exps" / "tmpab12cd" / "sub"
    exp.mkdir(parents=True)
    assert mlflow_runs.store_root(exp.parent) == tmp_path / "proj"
    assert mlflow_runs.store_root(exp) == tmp_path / "proj"
    assert mlflow_runs.tracking_uri(exp.parent) == f"sqlite:///{tmp_path / 'proj' / 'mlflow.db'}"
    assert mlflow_runs.store_root(tmp_path / "proj") == tmp_path / "proj"
    assert mlflow_runs.store_root(tmp_path / "other" / ".dvc") == tmp_path / "other" / ".dvc"
