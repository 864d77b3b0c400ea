"""Stage specs, up-to-date stamps, a tracked stage run, and one quick pipeline run that serves the
front-door checks (slow): the `arpo-train/quick` deployment on a real Prefect server with a process
worker, its MLflow runs, then `dvc repro` / `dvc exp run` on the same outputs."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import orchestration_helpers as oh
import pyarrow.parquet as pq
import pytest
import yaml

from arpo_core.config import load_params, parse_params
from flows.runner import PLOT_COLUMNS, StageRun, variant_name, write_epoch_plot
from flows.spec import (
    SPECS,
    STAGE_NAMES,
    STAMP_HISTORY,
    details_path,
    fingerprint,
    is_up_to_date,
    matching_stamp,
    read_stamp,
    stage_key,
    stage_params,
    write_stamp,
)
from tracking import mlflow_runs

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------
# Pure helpers


def test_stage_order_is_the_design_pipeline():
    assert STAGE_NAMES == (
        "init_policy",
        "ground",
        "demos",
        "sft",
        "baseline",
        "select",
        "train",
        "rft",
        "dpo",
        "kto",
        "evaluate",
        "compare",
    )


def test_stage_params_flattens_sections_and_keeps_cross_keys():
    p = parse_params({"select": {"min_successes": 3}, "env": {"in_domain_suite": "x.yaml"}})
    got = stage_params(p, SPECS["select"])
    assert got["select.min_successes"] == 3
    assert got["env.in_domain_suite"] == "x.yaml"
    # operational settings are not inputs (stage.py, decision "Read params keys")
    assert "env.n_envs" not in got
    assert all(
        k.startswith(("select.", "env.in_domain_suite", "env.out_of_domain_suite", "env.kind"))
        or k == "project.success_threshold"
        for k in got
    )


def test_fingerprint_tracks_content_and_names_but_not_bytecode(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.py").write_text("x = 1\n")
    f0 = fingerprint(["d"], tmp_path)
    (tmp_path / "d" / "__pycache__").mkdir()
    (tmp_path / "d" / "__pycache__" / "a.cpython-312.pyc").write_bytes(b"\0")
    (tmp_path / "d" / ".a.json.tmp").write_text("partial")
    assert fingerprint(["d"], tmp_path) == f0
    (tmp_path / "d" / "a.py").write_text("x = 2\n")
    f1 = fingerprint(["d"], tmp_path)
    assert f1 != f0
    (tmp_path / "d" / "a.py").rename(tmp_path / "d" / "b.py")
    assert fingerprint(["d"], tmp_path) not in (f0, f1)
    assert fingerprint(["missing"], tmp_path) != fingerprint(["missing2"], tmp_path)


def _fake_select_inputs(root: Path) -> None:
    for rel in SPECS["select"].deps:
        path = root / rel
        if rel.endswith((".py", ".json")):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"# {rel}\n")
        else:
            path.mkdir(parents=True, exist_ok=True)
            (path / "f.txt").write_text(rel)


def test_stage_key_changes_with_its_params_and_deps_only(tmp_path):
    _fake_select_inputs(tmp_path)
    spec = SPECS["select"]
    p = parse_params({})
    k0 = stage_key(p, spec, tmp_path)
    assert stage_key(parse_params({"env": {"n_envs": 3}}), spec, tmp_path) == k0
    assert stage_key(parse_params({"train": {"optimizer": {"lr": 0.5}}}), spec, tmp_path) == k0
    assert stage_key(parse_params({"select": {"min_successes": 2}}), spec, tmp_path) != k0
    (tmp_path / "arpo_core" / "algorithm" / "selection.py").write_text("# changed code\n")
    assert stage_key(p, spec, tmp_path) != k0


def _fake_select_outputs(root: Path, selected: str) -> None:
    """What a finished select stage leaves: its output and the two metrics files DVC tracks."""
    for rel in (SPECS["select"].metrics, details_path(SPECS["select"])):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("{}")
    (root / "data" / "selected_tasks.json").write_text(selected)


def test_stamp_up_to_date_until_params_inputs_or_outputs_change(tmp_path):
    _fake_select_inputs(tmp_path)
    spec, p = SPECS["select"], parse_params({})
    assert not is_up_to_date(p, spec, tmp_path)  # no stamp
    _fake_select_outputs(tmp_path, "{}")
    out = tmp_path / "data" / "selected_tasks.json"
    write_stamp(tmp_path, spec, stage_key(p, spec, tmp_path), {"mlflow_run_id": "r1"})
    assert read_stamp(tmp_path, "select")["mlflow_run_id"] == "r1"
    assert is_up_to_date(p, spec, tmp_path)
    assert not is_up_to_date(parse_params({"select": {"min_successes": 4}}), spec, tmp_path)
    out.write_text('{"other": 1}')  # e.g. `dvc checkout` of outputs this stamp never recorded
    assert not is_up_to_date(p, spec, tmp_path)
    out.write_text("{}")
    (tmp_path / details_path(spec)).unlink()  # a file DVC tracks is missing: DVC could not record it
    assert not is_up_to_date(p, spec, tmp_path)
    _fake_select_outputs(tmp_path, "{}")
    assert is_up_to_date(p, spec, tmp_path)
    out.unlink()
    assert not is_up_to_date(p, spec, tmp_path)


def test_outputs_brought_back_with_their_params_are_up_to_date_again(tmp_path):
    """`dvc exp apply` / `dvc checkout` of an earlier experiment restores its params and outputs; the
    stamp remembers earlier (key, outputs) pairs, so neither front door re-runs the stage then (spec.py,
    decision "Stamps"), and the MLflow run it names is that experiment's. A pair is remembered once."""
    _fake_select_inputs(tmp_path)
    spec = SPECS["select"]
    p1, p2 = parse_params({}), parse_params({"select": {"min_successes": 4}})
    _fake_select_outputs(tmp_path, '{"kept": 1}')
    write_stamp(tmp_path, spec, stage_key(p1, spec, tmp_path), {"mlflow_run_id": "r1"})
    _fake_select_outputs(tmp_path, '{"kept": 2}')
    write_stamp(tmp_path, spec, stage_key(p2, spec, tmp_path), {"mlflow_run_id": "r2"})
    assert is_up_to_date(p2, spec, tmp_path) and not is_up_to_date(p1, spec, tmp_path)
    _fake_select_outputs(tmp_path, '{"kept": 1}')  # the first experiment checked out again
    assert is_up_to_date(p1, spec, tmp_path) and not is_up_to_date(p2, spec, tmp_path)
    assert matching_stamp(p1, spec, tmp_path)["mlflow_run_id"] == "r1"
    write_stamp(tmp_path, spec, stage_key(p1, spec, tmp_path), {"mlflow_run_id": "r3"})  # re-run, same result
    stamp = read_stamp(tmp_path, "select")
    assert stamp["mlflow_run_id"] == "r3" and [e["mlflow_run_id"] for e in stamp["history"]] == ["r2"]
    for k in range(STAMP_HISTORY + 5):  # bounded
        write_stamp(tmp_path, spec, f"key{k}")
    assert len(read_stamp(tmp_path, "select")["history"]) == STAMP_HISTORY


