"""OSWorld task evaluation: result/expected getters, metrics, the evaluator combinator, and the support check.

Design decisions:
- **OSWorld semantics.** Semantics follow OSWorld's `DesktopEnv.evaluate` and its getters/metrics as published
  in desktop-env 1.0.2 (desktop_env/desktop_env.py `evaluate`, evaluators/metrics/general.py, basic_os.py,
  vscode.py, evaluators/getters/*.py; re-implemented, not copied, and checked function by function against
  that wheel's source): `func` is one metric name or a list combined by `conj` ("and": any 0 -> 0, else the
  mean; "or": any 1 -> 1, else the max); each metric is called as `metric(result, expected, **options)`,
  or `metric(result, **options)` when the task has no `expected`. A list evaluator's `"expected": []`
  means no expected, as there (its `and self.evaluator["expected"]` test); `"options": []` likewise
  (desktop-env would index the empty list and fail).
- **Unsupported by name.** Only what needs no proprietary app and no GNOME is implemented (the table in
  docs/osworld.md counts what that covers). Everything else is reported BY NAME by `unsupported_features`
  before a task runs, never silently scored: a task with an unknown setup step, getter or metric cannot be
  reset.
- **Desktop API.** Getters talk to the desktop through the small `DesktopAPI` protocol (HTTP client in
  production, anything in tests) and write files into a per-episode cache folder, as OSWorld's `cache_dir`
  does; metrics are pure functions of local values and files, each with a hand-computed test.
- **No eval.** No `eval` of desktop output: OSWorld's `check_gnome_favorite_apps` evals the gsettings string;
  here `ast.literal_eval` parses the same literal.
- **Getter failures score zero.** Any exception a getter raises fails the evaluation, which scores 0
  (arpo_core.rewards.score_or_error, applied by the env, keeps the error text), and NaN / out-of-range scores
  are sanitised there too. A result getter's FileNotFoundError scores an "and" evaluator 0 at once and gives
  the metric None under "or", as `DesktopEnv.evaluate` catches it. Differences from desktop-env, where it is
  wrong: our `get_cache_file` raises FileNotFoundError for a missing file, OSWorld's raises AssertionError (a
  bare `assert`), which its `except FileNotFoundError` misses, so there the whole evaluation fails (also
  under "or"); and under "or" desktop-env then calls the metric with an unbound (first metric) or the
  previous metric's result, here it gets None.
- **Or-evaluator fallthrough.** A metric that cannot score returns 0 and the next metric of an "or" evaluator
  decides (issue 32): desktop-env's metrics catch their own errors (`check_direct_json_object` on a result
  that is not a dict, on rules without a dict `expected`, on a type clash under `expect_in_result`;
  `file_contains` on a file that is not text in the locale's encoding, on a non-iterable `expected`, on rules
  without it), so the metrics here do the same, where desktop-env does. Where a desktop-env metric raises
  instead (`exact_match` on rules without `expected`; `check_direct_json_object` on a string that is
  not JSON: its `json.loads` sits outside its `try`), the metric here raises too, and `evaluate_task`
  scores that metric 0: alone or under "and" the task scores 0 either way; under "or" desktop-env's
  evaluation fails where this one moves on to the next metric. Each such reason is logged once per
  metric and kind of error (WARNING on the `arpo.osworld` logger, then DEBUG), not swallowed and not
  repeated for every episode.
"""

from __future__ import annotations

import ast
import difflib
import json
import logging
import os
import re
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any, Protocol

__all__ = [
    "GETTERS",
    "METRICS",
    "SETUP_STEPS",
    "DesktopAPI",
    "combine_scores",
    "evaluate_task",
    "unsupported_features",
]


_log = logging.getLogger("arpo.osworld")
_reported: set[tuple[str, str]] = set()


def _cannot_score(metric: str, exc: BaseException) -> float:
    """Decision "Or-evaluator fallthrough": score 0 for a metric that could not score; the reason logged once
    per metric and kind."""
    key = (metric, type(exc).__name__)
    level = logging.DEBUG if key in _reported else logging.WARNING
    _reported.add(key)
    _log.log(level, "OSWorld metric %s cannot score, scored 0: %s: %s", metric, type(exc).__name__, exc)
    return 0.0


