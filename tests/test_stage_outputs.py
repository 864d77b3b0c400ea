"""A stage's previous outputs are replaced only when it succeeds (issue 34 item 4, flows/runner.py,
decision "Staged outputs"): outputs are written to a staging path beside the old ones and swapped in at the
end; a failed attempt leaves the old outputs and their stamp byte-identical, a retry with the same key resumes
from what it staged, another key starts over; an interrupted swap is repaired. Errors a retry cannot fix
(disk full, a truncated input) are not retried by Prefect (tasks/stages.py,
decision "Non-retryable errors")."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import orchestration_helpers as oh

from arpo_core.infra.errors import InputError, NotRetryable, retryable
from arpo_core.infra.fileio import OutputError
from flows.runner import StageRun, commit_outputs, previous_path, recover_outputs, staging_path
from flows.spec import SPECS, is_up_to_date, read_stamp


def snapshot(path: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under `path`."""
    return {
        f.relative_to(path).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(path.rglob("*"))
        if f.is_file()
    }


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(oh.copy_project(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


def test_a_failed_stage_leaves_its_previous_outputs_and_stamp_as_they_were(project, monkeypatch):
    """Before: the outputs of the previous configuration were deleted before the stage ran, so a failure
    (here disk full half-way through writing the weights) left nothing, or half a policy."""
    from arpo_core.config import load_params

    def write(version: str, fail: bool = False):
        def run(p, out_dir):
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            (Path(out_dir) / "weights.bin").write_text(f"{version} " * (2 if fail else 1000))
            if fail:
                raise OSError(errno.ENOSPC, "No space left on device")
            (Path(out_dir) / "vocab.txt").write_text(version)
            return {"init_policy/parameters": 1.0}

        oh.replace_stage_run(monkeypatch, "init_policy", run)

    write("v1")
    StageRun("init_policy", preset="quick").execute()
    out = Path("models/init")
    before, stamp = snapshot(out), read_stamp(Path("."), "init_policy")
    assert sorted(before) == ["vocab.txt", "weights.bin"]

    write("v2", fail=True)
    with pytest.raises(OSError, match="No space left"):
        StageRun("init_policy", preset="quick", overrides=["init_policy.seed=5"]).execute()
    assert snapshot(out) == before and read_stamp(Path("."), "init_policy") == stamp
    assert is_up_to_date(load_params("params.yaml", preset="quick"), SPECS["init_policy"], Path("."))
    assert (staging_path(out) / "weights.bin").read_text() == "v2 v2 "  # beside the old output, not over it

    write("v3")
    StageRun("init_policy", preset="quick", overrides=["init_policy.seed=5"]).execute()
    assert (out / "vocab.txt").read_text() == "v3" and sorted(snapshot(out)) == ["vocab.txt", "weights.bin"]
    assert not staging_path(out).exists() and not previous_path(out).exists()


def test_a_retry_with_the_same_key_resumes_from_its_staged_outputs_another_key_starts_over(
    project, monkeypatch
):
    """What keeps train's resume working: its checkpoints live in the staging directory while it runs."""

    seen: list[tuple[str, list[str]]] = []

    def attempt(p, out_dir):
        out_dir = Path(out_dir)
        seen.append((out_dir.name, sorted(x.name for x in out_dir.glob("*"))))
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"part{len(seen)}").write_text("x")
        if len(seen) in (1, 3):
            raise RuntimeError("killed")
        return {"init_policy/parameters": 1.0}

    oh.replace_stage_run(monkeypatch, "init_policy", attempt)
    with pytest.raises(RuntimeError):
        StageRun("init_policy", preset="quick").execute()
    StageRun("init_policy", preset="quick").execute()  # same key: sees part1
    assert sorted(p.name for p in Path("models/init").iterdir()) == ["part1", "part2"]
    with pytest.raises(RuntimeError):
        StageRun("init_policy", preset="quick", overrides=["init_policy.seed=9"]).execute()
    assert seen[0] == (".init.staging", [])
    assert seen[1] == (".init.staging", ["part1"])  # resumed from what the failed attempt staged
    assert seen[2] == (".init.staging", [])  # another key: an empty staging area
    assert sorted(p.name for p in Path("models/init").iterdir()) == ["part1", "part2"]  # untouched


def test_another_configuration_sets_an_interrupted_attempts_staged_outputs_aside(
    project, monkeypatch, capsys
):
    """flows/runner.py, decision "Set aside, not deleted": before, a changed param or code file deleted an
    interrupted attempt's staging area without a word (a grounding run's hours of checkpoints). Now it is
    moved beside it and the stage names what differs; the same configuration still resumes from it."""
    from arpo_core.config import load_params
    from flows.runner import read_marker, set_aside_path

    def attempt(p, out_dir):  # stages a part, then is killed
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"part-{p.init_policy.seed}-{len(list(out_dir.iterdir()))}").write_text("x" * 3000)
        raise RuntimeError("killed")

    def run(*overrides):
        with pytest.raises(RuntimeError, match="killed"):
            StageRun("init_policy", preset="quick", overrides=list(overrides)).execute()
        return capsys.readouterr().out

    oh.replace_stage_run(monkeypatch, "init_policy", attempt)
    dep = Path("data/extra.txt")  # the stand-in run's code is not in the project: a data file in its place
    dep.write_text("one")
    monkeypatch.setitem(
        SPECS, "init_policy", dataclasses.replace(SPECS["init_policy"], data=(dep.as_posix(),))
    )
    seed = load_params("params.yaml", preset="quick").init_policy.seed
    out = Path("models/init")
    staged, aside = staging_path(out), set_aside_path(out)
    assert "set aside" not in run()
    assert "set aside" not in run()  # the same configuration resumes: a second part beside the first
    assert sorted(p.name for p in staged.iterdir()) == [f"part-{seed}-0", f"part-{seed}-1"]
    marker = read_marker(Path(".arpo/stamps/init_policy.running"))
    assert marker is not None and marker["params"]["init_policy.seed"] == seed and marker["files"]

    said = run("init_policy.seed=9")  # other params
    assert sorted(p.name for p in aside.iterdir()) == [f"part-{seed}-0", f"part-{seed}-1"]
    assert sorted(p.name for p in staged.iterdir()) == ["part-9-0"]
    assert (
        "[init_policy] an interrupted attempt's staged outputs were made with other params init_policy.seed"
        in said
    )
    assert (
        "files" not in said
        and "replaced" not in said
        and "0 MB" in said
        and "models/.init.set-aside (back to models/.init.staging" in said
    )

    dep.write_text("two")
    said = run("init_policy.seed=9")  # the same params, another file
    assert "made with other files data/extra.txt" in said and "params" not in said, said
    assert said.rstrip().endswith("(this replaced an older set-aside of init)")
    assert sorted(p.name for p in aside.iterdir()) == ["part-9-0"]  # the newer set-aside replaced the older
    assert sorted(p.name for p in staged.iterdir()) == ["part-9-0"]

    Path(".arpo/stamps/init_policy.running").write_text("an-old-key")  # a marker from before it held more
    said = run()
    assert "made by an attempt whose configuration was not recorded" in said