@pytest.mark.parametrize(
    ("preset", "overrides", "exp", "want"),
    [
        (None, None, None, "default"),
        ("quick", [], None, "quick"),
        ("presets/grpo.yaml", ["train.optimizer.lr=0.001"], None, "grpo | train.optimizer.lr=0.001"),
        ("quick", ["train.replay.enabled=false"], None, "quick | train.replay.enabled=false"),
        (None, None, "puffy-walk", "dvc-exp:puffy-walk"),
    ],
)
def test_variant_name(preset, overrides, exp, want):
    assert variant_name(preset, overrides, exp) == want


def test_epoch_plot_has_one_row_per_epoch(tmp_path):
    path = tmp_path / "plots" / "train_epochs.csv"
    write_epoch_plot([{"epoch": 1, "rollout/success_rate": 0.25}, {"epoch": 2, "loss/policy": -0.5}], path)
    lines = path.read_text().splitlines()
    assert lines[0].split(",") == list(PLOT_COLUMNS)
    assert lines[1].split(",")[:2] == ["1", "0.25"]
    assert lines[2].split(",")[0] == "2" and lines[2].split(",")[PLOT_COLUMNS.index("loss/policy")] == "-0.5"


def test_prefect_yaml_deployments_use_existing_presets_and_the_pipeline_flow():
    cfg = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    names = {d["name"] for d in cfg["deployments"]}
    assert {"arpo-train", "quick", "grpo", "no-selection"} <= names
    for d in cfg["deployments"]:
        assert d["entrypoint"] == "flows/arpo_train.py:arpo_train"
        assert d["work_pool"]["name"] == "arpo-local"
        params = d["parameters"]
        load_params(ROOT / params["params"], preset=params.get("preset"))  # every preset parses
    assert load_params(ROOT / "params.yaml", preset="grpo").train.replay.enabled is False
    assert load_params(ROOT / "params.yaml", preset="no-selection").train.use_selection is False


def test_arpo_train_flow_is_named_for_the_deployments():
    from flows.arpo_train import FLOWS, arpo_train

    assert arpo_train.name == "arpo-train"
    assert {name: f.name for name, f in FLOWS.items()} == {n: n for n in STAGE_NAMES}


def test_upstream_is_what_dvc_repro_of_the_target_runs():
    """`arpo run --target X` runs X and the stages it needs: the producers of its inputs, recursively,
    the same set as dvc.yaml's graph (a stage's deps that are another stage's outs)."""
    from arpo_core.pipeline.table import upstream

    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    producer = {next(iter(out)): name for name, st in stages.items() for out in st.get("outs", [])}

    def ancestors(name):
        found = {name}
        for dep in stages[name]["deps"]:
            if dep in producer:
                found |= ancestors(producer[dep])
        return found

    for name in STAGE_NAMES:
        got = upstream([name])
        assert set(got) == ancestors(name), name
        assert list(got) == [n for n in STAGE_NAMES if n in got]  # pipeline order
    assert upstream(["select"]) == ("init_policy", "ground", "demos", "sft", "baseline", "select")
    assert "rft" not in upstream(["evaluate"]) and "compare" not in upstream(["evaluate"])
    assert upstream(["train", "select"]) == upstream(["train"])
    with pytest.raises(KeyError, match="unknown stage 'evaluat'; stages: init_policy"):
        upstream(["evaluat"])