class DesktopAPI(Protocol):
    """What getters need from a desktop (OSWorld's controller calls)."""

    def execute(self, command: Any, shell: bool = False) -> dict: ...

    def get_file(self, path: str) -> bytes | None: ...

    def terminal_output(self) -> str | None: ...

    def list_directory(self, path: str) -> dict | None: ...

    def screen_size(self) -> dict: ...


# ---------------------------------------------------------------------------------------------------------
# Setup steps the env can run (the env implements them; listed here for the support check)
# ---------------------------------------------------------------------------------------------------------

SETUP_STEPS: frozenset[str] = frozenset(
    {
        "launch",
        "execute",
        "command",
        "open",
        "sleep",
        "activate_window",
        "close_window",
        "download",
        "upload_file",
    }
)
"""Setup / postconfig step types `OSWorldEnv` runs. `download` fetches the URL (needs internet unless the
file is already in the download cache) and uploads it, as OSWorld's SetupController does."""


def download_cache_name(url: str, path: str) -> str:
    """OSWorld's cache file name for a downloaded URL: uuid5(URL namespace, url) + '_' + basename(path)."""
    return f"{uuid.uuid5(uuid.NAMESPACE_URL, url)}_{os.path.basename(path)}"


def fetch_url(url: str, dest: str, timeout_s: float = 60.0) -> str:
    """Download `url` to `dest` unless it is already there; returns dest."""
    if not os.path.exists(dest):
        os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
        tmp = dest + ".part"
        with urllib.request.urlopen(url, timeout=timeout_s) as r, open(tmp, "wb") as f:
            f.write(r.read())
        os.replace(tmp, dest)
    return dest


# ---------------------------------------------------------------------------------------------------------
# Getters: (desktop, cache_dir, config) -> value
# ---------------------------------------------------------------------------------------------------------


def get_rule(desk: DesktopAPI, cache_dir: str, config: dict) -> Any:
    return config["rules"]


def get_vm_command_line(desk: DesktopAPI, cache_dir: str, config: dict) -> str | None:
    return desk.execute(config["command"], bool(config.get("shell", False))).get("output")


def get_vm_command_error(desk: DesktopAPI, cache_dir: str, config: dict) -> str | None:
    return desk.execute(config["command"], bool(config.get("shell", False))).get("error")


def get_vm_terminal_output(desk: DesktopAPI, cache_dir: str, config: dict) -> str | None:
    return desk.terminal_output()


def get_list_directory(desk: DesktopAPI, cache_dir: str, config: dict) -> dict | None:
    return desk.list_directory(config["path"])


def get_vm_screen_size(desk: DesktopAPI, cache_dir: str, config: dict) -> dict:
    return desk.screen_size()


def _multi(config: dict, key_src: str) -> tuple[list[str], list[str], list[int]]:
    if config.get("multi", False):
        return list(config[key_src]), list(config["dest"]), list(config.get("gives", [0]))
    return [config[key_src]], [config["dest"]], [0]


def get_vm_file(desk: DesktopAPI, cache_dir: str, config: dict) -> str | list[str | None] | None:
    """Copy file(s) from the desktop into the cache; the local path (None for a missing file).

    `multi: true` takes lists `path` / `dest` and returns the entries listed in `gives` (default [0]); a
    single given entry is returned bare, as in OSWorld.
    """
    srcs, dests, gives = _multi(config, "path")
    out: list[str | None] = []
    for i, (src, dest) in enumerate(zip(srcs, dests, strict=True)):
        data = desk.get_file(src)
        local = os.path.join(cache_dir, dest)
        if data is not None:
            os.makedirs(os.path.dirname(local) or ".", exist_ok=True)
            with open(local, "wb") as f:
                f.write(data)
        if i in gives:
            out.append(local if data is not None else None)
    return out[0] if len(out) == 1 else out


