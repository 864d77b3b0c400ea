"""presets/paper.yaml: the reference hyperparameters load (with a stand-in for the UI-TARS checkpoint),
and an unset checkpoint path is one clear error naming the key and the preset line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from arpo_core.config import ConfigError, load_params, merge, parse_params

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def uitars_dir(tmp_path) -> Path:
    """A directory in UI-TARS-1.5-7B's layout as far as params check it (config.json inside)."""
    d = tmp_path / "UI-TARS-1.5-7B"
    d.mkdir()
    shutil.copy(ROOT / "assets/checkpoints/grounded-xs/config.json", d / "config.json")
    return d


def test_paper_preset_without_a_checkpoint_names_the_key(monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError) as err:
        load_params(ROOT / "params.yaml", preset="paper")
    msg = str(err.value)
    assert msg.startswith("init_policy.pretrained = '/models/UI-TARS-1.5-7B' is not a checkpoint"), msg
    assert "presets/paper.yaml:" in msg, msg


def test_paper_preset_loads_the_reference_hyperparameters(uitars_dir, monkeypatch):
    monkeypatch.chdir(ROOT)
    p = load_params(ROOT / "params.yaml", [f"init_policy.pretrained={uitars_dir}"], preset="paper")
    assert p.init_policy.pretrained == str(uitars_dir)
    assert (p.env.kind, p.env.osworld.provider, p.env.backend) == ("osworld", "remote", "ray")
    assert (
        p.env.n_envs
        == 128
        == p.train.tasks_per_iteration * p.train.group_size
        == len(p.env.osworld.base_urls)
    )
    assert (p.train.group_size, p.train.max_steps, p.baseline.max_steps, p.evaluate.max_steps) == (
        8,
        15,
        15,
        15,
    )
    assert (
        p.train.optimizer.lr == 1e-6
        and p.train.optimizer.weight_decay == 0.01
        and p.train.optimizer.max_grad_norm == 1.0
    )
    assert (p.train.engine, p.train.zero_stage, p.train.optimizer.bf16) == ("deepspeed", 3, True)
    assert (p.train.mini_batch_size, p.train.epochs) == (64, 15)
    loss = p.train.loss
    assert (loss.clip_low, loss.clip_high, loss.clip_dual, loss.kl_coef, loss.agg) == (
        0.2,
        0.3,
        3.0,
        0.0,
        "token-mean",
    )
    assert p.train.replay.capacity_per_task == 8 and p.select.min_successes == 1
    assert p.demos.episodes_per_task == 0  # no oracles, no behaviour cloning: sft passes the pointer on
    assert (p.policy.backend, p.policy.system_prompt, p.policy.history_images) == ("vllm", "uitars", None)
    # the same file through parse_params (what `arpo params --preset paper --out` writes for DVC)
    raw = merge(
        yaml.safe_load((ROOT / "params.yaml").read_text()),
        yaml.safe_load((ROOT / "presets/paper.yaml").read_text()),
    )
    raw["init_policy"]["pretrained"] = str(uitars_dir)
    assert parse_params(raw) == p


def test_paper_suite_holds_all_369_osworld_tasks_split_by_multi_apps(uitars_dir, monkeypatch):
    from arpo_core.pipeline.common import suite_tasks

    monkeypatch.chdir(ROOT)
    p = load_params(ROOT / "params.yaml", [f"init_policy.pretrained={uitars_dir}"], preset="paper")
    ind, ood = suite_tasks(p, "in_domain"), suite_tasks(p, "out_of_domain")
    assert (len(ind), len(ood)) == (268, 101)
    assert {t.domain for t in ood} == {"multi_apps"} and "multi_apps" not in {t.domain for t in ind}