def test_arpo_train_targets_run_only_the_needed_stages(monkeypatch):
    """The flow with `targets` calls exactly the upstream stages, in order, and skips none silently."""
    import flows.arpo_train as at

    called = []
    monkeypatch.setattr(at, "FLOWS", {n: (lambda n=n, **kw: called.append(n) or {}) for n in STAGE_NAMES})
    monkeypatch.setattr(at, "is_up_to_date", lambda *a, **k: False)
    monkeypatch.setattr(at, "start_pipeline_run", lambda *a, **k: "parent")
    monkeypatch.setattr(at.mlflow_runs, "client", lambda *a, **k: None)
    monkeypatch.setattr(at.mlflow_runs, "finish_run", lambda *a, **k: None)
    at.arpo_train.fn(params=str(ROOT / "params.yaml"), preset="quick", targets=["baseline"])
    assert called == ["init_policy", "ground", "demos", "sft", "baseline"]
    called.clear()
    at.arpo_train.fn(params=str(ROOT / "params.yaml"), preset="quick")
    assert called == list(STAGE_NAMES)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the swallowed interrupt
def test_an_interrupt_the_interpreter_swallowed_stops_the_run_before_the_next_stage(monkeypatch):
    """arpo_train.py, decision "Ctrl-C never lost": a Ctrl-C raised inside a finalizer is dropped by CPython
    ('Exception ignored in ...'); the handler's record still stops the flow before the next stage."""
    import gc
    import signal
    import weakref

    import flows.arpo_train as at

    class Obj:
        pass

    def swallowed_ctrl_c(**kw):
        called.append("ground")
        ref = weakref.ref(Obj(), lambda _: at.on_interrupt(signal.SIGINT, None))  # noqa: F841
        gc.collect()  # the callback ran and its KeyboardInterrupt was ignored; we are still here

    called = []
    flows = {n: (lambda n=n, **kw: called.append(n) or {}) for n in STAGE_NAMES}
    flows["ground"] = lambda **kw: swallowed_ctrl_c(**kw) or {}
    monkeypatch.setattr(at, "FLOWS", flows)
    monkeypatch.setattr(at, "is_up_to_date", lambda *a, **k: False)
    monkeypatch.setattr(at, "start_pipeline_run", lambda *a, **k: "parent")
    monkeypatch.setattr(at.mlflow_runs, "client", lambda *a, **k: None)
    finished = []
    monkeypatch.setattr(at.mlflow_runs, "finish_run", lambda c, run, ok: finished.append(ok))
    at.INTERRUPTED.clear()
    try:
        with pytest.raises(KeyboardInterrupt, match="interrupted before stage demos"):
            at.arpo_train.fn(params=str(ROOT / "params.yaml"), preset="quick")
    finally:
        at.INTERRUPTED.clear()
    # mlflow_runs.py, decision "Never left running"
    assert called == ["init_policy", "ground"] and finished == ["KILLED"]


def test_arpo_run_names_an_unknown_target():
    from typer.testing import CliRunner

    from flows.cli import app

    res = CliRunner().invoke(app, ["run", "--params", str(ROOT / "params.yaml"), "--target", "evaluat"])
    assert res.exit_code != 0 and "unknown stage 'evaluat'" in res.output


def test_env_stages_and_only_those_are_retried():
    """stages.py, decision "Env-stage retries": retries exactly where the stage table says a stage runs
    envs."""
    from tasks.stages import TASKS

    for s in SPECS.values():
        assert (TASKS[s.name].retries > 0) == s.envs, s.name
    assert SPECS["train"].envs and not SPECS["sft"].envs


# ------------------------------------------------------------------------------------------------
# One tracked stage, in process, outside Prefect (what `arpo stage` / DVC do)


