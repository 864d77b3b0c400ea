"""Comparison table (markdown + CSV + JSON) and PNG plots with real content."""

from __future__ import annotations

import csv
import io

import numpy as np
import pytest
from PIL import Image

from arpo_core.analysis.report import (
    comparison_json,
    comparison_table,
    epoch_series,
    plot_epochs,
    plot_replay,
)

RESULTS = {
    "base": {
        "eval/in_domain/success_rate": 0.4375,
        "eval/in_domain/success_ci_low": 0.31,
        "eval/in_domain/success_ci_high": 0.57,
        "eval/in_domain/episodes": 50.0,
        "eval/out_of_domain/success_rate": 0.552,
        "eval/out_of_domain/success_ci_low": 0.41,
        "eval/out_of_domain/success_ci_high": 0.69,
        "eval/out_of_domain/episodes": 40.0,
    },
    "arpo": {
        "eval/in_domain/success_rate": 0.8125,
        "eval/in_domain/success_ci_low": 0.70,
        "eval/in_domain/success_ci_high": 0.9,
        "eval/in_domain/episodes": 50.0,
    },
}


def test_comparison_table_markdown_and_csv():
    md, csv_text = comparison_table(RESULTS)
    lines = md.strip().splitlines()
    assert lines[0].startswith("| method | in_domain success | in_domain 95% CI | in_domain episodes |")
    assert lines[1].count("---") == 7
    assert lines[2] == "| base | 43.8 | [31.0, 57.0] | 50 | 55.2 | [41.0, 69.0] | 40 |"
    assert lines[3] == "| arpo | 81.2 | [70.0, 90.0] | 50 | - | - | - |"  # missing split: gaps
    rows = list(csv.DictReader(io.StringIO(csv_text)))
    assert [r["method"] for r in rows] == ["base", "arpo"]
    assert float(rows[0]["in_domain/success_rate"]) == 0.4375
    assert rows[1]["out_of_domain/success_rate"] == "" and rows[0]["out_of_domain/episodes"] == "40"


def test_comparison_json_shape():
    assert comparison_json(RESULTS) == {
        "base": {"in_domain": 0.4375, "out_of_domain": 0.552, "episodes": 90},
        "arpo": {"in_domain": 0.8125, "out_of_domain": None, "episodes": 50},
    }


def test_method_dependent_prefix_reads_the_evaluate_stage_keys():
    # the evaluate stage writes eval/<policy>/<mode>/<split>/... for every policy into one dict
    merged = {f"eval/{name}/greedy/{k[5:]}": v for name, m in RESULTS.items() for k, v in m.items()}
    results = {"base": merged, "arpo": merged}
    md, _ = comparison_table(results, prefix="eval/{method}/greedy")
    assert md == comparison_table(RESULTS)[0]
    assert comparison_json(results, prefix="eval/{method}/greedy") == comparison_json(RESULTS)


def test_epoch_series_skips_missing_and_uses_index_without_epoch():
    hist = [{"epoch": 1, "x": 0.1}, {"epoch": 2}, {"epoch": 3, "x": float("nan")}, {"epoch": 4, "x": 0.4}]
    assert epoch_series(hist, "x") == [(1.0, 0.1), (4.0, 0.4)]
    assert epoch_series([{"x": 0.5}, {"x": 0.6}], "x") == [(1.0, 0.5), (2.0, 0.6)]


def _check_png(path, min_colours=20):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    img = Image.open(path).convert("RGB")
    assert img.width > 300 and img.height > 200
    colours = img.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) >= min_colours  # anti-aliased lines and text
    # not blank: most pixels are background, but a real share is not
    most = max(c for c, _ in colours)
    assert most < 0.97 * img.width * img.height
    return img


def _count_near(img, rgb, tol=40):
    px = np.asarray(img, dtype=np.int32)  # (H, W, 3)
    return int((np.abs(px - np.array(rgb)) < tol).all(-1).sum())


def test_plot_epochs_draws_both_methods(tmp_path):
    curves = {
        "ARPO": [(1, 0.45), (2, 0.6), (3, 0.72)],
        "GRPO": [(1, 0.44), (2, 0.5), (3, 0.55)],
    }
    out = plot_epochs(curves, tmp_path / "plots" / "success.png", reference={"base": 0.43})
    assert out == tmp_path / "plots" / "success.png"
    img = _check_png(out)
    assert _count_near(img, (0xD6, 0x27, 0x28)) > 200  # ARPO red line
    assert _count_near(img, (0x1F, 0x77, 0xB4)) > 200  # GRPO blue line
    assert not list((tmp_path / "plots").glob(".*"))  # no temp file left behind


def test_plot_replay_overlays_runs(tmp_path):
    arpo = [
        {
            "epoch": e,
            "replay/groups_failed": 4 - e,
            "replay/groups_filled": 3 - e,
            "replay/n_items": 4 * e,
            "replay/n_tasks": e,
        }
        for e in (1, 2, 3)
    ]
    grpo = [{"epoch": e, "replay/groups_failed": 4.0, "replay/groups_filled": 0.0} for e in (1, 2, 3)]
    out = plot_replay({"ARPO": arpo, "GRPO": grpo}, tmp_path / "replay.png")
    img = _check_png(out)
    assert _count_near(img, (0xD6, 0x27, 0x28)) > 100
    single = plot_replay(arpo, tmp_path / "replay1.png", keys=("replay/n_items",))
    _check_png(single)


@pytest.mark.parametrize("curves", [{}, {"ARPO": []}])
def test_plot_epochs_with_no_data_still_writes_axes(tmp_path, curves):
    out = plot_epochs(curves, tmp_path / "empty.png")
    _check_png(out, min_colours=5)
