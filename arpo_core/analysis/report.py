"""Comparison tables and plots of evaluation and training metrics.

Decisions:
- **Flat metric inputs.** Inputs are the flat metric dicts the project already writes (`evaluate.summarize`
  keys such as `eval/in_domain/success_rate`, trainer history rows such as `rollout/success_rate` and
  `replay/groups_filled`), so a report can be rebuilt from `metrics/*.json` alone.
- **Rates with intervals.** The comparison table puts every method on one row with each split's success rate,
  its 95% interval and its episode count: a rate without its n and interval is how small-sample noise gets
  reported as a result (docs/method.md §7: 20 episodes give +-0.10 per cell). Markdown for humans, CSV
  for tools; `comparison_json` gives the compact `{method: {"in_domain": x, "out_of_domain": y,
  "episodes": n}}` form of `benchmarks/results/comparison.json`.
- **Agg plots.** Plots use matplotlib's Agg backend (no display; selected per figure, not with the global
  `matplotlib.use`, so importing this module changes nothing for the caller), are written atomically
  (temp file + rename) and each function returns the PNG path. Colours are fixed per method name
  so that ARPO is the same colour in every figure.
- **Gaps not zeros.** Missing values are gaps, not zeros: a method without an out-of-domain evaluation shows
  "-" in the table and a curve without a value at some epoch is simply not drawn there.
"""

from __future__ import annotations

import csv
import io
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from arpo_core.infra.fileio import atomic_open

__all__ = [
    "comparison_json",
    "comparison_table",
    "epoch_series",
    "plot_epoch_panels",
    "plot_epochs",
    "plot_replay",
]

Metrics = Mapping[str, float]

_COLOURS = {
    "base": "#7f7f7f",
    "rft": "#8c564b",
    "dpo": "#9467bd",
    "kto": "#e377c2",
    "grpo": "#1f77b4",
    "arpo": "#d62728",
}
_FALLBACK = ("#2ca02c", "#ff7f0e", "#17becf", "#bcbd22", "#393b79", "#637939")


def _colour(name: str, i: int) -> str:
    return _COLOURS.get(name.lower(), _FALLBACK[i % len(_FALLBACK)])


def _get(m: Metrics, key: str) -> float | None:
    v = m.get(key)
    if v is None:
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def comparison_table(
    results: Mapping[str, Metrics],
    splits: Sequence[str] = ("in_domain", "out_of_domain"),
    prefix: str = "eval",
) -> tuple[str, str]:
    """Markdown and CSV tables of `{method: metrics}`, one row per method in the given order.

    Per split: the success rate in %, its 95% interval and the episodes, read from
    `{prefix}/{split}/success_rate|success_ci_low|success_ci_high|episodes`. `prefix` may contain
    `{method}`, e.g. "eval/{method}/greedy" for the evaluate stage's keys.
    """
    head = ["method"]
    for s in splits:
        head += [f"{s} success", f"{s} 95% CI", f"{s} episodes"]
    md_rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    csv_head = ["method"]
    for s in splits:
        csv_head += [f"{s}/success_rate", f"{s}/ci_low", f"{s}/ci_high", f"{s}/episodes"]
    w.writerow(csv_head)
    for method, m in results.items():
        md, row = [method], [method]
        pre = prefix.format(method=method)
        for s in splits:
            rate = _get(m, f"{pre}/{s}/success_rate")
            lo = _get(m, f"{pre}/{s}/success_ci_low")
            hi = _get(m, f"{pre}/{s}/success_ci_high")
            n = _get(m, f"{pre}/{s}/episodes")
            md.append("-" if rate is None else f"{100 * rate:.1f}")
            md.append("-" if lo is None or hi is None else f"[{100 * lo:.1f}, {100 * hi:.1f}]")
            md.append("-" if n is None else f"{int(n)}")
            row += ["" if v is None else f"{v:.6g}" for v in (rate, lo, hi)]
            row.append("" if n is None else str(int(n)))
        md_rows.append("| " + " | ".join(md) + " |")
        w.writerow(row)
    return "\n".join(md_rows) + "\n", buf.getvalue()


def comparison_json(
    results: Mapping[str, Metrics], prefix: str = "eval"
) -> dict[str, dict[str, float | int | None]]:
    """`{method: {"in_domain": rate, "out_of_domain": rate, "episodes": n}}`, n = evaluation episodes
    summed over both splits; `prefix` as in `comparison_table`."""
    out: dict[str, dict[str, float | int | None]] = {}
    for method, m in results.items():
        pre = prefix.format(method=method)
        n = sum(int(_get(m, f"{pre}/{s}/episodes") or 0) for s in ("in_domain", "out_of_domain"))
        out[method] = {
            "in_domain": _get(m, f"{pre}/in_domain/success_rate"),
            "out_of_domain": _get(m, f"{pre}/out_of_domain/success_rate"),
            "episodes": n,
        }
    return out