def test_stage_run_tracks_metrics_params_artifacts_and_stamp(tmp_path, monkeypatch, one_thread):
    monkeypatch.chdir(oh.copy_project(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    stale = tmp_path / "models" / "init" / "stale.bin"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"from another configuration")
    from flows.stage_flows import FLOWS

    metrics = FLOWS["init_policy"].fn(
        preset="quick", pipeline_id="pipe-1"
    )  # the flow body, no Prefect server
    assert metrics["init_policy/parameters"] > 0 and metrics["time/init_policy_s"] > 0
    # outputs of another configuration are removed first (runner.py, decision "Staged outputs")
    assert not stale.exists()
    summary = json.loads((tmp_path / "metrics" / "init_policy.json").read_text())
    details = json.loads((tmp_path / "metrics" / "details" / "init_policy.json").read_text())
    assert summary == {"init_policy/parameters": metrics["init_policy/parameters"]}
    # the rest in the details file (spec.py, decision "Short metrics files")
    assert summary | details == metrics
    stamp = read_stamp(Path("."), "init_policy")
    p = load_params("params.yaml", preset="quick")
    assert is_up_to_date(p, SPECS["init_policy"], Path("."))
    assert not Path(".arpo/stamps/init_policy.running").exists()

    c = mlflow_runs.client(".")
    (row,) = mlflow_runs.run_rows(c, "arpo-embedded", "init_policy")
    run = c.get_run(row["run"])
    assert run.info.run_id == stamp["mlflow_run_id"] and run.info.status == "FINISHED"
    assert run.data.tags["arpo.variant"] == "quick" and run.data.tags["arpo.pipeline_id"] == "pipe-1"
    assert run.data.tags["arpo.key"] == stamp["key"]
    assert run.data.params["init_policy.size"] == "xs"
    assert run.data.metrics["init_policy/parameters"] == metrics["init_policy/parameters"]
    arts = {a.path for a in c.list_artifacts(run.info.run_id)}
    # the policy is a logged model, not a plain artifact (runner.py, decision "What a run logs")
    assert arts == {"metrics"}
    (model_out,) = run.outputs.model_outputs
    assert stamp["mlflow_model_ids"] == {"init_policy": model_out.model_id}
    model = c.get_logged_model(model_out.model_id)
    assert model.source_run_id == run.info.run_id and model.name == "init_policy"
    assert {m.key for m in model.metrics} >= {"init_policy/parameters"}  # linked to the run's metrics
    assert model.params["init_policy.size"] == "xs"
    exp = c.get_experiment_by_name("arpo-embedded")
    assert exp.artifact_location == (tmp_path / "mlruns" / "arpo-embedded").resolve().as_uri()
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # not the GenAI overview

    # `arpo stage` (every DVC stage's cmd) asks the same stamp as `arpo run` (spec.py,
    # decision "One staleness authority"): up to date, it runs nothing and opens no MLflow run; --force runs
    # it
    from typer.testing import CliRunner

    from flows.cli import app

    res = CliRunner().invoke(app, ["stage", "init_policy", "--preset", "quick"])
    assert res.exit_code == 0 and "init_policy: up to date, skipped" in res.output, res.output
    assert len(mlflow_runs.run_rows(c, "arpo-embedded", "init_policy")) == 1
    assert read_stamp(Path("."), "init_policy") == stamp
    res = CliRunner().invoke(app, ["stage", "init_policy", "--preset", "quick", "--force"])
    assert res.exit_code == 0 and "init_policy/parameters" in res.output, res.output
    assert len(mlflow_runs.run_rows(c, "arpo-embedded", "init_policy")) == 2


def test_logged_policy_model_loads_back_and_answers(tmp_path, monkeypatch, one_thread):
    """The MLflow model of a policy loads with mlflow.pyfunc and turns (instruction, screenshot) into
    a UI-TARS reply (tracking/policy_model.py)."""
    import io

    import mlflow
    import pandas as pd
    from PIL import Image

    from tracking.policy_model import log_policy_model

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    c = mlflow_runs.client(".")
    run_id = mlflow_runs.start_run(c, mlflow_runs.ensure_experiment(c, "e", "."), "sft")
    mlflow_runs.log_metrics(c, run_id, {"sft/loss_last": 0.5})
    config = {"system_prompt": "compact", "history_images": None, "max_new_tokens": 12}
    model_id = log_policy_model(
        mlflow_runs.tracking_uri("."), run_id, ROOT / "assets/checkpoints/grounded-xs", "base", config
    )
    # MLflow's set_tracking_uri exports MLFLOW_TRACKING_URI: it must not outlive the call (it sent the
    # later tests' clients, and the stage processes' children, to this store)
    assert "MLFLOW_TRACKING_URI" not in os.environ
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_runs.tracking_uri("."))  # for the lookup by model id
    model = mlflow.pyfunc.load_model(f"models:/{model_id}")
    png = io.BytesIO()
    Image.new("RGB", (160, 210), "white").save(png, format="PNG")
    (reply,) = model.predict(pd.DataFrame({"instruction": ["Click OK"], "screenshot": [png.getvalue()]}))
    assert isinstance(reply, str) and reply
    logged = c.get_logged_model(model_id)
    assert [m.key for m in logged.metrics] == ["sft/loss_last"]
    assert logged.experiment_id == c.get_run(run_id).info.experiment_id  # in the run's experiment
    assert [m.model_id for m in c.search_logged_models([logged.experiment_id])] == [model_id]


def test_effective_params_carry_the_upstream_stages(tmp_path):
    """ARPO's and GRPO's evaluate runs differ in params (spec.py, decision "Effective params"): the evaluate
    stage's effective params include train's, its own `method`, and every upstream stage's sections."""
    from flows.spec import effective_params, upstream

    assert [s.name for s in upstream(SPECS["evaluate"])] == [
        "init_policy", "ground", "demos", "sft", "baseline", "select", "train",
    ]  # fmt: skip
    assert upstream(SPECS["init_policy"]) == ()
    assert "train" not in [s.name for s in upstream(SPECS["rft"])]
    arpo = load_params(ROOT / "params.yaml", preset="quick")
    grpo = load_params(ROOT / "params.yaml", ["train.replay.enabled=false"], preset="quick")
    from arpo_core.pipeline.evaluate import tracked_params

    a, g = (effective_params(q, SPECS["evaluate"]) | tracked_params(q) for q in (arpo, grpo))
    diff = {k for k in a.keys() | g.keys() if a.get(k) != g.get(k)}
    assert diff == {"train.replay.enabled", "method"}
    assert (a["method"], g["method"]) == ("arpo", "grpo")
    assert "sft.optimizer.lr" in a and "init_policy.size" in a and "select.min_successes" in a
    assert effective_params(arpo, SPECS["rft"])["method"] == "rft"