def get_cache_file(desk: DesktopAPI, cache_dir: str, config: dict) -> str:
    """A file an earlier setup step left in the cache (e.g. `execute` with `stdout`). A missing file is
    FileNotFoundError here; OSWorld's getter raises AssertionError instead
    (decision "Getter failures score zero")."""
    path = os.path.join(cache_dir, config["path"])
    if not os.path.exists(path):
        raise FileNotFoundError(f"cache_file {config['path']!r} is not in the episode cache")
    return path


def get_cloud_file(desk: DesktopAPI, cache_dir: str, config: dict) -> str | list[str]:
    """Download gold file(s) by URL into the cache (needs internet unless already cached)."""
    srcs, dests, gives = _multi(config, "path")
    out = [
        fetch_url(src, os.path.join(cache_dir, dest))
        for i, (src, dest) in enumerate(zip(srcs, dests, strict=True))
        if i in gives
    ]
    return out[0] if len(out) == 1 else out


GETTERS: dict[str, Callable[[DesktopAPI, str, dict], Any]] = {
    "rule": get_rule,
    "vm_command_line": get_vm_command_line,
    "vm_command_error": get_vm_command_error,
    "vm_terminal_output": get_vm_terminal_output,
    "list_directory": get_list_directory,
    "vm_screen_size": get_vm_screen_size,
    "vm_file": get_vm_file,
    "cache_file": get_cache_file,
    "cloud_file": get_cloud_file,
}


# ---------------------------------------------------------------------------------------------------------
# Metrics (OSWorld names and argument conventions)
# ---------------------------------------------------------------------------------------------------------


def exact_match(result: Any, rules: dict) -> float:
    return float(result == rules["expected"])


def match_in_list(result: Any, rules: dict) -> float:
    return float(result in rules["expected"])


def is_in_list(result: Any, rules: dict) -> float:
    """OSWorld's is_in_list: the expected value is contained in the result."""
    return float(rules["expected"] in result)


def check_include_exclude(result: str | None, rules: dict) -> float:
    if result is None:
        return 0.0
    inc, exc = rules.get("include", []), rules.get("exclude", [])
    return float(all(s in result for s in inc) and all(s not in result for s in exc))


def literal_match(result: Any, expected: Any, **options: Any) -> float:
    kind = options.get("type", "str")
    fold = options.get("ignore_case", False)
    if kind == "str":
        a, b = str(result), str(expected)
        return float(a.lower() == b.lower() if fold else a == b)
    if kind == "list":
        if not isinstance(result, (list, tuple)) or not isinstance(expected, (list, tuple)):
            return 0.0
        a = [str(s).lower() if fold else str(s) for s in result]
        b = [str(s).lower() if fold else str(s) for s in expected]
        return float(a == b)
    raise ValueError(f"literal_match: type {kind!r} is not supported")


def check_list(result: str | None, rules: dict) -> float:
    """File at `result`: every `expect` regex matches some line, no `unexpect` regex matches any line."""
    if result is None:
        return 0.0
    expect = [re.compile(p) for p in rules.get("expect", [])]
    unexpect = [re.compile(p) for p in rules.get("unexpect", [])]
    seen = [False] * len(expect)
    with open(result) as f:
        for line in f:
            for i, p in enumerate(expect):
                seen[i] = seen[i] or p.search(line) is not None
            if any(p.search(line) for p in unexpect):
                return 0.0
    return float(all(seen))


def compare_text_file(actual: str | None, expected: str, **options: Any) -> float:
    if not actual:
        return 0.0
    with open(actual) as f:
        a = f.read()
    with open(expected) as f:
        b = f.read()
    if options.get("ignore_blanks", False):
        a = re.sub(r"\s+", " ", re.sub(r"[\t\n]", " ", a).strip())
        b = re.sub(r"\s+", " ", re.sub(r"[\t\n]", " ", b).strip())
    if options.get("ignore_case", False):
        a, b = a.lower(), b.lower()
    return float(a == b)


def diff_text_file(result: str | None, expected: str) -> float:
    """Line-level similarity ratio of two text files (difflib), in [0, 1]."""
    if result is None:
        return 0.0
    with open(result) as f:
        a = f.read().splitlines()
    with open(expected) as f:
        b = f.read().splitlines()
    return difflib.SequenceMatcher(a=a, b=b).ratio()