def epoch_series(history: Sequence[Metrics], key: str, x_key: str = "epoch") -> list[tuple[float, float]]:
    """(x, value) points of `key` over history rows; x is the row's `x_key`, else its 1-based index.
    Rows without a finite value of `key` are skipped (decision "Gaps not zeros")."""
    pts = []
    for i, row in enumerate(history):
        v = _get(row, key)
        if v is None:
            continue
        x = _get(row, x_key)
        pts.append((x if x is not None else float(i + 1), v))
    return pts


def _save(fig: Figure, out_png: str | os.PathLike) -> Path:
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    with atomic_open(out) as f:
        fig.savefig(f, format="png", dpi=100, bbox_inches="tight")
    return out


def plot_epochs(
    curves: Mapping[str, Sequence[tuple[float, float]]],
    out_png: str | os.PathLike,
    *,
    title: str = "Training success rate per epoch",
    ylabel: str = "success rate",
    xlabel: str = "epoch",
    reference: Mapping[str, float] | None = None,
    ylim: tuple[float, float] | None = (0.0, 1.0),
) -> Path:
    """Line plot of `{name: [(epoch, value), ...]}` (e.g. ARPO vs GRPO per-epoch success).

    `reference` draws horizontal dashed lines, e.g. {"base": 0.31, "image-blind ceiling": 0.29}.
    Returns the PNG path.
    """
    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = fig.add_subplot()
    for i, (name, pts) in enumerate(curves.items()):
        if not pts:
            continue
        xs, ys = zip(*sorted(pts), strict=True)
        ax.plot(xs, ys, marker="o", linewidth=2, color=_colour(name, i), label=name)
    for j, (name, y) in enumerate((reference or {}).items()):
        ax.axhline(y, linestyle="--", linewidth=1.2, color=_colour(name, j + len(curves)), label=name)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best")
    return _save(fig, out_png)


def plot_epoch_panels(
    history: Sequence[Metrics],
    panels: Mapping[str, Sequence[str]],
    out_png: str | os.PathLike,
    *,
    x_key: str = "epoch",
) -> Path:
    """One panel per `{title: [metric keys]}`, each key a line over `x_key` from the history rows (a
    training run's per-epoch rows). A static image: it renders anywhere, offline (`dvc plots show`)."""
    fig = Figure(figsize=(4.0 * max(1, len(panels)), 3.4), layout="constrained")
    for j, (title, keys) in enumerate(panels.items()):
        ax = fig.add_subplot(1, max(1, len(panels)), j + 1)
        for i, key in enumerate(keys):
            pts = epoch_series(history, key, x_key)
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="o", linewidth=2, color=_FALLBACK[i % len(_FALLBACK)], label=key)
        ax.set_title(title)
        ax.set_xlabel(x_key)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=7)
    return _save(fig, out_png)


_REPLAY_KEYS = (
    "replay/groups_failed",
    "replay/groups_filled",
    "replay/n_items",
    "replay/n_tasks",
)


def plot_replay(
    history: Sequence[Metrics] | Mapping[str, Sequence[Metrics]],
    out_png: str | os.PathLike,
    *,
    keys: Sequence[str] = _REPLAY_KEYS,
    x_key: str = "epoch",
    title: str = "Experience replay",
) -> Path:
    """One panel per replay statistic over epochs (all-failed groups, groups filled from the buffer,
    stored successes, tasks with a stored success). `history` is one run's rows or
    `{run name: rows}` to overlay runs (e.g. ARPO vs GRPO with replay off). Returns the PNG path."""
    runs = {"": history} if not isinstance(history, Mapping) else dict(history)
    ncols = 2
    nrows = max(1, math.ceil(len(keys) / ncols))
    fig = Figure(figsize=(6.4 * ncols / 1.4, 3.0 * nrows), layout="constrained")
    for k, key in enumerate(keys):
        ax = fig.add_subplot(nrows, ncols, k + 1)
        for i, (name, rows) in enumerate(runs.items()):
            pts = epoch_series(rows, key, x_key)
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="o", color=_colour(name or "arpo", i), label=name or None)
        ax.set_title(key, fontsize=10)
        ax.set_xlabel(x_key)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        if any(runs) and ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, out_png)