def test_an_interrupted_swap_is_repaired_and_outputs_are_committed_by_rename(tmp_path):
    # killed between the two renames: the previous output is put back, the staged one kept for a resume
    out = tmp_path / "models" / "grounded"
    previous_path(out).mkdir(parents=True)
    (previous_path(out) / "w").write_text("old")
    staging_path(out).mkdir()
    (staging_path(out) / "w").write_text("new")
    recover_outputs([out])
    assert (out / "w").read_text() == "old" and (staging_path(out) / "w").read_text() == "new"
    # killed after both renames: the previous one is deleted
    previous_path(out).mkdir()
    recover_outputs([out])
    assert not previous_path(out).exists() and (out / "w").read_text() == "old"
    inode = (staging_path(out) / "w").stat().st_ino
    sel = tmp_path / "data" / "selected_tasks.json"
    sel.parent.mkdir()
    sel.write_text("old")
    staging_path(sel).write_text("new")
    gone = tmp_path / "data" / "eval_rft"
    gone.mkdir()
    commit_outputs([out, sel, gone])
    assert (out / "w").read_text() == "new" and (out / "w").stat().st_ino == inode  # moved, not copied
    assert sel.read_text() == "new" and not gone.exists()  # written nothing this time: removed
    assert sorted(p.name for p in tmp_path.rglob(".*")) == []


def _truncated_parquet(path: Path) -> None:
    from arpo_core.trajectory import Step, Trajectory, write_trajectories

    step = Step(step_idx=0, screenshot_png=b"png" * 100, screen_w=160, screen_h=210, response_text="r")
    write_trajectories(path, [Trajectory("r", "baseline", 0, "miniwob", "click-test", "i", [step])])
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_a_truncated_input_fails_naming_it_and_leaves_the_outputs(project):
    """Issue 34's case: a truncated baseline Parquet made `arpo stage rft` delete models/rft and
    data/eval_rft, then fail with pyarrow's error naming no file."""
    baseline = Path("data/baseline/in_domain.parquet")
    _truncated_parquet(baseline)
    for rel in ("models/rft/config.json", "data/eval_rft/rft.parquet"):
        Path(rel).parent.mkdir(parents=True, exist_ok=True)
        Path(rel).write_text(f"previous {rel}")
    before = {rel: snapshot(Path(rel)) for rel in ("models/rft", "data/eval_rft")}
    with pytest.raises(
        InputError, match=r"data/baseline/in_domain\.parquet is not a readable trajectory file"
    ) as e:
        StageRun("rft", preset="quick").execute()
    assert not retryable(e.value)
    assert {rel: snapshot(Path(rel)) for rel in before} == before


def test_env_stages_do_not_retry_what_a_retry_cannot_fix():
    """Before: Prefect retried disk-full and bad-input errors twice, with back-off (72-103 s in issue 34)."""
    from prefect.states import Failed

    from tasks.stages import TASKS, retry_unless_not_retryable

    for s in SPECS.values():
        assert (TASKS[s.name].retry_condition_fn is retry_unless_not_retryable) == s.envs, s.name
    task = TASKS["demos"]
    wrapped = RuntimeError("a library's own error")
    wrapped.__cause__ = OutputError(errno.ENOSPC, "disk full while writing demos.parquet")
    for exc in (
        OutputError(errno.ENOSPC, "disk full while writing demos.parquet to data/demos"),
        OSError(errno.ENOSPC, "No space left on device"),
        InputError("data/suites/x.yaml: not a suite"),
        wrapped,
    ):
        assert retry_unless_not_retryable(task, None, Failed(data=exc)) is False, exc
    for exc in (
        RuntimeError("browser died"),
        TimeoutError("reset timed out"),
        OSError(errno.ECONNRESET, "x"),
    ):
        assert retry_unless_not_retryable(task, None, Failed(data=exc)) is True, exc
    assert issubclass(OutputError, NotRetryable) and issubclass(OutputError, OSError)


def test_a_truncated_policy_checkpoint_is_an_input_error_naming_the_file(tmp_path):
    from arpo_core.policy.model import build_tiny_policy, load_policy

    build_tiny_policy(tmp_path, size="xs", seed=0)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    with pytest.raises(InputError, match=r"cannot load the policy at .*model\.safetensors is truncated"):
        load_policy(tmp_path)