def test_metrics_split_into_summary_and_details():
    from flows.spec import split_metrics

    summary, details = split_metrics(
        {
            "eval/trained/greedy/in_domain/success_rate": 0.5,
            "eval/trained/greedy/in_domain/success_ci_low": 0.25,
            "eval/trained/greedy/all/success_rate": 0.5,
            "eval/trained/greedy/task/miniwob/click-button/success_rate": 1.0,
            "eval/base/greedy/domain/miniwob/success_rate": 0.25,
            "eval/base/greedy/time/rollout_s": 9.0,
            "task/miniwob/click-button/episodes": 4.0,
            "rollout/success_rate": 0.5,
            "rollout/episodes": 16.0,
            "rollout/faults/timeouts": 0.0,
            "loss/policy": -0.1,
            "dpo/last/loss/dpo": 0.6,
            "ground/miniwob/hit_rate": 0.6,
            "ground/miniwob/corr_x": 0.1,
            "ground/miniwob/blind_hit_rate": 0.2,
            "compare/arpo/in_domain/delta_vs_base": 0.0,
            "compare/arpo/in_domain/success_rate": 0.5,
            "time/train_s": 3.0,
            "time/inference_s": 2.0,
        }
    )
    assert summary == {
        "eval/trained/greedy/in_domain/success_rate": 0.5,
        "rollout/success_rate": 0.5,
        "rollout/episodes": 16.0,
        "loss/policy": -0.1,
        "ground/miniwob/hit_rate": 0.6,
        "compare/arpo/in_domain/delta_vs_base": 0.0,
    }
    assert len(details) == 13


def test_prefect_artifact_tables_name_role_mode_split():
    from flows.runner import evaluation_rows, summary_markdown

    m = {
        "eval/trained/greedy/in_domain/success_rate": 0.5,
        "eval/trained/greedy/in_domain/success_ci_low": 0.25,
        "eval/trained/greedy/in_domain/success_ci_high": 0.75,
        "eval/trained/greedy/in_domain/episodes": 8.0,
        "eval/trained/greedy/task/miniwob/x/success_rate": 1.0,
    }
    assert evaluation_rows(m) == [
        {"policy": "trained", "mode": "greedy", "split": "in_domain", "success": 0.5, "ci95_low": 0.25,
         "ci95_high": 0.75, "episodes": 8},
    ]  # fmt: skip
    md = summary_markdown("evaluate", "quick | train.replay.enabled=false", {"a/b": 0.5}, "r1")
    assert md.startswith("# evaluate (quick | train.replay.enabled=false)") and "| `a/b` | 0.5 |" in md


