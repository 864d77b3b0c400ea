"""A self-contained HTML trajectory viewer: what the agent saw, thought and did, step by step.

Users' recurring question on GUI-agent RL is "what did the agent actually do?" (docs/method.md §5); the
maintainers' answer is "save and visualise your rollouts". This module is that visualisation.

Decisions:
- **Self-contained HTML.** One HTML file, no external resources: the screenshots are embedded as base64 PNG
  data URIs, the CSS and JavaScript are inline, no URL is fetched, so the page works offline, as an MLflow
  artifact and as an e-mail attachment. Identical screenshots (a replayed trajectory shown in several epochs)
  are stored once, keyed by their SHA-1.
- **Escaped model output.** Model output is untrusted text: the data travels as JSON inside `<script
  type="application/json">` with `<`, `>` and `&` escaped as \\u003c / \\u003e / \\u0026 (so `</script>` in a
  reply cannot end the block), and the page puts text into the DOM with `textContent` only. The only markup
  built from data is the SVG overlay, and only from numbers (coerced with `Number`, non-finite ones dropped).
- **SVG action overlay.** The action overlay is an SVG laid over the screenshot with `viewBox = 0 0 screen_w
  screen_h`, so the stored screen coordinates (`actions_json`, what was sent to the env) land on the right
  pixel at any display size: a ring + crosshair for point actions (click, double, right, hover, scroll, with
  an arrow for the scroll direction), a line with an arrowhead for drag.
- **Lazy rendering.** Episodes render lazily: a collapsed episode holds no `<img>` until it is opened, so a
  page with thousands of steps stays responsive. The first visible episode is open.
- **Episode filters.** Filters by task, outcome (success / failure / replayed / format error) and epoch; the
  header shows "N of M episodes" for the current filter.
- **Episode provenance.** Every episode says where it came from: its policy (given, e.g. the evaluation file's
  name `base` / `arpo`, else the stage and run id the trajectory was written with) and its source file, so a
  page combining several files never leaves the reader guessing which policy played an episode.
- **Readable pages.** Pages are readable by everyone who can read the directory (mode 0644, as any other
  generated report): the atomic temp file is created 0600, so the written page is set to 0644.
- **Descriptive title.** A page's default title names what it shows, counted after the filters:
  `describe_episodes`, "12 train episodes (models/arpo/trajectories), 8 evaluate episodes (data/eval)" (issue
  32 item 3: the title was the names of the paths given, "trajectories, eval", on a page of training
  episodes).
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

from arpo_core.infra.fileio import atomic_write_text
from arpo_core.trajectory import Trajectory

__all__ = ["describe_episodes", "policy_label", "split_reply", "viewer_data", "write_viewer"]

_THOUGHT = re.compile(r"^\s*(?:Thought|Reflection|Action_Summary)\s*:\s*", re.IGNORECASE)


def split_reply(text: str) -> tuple[str, str]:
    """(thought, action text) of a UI-TARS reply, split at the last `Action:`; a reply without
    `Action:` is all thought (it will also have failed to parse)."""
    idx = text.rfind("Action:")
    if idx < 0:
        return _THOUGHT.sub("", text).strip(), ""
    return _THOUGHT.sub("", text[:idx]).strip(), text[idx + len("Action:") :].strip()


def _json_for_script(obj: object) -> str:
    """JSON safe to embed inside <script> (decision "Escaped model output")."""
    s = json.dumps(obj, separators=(",", ":"), allow_nan=False)
    return s.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _finite(x: object) -> float | None:
    try:
        v = float(x)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return v if v == v and abs(v) != float("inf") else None


def _actions(actions_json: str) -> tuple[list[dict], str]:
    """Actions as plain dicts with numeric points only, and the parse error text if any."""
    try:
        raw = json.loads(actions_json)
    except (json.JSONDecodeError, TypeError):
        return [], "unreadable actions_json"
    if isinstance(raw, dict):
        return [], str(raw.get("parse_error", ""))
    out = []
    for a in raw if isinstance(raw, list) else []:
        if not isinstance(a, dict):
            continue
        item: dict = {"kind": str(a.get("kind", ""))}
        for key in ("point", "end_point"):
            p = a.get(key)
            if isinstance(p, (list, tuple)) and len(p) == 2:
                xy = [_finite(p[0]), _finite(p[1])]
                if None not in xy:
                    item[key] = xy
        for key in ("key", "content", "direction"):
            if a.get(key) is not None:
                item[key] = str(a[key])
        out.append(item)
    return out, ""


def policy_label(t: Trajectory) -> str:
    """Decision "Episode provenance"'s default label: the policy part of the run id the trajectory was written
    with ('evaluate-arpo' -> 'arpo'), else 'stage/run id'."""
    if t.run_id.startswith(f"{t.stage}-"):
        return t.run_id[len(t.stage) + 1 :]
    return t.run_id if t.run_id == t.stage else f"{t.stage}/{t.run_id}"


def viewer_data(
    trajectories: Sequence[Trajectory],
    policies: Sequence[str] | None = None,
    sources: Sequence[str] | None = None,
) -> dict:
    """The JSON the page renders: {"images": {sha1: base64}, "episodes": [...]}. `policies` and
    `sources` label each episode (decision "Episode provenance"), one entry per trajectory."""
    for what, labels in (("policies", policies), ("sources", sources)):
        if labels is not None and len(labels) != len(trajectories):
            raise ValueError(f"{what}: {len(labels)} labels for {len(trajectories)} trajectories")
    images: dict[str, str] = {}
    episodes = []
    for n, t in enumerate(trajectories):
        steps = []
        for s in t.steps:
            h = hashlib.sha1(s.screenshot_png).hexdigest()
            if h not in images:
                images[h] = base64.b64encode(s.screenshot_png).decode("ascii")
            thought, action = split_reply(s.response_text)
            actions, parse_error = _actions(s.actions_json)
            steps.append(
                {
                    "i": s.step_idx,
                    "img": h,
                    "w": s.screen_w,
                    "h": s.screen_h,
                    "thought": thought,
                    "action": action,
                    "actions": actions,
                    "parse_ok": bool(s.parse_ok),
                    "parse_error": parse_error,
                    "env_error": s.env_error,
                    "done": bool(s.done),
                }
            )
        episodes.append(
            {
                "n": n,
                "task": f"{t.task_domain}/{t.task_id}",
                "instruction": t.instruction,
                "policy": policies[n] if policies is not None and policies[n] else policy_label(t),
                "source": sources[n] if sources is not None else "",
                "run": t.run_id,
                "stage": t.stage,
                "epoch": t.epoch,
                "group": t.group_id,
                "sample": t.sample_idx,
                "success": _finite(t.success) or 0.0,
                "reward": _finite(t.reward) or 0.0,
                "replayed": bool(t.replayed),
                "format_error": t.format_error,
                "env_error": t.env_error,
                "policy_version": t.policy_version,
                "steps": steps,
            }
        )
    return {"images": images, "episodes": episodes}


def describe_episodes(trajectories: Sequence[Trajectory], sources: Sequence[str] | None = None) -> str:
    """Decision "Descriptive title": '<n> <stage> episodes (<folder of their files>)' per stage and folder, in
    order."""
    groups: dict[tuple[str, str], int] = {}
    for i, t in enumerate(trajectories):
        where = str(Path(sources[i]).parent) if sources and sources[i] else ""
        groups[(t.stage or "?", where)] = groups.get((t.stage or "?", where), 0) + 1
    return ", ".join(
        f"{n} {stage} episode{'' if n == 1 else 's'}" + (f" ({where})" if where else "")
        for (stage, where), n in groups.items()
    )


def write_viewer(
    trajectories: Sequence[Trajectory],
    out_html: str | os.PathLike,
    title: str = "Trajectories",
    *,
    policies: Sequence[str] | None = None,
    sources: Sequence[str] | None = None,
) -> Path:
    """Write the viewer page for `trajectories` to `out_html` (atomically, mode 0644); returns the
    path. `policies` / `sources`: per-episode labels (decision "Episode provenance")."""
    out = Path(out_html)
    out.parent.mkdir(parents=True, exist_ok=True)
    page = (
        _PAGE.replace("__TITLE__", html.escape(title))
        .replace("__STYLE__", _STYLE)
        .replace("__SCRIPT__", _SCRIPT)
        .replace("__DATA__", _json_for_script(viewer_data(trajectories, policies, sources)))
    )
    atomic_write_text(out, page)
    out.chmod(0o644)  # decision "Readable pages"
    return out


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<title>__TITLE__</title><style>__STYLE__</style></head>
<body>
<header>
  <h1>__TITLE__</h1>
  <div id="filters">
    <label>Task <select id="f-task"><option value="">all</option></select></label>
    <label>Outcome <select id="f-outcome">
      <option value="">all</option><option value="success">success</option>
      <option value="failure">failure</option><option value="replayed">replayed</option>
      <option value="format_error">format error</option><option value="env_error">env error</option>
    </select></label>
    <label>Epoch <select id="f-epoch"><option value="">all</option></select></label>
    <span id="count"></span>
  </div>
</header>
<main id="episodes"></main>
<script type="application/json" id="data">__DATA__</script>
<script>__SCRIPT__</script>
</body></html>
"""

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 0; background: #f4f5f7; color: #1d2330; }
header { position: sticky; top: 0; background: #fff; border-bottom: 1px solid #d8dbe2; padding: 8px 16px; z-index: 2; }
h1 { font-size: 18px; margin: 0 0 6px 0; }
#filters label { margin-right: 14px; }
#count { font-weight: 600; }
main { padding: 12px 16px; }
details.episode { background: #fff; border: 1px solid #d8dbe2; border-left: 6px solid #c0392b; border-radius: 6px; margin-bottom: 10px; }
details.episode.ok { border-left-color: #27ae60; }
summary { cursor: pointer; padding: 8px 10px; }
.badge { display: inline-block; padding: 1px 7px; border-radius: 9px; font-size: 12px; margin-left: 6px; background: #e8eaef; }
.badge.success { background: #d4f3df; color: #14692f; }
.badge.failure { background: #fadbd8; color: #922b21; }
.badge.replayed { background: #fdebd0; color: #935116; }
.badge.format { background: #f5cba7; color: #6e2c00; }
.badge.env { background: #d6eaf8; color: #1b4f72; }
.instr { color: #555; padding: 0 10px 6px 10px; }
.source { color: #888; font-size: 12px; padding: 0 10px 6px 10px; }
.badge.policy { background: #e5e0f5; color: #3c2a7a; margin-left: 0; margin-right: 6px; }
.steps { display: flex; flex-wrap: wrap; gap: 12px; padding: 6px 10px 12px 10px; }
.step { width: 340px; border: 1px solid #e1e4ea; border-radius: 4px; padding: 6px; background: #fafbfc; }
.shot { position: relative; display: inline-block; line-height: 0; }
.shot img { width: 320px; image-rendering: pixelated; border: 1px solid #ccc; }
.shot svg { position: absolute; left: 0; top: 0; width: 100%; height: 100%; pointer-events: none; overflow: hidden; }
.thought { white-space: pre-wrap; margin: 6px 0 2px 0; color: #333; }
.action { white-space: pre-wrap; font-family: ui-monospace, monospace; background: #eef1f6; padding: 3px 5px; border-radius: 3px; }
.sent { white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: 12px; color: #444; }
.err { color: #b03a2e; font-family: ui-monospace, monospace; white-space: pre-wrap; }
.label { font-size: 11px; color: #888; text-transform: uppercase; letter-spacing: .04em; }
"""

_SCRIPT = r"""
(function () {
  const DATA = JSON.parse(document.getElementById('data').textContent);
  const root = document.getElementById('episodes');
  const fTask = document.getElementById('f-task');
  const fOutcome = document.getElementById('f-outcome');
  const fEpoch = document.getElementById('f-epoch');
  const count = document.getElementById('count');

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function num(x) { const v = Number(x); return Number.isFinite(v) ? v : null; }
  function option(select, value) { const o = el('option', null, value); o.value = value; select.appendChild(o); }

  [...new Set(DATA.episodes.map(e => e.task))].sort().forEach(t => option(fTask, t));
  [...new Set(DATA.episodes.map(e => e.epoch))].sort((a, b) => a - b).forEach(t => option(fEpoch, String(t)));

  // SVG overlay from numbers only (decision "Escaped model output"): rings, crosshairs, drag arrows.
  function overlay(step) {
    const w = num(step.w) || 1, h = num(step.h) || 1;
    const r = Math.max(w, h) / 40, sw = Math.max(w, h) / 160;
    let s = '';
    const mark = (x, y, colour) => {
      s += `<circle class="mark" cx="${x}" cy="${y}" r="${r}" fill="none" stroke="${colour}" stroke-width="${sw * 1.5}"/>`;
      s += `<line x1="${x - 2 * r}" y1="${y}" x2="${x + 2 * r}" y2="${y}" stroke="${colour}" stroke-width="${sw}"/>`;
      s += `<line x1="${x}" y1="${y - 2 * r}" x2="${x}" y2="${y + 2 * r}" stroke="${colour}" stroke-width="${sw}"/>`;
    };
    const arrow = (x1, y1, x2, y2, colour) => {
      const a = Math.atan2(y2 - y1, x2 - x1), L = 2 * r;
      s += `<line class="drag" x1="${x1}" y1="${y1}" x2="${x2}" y2="${y2}" stroke="${colour}" stroke-width="${sw * 1.5}"/>`;
      const p1 = [x2 - L * Math.cos(a - 0.45), y2 - L * Math.sin(a - 0.45)];
      const p2 = [x2 - L * Math.cos(a + 0.45), y2 - L * Math.sin(a + 0.45)];
      s += `<polygon points="${x2},${y2} ${p1[0]},${p1[1]} ${p2[0]},${p2[1]}" fill="${colour}"/>`;
    };
    const dirs = { up: [0, -1], down: [0, 1], left: [-1, 0], right: [1, 0] };
    (step.actions || []).forEach((act, k) => {
      const colour = k === 0 ? '#ff1744' : '#ff9100';
      const p = act.point ? [num(act.point[0]), num(act.point[1])] : null;
      if (!p || p[0] === null || p[1] === null) return;
      const q = act.end_point ? [num(act.end_point[0]), num(act.end_point[1])] : null;
      if (act.kind === 'drag' && q && q[0] !== null && q[1] !== null) {
        mark(p[0], p[1], colour); arrow(p[0], p[1], q[0], q[1], colour);
      } else {
        mark(p[0], p[1], colour);
        const d = dirs[act.direction];
        if (act.kind === 'scroll' && d) arrow(p[0], p[1], p[0] + d[0] * 4 * r, p[1] + d[1] * 4 * r, colour);
      }
    });
    return `<svg viewBox="0 0 ${w} ${h}" preserveAspectRatio="none">${s}</svg>`;
  }

  function describe(a) {
    const pt = p => `(${Math.round(num(p[0]))}, ${Math.round(num(p[1]))})`;
    let s = a.kind;
    if (a.point) s += ' ' + pt(a.point);
    if (a.end_point) s += ' -> ' + pt(a.end_point);
    if (a.direction) s += ' ' + a.direction;
    if (a.key) s += ' ' + a.key;
    if (a.content !== undefined) s += ' ' + JSON.stringify(a.content);
    return s;
  }

  function renderSteps(ep, box) {
    ep.steps.forEach(step => {
      const card = el('div', 'step');
      card.appendChild(el('div', 'label', `step ${step.i}` + (step.done ? ' (done)' : '')));
      const shot = el('div', 'shot');
      const img = el('img');
      img.alt = `screenshot of step ${step.i}`;
      img.src = 'data:image/png;base64,' + DATA.images[step.img];
      shot.appendChild(img);
      shot.insertAdjacentHTML('beforeend', overlay(step));
      card.appendChild(shot);
      card.appendChild(el('div', 'label', 'thought'));
      card.appendChild(el('div', 'thought', step.thought || '(none)'));
      card.appendChild(el('div', 'label', 'action'));
      card.appendChild(el('div', 'action', step.action || '(none)'));
      if ((step.actions || []).length) {
        card.appendChild(el('div', 'label', 'sent to the env (screen pixels)'));
        card.appendChild(el('div', 'sent', step.actions.map(describe).join('\n')));
      }
      if (!step.parse_ok) card.appendChild(el('div', 'err', 'format error: ' + (step.parse_error || 'unparseable reply')));
      if (step.env_error) card.appendChild(el('div', 'err', 'env error: ' + step.env_error));
      box.appendChild(card);
    });
  }

  const nodes = DATA.episodes.map(ep => {
    const ok = ep.success > 0;
    const d = el('details', 'episode' + (ok ? ' ok' : ''));
    d.dataset.task = ep.task;
    d.dataset.epoch = String(ep.epoch);
    const sum = el('summary');
    sum.appendChild(el('span', 'badge policy', ep.policy));
    sum.appendChild(el('b', null, ' ' + ep.task));
    sum.appendChild(el('span', null, `  epoch ${ep.epoch} · group ${ep.group} · sample ${ep.sample} · ${ep.steps.length} step${ep.steps.length === 1 ? '' : 's'} · reward ${ep.reward.toFixed(2)}`));
    sum.appendChild(el('span', 'badge ' + (ok ? 'success' : 'failure'), ok ? `success ${ep.success.toFixed(2)}` : 'failure'));
    if (ep.replayed) sum.appendChild(el('span', 'badge replayed', 'replayed'));
    if (ep.format_error) sum.appendChild(el('span', 'badge format', 'format error'));
    if (ep.env_error) sum.appendChild(el('span', 'badge env', 'env error'));
    d.appendChild(sum);
    d.appendChild(el('div', 'instr', ep.instruction));
    if (ep.source) d.appendChild(el('div', 'source', 'from ' + ep.source));
    const box = el('div', 'steps');
    d.appendChild(box);
    let rendered = false;
    d.addEventListener('toggle', () => { if (d.open && !rendered) { rendered = true; renderSteps(ep, box); } });
    root.appendChild(d);
    return { ep, d, ok };
  });

  function matches(n) {
    const o = fOutcome.value;
    if (fTask.value && n.ep.task !== fTask.value) return false;
    if (fEpoch.value && String(n.ep.epoch) !== fEpoch.value) return false;
    if (o === 'success' && !n.ok) return false;
    if (o === 'failure' && n.ok) return false;
    if (o === 'replayed' && !n.ep.replayed) return false;
    if (o === 'format_error' && !n.ep.format_error) return false;
    if (o === 'env_error' && !n.ep.env_error) return false;
    return true;
  }
  function apply() {
    let shown = 0, first = null;
    nodes.forEach(n => {
      const on = matches(n);
      n.d.hidden = !on;
      if (on) { shown++; if (!first) first = n; }
    });
    if (first && !nodes.some(n => !n.d.hidden && n.d.open)) first.d.open = true;
    count.textContent = `${shown} of ${nodes.length} episodes`;
  }
  [fTask, fOutcome, fEpoch].forEach(s => s.addEventListener('change', apply));
  apply();
})();
"""