def file_contains(path: str | None, rules: dict) -> float:
    """Every string of `rules["expected"]` occurs in the text file at `path`. As desktop-env: no path,
    an unreadable or undecodable file, a missing or non-iterable `expected` score 0
    (decision "Or-evaluator fallthrough")."""
    if not path:
        return 0.0
    try:
        with open(path) as f:
            text = f.read()
        for s in rules["expected"]:
            if s not in text:
                return 0.0
    except Exception as e:  # desktop-env: a bare `except` around the same block
        return _cannot_score("file_contains", e)
    return 1.0


def check_direct_json_object(result: Any, rules: dict) -> float:
    """Compare a JSON object (or its text, single quotes allowed) with `rules["expected"]`.

    Default: every expected key equal (with `ignore_list_order` in expected: compare sorted lists; as in
    desktop-env the flag is itself a key of `expected`, so its own `sorted(True)` fails and the metric
    scores 0 whenever the flag is set: kept, so scores match OSWorld's; no shipped task sets it).
    `expect_in_result`: a list value means "the result's value (list or str) contains / equals one of
    them", a str value means "is a substring of (or, for a list value, an item of) the result's value".
    Anything that cannot be compared scores 0 (decision "Or-evaluator fallthrough"); a string that is not JSON
    raises, as there.
    """
    if isinstance(result, str):
        result = json.loads(result.strip().replace("'", '"'))
    if result is None:
        return 0.0
    try:
        return _json_object_score(result, rules)
    except Exception as e:  # desktop-env: `except Exception` around the same comparisons
        return _cannot_score("check_direct_json_object", e)


def _json_object_score(result: Any, rules: dict) -> float:
    expected_or_empty = rules.get("expected", {})
    if expected_or_empty and any(v == "__EVALUATION_FAILED__" for v in expected_or_empty.values()):
        return 0.0
    expected = rules["expected"]
    if not rules.get("expect_in_result", False):
        for key in expected.keys():  # noqa: SIM118 - a list `expected` (even []) must fail, as there
            want, got = expected.get(key), result.get(key)
            if expected.get("ignore_list_order", False):
                if sorted(want) != sorted(got):
                    return 0.0
            elif want != got:
                return 0.0
        return 1.0
    for key in expected.keys():  # noqa: SIM118 - likewise
        want, got = expected.get(key), result.get(key)
        if isinstance(want, list):
            if not any(
                (isinstance(got, list) and w in got) or (isinstance(got, str) and w == got) for w in want
            ):
                return 0.0
        elif isinstance(want, str):
            if want not in got:
                return 0.0
        else:
            return 0.0
    return 1.0


def check_moved_jpgs(directory_list: dict, rules: dict) -> float:
    names = [node["name"] for node in directory_list["children"]]
    want = rules["expected"]
    return float(len(names) == len(want) and set(names) == set(want))


def check_gnome_favorite_apps(apps_str: str, rules: dict) -> float:
    apps = ast.literal_eval(apps_str.strip())  # decision "No eval": never eval desktop output
    want = rules["expected"]
    return float(len(apps) == len(want) and set(apps) == set(want))


def is_utc_0(timedatectl_output: str) -> float:
    return float(timedatectl_output.split("\n")[3].endswith("+0000)"))


def check_text_enlarged(scaling_factor_str: str) -> float:
    return float(float(scaling_factor_str) > 1.0)


METRICS: dict[str, Callable[..., float]] = {
    "exact_match": exact_match,
    "match_in_list": match_in_list,
    "is_in_list": is_in_list,
    "check_include_exclude": check_include_exclude,
    "literal_match": literal_match,
    "check_list": check_list,
    "compare_text_file": compare_text_file,
    "diff_text_file": diff_text_file,
    "file_contains": file_contains,
    "check_direct_json_object": check_direct_json_object,
    "check_moved_jpgs": check_moved_jpgs,
    "check_gnome_favorite_apps": check_gnome_favorite_apps,
    "is_utc_0": is_utc_0,
    "check_text_enlarged": check_text_enlarged,
}
"""`infeasible` is not here: it is decided by the agent's last action (the env handles it)."""