def test_failed_stage_marks_run_failed_and_keeps_marker(tmp_path, monkeypatch):
    monkeypatch.chdir(oh.copy_project(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)

    def boom(*_, **__):
        raise RuntimeError("env died")

    oh.replace_stage_run(monkeypatch, "select", boom)
    with pytest.raises(RuntimeError, match="env died"):
        StageRun("select", preset="quick").execute()
    (row,) = mlflow_runs.run_rows(mlflow_runs.client("."), "arpo-embedded", "select")
    assert row["status"] == "FAILED"
    assert read_stamp(Path("."), "select") is None
    assert Path(".arpo/stamps/select.running").exists()  # a retry with the same key may resume


# ------------------------------------------------------------------------------------------------
# The deployment on a real Prefect server (slow)


def _dvc_dir_files(project: Path, out: str) -> dict[str, str]:
    """{relpath: md5} of a directory output recorded in dvc.lock, from DVC's cache manifest."""
    lock = yaml.safe_load((project / "dvc.lock").read_text())
    for stage in lock["stages"].values():
        for o in stage.get("outs", []):
            if o["path"] == out:
                md5 = o["md5"]
                manifest = project / ".dvc" / "cache" / "files" / "md5" / md5[:2] / md5[2:]
                return {e["relpath"]: e["md5"] for e in json.loads(manifest.read_text())}
    raise KeyError(out)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_quick_pipeline_through_a_prefect_deployment_then_dvc_on_the_same_outputs(tmp_path):
    """The deployment three times (the pipeline; again: nothing runs; the GRPO ablation: train, evaluate,
    compare), the MLflow runs and Prefect artifacts they made, then DVC on the outputs they left: it
    re-runs nothing (one staleness authority, spec.py, decision "One staleness authority"), records them, and
    an experiment re-runs the stages its param reaches. One pipeline run for all three front doors (issue 30
    item 6)."""
    project = oh.copy_project(tmp_path / "proj")
    (project / "scripts").mkdir()
    for name in ("prefect_env.sh", "prefect_server.sh", "prefect_worker.sh"):
        (project / "scripts" / name).write_bytes((ROOT / "scripts" / name).read_bytes())
        (project / "scripts" / name).chmod(0o755)
    port = oh.free_port()
    env = oh.base_env(project) | {"PYTHONPATH": str(project)}  # the copy's code runs, the code it hashes
    env.update(PREFECT_PORT=str(port), PREFECT_WORKER_QUERY_SECONDS="2")
    cli_env = {**env, "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}
    server = oh.start(["bash", "scripts/prefect_server.sh"], project, env, tmp_path / "server.log")
    worker = None
    try:
        oh.wait_http(f"http://127.0.0.1:{port}/api/health", 120, server, tmp_path / "server.log")
        # started with SIGINT ignored (as from nohup or a supervisor): one Ctrl-C must still stop it
        worker = oh.start(
            ["bash", "scripts/prefect_worker.sh"], project, env, tmp_path / "worker.log", sigint_ignored=True
        )
        deadline = time.monotonic() + 60
        while "Worker" not in (tmp_path / "worker.log").read_text() and time.monotonic() < deadline:
            assert worker.poll() is None, (tmp_path / "worker.log").read_text()
            time.sleep(1)
        out = oh.run(["prefect", "--no-prompt", "deploy", "--all"], project, cli_env, timeout=180)
        assert out.returncode == 0, out.stdout + out.stderr
        t0 = time.monotonic()
        out = oh.run(
            ["prefect", "deployment", "run", "arpo-train/quick", "--watch", "--watch-timeout", "600"],
            project,
            cli_env,
            timeout=660,
        )
        run_s = time.monotonic() - t0
        log = (tmp_path / "worker.log").read_text()
        assert out.returncode == 0 and "Completed" in out.stdout, out.stdout + out.stderr + log[-5000:]
        print(f"arpo-train/quick deployment run: {run_s:.0f} s")
        # A second run finds every stage up to date and runs none (flows/spec.py).
        again = oh.run(
            ["prefect", "deployment", "run", "arpo-train/quick", "--watch", "--watch-timeout", "300"],
            project,
            cli_env,
            timeout=360,
        )
        assert again.returncode == 0 and "Completed" in again.stdout, again.stdout + again.stderr
        log2 = (tmp_path / "worker.log").read_text()[len(log) :]
        # The GRPO ablation of the same preset: train, evaluate and compare re-run.
        grpo = oh.run(
            ["prefect", "deployment", "run", "arpo-train/quick", "--watch", "--watch-timeout", "600",
             "--param", 'overrides=["train.replay.enabled=false"]'],
            project,
            cli_env,
            timeout=660,
        )  # fmt: skip
        assert grpo.returncode == 0 and "Completed" in grpo.stdout, grpo.stdout + grpo.stderr
        # Prefect: flow runs named by variant, each stage's artifacts (runner.py,
        # decision "Prefect artifacts")
        wide = {**cli_env, "COLUMNS": "400"}  # rich tables would cut the names
        flow_runs = oh.run(["prefect", "flow-run", "ls", "--limit", "60"], project, wide, timeout=120)
        artifacts = oh.run(["prefect", "artifact", "ls"], project, wide, timeout=120)
        # one Ctrl-C (SIGINT to the script's process group, as a terminal sends it) stops the worker
        os.killpg(worker.pid, signal.SIGINT)
        worker.wait(timeout=40)
        assert "worker stopped" in (tmp_path / "worker.log").read_text()[-2000:]
    finally:
        if worker is not None:
            oh.stop(worker)
        oh.stop(server)
    assert server.poll() is not None and (worker is None or worker.poll() is not None)
    for name in STAGE_NAMES:
        assert f"{name}: done in" in log, log[-3000:]
        assert f"{name}: up to date, skipped" in log2, log2[-3000:]
    assert "done in" not in log2

    assert "quick | train.replay.enabled=false" in flow_runs.stdout, flow_runs.stdout[-3000:]
    assert "evaluate | quick" in flow_runs.stdout, flow_runs.stdout[-3000:]
    for key in ("evaluate-evaluation", "evaluate-summary", "train-summary", "init-policy-summary"):
        assert key in artifacts.stdout, artifacts.stdout[-3000:]

    # MLflow: three pipeline runs named by variant; the first one's stage runs nested under it, one
    # finished run per stage, sharing the pipeline id (the flow run id).
    c = mlflow_runs.client(project)
    parents = mlflow_runs.run_rows(c, "arpo-embedded", "pipeline")  # newest first
    assert [c.get_run(r["run"]).info.run_name for r in parents] == [
        "quick | train.replay.enabled=false · deployment arpo-train/quick",
        "quick · deployment arpo-train/quick",
        "quick · deployment arpo-train/quick",
    ]  # fmt: skip  (runner.py, decision "Front door tag": the front door in the name)
    first = parents[-1]["run"]
    rows = [r for r in mlflow_runs.run_rows(c, "arpo-embedded") if r["parent"] == first]
    assert sorted(r["stage"] for r in rows) == sorted(STAGE_NAMES)
    assert {r["status"] for r in rows} == {"FINISHED"} and {r["variant"] for r in rows} == {"quick"}
    runs = {r["stage"]: c.get_run(r["run"]) for r in rows}
    assert len({r.data.tags["arpo.pipeline_id"] for r in runs.values()}) == 1
    train = runs["train"]
    assert train.data.params["train.replay.enabled"] == "True" and train.data.params["method"] == "arpo"
    assert "iter/rollout/success_rate" in train.data.metrics and "rollout/success_rate" in train.data.metrics
    assert {a.path for a in c.list_artifacts(train.info.run_id)} >= {"trajectories", "checkpoint"}
    (model_out,) = train.outputs.model_outputs  # the trained policy as an MLflow model
    assert c.get_logged_model(model_out.model_id).name == "arpo"
    assert "eval/trained/greedy/in_domain/success_rate" in runs["evaluate"].data.metrics
    # ARPO's and GRPO's evaluate runs differ in params (upstream train.replay.enabled, method)
    grpo_rows = [r for r in mlflow_runs.run_rows(c, "arpo-embedded") if r["parent"] == parents[0]["run"]]
    assert sorted(r["stage"] for r in grpo_rows) == ["compare", "evaluate", "train"]
    evals = [r for r in mlflow_runs.run_rows(c, "arpo-embedded", "evaluate")]
    assert len(evals) == 2
    diff = {k for k in evals[0]["params"] if evals[0]["params"][k] != evals[1]["params"].get(k)}
    assert diff == {"train.replay.enabled", "method"}
    assert {r["params"]["method"] for r in evals} == {"arpo", "grpo"}
    linked = c.get_logged_model(model_out.model_id).metrics
    assert any(m.key.startswith("eval/trained/") for m in linked)  # evaluations linked to the model
    exp_id = c.get_experiment_by_name("arpo-embedded").experiment_id
    models = c.search_logged_models([exp_id])
    assert {"arpo", "grpo", "sft"} <= {m.name for m in models}  # the experiment's "Logged models"
    print(f"MLflow: {len(parents)} pipeline runs, {len(rows)} nested stage runs in the first, "
          f"{len(models)} logged models ({sorted(m.name for m in models)}); evaluate params differ in {sorted(diff)}")  # fmt: skip
    # The trajectory viewer (issue 8): one page per evaluated policy, logged to the evaluate run.
    assert {a.path for a in c.list_artifacts(runs["evaluate"].info.run_id, "viewer")} == {
        "viewer/base.html",
        "viewer/arpo.html",
    }
    assert "viewer" in {a.path for a in c.list_artifacts(train.info.run_id)}

    # Outputs at the dvc.yaml paths; Parquet row counts as the quick preset implies.
    demos = pq.read_table(project / "data" / "demos" / "demos.parquet")
    assert demos.num_rows > 0 and "screenshot_png" in demos.column_names
    assert pq.read_table(project / "data" / "baseline" / "in_domain.parquet").num_rows >= 4  # 2 tasks x 2
    assert list((project / "models" / "arpo" / "trajectories").glob("*.parquet"))
    # the last variant's outputs are on disk (the GRPO run's), with no page or file of ARPO's left
    assert {p.name for p in (project / "data" / "eval").glob("*.parquet")} == {"base.parquet", "grpo.parquet"}
    assert {p.name for p in (project / "plots" / "viewer" / "evaluate").iterdir()} == {
        "base.html",
        "grpo.html",
    }

    # DVC on the same outputs (issue 30 item 6: one quick pipeline run serves the Prefect, MLflow and DVC
    # checks). params.yaml := the variant on disk (the quick preset, GRPO): `dvc repro` calls every
    # stage's `arpo stage`, each finds its stamp current and only says so (spec.py,
    # decision "One staleness authority"), and DVC records the outputs as they are in dvc.lock; again, nothing
    # to do.
    denv = oh.base_env(project) | {"PYTHONPATH": str(project)}
    grpo_params = oh.run(
        ["arpo", "params", "--preset", "quick", "-S", "train.replay.enabled=false"], project, denv, 120
    )
    (project / "params.yaml").write_text(grpo_params.stdout)
    oh.git(project, "init", "-q")
    oh.git(project, "add", "-A")
    oh.git(project, "commit", "-qm", "quick, GRPO")
    first = oh.run(["dvc", "repro"], project, denv, timeout=600)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    for name in STAGE_NAMES:
        assert f"Running stage '{name}'" in first.stdout and f"{name}: up to date, skipped" in first.stdout
    assert len(mlflow_runs.run_rows(c, "arpo-embedded", "train")) == 2  # DVC ran no stage again
    lock = (project / "dvc.lock").read_text()
    again = oh.run(["dvc", "repro"], project, denv, timeout=300)
    assert again.returncode == 0 and "Running stage" not in again.stdout, again.stdout + again.stderr
    assert "Data and pipelines are up to date." in again.stdout
    assert (project / "dvc.lock").read_text() == lock
    metrics = json.loads((project / "metrics" / "evaluate.json").read_text())
    assert "eval/trained/greedy/in_domain/success_rate" in metrics
    assert not any("/task/" in k for k in metrics)  # breakdowns are in metrics/details/
    shown = oh.run(["dvc", "metrics", "show"], project, denv, 120)
    assert shown.returncode == 0 and "/task/" not in shown.stdout, shown.stdout + shown.stderr
    print(f"dvc metrics show: {len(shown.stdout.splitlines())} lines")
    plots = oh.run(["dvc", "plots", "show", "-o", "dvc_plots"], project, denv, 120)
    assert plots.returncode == 0, plots.stdout + plots.stderr
    page = (project / "dvc_plots" / "index.html").read_text()
    assert "<script src" not in page and "cdn." not in page and page.count("<img") == 2, page[:2000]
    # the Parquet files are in DVC's cache and, after `dvc push`, in the local remote
    out = oh.run(["dvc", "push"], project, denv, 300)
    assert out.returncode == 0, out.stdout + out.stderr
    out = oh.run(["dvc", "status"], project, denv, 120)
    assert "up to date" in out.stdout, out.stdout + out.stderr
    files = _dvc_dir_files(project, "data/demos")
    md5 = files["demos.parquet"]
    assert (project / "dvc-remote" / "files" / "md5" / md5[:2] / md5[2:]).exists()
    assert any(
        k.startswith("trajectories/") and k.endswith(".parquet")
        for k in _dvc_dir_files(project, "models/arpo")
    )

    # A DVC experiment: another training seed; only the stages reading train.* run (the offline
    # baselines do not), tracked in MLflow with the experiment's name.
    oh.git(project, "add", "-A")
    oh.git(project, "commit", "-qm", "lock")
    exp = oh.run(["dvc", "exp", "run", "-S", "train.seed=1"], project, denv, timeout=600)
    assert exp.returncode == 0, exp.stdout[-4000:] + exp.stderr[-4000:]
    for name in ("train", "evaluate", "compare"):
        assert f"Running stage '{name}'" in exp.stdout and f"{name}: up to date" not in exp.stdout
    assert "Running stage 'sft'" not in exp.stdout and "Running stage 'rft'" not in exp.stdout
    shown = oh.run(["dvc", "exp", "show", "--json"], project, denv, timeout=120)
    assert '"seed": 1' in shown.stdout or "train.seed" in shown.stdout, shown.stdout[-2000:]
    # the documented view (docs/orchestration.md): only what differs, every column shown in a wide
    # terminal (the changed param, the evaluation's and compare's changed metrics, the changed outputs;
    # measured: a header of about 500 characters) instead of 300+ metric columns cut to '…'
    table = oh.run(
        ["dvc", "exp", "show", "--only-changed", "--no-pager"], project, {**denv, "COLUMNS": "1000"}, 120
    )
    assert table.returncode == 0, table.stderr
    print(table.stdout)
    header = next(line for line in table.stdout.splitlines() if "Experiment" in line)
    assert "train.seed" in header and "…" not in header, table.stdout
    trains = [c.get_run(r["run"]).data for r in mlflow_runs.run_rows(c, "arpo-embedded", "train")]
    assert len(trains) == 3 and sum("dvc.exp_name" in t.tags for t in trains) == 1
    exp_train = next(t for t in trains if "dvc.exp_name" in t.tags)
    assert exp_train.params["train.seed"] == "1" and exp_train.params["method"] == "grpo"
    assert exp_train.tags["arpo.front_door"] == "dvc exp"


def test_stage_runs_name_their_arm_and_lead_with_their_headline(tmp_path, monkeypatch):
    """runner.py, decision "Headline metric first" (issue 32 item 3): `evaluate · grpo` / `compare · grpo` in
    MLflow and in `arpo runs`, each run's first metric in sort order (what MLflow's compare page plots first)
    its headline: the trained policy's success for evaluate, the paired delta for compare."""
    from typer.testing import CliRunner

    from flows.cli import app

    monkeypatch.chdir(oh.copy_project(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    fake = {
        "evaluate": {
            "eval/base/greedy/all/click_spread_px": 12.0,  # what the compare page opened on before
            "eval/base/greedy/in_domain/success_rate": 0.5,
            "eval/trained/greedy/in_domain/success_rate": 0.625,
        },
        "compare": {
            "compare/base/in_domain/success_rate": 0.5,
            "compare/grpo/in_domain/delta_vs_base": 0.125,
            "compare/rft/in_domain/delta_vs_base": -0.25,
        },
    }
    for stage, metrics in fake.items():
        oh.replace_stage_run(monkeypatch, stage, lambda *_, m=metrics, **__: dict(m))
        StageRun(stage, preset="quick", overrides=["train.replay.enabled=false"]).execute()
    c = mlflow_runs.client(".")
    want = {"evaluate": ("_success_rate", 0.625), "compare": ("_delta_vs_base", 0.125)}
    for stage, (key, value) in want.items():
        (row,) = mlflow_runs.run_rows(c, "arpo-embedded", stage)
        run = c.get_run(row["run"])
        assert run.info.run_name == f"{stage} · grpo" and run.data.params["method"] == "grpo"
        assert sorted(run.data.metrics)[0] == key and run.data.metrics[key] == value
        assert json.loads(Path(f"metrics/{stage}.json").read_text())[key] == value  # DVC's too
    res = CliRunner().invoke(app, ["runs", "-e", "arpo-embedded"])
    assert res.exit_code == 0, res.output
    head, _, *lines = res.output.splitlines()
    assert head.split()[:2] == ["run", "name"] and "_success" in head and "_delta_vs_base" in head
    assert any("evaluate · grpo" in line and "0.625" in line for line in lines), res.output
    assert any("compare · grpo" in line and "0.125" in line for line in lines), res.output
