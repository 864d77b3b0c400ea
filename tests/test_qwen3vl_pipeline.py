"""A tiny Qwen3-VL through the pipeline's stages (docs/models.md), on the `qwen3vl-tiny` preset: `init_policy`
builds it in the Hub's sharded layout, `ground` passes it through, the demos are tool calls, `sft`,
`train` and `evaluate` run, every reply parsed in the Qwen3-VL grammar."""

from __future__ import annotations

import json
import time

import orchestration_helpers as oh
import pytest

from arpo_core.actions import ActionParseError, parse_response, parse_tool_call_response
from arpo_core.config import load_params
from arpo_core.pipeline.table import STAGES
from arpo_core.trajectory import read_trajectories

UPSTREAM = ("init_policy", "ground", "demos", "sft", "baseline", "select", "train", "evaluate")


def test_the_preset_describes_a_tiny_qwen3vl(monkeypatch):
    monkeypatch.chdir(oh.ROOT)
    p = load_params(oh.ROOT / "params.yaml", preset="qwen3vl-tiny")
    assert (p.init_policy.family, p.init_policy.mrope, p.ground.checkpoint) == ("qwen3_vl", None, None)
    assert (p.policy.action_format, p.policy.coord_mode, p.policy.system_prompt) == (
        "qwen3vl_tool_call",
        "relative1000",
        "qwen3vl_compact",
    )
    assert p.ground.phases == [] and p.ground.eval_levels == [] and p.ground.eval_miniwob_seeds == 0


def _parses(text: str, parse) -> bool:
    try:
        parse(text)
    except ActionParseError:
        return False
    return True


@pytest.mark.timeout(600)
def test_a_tiny_qwen3vl_goes_through_sft_train_and_evaluate(tmp_path, monkeypatch, one_thread):
    """The stage functions of init_policy .. evaluate, in order, on the preset's budgets cut further, in
    this process (the front door adds Prefect and MLflow, not stage work: `arpo run --preset qwen3vl-tiny
    --target evaluate` ran them all in 2.5 min here, docs/models.md)."""
    monkeypatch.chdir(oh.ROOT)  # the suites are read relative to the project root
    p = load_params(
        oh.ROOT / "params.yaml",
        [
            "demos.episodes_per_task=2",
            "baseline.episodes_per_task=1",
            "sft.steps=6",
            "evaluate.episodes_per_task=1",
        ],
        preset="qwen3vl-tiny",
    )
    by_name = {s.name: s for s in STAGES}
    t0 = time.monotonic()
    for name in UPSTREAM:
        stage = by_name[name]
        paths = {k: tmp_path / v for k, v in {**stage.inputs, **stage.outputs}.items()}
        stage.run(p, **stage.consts, **paths)
    print(f"init_policy .. evaluate of the tiny Qwen3-VL, in process: {time.monotonic() - t0:.0f} s")

    init = tmp_path / "models" / "init"
    assert json.loads((init / "config.json").read_text())["model_type"] == "qwen3_vl"
    assert (
        len(list(init.glob("model-*-of-*.safetensors"))) >= 2
        and (init / "model.safetensors.index.json").exists()
    )
    for trained in ("base", "arpo/policy"):
        config = json.loads((tmp_path / "models" / trained / "config.json").read_text())
        assert config["model_type"] == "qwen3_vl"

    demos = read_trajectories(tmp_path / "data" / "demos")
    assert demos and all(t.success == 1.0 for t in demos)
    for t in demos:  # behaviour cloning is taught the family's own grammar, never UI-TARS calls
        for s in t.steps:
            assert _parses(s.response_text, parse_tool_call_response), s.response_text
            assert not _parses(s.response_text, parse_response)
    for policy in ("base", "arpo"):
        episodes = read_trajectories(tmp_path / "data" / "eval" / f"{policy}.parquet")
        assert episodes
        for t in episodes:  # every reply was judged by the tool-call parser
            for s in t.steps:
                assert s.parse_ok == _parses(s.response_text, parse_tool_call_response)
