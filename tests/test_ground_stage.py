"""The `ground` stage: its params section, the phase -> GroundConfig mapping, and the stage on a tiny
fresh xs model (one short synthetic phase, depth growth), on the versioned checkpoint (copied bit for
bit), on a pretrained pointer (passed through) and, slow, with real MiniWoB screens."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image

from arpo_core.config import ConfigError, GroundPhase, load_params, parse_params, to_dict
from arpo_core.config.sections import OptimizerConfig
from arpo_core.offline.grounding import GroundConfig
from arpo_core.pipeline import ground, init_policy, policies
from arpo_core.policy.model import image_inputs, load_policy

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT = ROOT / "assets" / "checkpoints" / "grounded-xs"
MEASURES = {
    "n",
    "parse_rate",
    "mean_err_px",
    "hit_rate",
    "corr_x",
    "corr_y",
    "spread_px",
    "blind_err_px",
    "blind_hit_rate",
    "coord_nll",
    "other_hit_rate",
}
TINY_PHASE = (
    "ground.phases=[{steps: 3, batch_size: 4, warmup_steps: 1, optimizer: {bf16: false}, mix: {box1: 1}}]"
)
TINY_EVAL = ("ground.eval_levels=[box1h, box4]", "ground.eval_per_level=3")


def params(*overrides):
    """Quick params without a browser (held-out MiniWoB screens off unless an override turns them on)."""
    over = ["ground.eval_miniwob_seeds=0", *overrides]
    return load_params(ROOT / "params.yaml", over, preset=ROOT / "presets" / "quick.yaml")


@pytest.fixture(scope="module")
def init_dir(tmp_path_factory):
    """A freshly built xs model (the params' init_policy architecture) in models/init's place."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("ground") / "init"
    init_policy.run(params(), d)
    yield d
    torch.set_num_threads(n)


def _state(path: Path) -> dict[str, torch.Tensor]:
    return load_policy(path).model.state_dict()


def _stopping_in_phase_1(train):
    """`train` (grounding.train_grounding) stopped by a KeyboardInterrupt after one saved step of the second
    phase, as a kill would stop it."""

    def stop_in_phase_1(*args, checkpoint, **kw):
        if checkpoint.name == "phase-1.pt":
            train(*args, checkpoint=checkpoint, time_limit_s=0.0, **kw)  # one step, saved
            raise KeyboardInterrupt
        return train(*args, checkpoint=checkpoint, **kw)

    return stop_in_phase_1


# ------------------------------------------------------------------------------------------------
# Params


def test_ground_section_parses_phases_and_names_unknown_keys():
    g = parse_params(
        {"ground": {"checkpoint": None, "phases": [{"steps": 5, "mix": {"box4": 2}, "grow_after": [0, 1]}]}}
    ).ground
    assert g.checkpoint is None
    assert g.phases == [GroundPhase(steps=5, mix={"box4": 2}, grow_after=[0, 1])]
    with pytest.raises(
        ConfigError,
        match=r"unknown key 'stepz' in section 'ground\.phases\[0\]' \(set by params file my\.yaml\)",
    ):
        parse_params({"ground": {"phases": [{"stepz": 5}]}}, file="my.yaml")
    with pytest.raises(ConfigError, match=r"unknown key 'eval_level' in section 'ground'"):
        parse_params({"ground": {"eval_level": ["box4"]}})
    with pytest.raises(ConfigError, match=r"ground\.phases\[0\]\.grow_after = 'x' is not a list or null"):
        parse_params({"ground": {"phases": [{"grow_after": "x"}]}})
    with pytest.raises(ConfigError, match=r"ground\.phases\[0\]\.mix\.box1 = 0 is out of range: must be > 0"):
        parse_params({"ground": {"phases": [{"mix": {"box1": 0}}]}})
    with pytest.raises(
        ConfigError,
        match=r"ground\.eval_per_level = 1 is out of range: must be >= 2 when eval_levels is not empty",
    ):
        parse_params({"ground": {"eval_per_level": 1}})


def test_ground_section_survives_the_printed_params_round_trip():
    """`arpo params > params.yaml` (how a preset reaches DVC) keeps the phases as they were."""
    raw = {
        "ground": {"phases": [{"steps": 5, "mix": {"box4": 2.0}, "grow_after": [1]}, {"miniwob_seeds": 2}]}
    }
    p = parse_params(raw)
    assert parse_params(yaml.safe_load(yaml.safe_dump(to_dict(p)))) == p


def test_repo_params_start_from_the_versioned_checkpoint_with_its_architecture():
    p = load_params(ROOT / "params.yaml")
    assert (ROOT / p.ground.checkpoint / "config.json").exists()
    text = json.loads((ROOT / p.ground.checkpoint / "config.json").read_text())["text_config"]
    # init_policy builds the same architecture, so `ground.checkpoint: null` + the recipe rebuilds it
    assert p.init_policy.size == "xs" and text["hidden_size"] == 128
    assert text["rope_parameters"]["mrope_section"] == p.init_policy.mrope
    assert text["rope_parameters"]["rope_theta"] == p.init_policy.rope_theta


def test_every_phase_training_field_is_a_ground_config_field():
    config_fields = {f.name for f in dataclasses.fields(GroundConfig)}
    phase_fields = {f.name for f in dataclasses.fields(GroundPhase)} - {
        "miniwob_seeds",
        "grow_after",
        "grow_vision_after",
        "widen_vision_to",
    }
    assert phase_fields <= config_fields
    for name in phase_fields:  # the same defaults, so an omitted key means what GroundConfig means
        assert getattr(GroundPhase(), name) == getattr(GroundConfig(), name), name


def test_ground_config_copies_a_phase():
    phase = GroundPhase(
        steps=7,
        batch_size=6,
        optimizer=OptimizerConfig(lr=0.5),
        warmup_steps=2,
        mix={"box4": 2},
        seed=3,
        grow_after=[0],
    )
    cfg = ground.ground_config(phase)
    assert (cfg.steps, cfg.batch_size, cfg.optimizer.lr, cfg.warmup_steps, cfg.seed) == (7, 6, 0.5, 2, 3)
    assert cfg.mix == {"box4": 2.0} and isinstance(cfg.mix["box4"], float)
    assert cfg.eval_every == 0 and cfg.curriculum == ()


def test_ground_measure_keys():
    got = ground.ground_measure_keys("miniwob", {"hit_rate": 0.25, "n": 8})
    assert got == {"ground/miniwob/hit_rate": 0.25, "ground/miniwob/n": 8.0}


# ------------------------------------------------------------------------------------------------
# The stage


def test_one_short_phase_from_a_fresh_model_writes_a_checkpoint_and_measures(init_dir, tmp_path):
    p = params("ground.checkpoint=null", TINY_PHASE, *TINY_EVAL)
    m = ground.run(p, init_dir, tmp_path / "grounded")
    trained, init = _state(tmp_path / "grounded"), _state(init_dir)
    assert trained.keys() == init.keys()
    assert any(not torch.equal(trained[k], init[k]) for k in init)  # the phase trained it
    expected = {f"ground/{lv}/{k}" for lv in ("box1h", "box4") for k in MEASURES}
    expected |= {"ground/phase0/loss_first", "ground/phase0/loss_last", "ground/phase0/seconds"}
    expected |= {"ground/eval_s", "ground/parameters", "ground/layers", "ground/steps"}
    assert set(m) == expected
    assert m["ground/steps"] == 3.0 and m["ground/layers"] == 2.0 and m["ground/box4/n"] == 3.0
    report = json.loads((tmp_path / "grounded" / ground.GROUND_REPORT).read_text())
    assert report["start"] == str(init_dir)
    if (ROOT / ".git").exists():  # provenance; a source tree without git history reports none
        assert len(report["code"]["commit"]) == 40 and isinstance(report["code"]["dirty"], bool)
    else:
        assert report["code"] is None
    assert report["phases"][0]["steps"] == 3 and len(report["phases"][0]["loss_every_50"]) == 1
    assert report["config"]["phases"][0]["steps"] == 3
    assert set(report["measures"]) == {"box1h", "box4"}


def test_grow_after_adds_layers_before_its_phase(init_dir, tmp_path):
    """`grow_after` deepens the language model, `widen_vision_to` widens the vision tower and
    `grow_vision_after` deepens it before their phase (the stage names the grown parameters for
    `grown_lr_scale`); the saved policy loads at its new depths
    and the report says each phase's, and a growing phase's output projections' norms."""
    phases = (
        "ground.phases=[{steps: 2, batch_size: 2, warmup_steps: 1, optimizer: {bf16: false}},"
        " {steps: 2, batch_size: 2, warmup_steps: 1, optimizer: {bf16: false}, grow_after: [0, 1],"
        " grow_vision_after: [0], grown_lr_scale: 10.0, widen_vision_to: 128}]"
    )
    m = ground.run(params("ground.checkpoint=null", phases, *TINY_EVAL), init_dir, tmp_path / "g")
    policy = load_policy(tmp_path / "g")
    assert policy.model.config.text_config.num_hidden_layers == 4 and m["ground/layers"] == 4.0
    assert policy.model.config.vision_config.depth == 2
    report = json.loads((tmp_path / "g" / ground.GROUND_REPORT).read_text())
    assert [ph["layers"] for ph in report["phases"]] == [2, 4]
    assert [ph["vision_blocks"] for ph in report["phases"]] == [1, 2]
    assert [ph["vision_width"] for ph in report["phases"]] == [64, 128]  # widened, then a block grown
    assert policy.model.config.vision_config.hidden_size == 128
    assert "output_norms" not in report["phases"][0]  # it grew nothing
    norms = report["phases"][1]["output_norms"]  # every layer's and block's, the grown ones engaged
    assert set(norms) == {f"layers.{i}.{n}" for i in range(4) for n in ("self_attn.o_proj.weight",
                          "mlp.down_proj.weight")} | {f"blocks.{i}.{n}" for i in range(2) for n in
                          ("attn.proj.weight", "mlp.down_proj.weight")}  # fmt: skip
    assert (
        all(norms[f"layers.{i}.mlp.down_proj.weight"] > 0 for i in (1, 3))
        and norms["blocks.1.attn.proj.weight"]
    )
    assert m["ground/steps"] == 4.0


def test_an_interrupted_stage_resumes_its_phases_to_the_same_weights(init_dir, tmp_path, monkeypatch):
    """ground.py, decision "Resumable phases": a stage stopped in its second phase (after one step; the
    first phase finished) and run again on the same staged output trains only what was left and ends with
    the weights, losses and report of a run that never stopped, leaving no checkpoints in its output (the
    second phase's place probe, which is not in the policy, resumed from its checkpoint too)."""
    from arpo_core.offline import grounding

    phases = (
        "ground.phases=[{steps: 3, batch_size: 2, warmup_steps: 1, optimizer: {bf16: false}},"
        " {steps: 4, batch_size: 2, warmup_steps: 1, optimizer: {bf16: false}, grow_after: [0], seed: 2,"
        " place_weight: 1.0}]"
    )
    p = params("ground.checkpoint=null", phases, *TINY_EVAL, "ground.checkpoint_every_s=0")
    ground.run(p, init_dir, tmp_path / "whole")

    real = grounding.train_grounding
    monkeypatch.setattr(grounding, "train_grounding", _stopping_in_phase_1(real))
    with pytest.raises(KeyboardInterrupt):
        ground.run(p, init_dir, tmp_path / "again")
    saved = tmp_path / "again" / ground.CHECKPOINTS
    assert sorted(f.name for f in saved.iterdir()) == ["phase-0.pt", "phase-1.pt"]
    assert torch.load(saved / "phase-1.pt", weights_only=False)["step"] == 1
    monkeypatch.setattr(grounding, "train_grounding", real)
    drawn = []
    draw = grounding.synthetic_example
    monkeypatch.setattr(grounding, "synthetic_example", lambda *a, **k: drawn.append(1) or draw(*a, **k))
    ground.run(p, init_dir, tmp_path / "again")
    # phase 0 not trained again; phase 1's last 3 steps of 2 screens each; then 2 levels x 3 held-out screens
    # (a run from scratch draws 3 x 2 + 4 x 2 + 6)
    assert len(drawn) == 3 * 2 + 2 * 3

    want, got = _state(tmp_path / "whole"), _state(tmp_path / "again")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    reports = [json.loads((tmp_path / d / ground.GROUND_REPORT).read_text()) for d in ("whole", "again")]
    whole, again = ([ph["loss_every_50"] for ph in r["phases"]] for r in reports)
    assert whole == again and [ph["steps"] for ph in reports[1]["phases"]] == [3, 4]
    assert not saved.exists() and not (tmp_path / "whole" / ground.CHECKPOINTS).exists()


def test_a_snapshot_of_an_interrupted_stage_is_its_latest_checkpoint_as_a_policy(
    init_dir, tmp_path, monkeypatch
):
    """ground.py, decision "Snapshots": a stage stopped one step into its second phase (which grew the LM
    and the vision tower)
    gives, through `arpo snapshot ground`, a loadable policy whose weights are that checkpoint's, with a
    report saying which; the staged output is left as it was and the run resumes from it. A checkpoint of
    another recipe, a used destination and a finished stage are one-line errors, and write nothing."""
    from typer.testing import CliRunner

    from arpo_core.offline import grounding
    from flows.cli import app
    from flows.runner import staging_path

    phases = (
        "ground.phases=[{steps: 2, batch_size: 2, warmup_steps: 1, optimizer: {bf16: false}},"
        " {steps: 3, batch_size: 2, warmup_steps: 1, optimizer: {bf16: false}, grow_after: [0], seed: 2,"
        " grow_vision_after: [0]}]"
    )
    over = ["ground.eval_miniwob_seeds=0", "ground.checkpoint=null", phases, *TINY_EVAL]
    p = params(*over[1:])
    monkeypatch.chdir(tmp_path)  # a project folder: models/init and the stage's staged output
    init = tmp_path / "models" / "init"
    init.parent.mkdir()
    init.symlink_to(init_dir)
    (tmp_path / "data").symlink_to(ROOT / "data")  # the suites params name
    staged = staging_path(tmp_path / "models" / "grounded")
    real = grounding.train_grounding
    monkeypatch.setattr(grounding, "train_grounding", _stopping_in_phase_1(real))
    with pytest.raises(KeyboardInterrupt):
        ground.run(p, init, staged)
    monkeypatch.setattr(grounding, "train_grounding", real)
    saved = {f.name: f.stat().st_mtime_ns for f in (staged / ground.CHECKPOINTS).iterdir()}

    cli = [
        "snapshot",
        "ground",
        "-p",
        str(ROOT / "params.yaml"),
        "--preset",
        str(ROOT / "presets" / "quick.yaml"),
    ]
    cli += [a for o in over for a in ("-S", o)]
    res = CliRunner().invoke(app, [*cli, "--out", "snap"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["phase"] == 1 and json.loads(res.stdout)["step"] == 1
    state = torch.load(staged / ground.CHECKPOINTS / "phase-1.pt", weights_only=False)["model"]
    got = _state(tmp_path / "snap")
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in got)
    snap = load_policy(tmp_path / "snap").model.config
    assert snap.text_config.num_hidden_layers == 3 and snap.vision_config.depth == 2  # grown
    report = json.loads((tmp_path / "snap" / ground.GROUND_REPORT).read_text())
    assert report["snapshot"]["phase"] == 1 and report["snapshot"]["phase_steps"] == 3
    assert [ph["steps"] for ph in report["phases"]] == [2, 1] and "measures" not in report
    assert {f.name: f.stat().st_mtime_ns for f in (staged / ground.CHECKPOINTS).iterdir()} == saved

    again = CliRunner().invoke(app, [*cli, "--out", "snap"])
    assert again.exit_code == 1 and "snap exists and is not an empty directory" in again.output
    other = CliRunner().invoke(app, [*cli, "-S", "ground.phases.1.seed=3", "--out", "other"])
    assert other.exit_code == 1 and "was made by another phase 1 than these params'" in other.output
    assert not (tmp_path / "other").exists() and not list(tmp_path.glob(".other*"))
    nothing = CliRunner().invoke(app, ["snapshot", "compare", "--out", "x"])
    assert nothing.exit_code == 1 and "keeps nothing to snapshot while it runs (stages that do: ground)" in (
        nothing.output
    )

    ground.run(p, init, staged)  # the run goes on from its checkpoint and finishes
    gone = CliRunner().invoke(app, [*cli, "--out", "late"])
    assert gone.exit_code == 1 and "no phase checkpoint in" in gone.output


def test_checkpoint_without_phases_is_copied_bit_for_bit_and_measured(init_dir, tmp_path):
    p = params(f"ground.checkpoint={CHECKPOINT}", "ground.eval_levels=[box1h]", "ground.eval_per_level=16")
    m = ground.run(p, init_dir, tmp_path / "g")
    want, got = _state(CHECKPOINT), _state(tmp_path / "g")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert (tmp_path / "g" / "model.safetensors").read_bytes() == (
        CHECKPOINT / "model.safetensors"
    ).read_bytes()
    assert m["ground/steps"] == 0.0 and "ground/miniwob/n" not in m
    # the versioned policy looks at the screen: one box under the instruction strip is clicked where it is
    assert m["ground/box1h/corr_x"] > 0.8 and m["ground/box1h/hit_rate"] > m["ground/box1h/blind_hit_rate"]


def test_min_pixels_rescales_the_start_and_the_output_keeps_it(init_dir, tmp_path):
    """ground.py, decision "Pixel budget": the same weights at 2x, measured there, saved with the budget;
    a phase trains at that scale."""
    two_x = 134_400
    p = params(f"ground.checkpoint={CHECKPOINT}", f"ground.min_pixels={two_x}", *TINY_EVAL)
    ground.run(p, init_dir, tmp_path / "g")
    want, got = _state(CHECKPOINT), _state(tmp_path / "g")
    assert all(torch.equal(want[k], got[k]) for k in want)  # the weights as they were
    assert policies.pixel_budget(CHECKPOINT) != policies.pixel_budget(tmp_path / "g")
    assert policies.pixel_budget(tmp_path / "g") == (two_x, policies.pixel_budget(CHECKPOINT)[1])
    policy = load_policy(tmp_path / "g")
    _, grid = image_inputs(policy.image_processor, [Image.new("RGB", (160, 210))])
    assert grid.tolist() == [[1, 30, 24]]  # 336x420 model pixels: 180 merged tokens (48 at 1x)
    # a phase at 2x: its held-out clicks are in the bigger image's pixels
    p = params("ground.checkpoint=null", "ground.min_pixels=300000", TINY_PHASE, *TINY_EVAL)
    ground.run(p, init_dir, tmp_path / "t")
    assert policies.pixel_budget(tmp_path / "t") == (300_000, 300_000)
    report = json.loads((tmp_path / "t" / ground.GROUND_REPORT).read_text())
    assert report["config"]["min_pixels"] == 300_000 and report["phases"][0]["steps"] == 3


def test_no_checkpoint_no_phases_passes_models_init_on(init_dir, tmp_path):
    p = params("ground.checkpoint=null", "ground.eval_levels=[box1]", "ground.eval_per_level=2")
    m = ground.run(p, init_dir, tmp_path / "g")
    want, got = _state(init_dir), _state(tmp_path / "g")
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert set(m) >= {"ground/box1/hit_rate", "ground/box1/blind_hit_rate"}


def test_a_pretrained_pointer_passes_through_over_the_checkpoint(init_dir, tmp_path):
    p = params(f"init_policy.pretrained={init_dir}")
    init_policy.run(p, tmp_path / "init")
    m = ground.run(p, tmp_path / "init", tmp_path / "g")
    assert m == {"ground/pretrained": 1.0}
    assert policies.resolve_policy(tmp_path / "g") == init_dir.resolve()


def test_unknown_level_fails_before_any_work(init_dir, tmp_path):
    with pytest.raises(ValueError, match=r"unknown synthetic level\(s\) \['box9'\]"):
        ground.run(params("ground.eval_levels=[box9]"), init_dir, tmp_path / "g")
    assert not (tmp_path / "g").exists()


def test_missing_checkpoint_is_a_clear_error_when_params_load(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"ground\.checkpoint = .* is not a checkpoint: must be a directory holding config\.json",
    ):
        params(f"ground.checkpoint={tmp_path / 'none'}")


def test_real_miniwob_screens_train_and_measure(init_dir, tmp_path, monkeypatch):
    """Real Chromium (~4 s): a phase with real screens of the quick suite (2 tasks, seed 0) and held-out
    screens (seed 1000), all from one browser that is closed afterwards."""
    from arpo_core.envs.miniwob.miniwob_env import MiniWoBEnv

    opened, closed = [], []
    monkeypatch.setattr(MiniWoBEnv, "__init__", _spy(MiniWoBEnv.__init__, opened))
    monkeypatch.setattr(MiniWoBEnv, "close", _spy(MiniWoBEnv.close, closed))
    phase = "ground.phases=[{steps: 2, batch_size: 4, warmup_steps: 1, optimizer: {bf16: false}, miniwob_seeds: 1}]"
    p = params(
        "ground.checkpoint=null",
        phase,
        "ground.eval_levels=[]",
        "ground.eval_miniwob_seeds=1",
        f"ground.screen_cache={tmp_path / 'screens'}",  # empty: the browser reads them
    )
    m = ground.run(p, init_dir, tmp_path / "g")
    report = json.loads((tmp_path / "g" / ground.GROUND_REPORT).read_text())
    assert report["phases"][0]["real_examples"] >= 2
    assert m["ground/miniwob/n"] >= 2 and "ground/miniwob/hit_rate" in m
    by_target = report["miniwob_targets"]  # the same clicks per task and target kind
    assert sum(g["n"] for g in by_target.values()) == m["ground/miniwob/n"]
    assert sum(g["n"] * g["hit_rate"] for g in by_target.values()) == pytest.approx(
        m["ground/miniwob/n"] * m["ground/miniwob/hit_rate"]
    )
    kinds = {"button", "link", "label", "text"}
    tasks = set(ground._miniwob_task_ids(p))
    assert all(k.split("/")[0] in tasks and k.split("/")[1] in kinds for k in by_target), by_target
    assert all(m[f"ground/miniwob/{k}/hit_rate"] == g["hit_rate"] for k, g in by_target.items())
    assert all(m[f"ground/miniwob/{k}/copy_rate"] == g["copy_rate"] for k, g in by_target.items())
    assert len(opened) == 1 and len(closed) == 1


def test_the_final_measures_click_with_the_policys_readout(init_dir, tmp_path, monkeypatch):
    """ground.py, decision "Image dependence measured": the stage's measures read the clicks as the policy
    will act (`policy.click_readout`, generate.py decision "Read clicks"), every level's."""
    from arpo_core.offline import grounding

    asked = []
    greedy = grounding.greedy_replies

    def spy(*args, readout="tokens", **kwargs):
        asked.append(readout)
        return greedy(*args, readout=readout, **kwargs)

    monkeypatch.setattr(grounding, "greedy_replies", spy)
    m = ground.run(params("policy.click_readout=cell", *TINY_EVAL), init_dir, tmp_path / "g")
    assert asked == ["cell", "cell"] and "ground/box4/hit_rate" in m


def test_no_count_of_training_screens_reaches_the_held_out_seeds(monkeypatch):
    """ground.py, decision "Image dependence measured": a phase asking for more real screens than there are
    seeds below the held-out block (1000) skips the block (0-999, then 2000..), while the held-out screens
    are seeds 1000..; a held-out count beyond the block is a one-line error. (The env and pages are
    stand-ins: this is the seed arithmetic, not the browser.)"""
    from arpo_core.envs.miniwob import miniwob_env
    from arpo_core.offline import grounding

    asked: dict[str, list[int]] = {}

    class Env:
        def __init__(self, **_):
            pass

        def close(self):
            pass

    def examples(env, tasks, seeds, size, per_screen):
        seeds = list(seeds)
        asked["held" if seeds[0] == ground.MINIWOB_HELDOUT_SEED else "train"] = seeds
        return []

    monkeypatch.setattr(miniwob_env, "MiniWoBEnv", Env)
    monkeypatch.setattr(grounding, "miniwob_examples", examples)
    phase = "ground.phases=[{steps: 2, batch_size: 4, miniwob_seeds: 1010}]"
    ground.real_screens(params(phase, "ground.eval_miniwob_seeds=6"), (56, 56))
    assert len(asked["train"]) == len(set(asked["train"])) == 1010
    assert asked["train"][:1000] == list(range(1000)) and asked["train"][1000:] == list(range(2000, 2010))
    assert asked["held"] == list(range(1000, 1006))
    assert not set(asked["train"]) & set(range(1000, 2000))
    with pytest.raises(ValueError, match=r"ground\.eval_miniwob_seeds is 1001: at most 1000 held-out"):
        ground.real_screens(params(phase, "ground.eval_miniwob_seeds=1001"), (56, 56))


def _spy(fn, calls):
    def wrapped(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return wrapped


def test_until_hit_without_measurements_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"until_hit 0\.8 needs eval_every > 0"):
        GroundPhase(until_hit=0.8)
    assert GroundPhase(until_hit=0.8, eval_every=100).until_hit == 0.8


def test_a_grown_rate_without_growing_is_a_one_line_error():
    with pytest.raises(ValueError, match="grown_lr_scale needs grow_after or grow_vision_after"):
        GroundPhase(grown_lr_scale=10.0)
    assert GroundPhase(grown_lr_scale=10.0, grow_vision_after=[0]).grown_lr_scale == 10.0


def test_phases_send_held_out_curves_at_stage_wide_steps_and_report_them(init_dir, tmp_path):
    """ground.py, decision "Curves while it trains": every eval_every steps a phase measures its own levels'
    held-out screens (with its naming head's, pointing heads', place probe's and spelling head's measures
    where it has them, and the thought's copy rate where the instructions quote their names);
    `on_metrics` gets them at the stage-wide step (phase 2 continues phase 1's count), the report keeps each
    phase's curve."""
    phases = (
        "ground.phases=[{steps: 2, batch_size: 2, warmup_steps: 1, optimizer: {bf16: false}, eval_every: 1,"
        " mix: {box1: 1}}, {steps: 2, batch_size: 2, warmup_steps: 1, optimizer: {bf16: false},"
        " eval_every: 2, name_weight: 1.0, vision_lr_scale: 0.5, point_weight: 0.5, place_weight: 0.5,"
        " spell_weight: 0.2, match_weight: 0.5, quote_names: true, mix: {box1h: 1, boxes8: 1, opentexts8: 1}}]"
    )
    seen: list[tuple[int, dict]] = []
    p = params("ground.checkpoint=null", phases, *TINY_EVAL)
    ground.run(p, init_dir, tmp_path / "g", on_metrics=lambda step, m: seen.append((step, m)))
    assert [s for s, _ in seen] == [0, 1, 2, 2, 4]  # each phase's start, then every eval_every steps
    assert {k for k in seen[1][1] if k.rsplit("/", 1)[1] == "hit_rate"} == {
        "ground/curve/hit_rate",
        "ground/curve/box1/hit_rate",
    }
    assert "ground/curve/loss" not in seen[0][1] and "ground/curve/loss" in seen[1][1]

    last = seen[-1][1]
    assert last["ground/curve/phase"] == 1.0
    assert {"ground/curve/box1h/hit_rate", "ground/curve/boxes8/corr_x", "ground/curve/loss"} <= set(last)
    assert 0 <= last["ground/curve/boxes8/name_acc"] <= 1  # the naming head's accuracy (grounding.py)
    assert not any(k.endswith("name_acc") for _, m in seen[:3] for k in m)  # phase 1 names nothing
    assert 0 < last["ground/curve/boxes8/point_mass"] < 1 and 0 < last["ground/curve/boxes8/point_other"] < 1
    assert not any("/point_" in k for _, m in seen[:3] for k in m)  # nor points
    assert (
        0 <= last["ground/curve/boxes8/point_first"] <= 1 and 0 <= last["ground/curve/boxes8/cell_hit"] <= 1
    )
    assert all(0 <= last[f"ground/curve/boxes8/match_{k}"] <= 1 for k in ("query", "key", "pick"))
    assert not any("/match_" in k or "/cell_hit" in k for _, m in seen[:3] for k in m)  # nor matches
    assert last["ground/curve/boxes8/place_col"] <= 1 and "ground/curve/box1h/place_row" in last
    assert not any("/place_" in k for _, m in seen[:3] for k in m)  # nor places
    assert 0 <= last["ground/curve/opentexts8/spell_f1"] <= 1 and "ground/curve/boxes8/spell_f1" not in last
    assert not any("/spell_" in k for _, m in seen[:3] for k in m)  # nor spells
    assert 0 <= last["ground/curve/opentexts8/copy_rate"] <= 1 and "ground/curve/box1h/copy_rate" not in last
    assert last["ground/curve/hit_rate"] == min(
        last["ground/curve/box1h/hit_rate"],
        last["ground/curve/boxes8/hit_rate"],
        last["ground/curve/opentexts8/hit_rate"],
    )
    report = json.loads((tmp_path / "g" / ground.GROUND_REPORT).read_text())
    assert [len(ph["curve"]) for ph in report["phases"]] == [3, 2]
    assert [ph["stopped_at"] for ph in report["phases"]] == [None, None]


def test_a_phase_that_reads_measures_its_reading_sets_and_the_stage_reads_at_the_end(init_dir, tmp_path):
    """grounding.py, decision "Reading examples": read_share turns screens into reading examples; the curves
    and the final measures score reading on the click sets' screens."""
    phases = (
        "ground.phases=[{steps: 2, batch_size: 4, warmup_steps: 1, optimizer: {bf16: false}, eval_every: 2,"
        " read_share: 0.5, mix: {boxes8: 1}}]"
    )
    seen: list[tuple[int, dict]] = []
    m = ground.run(
        params("ground.checkpoint=null", phases, *TINY_EVAL),
        init_dir,
        tmp_path / "g",
        on_metrics=lambda step, m: seen.append((step, m)),
    )
    assert [s for s, _ in seen] == [0, 2]
    assert 0.0 <= seen[-1][1]["ground/curve/read-boxes8/read_score"] <= 1.0
    assert "ground/curve/read-boxes8/hit_rate" not in seen[-1][1]
    assert seen[-1][1]["ground/curve/hit_rate"] == seen[-1][1]["ground/curve/boxes8/hit_rate"]  # clicks gate
    assert {"ground/read-box1h/read_score", "ground/read-box4/read_score", "ground/box4/hit_rate"} <= set(m)


def test_a_naming_only_phase_runs_through_the_stage_and_curves_its_head(init_dir, tmp_path):
    """grounding.py, decision "Naming loss": `name_only` trains the tower alone; its curve has the head's
    accuracy beside the clicks it leaves."""
    phases = (
        "ground.phases=[{steps: 2, batch_size: 2, warmup_steps: 1, optimizer: {bf16: false}, eval_every: 2,"
        " name_only: true, name_weight: 1.0, mix: {texts8: 1}}]"
    )
    seen: list[tuple[int, dict]] = []
    ground.run(
        params("ground.checkpoint=null", phases, *TINY_EVAL),
        init_dir,
        tmp_path / "g",
        on_metrics=lambda step, m: seen.append((step, m)),
    )
    last = seen[-1][1]
    assert [s for s, _ in seen] == [0, 2] and 0 <= last["ground/curve/texts8/name_acc"] <= 1
    assert "ground/curve/texts8/hit_rate" in last and last["ground/curve/loss"] > 0


def test_a_phase_carries_its_heads_from_the_previous_phases_checkpoint(init_dir, tmp_path, monkeypatch):
    """grounding.py, decision "Carried heads": the stage hands a `carry_heads` phase the checkpoint of the
    phase before it, so the head names the held-out words at the new phase's start as it did at the old
    one's end; the first phase starts fresh."""
    from arpo_core.offline import grounding

    phase = (
        "steps: 2, batch_size: 2, warmup_steps: 1, optimizer: {bf16: false}, eval_every: 2, name_only: true"
    )
    phases = f"ground.phases=[{{{phase}, name_weight: 1.0, mix: {{texts8: 1}}}}, {{{phase}, name_weight: 1.0,"
    phases += " mix: {texts8: 1}, seed: 1, carry_heads: true}]"
    given: list = []
    real = grounding.train_grounding

    def keep(*a, **k):  # and keep each phase's checkpoint, which the stage removes when it ends
        given.append(k["heads_from"])
        hist = real(*a, **k)
        shutil.copy(k["checkpoint"], tmp_path / f"kept-{len(given)}.pt")
        return hist

    monkeypatch.setattr(grounding, "train_grounding", keep)
    seen: list[tuple[int, dict]] = []
    out = tmp_path / "g"
    ground.run(
        params("ground.checkpoint=null", phases, *TINY_EVAL),
        init_dir,
        out,
        on_metrics=lambda s, m: seen.append((s, m)),
    )
    assert given == [None, out / ground.CHECKPOINTS / "phase-0.pt"]
    acc = [(s, m["ground/curve/phase"], m["ground/curve/texts8/name_acc"]) for s, m in seen]
    assert [a[:2] for a in acc] == [(0, 0.0), (2, 0.0), (2, 1.0), (4, 1.0)]
    assert acc[2][2] == acc[1][2]  # the carried head names as it did at the previous phase's end
    # a run branched from another's end (its model, and its heads from its last phase's checkpoint file,
    # `heads_from`): its first phase's head starts as the other run's ended
    one = f"ground.phases=[{{{phase}, name_weight: 1.0, mix: {{texts8: 1}}, seed: 2, carry_heads: true}}]"
    heads: list[dict] = []
    measure = grounding._name_accuracy
    monkeypatch.setattr(
        grounding,
        "_name_accuracy",
        lambda policy, head, *a, **k: (
            heads.append({n: v.clone() for n, v in head.state_dict().items()})
            or measure(policy, head, *a, **k)
        ),
    )
    branch = params(
        f"ground.checkpoint={out}", one, f"ground.heads_from={tmp_path / 'kept-2.pt'}", *TINY_EVAL
    )
    ground.run(branch, init_dir, tmp_path / "b")
    ended = torch.load(tmp_path / "kept-2.pt", weights_only=False)["head"]
    assert given[-1] == tmp_path / "kept-2.pt" and all(torch.equal(v, ended[n]) for n, v in heads[0].items())


def test_the_stage_reports_progress_through_the_runner_hook():
    from arpo_core.pipeline.table import stage

    s = stage("ground")
    assert s.progress and not s.iterations  # curves to MLflow, no per-epoch table in DVC