# ---------------------------------------------------------------------------------------------------------
# Support check and evaluation
# ---------------------------------------------------------------------------------------------------------


def _as_list(x: Any) -> list:
    return x if isinstance(x, list) else [x]


def unsupported_features(task: dict) -> list[str]:
    """Names of what this task needs and `OSWorldEnv` cannot do: 'setup:<type>', 'postconfig:<type>',
    'getter:<type>', 'metric:<name>' (sorted, unique). Empty = the task can run."""
    missing: set[str] = set()
    for step in task.get("config") or []:
        if step.get("type") not in SETUP_STEPS:
            missing.add(f"setup:{step.get('type')}")
    ev = task.get("evaluator") or {}
    for step in ev.get("postconfig") or []:
        if step.get("type") not in SETUP_STEPS:
            missing.add(f"postconfig:{step.get('type')}")
    funcs = _as_list(ev.get("func"))
    if funcs != ["infeasible"]:
        for name in funcs:
            if name not in METRICS:
                missing.add(f"metric:{name}")
        for key in ("result", "expected"):
            for g in _as_list(ev.get(key)):
                if g and g.get("type") not in GETTERS:
                    missing.add(f"getter:{g.get('type')}")
    return sorted(missing)


def needs_internet(task: dict) -> bool:
    """The task downloads something (setup `download`, getter `cloud_file`): no offline run."""
    steps = list(task.get("config") or []) + list((task.get("evaluator") or {}).get("postconfig") or [])
    if any(s.get("type") == "download" for s in steps):
        return True
    ev = task.get("evaluator") or {}
    return any(
        g and g.get("type") == "cloud_file" for k in ("result", "expected") for g in _as_list(ev.get(k))
    )


def combine_scores(scores: list[float], conj: str) -> float:
    """OSWorld's combination of several metrics: 'and' -> 0 if any is 0 else the mean; 'or' -> the max."""
    if conj == "and":
        return 0.0 if any(s == 0.0 for s in scores) else sum(scores) / len(scores)
    if conj == "or":
        return max(scores)
    raise ValueError(f"unknown conj {conj!r} (expected 'and' or 'or')")


def evaluate_task(evaluator: dict, desk: DesktopAPI, cache_dir: str) -> float:
    """Score a finished episode with the task's `evaluator` (not `infeasible`; postconfig already run).

    Raises for unsupported getters/metrics and whatever a getter raises
    (decision "Getter failures score zero"; the env turns any exception into score 0); a metric that raises
    scores 0 and the evaluation goes on (decision "Or-evaluator fallthrough").
    """
    funcs = _as_list(evaluator["func"])
    n = len(funcs)
    single = not isinstance(evaluator["func"], list)

    def per_metric(key: str, default: Any) -> list:
        v = evaluator.get(key, default)
        if single:
            return [v]
        if isinstance(v, list):
            return v if v or key == "result" else [default] * n  # decision "OSWorld semantics": [] means none
        return [v] * n

    results = per_metric("result", None)
    expecteds = per_metric("expected", None)
    options = per_metric("options", {})
    conj = evaluator.get("conj", "and")
    scores: list[float] = []
    for name, rcfg, ecfg, opts in zip(funcs, results, expecteds, options, strict=True):
        metric = METRICS[name]
        try:
            result = GETTERS[rcfg["type"]](desk, cache_dir, rcfg) if rcfg else None
        except FileNotFoundError:
            if conj == "and":
                return 0.0
            result = None
        args = (result, GETTERS[ecfg["type"]](desk, cache_dir, ecfg)) if ecfg else (result,)
        try:
            score = float(metric(*args, **(opts or {})))
        except Exception as e:
            # decision "Or-evaluator fallthrough": this metric cannot score; under "or" the next one may
            score = _cannot_score(name, e)
        if conj == "and" and score == 0.0:
            return 0.0
        if conj == "or" and score == 1.0:
            return 1.0
        scores.append(score)
    return combine_scores(scores, conj)
