"""The reading curriculum's runs side by side (issue 33): the held-out curves and final measures of `ground`
stage outputs (each `ground_report.json`: the recipe, the code, each phase's curve, the final measures),
against the start they were trained from, into benchmarks/results/reading_curriculum.{json,md,png}.

    .venv/bin/python benchmarks/reading_report.py --start START/models/grounded \\
        --arm "4 layers=A/models/grounded" --arm "2 layers=B/models/grounded"

An arm still running is read from its staged phase checkpoints (`models/.grounded.staging/checkpoints/
phase-<i>.pt`, their histories) with `--arm name=DIR/models/.grounded.staging`: curves only, no final measures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SETS = (
    *("box4", "widget4", "boxes8", "buttons8", "links8", "texts8", "checks8", "box1h", "widget1"),
    *("lorem8", "paralinks", "miniwob"),
)
READ_SETS = tuple(f"read-{s}" for s in SETS if s != "miniwob")
"""The same screens asked to be read (grounding.py, decision "Reading examples"): `read_score`."""
PANELS = {
    "colours among look-alikes": ("box4", "boxes8"),
    "words among look-alikes": ("widget4", "buttons8", "links8", "texts8", "checks8"),
    "MiniWoB's lorem-ipsum links": ("lorem8", "paralinks"),
    "real MiniWoB (held out)": ("miniwob",),
    "reading (read_score)": READ_SETS,
    "naming head (name_acc)": tuple(
        f"name {s}" for s in ("boxes8", "buttons8", "links8", "texts8", "checks8", "lorem8", "miniwob")
    ),
}
"""A panel's curves by set; `name <set>`: the naming head's held-out accuracy (grounding.py, decision "Naming
loss"), only in arms trained with `name_weight`."""


def score(m: dict) -> float:
    """A set's headline: the hit rate of clicks, the read score of a reading set."""
    return m["read_score"] if "read_score" in m else m["hit_rate"]


def read_arm(path: Path) -> dict:
    """Phases (steps, seconds, stopped_at, curve at stage-wide steps) and final measures of one output."""
    report = path / "ground_report.json"
    if report.exists():
        r = json.loads(report.read_text())
        phases = [
            {k: ph.get(k) for k in ("phase", "steps", "seconds", "layers", "stopped_at")}
            | {"curve": ph["curve"]}
            for ph in r["phases"]
        ]
        return {"phases": phases, "measures": r["measures"], "code": r.get("code"), "start": r["start"]}
    import torch

    phases = []
    for f in sorted((path / "checkpoints").glob("phase-*.pt")):
        s = torch.load(f, weights_only=False)
        h = s["history"]
        phases.append(
            {
                "phase": int(f.stem.split("-")[1]),
                "steps": s["step"],
                "seconds": round(s["seconds"], 1),
                "stopped_at": h.get("stopped_at"),
                "curve": h["evals"],
                "running": True,
            }
        )
    return {"phases": phases, "measures": None}


def curve_rows(arm: str, phases: list[dict], start: dict) -> list[dict]:
    """Every measurement of an arm at its stage-wide step: {"step", "<arm> <set>": hit rate}; the start's
    measures at step 0 when the run did not measure its start itself (growing depth keeps the function)."""
    rows, offset = [], 0
    if not (phases and phases[0]["curve"] and phases[0]["curve"][0]["step"] == 0):
        rows.append(
            {"step": 0, **{f"{arm} {s}": score(m) for s, m in start.items() if s in SETS + READ_SETS}}
        )
    for ph in phases:
        for ev in ph["curve"]:
            row = {"step": offset + ev["step"], "phase": ph["phase"]}
            row |= {f"{arm} {s}": ev[f"{s}/hit_rate"] for s in SETS if f"{s}/hit_rate" in ev}
            row |= {f"{arm} {s}": ev[f"{s}/read_score"] for s in READ_SETS if f"{s}/read_score" in ev}
            row |= {f"{arm} name {s}": ev[f"{s}/name_acc"] for s in SETS if f"{s}/name_acc" in ev}
            rows.append(row)
        offset += ph["steps"]
    return rows


def cell(m: dict | None) -> str:
    """'hit' or 'hit / wrong pick' (a click on another target, when measured), or a read score."""
    if m is None:
        return "-"
    if "read_score" in m:
        return f"{m['read_score']:.2f}"
    wrong = f" / {m['other_hit_rate']:.2f}" if "other_hit_rate" in m else ""
    return f"{m['hit_rate']:.2f}{wrong}"


def last_measures(arm: dict) -> tuple[int, dict[str, dict]] | None:
    """A running arm's latest held-out measurement as measures: (stage-wide step, {set: {hit_rate,
    other_hit_rate, read_score, n}}); None when it has not measured yet."""
    offset, last = 0, None
    for ph in arm["phases"]:
        if ph["curve"]:
            last = (offset + ph["curve"][-1]["step"], ph["curve"][-1])
        offset += ph["steps"]
    if last is None:
        return None
    step, ev = last
    measures: dict[str, dict] = {}
    for key, value in ev.items():
        if "/" in key:
            s, measure = key.rsplit("/", 1)
            if measure in ("hit_rate", "other_hit_rate", "read_score", "n"):
                measures.setdefault(s, {})[measure] = value
    return step, {s: m for s, m in measures.items() if "hit_rate" in m or "read_score" in m}


def table(start: dict, arms: dict[str, dict]) -> list[str]:
    """The final measures of each arm beside the start's; an arm still running (no final measures) shows
    its latest curve measurement, its column named with the step."""
    cols: dict[str, dict] = {}
    for n, a in arms.items():
        if a["measures"]:
            cols[n] = a["measures"]
        elif (latest := last_measures(a)) is not None:
            cols[f"{n} (running, step {latest[0]:,})"] = latest[1]
    names = list(cols)
    head = "| held-out set | start (blind) |" + "".join(f" {n} |" for n in names)
    lines = [head, "|" + "---|" * (2 + len(names))]
    for s in SETS + READ_SETS:
        ms = [cols[n].get(s) for n in names]
        if s not in start and not any(ms):
            continue
        m0 = start.get(s)
        ns = {int(m["n"]) for m in (m0, *ms) if m and "n" in m} if s in SETS else set()
        label = f"{s} (n={next(iter(ns))})" if len(ns) == 1 else s  # else each cell says its own n

        def sized(m: dict | None, several: bool = len(ns) > 1) -> str:
            return cell(m) + (f" (n={int(m['n'])})" if several and m and "n" in m else "")

        first = sized(m0) + (f" ({m0['blind_hit_rate']:.2f})" if m0 and "blind_hit_rate" in m0 else "")
        lines.append(f"| {label} | {first} |" + "".join(f" {sized(m)} |" for m in ms))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--start", required=True, help="the start's ground output (phases: [])")
    ap.add_argument("--arm", action="append", required=True, help="name=ground output dir")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "reading_curriculum"))
    ap.add_argument("--note", default="", help="a line for the markdown (how the runs were made)")
    args = ap.parse_args()
    start = json.loads((Path(args.start) / "ground_report.json").read_text())["measures"]
    arms = {n: read_arm(Path(p)) for n, p in (a.split("=", 1) for a in args.arm)}
    rows = [r for n, a in arms.items() for r in curve_rows(n, a["phases"], start)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": "reading_curriculum", "start": start, "arms": arms, "note": args.note}
    out.with_suffix(".json").write_text(json.dumps(record, indent=1))

    from arpo_core.analysis.report import plot_epoch_panels

    panels = {t: [f"{n} {s}" for n in arms for s in sets] for t, sets in PANELS.items()}
    panels = {t: keys for t, keys in panels.items() if any(k in r for r in rows for k in keys)}
    plot_epoch_panels(sorted(rows, key=lambda r: r["step"]), panels, out.with_suffix(".png"), x_key="step")
    legend = (
        "Cells: held-out greedy hit rate / share of clicks on another target (a wrong pick; the rest missed "
        "every target), or a reading set's read_score; 'blind' = the best constant click."
    )
    md = ["# Reading curriculum (issue 33)\n", args.note, "", legend, "", *table(start, arms), ""]
    for n, a in arms.items():
        for ph in a["phases"]:
            stop = f", advanced at step {ph['stopped_at']}" if ph.get("stopped_at") is not None else ""
            md.append(f"- {n}, phase {ph['phase']}: {ph['steps']} steps, {ph['seconds']:.0f} s{stop}")
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
