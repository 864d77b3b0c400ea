"""A tiny Qwen3-VL through the front door (docs/models.md): `arpo run --preset qwen3vl-tiny --target evaluate`
in a project copy builds it in the Hub's sharded layout, passes it through `ground`, clones tool-call
demos, trains and evaluates it, every reply parsed in the Qwen3-VL grammar."""

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


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_tiny_qwen3vl_goes_through_sft_train_and_evaluate(tmp_path):
    project = oh.copy_project(tmp_path / "proj")
    env = oh.base_env(project)
    cmd = [str(oh.VENV_BIN / "arpo"), "run", "--preset", "qwen3vl-tiny", "--target", "evaluate"]
    t0 = time.monotonic()
    res = oh.run(cmd, project, env, timeout=780)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    print(f"arpo run --preset qwen3vl-tiny --target evaluate: {time.monotonic() - t0:.0f} s")
    for i, name in enumerate(UPSTREAM, 1):
        assert f"{i}/{len(UPSTREAM)} {name}: done in" in out, f"stage {name} did not run:\n{out[-4000:]}"
    by_name = {s.name: s for s in STAGES}
    for name in UPSTREAM:
        assert (project / by_name[name].metrics).is_file(), name

    init = project / "models" / "init"
    assert json.loads((init / "config.json").read_text())["model_type"] == "qwen3_vl"
    assert (
        len(list(init.glob("model-*-of-*.safetensors"))) >= 2
        and (init / "model.safetensors.index.json").exists()
    )
    for trained in ("base", "arpo/policy"):
        assert (
            json.loads((project / "models" / trained / "config.json").read_text())["model_type"] == "qwen3_vl"
        )

    demos = read_trajectories(project / "data" / "demos")
    assert demos and all(t.success == 1.0 for t in demos)
    for t in demos:  # behaviour cloning is taught the family's own grammar, never UI-TARS calls
        for s in t.steps:
            assert _parses(s.response_text, parse_tool_call_response), s.response_text
            assert not _parses(s.response_text, parse_response)

    metrics = json.loads((project / "metrics" / "evaluate.json").read_text())
    for policy in ("base", "trained"):
        assert f"eval/{policy}/greedy/in_domain/success_rate" in metrics, sorted(metrics)[:20]
    episodes = read_trajectories(project / "data" / "eval" / "arpo.parquet")
    assert episodes
    for t in episodes:  # every reply was judged by the tool-call parser
        for s in t.steps:
            assert s.parse_ok == _parses(s.response_text, parse_tool_call_response)
