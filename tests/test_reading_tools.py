"""The reading levers' sweep (benchmarks/grounding_sweep.py), the reading runs' report
(benchmarks/reading_report.py) and the word and place probes (benchmarks/word_probe.py, place_probe.py) run
end to end on CPU at a tiny size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_sweep_trains_each_lever_in_its_own_process_and_records_curves(tmp_path):
    out = tmp_path / "sweep"
    cmd = [sys.executable, "benchmarks/grounding_sweep.py", "--device", "cpu", "--levers", "xs,xs-l4"]
    cmd += ["--seconds", "4", "--grace", "120", "--eval-every", "3", "--eval-n", "2", "--batch", "2"]
    res = subprocess.run(
        [*cmd, "--threads", "1", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"xs", "xs-l4"}
    for name, layers in (("xs", 2), ("xs-l4", 4)):
        rec = json.loads((out / f"{name}.json").read_text())
        assert rec["arch"]["layers"] == layers and rec["steps"] >= 1
        assert rec["evals"][0]["step"] == 0  # the start is measured too
        assert set(rec["evals"][-1]) >= {"step", "box4", "widget4", "boxes8", "buttons8", "checks8"}


def test_sweep_names_an_unknown_lever():
    res = subprocess.run(
        [sys.executable, "benchmarks/grounding_sweep.py", "--out", "x", "--levers", "xs,huge"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "unknown lever(s) ['huge']" in res.stderr


def _report(path: Path, hits: dict[str, float], phases: list[dict], extra: dict | None = None) -> None:
    path.mkdir(parents=True)
    measures = {s: {"n": 64, "hit_rate": h, "blind_hit_rate": 0.1} for s, h in hits.items()} | (extra or {})
    (path / "ground_report.json").write_text(
        json.dumps({"start": "x", "measures": measures, "phases": phases})
    )


def test_report_puts_each_arm_beside_the_start_with_curves_at_stage_wide_steps(tmp_path):
    _report(tmp_path / "start", {"box4": 0.25, "boxes8": 0.1}, [])
    curve = [{"step": 0, "box4/hit_rate": 0.25}, {"step": 10, "box4/hit_rate": 0.5}]
    phase = {"phase": 0, "steps": 10, "seconds": 5.0, "layers": 4, "stopped_at": None, "curve": curve}
    _report(tmp_path / "a", {"box4": 0.75, "boxes8": 0.5}, [phase, {**phase, "phase": 1, "stopped_at": 10}])
    out = tmp_path / "rc"
    reads = {
        "boxes8": {"n": 64, "hit_rate": 0.5, "other_hit_rate": 0.25, "blind_hit_rate": 0.1},
        "read-boxes8": {"read_score": 0.4},
    }
    read_curve = [
        {"step": 0, "read-boxes8/read_score": 0.1},
        {"step": 10, "read-boxes8/read_score": 0.4, "boxes8/name_acc": 0.7},  # a naming head's accuracy
    ]
    _report(tmp_path / "r", {"box4": 0.5}, [{**phase, "curve": read_curve}], reads)
    cmd = [sys.executable, "benchmarks/reading_report.py", "--start", str(tmp_path / "start")]
    cmd += ["--arm", f"deep={tmp_path / 'a'}", "--arm", f"reads={tmp_path / 'r'}"]
    res = subprocess.run(
        [*cmd, "--out", str(out), "--note", "tiny"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    md = out.with_suffix(".md").read_text()
    assert "| boxes8 (n=64) | 0.10 (0.10) | 0.50 | 0.50 / 0.25 |" in md  # hit / wrong pick
    assert "| read-boxes8 | - | - | 0.40 |" in md
    assert (
        "| box4 (n=64) | 0.25 (0.10) | 0.75 | 0.50 |" in md
        and "deep, phase 1: 10 steps, 5 s, advanced at step 10" in md
    )
    rec = json.loads(out.with_suffix(".json").read_text())
    assert rec["arms"]["deep"]["measures"]["boxes8"]["hit_rate"] == 0.5
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import reading_report

    rows = reading_report.curve_rows("reads", rec["arms"]["reads"]["phases"], {})
    assert rows[-1]["reads name boxes8"] == 0.7 and "reads name boxes8" not in rows[0]
    assert out.with_suffix(".png").stat().st_size > 1000
    # an arm still running: its latest curve measurement, at its stage-wide step
    running = {"phases": [{**phase, "curve": curve}, {**phase, "phase": 1, "curve": []}], "measures": None}
    latest = reading_report.table(rec["start"], {"live": running})
    assert latest[0] == "| held-out set | start (blind) | live (running, step 10) |"
    assert "| box4 (n=64) | 0.25 (0.10) | 0.50 |" in latest
    assert reading_report.table(rec["start"], {"new": {**running, "phases": []}})[0].endswith("(blind) |")
    # arms measured on other numbers of screens than the start: each cell says its own
    small = {"phases": [], "measures": {"box4": {"n": 32, "hit_rate": 1.0}}}
    sized = reading_report.table(rec["start"], {"small": small})
    assert "| box4 | 0.25 (n=64) (0.10) | 1.00 (n=32) |" in sized


def test_word_probe_reads_the_tokens_window_around_each_word_and_scores_other_screens(tmp_path):
    out = tmp_path / "wp"
    cmd = [sys.executable, "benchmarks/word_probe.py", "--model", "px=pixels-centred", "--model", "rand=init"]
    cmd += ["--model", "taught=tower:xs", "--model", "conv=cnn", "--tower-seconds", "3", "--tower-lr", "2e-4"]
    cmd += ["--train-screens", "12", "--test-screens", "6", "--steps", "20", "--out", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rec = json.loads(out.with_suffix(".json").read_text())
    assert [r["model"] for r in rec["rows"]] == ["px", "rand", "taught", "conv"]
    assert rec["rows"][3]["features"] == 64 * 6 and rec["rows"][3]["tower_steps"] >= 1  # the conv reference
    assert rec["rows"][2]["tower_steps"] >= 1 and rec["rows"][2]["features"] == 6 * 128  # a taught xs tower
    assert rec["rows"][2]["tower_lr"] == 2e-4
    assert rec["rows"][0]["features"] == 84 * 56 and rec["rows"][1]["features"] == 6 * 128  # 3 x 2 tokens
    assert rec["test_words"] >= 12 and 0 <= rec["rows"][1]["test_acc"] <= 1
    assert "| rand | 768 |" in out.with_suffix(".md").read_text() and 0 <= rec["rows"][1]["mlp_test_acc"] <= 1
    # the colour control: the boxes' colours are the names
    cmd = [sys.executable, "benchmarks/word_probe.py", "--model", "px=pixels", "--level", "boxes8"]
    cmd += ["--train-screens", "8", "--test-screens", "4", "--steps", "5", "--out", str(tmp_path / "colours")]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rec = json.loads((tmp_path / "colours.json").read_text())
    assert (rec["level"], rec["words"], rec["chance"]) == ("boxes8", 10, 0.1)


def test_place_probe_scores_each_depth_of_each_model_on_other_screens(tmp_path):
    """benchmarks/place_probe.py: per model, the held-out R^2 of the image tokens' row and column at every
    depth the language model reads them (each layer's input, the final norm), a checkpoint directory with
    a ground phase's training state loaded over it as well as a fresh model."""
    import torch

    from arpo_core.offline.grounding import GroundConfig, train_grounding
    from arpo_core.policy.model import build_tiny_policy

    policy = build_tiny_policy(tmp_path / "p", size="xs", rope_theta=5.0)
    state = tmp_path / "phase.pt"
    train_grounding(
        policy,
        GroundConfig(steps=1, batch_size=2),
        system="compact",
        max_new_tokens=8,
        checkpoint=state,
        checkpoint_every_s=0,
    )
    out = tmp_path / "pp"
    cmd = [
        sys.executable,
        "benchmarks/place_probe.py",
        "--model",
        "fresh=init",
        "--model",
        f"trained={tmp_path / 'p'}:{state}",
    ]
    res = subprocess.run(
        [*cmd, "--screens", "6", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    rec = json.loads(out.with_suffix(".json").read_text())
    assert [m["model"] for m in rec["models"]] == ["fresh", "trained"] and rec["screens"] == 6
    for m in rec["models"]:
        assert [d["where"] for d in m["depths"]] == ["layer 0's input", "layer 1's input", "final norm"]
        assert all(d["row"] <= 1 and d["col"] <= 1 for d in m["depths"])
    assert rec["models"][0]["depths"] != rec["models"][1]["depths"]  # the state was loaded over the directory
    assert (
        "| trained |" in out.with_suffix(".md").read_text()
        and torch.load(state, weights_only=False)["step"] == 1
    )


def test_point_positions_splits_the_heads_mass_by_position_beside_the_greedy_click(tmp_path):
    """benchmarks/point_positions.py: per model and level, the pointing head's mass on the target at x's
    and y's first characters and over every coordinate position (fractions), whether its pick at x's first
    is the named look-alike, and the greedy click's hit, other and right-but-missed rates, consistent with
    one another; beside them the clicks read off the head (`cell`, `block`), and with `--real` held-out real
    MiniWoB screens (one browser, ~5 s), split by target kind as well."""
    out = tmp_path / "pos"
    own_cache = ["--screen-cache", str(tmp_path / "screens")]  # the checkout's .arpo/screens stays untouched
    cmd = [
        sys.executable,
        "benchmarks/point_positions.py",
        "--model",
        "fresh=init",
        "--levels",
        "boxes8,box1h",
    ]
    res = subprocess.run(
        [*cmd, "--screens", "4", "--real", "1", "--per-screen", "2", "--out", str(out), *own_cache],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert len(list((tmp_path / "screens").rglob("train-1000.json"))) == 4  # the in-domain tasks' seed 1000
    rec = json.loads(out.with_suffix(".json").read_text())
    (model,) = rec["models"]
    assert model["model"] == "fresh" and set(model["levels"]) == {"boxes8", "box1h", "real"}
    for level, m in model["levels"].items():
        assert m["screens"] == 4 or level == "real"
        measures = ("x_first", "y_first", "all", "head_right", "hit", "other", "cell_hit", "block_other")
        assert all(0.0 <= m[k] <= 1.0 for k in measures)
        assert m["hit"] + m["other"] <= 1.0 and m["right_but_missed"] <= m["head_right"]
        assert m["cell_hit"] + m["cell_other"] <= 1.0 and m["block_hit"] + m["block_other"] <= 1.0
        assert m["guarded_hit"] + m["guarded_other"] <= 1.0
    assert model["levels"]["box1h"]["head_right"] == 1.0  # one look-alike: the head's pick is the target
    real = model["levels"]["real"]
    assert 2 <= real["screens"] <= 8 and set(real["by_kind"]) <= {"button", "link", "label", "text"}
    assert sum(k["screens"] for k in real["by_kind"].values()) == real["screens"]
    assert sum(k["hit"] * k["screens"] for k in real["by_kind"].values()) == pytest.approx(
        real["hit"] * real["screens"], abs=0.01
    )
    assert "| fresh | boxes8 |" in out.with_suffix(".md").read_text()


def test_match_probe_finds_a_word_where_the_states_carry_it_and_chance_where_they_do_not(tmp_path):
    """benchmarks/match_probe.py: fit on two thirds, scored on the rest, picks among each screen's
    look-alikes. States made to carry their word (a code per word plus noise) are read: the query names the
    target, the keys name themselves, the match through the names picks the target; states of noise are
    read at about chance. Tokens that carry the word only in their mean (each token the word's code plus an
    offset, the offsets summing to zero over the look-alike's tokens) are named by `key_name` and not one by
    one (`token_name`, `token_match`). Then the script on a fresh model writes its record, every measure a
    fraction."""
    import random as rnd

    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from match_probe import depth_probe

    gen = torch.Generator().manual_seed(0)
    codes = torch.randn(40, 32, generator=gen)
    pick = rnd.Random(1)

    def rows(carry: bool, spread: float = 0.3) -> list[dict]:
        out = []
        for _ in range(600):
            names = torch.tensor(pick.sample(range(40), 4))
            target = pick.randrange(4)
            noise = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
            query = codes[names[target]] + 0.3 * noise(32) if carry else noise(32)
            keys = codes[names] + 0.3 * noise(4, 32) if carry else noise(4, 32)
            offsets = spread * noise(4, 2, 32)  # three tokens a look-alike, offsets summing to zero
            offsets = torch.cat([offsets, -offsets.sum(1, keepdim=True)], dim=1)
            tokens = (keys[:, None] + offsets).reshape(12, 32)
            words = torch.randn(4, 8, generator=gen)
            owner = torch.arange(4).repeat_interleave(3)
            out.append(
                {"query": [query], "keys": [keys], "tokens": [tokens], "owner": owner, "classes": names}
                | {"words": words, "target": target}
            )
        return out

    read, blind = depth_probe(rows(True), 0, 40), depth_probe(rows(False), 0, 40)
    each = ("query_name", "key_name", "match", "token_name", "token_match")
    assert min(read[k] for k in each) > 0.9, read
    assert max(blind[k] for k in each) < 0.4, blind  # chance 0.25
    mean_only = depth_probe(rows(True, spread=10.0), 0, 40)
    assert mean_only["key_name"] > 0.9 and mean_only["match"] > 0.9, mean_only
    assert mean_only["token_name"] < 0.6 and mean_only["token_match"] < 0.6, mean_only
    out = tmp_path / "mp"
    cmd = [sys.executable, "benchmarks/match_probe.py", "--model", "fresh=init", "--levels", "links8"]
    res = subprocess.run(
        [*cmd, "--screens", "12", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    rec = json.loads(out.with_suffix(".json").read_text())
    (level,) = rec["models"][0]["levels"].values()
    assert level["screens"] == 12 and [d["depth"] for d in level["depths"]] == [0, 1]
    measures = ("query_name", "key_name", "match", "query_word", "key_word", "token_name", "token_match")
    assert all(0 <= d[k] <= 1 for d in level["depths"] for k in measures) and 0 < level["chance"] < 1
    assert "| fresh | links8 |" in out.with_suffix(".md").read_text()
