"""OSWorld desktops behind `GuiEnv`: the OSWorld HTTP protocol, task JSON loading, setup and evaluation.

Design decisions:
- **VM server protocol.** The env speaks OSWorld's VM server protocol over HTTP (docs/method.md §5) and
  nothing else, so one class drives the official Ubuntu VM (docker image, cloud VMs) and the project's own
  local Xvfb desktop (`desktop_server`). Actions arrive as screen-pixel `Action`s, are rendered by
  `actions.to_pyautogui` and sent as `python -c` through POST /execute, exactly as OSWorld's PythonController
  does (prefix `import pyautogui; import time; pyautogui.FAILSAFE = False; ` - without OSWorld's pyperclip
  import, which the local desktop does not need). DONE / FAIL / WAIT markers are not sent; WAIT sleeps.
- **Providers.** Providers: `local` starts a fresh `LocalDesktop` at every reset (new display, new home, no
  process left from the previous episode); `remote` drives already-running desktops given by base URL. With
  many URLs and one factory for all pool workers, each worker claims a free URL by holding an
  exclusive `flock` on `<claim_dir>/<i>.lock` for its lifetime; the kernel drops the lock when the
  worker dies, so a restarted worker finds the slot free again. A remote reset does NOT revert the VM
  (plain HTTP cannot); use the `desktop_env` bridge (desktop_env_bridge.py) for snapshot reverts.
  `check_desktops` is the health check a pipeline runs on the URLs before it starts a pool.
- **Task files.** Tasks are OSWorld JSON files, loaded unchanged into `TaskSpec(config={"path", "task",
  "unsupported"})`. `unsupported` names every setup step / getter / metric the env lacks; `reset`
  refuses such a task with that list in the message, so nothing is silently scored 0 or 1.
  Local suite tasks may carry an extra `oracle` key (or the suite entry a `config.oracle`): scripted
  UI-TARS replies in 0-1000 relative screen coordinates, one per step, so one script holds at any screen
  size. OSWorld ignores the key; `oracle_actions` serves them in screen pixels and `oracle_reply` in the
  model-image frame (what `arpo_core.offline.demonstrations` and the rollout code parse and map back).
- **OSWorld scoring.** Scoring follows OSWorld's `DesktopEnv.evaluate`, then docs/method.md §1: postconfig
  steps run first; an `infeasible` task scores 1 iff the agent's last action is FAIL
  (`rewards.infeasible_score`); a feasible task whose last action is FAIL scores 0; otherwise the evaluator
  decides (`osworld_evaluators.evaluate_task`). Any exception scores 0 (`rewards.score_or_error`; the text is
  kept in `last_eval_error`). With `osworld_hard=True` and `max_steps`, "OSWorld Hard" applies on top
  (`rewards.osworld_hard`: step limit reached with a final FAIL scores 0).
- **Faults as data.** Faults are data (base.py, decision "Faults are data"): a desktop that does not answer
  turns a step into `info={"error", "fatal": True}`, so the pool restarts the worker (and with it the
  desktop); a pyautogui command that fails inside the desktop (e.g. an unknown key) is the policy's mistake
  and goes to `info["action_errors"]`, the episode continues.
- **OSWorld suites.** Suites: `load_osworld_suite` reads a suite YAML (`base.load_suite` format, backend
  "osworld") whose tasks name their JSON in `config.path`, relative to the repository root, or
  `osworld:<relpath>` relative to the OSWorld task folder: by default `data/osworld` inside the repository,
  which ships OSWorld's task files unmodified with their Apache-2.0 LICENSE (`data/osworld/NOTICE.md`);
  `ARPO_OSWORLD_ROOT` overrides it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import logging
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from PIL import Image

from arpo_core.actions import (
    PYAUTOGUI_MARKERS,
    Action,
    format_response,
    parse_response,
    to_model,
    to_pyautogui,
)
from arpo_core.envs.base import TERMINAL_KINDS, Observation, StepResult, TaskSpec, load_suite
from arpo_core.envs.osworld.desktop_server import LocalDesktop
from arpo_core.envs.osworld.osworld_evaluators import (
    download_cache_name,
    evaluate_task,
    fetch_url,
    needs_internet,
    unsupported_features,
)
from arpo_core.rewards import FAIL_ACTIONS, infeasible_score, osworld_hard, score_or_error

REPO_ROOT = Path(__file__).resolve().parents[3]
OSWORLD_DEFAULT_ROOT = REPO_ROOT / "data" / "osworld"  # shipped unmodified, Apache-2.0 (its NOTICE.md)
PYAUTOGUI_PREFIX = "import pyautogui; import time; pyautogui.FAILSAFE = False; "
PROVIDERS = ("local", "remote")
log = logging.getLogger("arpo.osworld")


def osworld_root() -> Path:
    """Folder of the OSWorld task definitions: `ARPO_OSWORLD_ROOT` if set, else `data/osworld` in the
    repository (decision "OSWorld suites")."""
    return Path(os.environ.get("ARPO_OSWORLD_ROOT") or OSWORLD_DEFAULT_ROOT)


def resolve_task_path(path: str) -> Path:
    """`osworld:<rel>` -> under `osworld_root()`; a relative path -> under the repository root."""
    if path.startswith("osworld:"):
        return osworld_root() / path[len("osworld:") :]
    p = Path(path)
    return p if p.is_absolute() else REPO_ROOT / p


# ---------------------------------------------------------------------------------------------------------
# Task loading
# ---------------------------------------------------------------------------------------------------------


class TaskFileError(ValueError):
    """An OSWorld task file that cannot be used; the message names the file and the field."""


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _check_steps(steps: Any, where: str, field: str) -> None:
    if steps is None:
        return
    if not isinstance(steps, list):
        raise TaskFileError(f"{where}: {field!r} must be a list of steps, got {_kind(steps)} {steps!r:.60}")
    for i, step in enumerate(steps):
        if not isinstance(step, dict):
            raise TaskFileError(f"{where}: {field}[{i}] must be an object, got {_kind(step)}")
        if not isinstance(step.get("type"), str):
            raise TaskFileError(f"{where}: {field}[{i}].type must be a string, got {_kind(step.get('type'))}")
        if not isinstance(step.get("parameters", {}), dict):
            raise TaskFileError(f"{where}: {field}[{i}].parameters must be an object")


def validate_task(task: Any, where: str) -> None:
    """Raise `TaskFileError` naming `where` (the file) and the field when `task` is not an OSWorld task
    the loader and `unsupported_features` can read (decision "Task files")."""
    if not isinstance(task, dict):
        raise TaskFileError(f"{where}: a task file must hold a JSON object, got {_kind(task)}")
    for key in ("id", "instruction", "evaluator"):
        if key not in task:
            raise TaskFileError(f"{where}: OSWorld task without {key!r}")
    if not isinstance(task["id"], str | int) or isinstance(task["id"], bool) or str(task["id"]) == "":
        raise TaskFileError(
            f"{where}: 'id' must be a non-empty string, got {_kind(task['id'])} {task['id']!r:.60}"
        )
    if not isinstance(task["instruction"], str):
        raise TaskFileError(f"{where}: 'instruction' must be a string, got {_kind(task['instruction'])}")
    ev = task["evaluator"]
    if not isinstance(ev, dict):
        raise TaskFileError(f"{where}: 'evaluator' must be an object, got {_kind(ev)} {ev!r:.60}")
    funcs = ev.get("func")
    if not (
        isinstance(funcs, str)
        or (isinstance(funcs, list) and funcs and all(isinstance(f, str) for f in funcs))
    ):
        raise TaskFileError(f"{where}: evaluator.func must be a name or a list of names, got {_kind(funcs)}")
    _check_steps(task.get("config"), where, "config")
    _check_steps(ev.get("postconfig"), where, "evaluator.postconfig")
    for key in ("result", "expected"):
        value = ev.get(key)
        items = value if isinstance(value, list) else [value]
        for item in items:
            if item is not None and not isinstance(item, dict):
                raise TaskFileError(
                    f"{where}: evaluator.{key} must be an object or a list of them, got {_kind(item)}"
                )
            if isinstance(item, dict) and not isinstance(item.get("type", ""), str):
                raise TaskFileError(f"{where}: evaluator.{key}.type must be a string")
    for key in ("options",):
        if ev.get(key) is not None and not isinstance(ev[key], dict | list):
            raise TaskFileError(f"{where}: evaluator.{key} must be an object or a list, got {_kind(ev[key])}")


def read_task_file(path: str | Path) -> dict:
    """The JSON object of a task file; `TaskFileError` naming the file for unreadable, binary or
    malformed content (with the line and column of a JSON error)."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise TaskFileError(f"{p}: cannot read: {e.strerror or e}") from e
    if b"\0" in raw:
        raise TaskFileError(f"{p}: not a JSON text file (binary content)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TaskFileError(f"{p}: not UTF-8 text (byte {e.start}): not a JSON task file") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise TaskFileError(f"{p}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from e
    except RecursionError as e:
        raise TaskFileError(f"{p}: invalid JSON: nested too deeply") from e


def task_spec_from_json(task: dict, domain: str, path: str = "", split: str = "in_domain") -> TaskSpec:
    """An OSWorld task dict -> TaskSpec (feasible unless func is `infeasible`; see decision "Task files").
    Raises `TaskFileError` (a ValueError) naming the file and the field for a malformed task."""
    validate_task(task, path or "task")
    return TaskSpec(
        domain=domain,
        task_id=str(task["id"]),
        instruction=str(task["instruction"]),
        split=split,
        feasible=task["evaluator"].get("func") != "infeasible",
        backend="osworld",
        config={"path": path, "task": task, "unsupported": unsupported_features(task)},
    )


def load_osworld_task(path: str | Path, domain: str | None = None) -> TaskSpec:
    """One OSWorld task file; the domain defaults to its folder name (`examples/<domain>/<id>.json`)."""
    p = Path(path)
    return task_spec_from_json(read_task_file(p), domain or p.parent.name, str(p))


def load_osworld_files(paths: Iterable[str | Path]) -> tuple[list[TaskSpec], list[tuple[str, str]]]:
    """Every file that loads, and (file, reason) for each rejected one: a bad file is listed and
    logged (one warning line) without stopping the others."""
    specs, rejected = [], []
    for path in paths:
        try:
            specs.append(load_osworld_task(path))
        except TaskFileError as e:
            rejected.append((str(path), str(e)))
            log.warning("OSWorld task file rejected: %s", e)
    return specs, rejected


def load_osworld_index(
    root: str | Path | None = None, index: str = "test_all.json", rejected: list | None = None
) -> list[TaskSpec]:
    """All tasks listed in `<root>/evaluation_examples/<index>` ({domain: [ids]}), in index order. A
    listed file that is missing or malformed is skipped with a warning and appended to `rejected`
    ((file, reason)) when given, instead of aborting the whole index."""
    base = Path(root) if root is not None else osworld_root()
    ex = base / "evaluation_examples"
    listing = read_task_file(ex / index)
    if not isinstance(listing, dict) or not all(isinstance(v, list) for v in listing.values()):
        raise TaskFileError(f"{ex / index}: an index must map each domain to a list of task ids")
    specs, bad = load_osworld_files(
        ex / "examples" / d / f"{i}.json" for d, ids in listing.items() for i in ids
    )
    if rejected is not None:
        rejected.extend(bad)
    return specs


def support_report(specs: list[TaskSpec]) -> dict[str, Any]:
    """Counts for docs/osworld.md: supported tasks, tasks needing internet, and each missing feature with
    the number of tasks it blocks."""
    blocked: dict[str, int] = {}
    supported = offline = 0
    for s in specs:
        missing = s.config["unsupported"]
        for m in missing:
            blocked[m] = blocked.get(m, 0) + 1
        if not missing:
            supported += 1
            offline += not needs_internet(s.config["task"])
    return {
        "tasks": len(specs),
        "supported": supported,
        "supported_offline": offline,
        "blocked_by": dict(sorted(blocked.items(), key=lambda kv: (-kv[1], kv[0]))),
    }


def load_osworld_suite(path: str | Path) -> list[TaskSpec]:
    """A suite YAML of OSWorld tasks (decision "OSWorld suites") -> TaskSpecs with the task JSON loaded.

    The suite's `domain` / `split` / `task_id` win over the JSON (the id must match the JSON's `id`).
    """
    specs = []
    for s in load_suite(path):
        if "path" not in s.config:
            raise ValueError(f"{path}: task {s.task_id} has no config.path to its OSWorld JSON")
        file = resolve_task_path(s.config["path"])
        task = read_task_file(file)
        if not isinstance(task, dict):
            raise TaskFileError(f"{file}: a task file must hold a JSON object, got {_kind(task)}")
        if str(task.get("id")) != s.task_id:
            raise ValueError(f"{path}: task_id {s.task_id} != id {task.get('id')!r} in {file}")
        full = task_spec_from_json(task, s.domain, s.config["path"], s.split)
        specs.append(replace(full, config={**s.config, **full.config}))
    return specs


# ---------------------------------------------------------------------------------------------------------
# HTTP client (OSWorld protocol)
# ---------------------------------------------------------------------------------------------------------


class DesktopError(RuntimeError):
    """The desktop did not answer or answered with a transport-level error (an env fault)."""


class DesktopClient:
    """Minimal OSWorld-protocol client (stdlib only); `token` is sent as a Bearer header when given."""

    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 90.0):
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        ctype: str | None = None,
        timeout_s: float | None = None,
    ) -> tuple[int, bytes]:
        """Returns (status, body) for any HTTP status; raises DesktopError when there is no answer."""
        req = urllib.request.Request(self.base_url + path, data=body, method=method)
        if ctype:
            req.add_header("Content-Type", ctype)
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except (urllib.error.URLError, OSError) as e:
            raise DesktopError(f"{method} {path}: {e}") from e

    def post_json(self, path: str, payload: dict, timeout_s: float | None = None) -> tuple[int, Any]:
        code, raw = self.request("POST", path, json.dumps(payload).encode(), "application/json", timeout_s)
        try:
            return code, json.loads(raw)
        except ValueError:
            return code, raw.decode(errors="replace")

    # -- the calls getters and the env need (osworld_evaluators.DesktopAPI)
    def screenshot(self) -> Image.Image:
        code, raw = self.request("GET", "/screenshot")
        if code != 200:
            raise DesktopError(f"screenshot: HTTP {code}")
        return Image.open(io.BytesIO(raw)).convert("RGB")

    def execute(self, command: Any, shell: bool = False, timeout_s: float | None = None) -> dict:
        code, res = self.post_json("/execute", {"command": command, "shell": shell}, timeout_s)
        if not isinstance(res, dict):
            raise DesktopError(f"execute: HTTP {code}: {str(res)[:200]}")
        return res

    def get_file(self, path: str) -> bytes | None:
        body = urllib.parse.urlencode({"file_path": path}).encode()
        code, raw = self.request("POST", "/file", body, "application/x-www-form-urlencoded")
        return raw if code == 200 else None

    def terminal_output(self) -> str | None:
        code, raw = self.request("GET", "/terminal")
        return json.loads(raw).get("output") if code == 200 else None

    def list_directory(self, path: str) -> dict | None:
        code, res = self.post_json("/list_directory", {"path": path})
        return res.get("directory_tree") if code == 200 and isinstance(res, dict) else None

    def screen_size(self) -> dict:
        return self.post_json("/screen_size", {})[1]

    def upload(self, path: str, data: bytes) -> None:
        boundary = uuid.uuid4().hex
        parts = [
            f'--{boundary}\r\nContent-Disposition: form-data; name="file_path"\r\n\r\n{path}\r\n'.encode(),
            (
                f'--{boundary}\r\nContent-Disposition: form-data; name="file_data"; '
                f'filename="{os.path.basename(path)}"\r\nContent-Type: application/octet-stream\r\n\r\n'
            ).encode()
            + data
            + b"\r\n",
            f"--{boundary}--\r\n".encode(),
        ]
        code, raw = self.request(
            "POST", "/setup/upload", b"".join(parts), f"multipart/form-data; boundary={boundary}"
        )
        if code != 200:
            raise DesktopError(f"upload {path}: HTTP {code}: {raw[:200]!r}")


def claim_slot(urls: list[str], claim_dir: str | Path) -> tuple[int, Any]:
    """Claim the first free URL index (decision "Providers"); returns (index, open lock file to keep)."""
    d = Path(claim_dir)
    d.mkdir(parents=True, exist_ok=True)
    for i in range(len(urls)):
        f = open(d / f"{i}.lock", "w")  # noqa: SIM115 (held open for the worker's lifetime)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            continue
        return i, f
    raise RuntimeError(f"all {len(urls)} desktop URLs are claimed by other envs (claim dir {d})")


def check_desktops(
    urls: list[str] | tuple[str, ...], token: str | None = None, timeout_s: float = 5.0
) -> None:
    """Health check of remote desktops before a pool starts (decision "Providers"): every URL must answer
    GET /platform with 200 within `timeout_s`; otherwise one DesktopError names each URL that did not
    and why (no answer, wrong token, another status)."""
    problems = []
    for url in urls:
        try:
            code, raw = DesktopClient(url, token, timeout_s).request("GET", "/platform")
        except DesktopError as e:
            problems.append(f"{url} did not answer within {timeout_s:g} s ({e})")
            continue
        if code == 401:
            problems.append(f"{url} refused the token (HTTP 401)")
        elif code != 200:
            problems.append(f"{url} answered HTTP {code}: {raw[:200]!r}")
    if problems:
        raise DesktopError(
            "OSWorld desktops (env.osworld.base_urls) failed the health check GET /platform: "
            + "; ".join(problems)
        )


# ---------------------------------------------------------------------------------------------------------
# The env
# ---------------------------------------------------------------------------------------------------------


class OSWorldEnv:
    """GuiEnv over OSWorld's HTTP protocol (see the module docstring)."""

    def __init__(
        self,
        provider: str = "local",
        base_urls: tuple[str, ...] | list[str] = (),
        token: str | None = None,
        claim_dir: str | None = None,
        screen_size: tuple[int, int] = (1920, 1080),
        settle_s: float = 0.5,
        setup_settle_s: float = 1.0,
        wait_s: float = 2.0,
        command_timeout_s: float = 60.0,
        max_steps: int | None = None,
        osworld_hard_scoring: bool = False,
        download_cache_dir: str | None = None,
    ):
        """
        Args:
            provider: "local" (own Xvfb desktop, fresh per reset) or "remote" (running OSWorld servers).
            base_urls: remote: the desktops' base URLs (e.g. http://10.0.0.5:5000); one per parallel env.
            token: remote: Bearer token to send, if the servers want one (OSWorld's do not).
            claim_dir: remote: folder for the URL claims (default ~/.cache/arpo/osworld-claims/<hash>).
            screen_size: local: the desktop's (width, height); remote desktops report theirs.
            settle_s: pause after a step's actions before the screenshot (UI catches up).
            setup_settle_s: pause after the setup steps before the first screenshot.
            wait_s: how long the `wait()` action sleeps (OSWorld's WAIT).
            command_timeout_s: local: limit for one command run on the desktop.
            max_steps / osworld_hard_scoring: apply "OSWorld Hard" in `evaluate` (decision "OSWorld scoring").
            download_cache_dir: where setup `download` files are cached (OSWorld's cache naming); a
                pre-filled cache lets download steps run offline.
        """
        if provider not in PROVIDERS:
            raise ValueError(f"unknown provider {provider!r} (expected one of {PROVIDERS})")
        if provider == "remote" and not base_urls:
            raise ValueError("provider 'remote' needs base_urls")
        self.provider = provider
        self.base_urls = list(base_urls)
        self.token = token
        self.screen_size = tuple(screen_size)
        self.settle_s, self.setup_settle_s, self.wait_s = settle_s, setup_settle_s, wait_s
        self.command_timeout_s = command_timeout_s
        self.max_steps = max_steps
        self.osworld_hard_scoring = osworld_hard_scoring
        self.download_cache_dir = download_cache_dir or str(
            Path.home() / ".cache" / "arpo" / "osworld-downloads"
        )
        key = hashlib.sha1("\n".join(self.base_urls).encode()).hexdigest()[:12]
        self.claim_dir = claim_dir or str(Path.home() / ".cache" / "arpo" / "osworld-claims" / key)
        self.observed_size: tuple[int, int] = self.screen_size
        """Size of the last screenshot: the frame actions are clamped to and oracles are scaled to."""
        self.desktop: LocalDesktop | None = None
        self.client: DesktopClient | None = None
        self._claim: Any = None
        self.task: TaskSpec | None = None
        self.cache_dir: str | None = None
        self.history: list[Action] = []
        self.steps = 0
        self.last_eval_error: str | None = None

    # ------------------------------------------------------------------ connection
    def _connect(self) -> DesktopClient:
        if self.provider == "local":
            if self.desktop is None:
                self.desktop = LocalDesktop(self.screen_size, self.command_timeout_s)
            info = self.desktop.start()  # a fresh desktop every episode (decision "Providers")
            self.client = DesktopClient(info.base_url, info.token)
        elif self.client is None:
            idx, self._claim = claim_slot(self.base_urls, self.claim_dir)
            self.client = DesktopClient(self.base_urls[idx], self.token)
        return self.client

    def desktop_pid(self) -> int | None:
        """Local provider: pid (= process group) of the current desktop server, else None."""
        return self.desktop.info.pid if self.desktop is not None and self.desktop.info else None

    def home_dir(self) -> str | None:
        """Local provider: the current episode's home directory (for tests and debugging)."""
        return self.desktop.info.home if self.desktop is not None and self.desktop.info else None

    # ------------------------------------------------------------------ setup steps
    def run_steps(self, steps: list[dict]) -> None:
        """Run OSWorld setup / postconfig steps in order (types: osworld_evaluators.SETUP_STEPS)."""
        c = self.client
        assert c is not None and self.cache_dir is not None
        for step in steps:
            kind, p = step["type"], step.get("parameters", {})
            if kind == "sleep":
                time.sleep(float(p["seconds"]))
            elif kind in ("execute", "command"):
                self._execute_step(p)
            elif kind == "launch":
                code, res = c.post_json(
                    "/setup/launch", {"command": p["command"], "shell": p.get("shell", False)}
                )
                self._check(code, res, kind)
            elif kind == "open":
                code, res = c.post_json("/setup/open_file", {"path": p["path"]})
                self._check(code, res, kind)
            elif kind in ("activate_window", "close_window"):
                payload = {k: p[k] for k in ("window_name", "strict", "by_class") if k in p}
                c.post_json(f"/setup/{kind}", payload)  # OSWorld logs a missing window and goes on
            elif kind == "download":
                for f in p["files"]:
                    local = os.path.join(self.download_cache_dir, download_cache_name(f["url"], f["path"]))
                    c.upload(f["path"], Path(fetch_url(f["url"], local)).read_bytes())
            elif kind == "upload_file":
                for f in p["files"]:
                    c.upload(f["path"], resolve_task_path(f["local_path"]).read_bytes())
            else:
                raise ValueError(f"unsupported setup step {kind!r}")

    def _check(self, code: int, res: Any, kind: str) -> None:
        if code >= 500 or code == 401:
            raise DesktopError(f"setup {kind}: HTTP {code}: {str(res)[:200]}")

    def _execute_step(self, p: dict) -> None:
        """OSWorld's execute step: optional `stdout`/`stderr` files in the cache, optional `until` loop."""
        assert self.client is not None and self.cache_dir is not None
        until = p.get("until") or {}
        for _ in range(30 if until else 1):
            code, res = self.client.post_json(
                "/setup/execute", {"command": p["command"], "shell": p.get("shell", False)}
            )
            if not isinstance(res, dict):
                raise DesktopError(f"setup execute: HTTP {code}: {str(res)[:200]}")
            for key, field in (("stdout", "output"), ("stderr", "error")):
                if p.get(key):
                    Path(self.cache_dir, p[key]).write_text(res.get(field) or "")
            if (
                not until
                or ("returncode" in until and res.get("returncode") == until["returncode"])
                or ("stdout" in until and until["stdout"] in (res.get("output") or ""))
                or ("stderr" in until and until["stderr"] in (res.get("error") or ""))
            ):
                return
            time.sleep(0.3)

    # ------------------------------------------------------------------ GuiEnv
    def reset(self, task: TaskSpec, seed: int | None = None) -> Observation:
        """Fresh desktop (local) and the task's setup steps; `seed` is unused (desktops are not seeded)."""
        if task.backend != "osworld" or "task" not in task.config:
            raise ValueError(f"{task.key}: not an OSWorld task (load it with load_osworld_task / _suite)")
        missing = task.config.get("unsupported") or unsupported_features(task.config["task"])
        if missing:
            raise ValueError(f"{task.key}: unsupported by OSWorldEnv: {', '.join(missing)}")
        self.task = task
        self.history, self.steps, self.last_eval_error = [], 0, None
        if self.cache_dir:
            shutil.rmtree(self.cache_dir, ignore_errors=True)
        self.cache_dir = tempfile.mkdtemp(prefix="arpo-osworld-cache-")
        self._connect()
        self.run_steps(task.config["task"].get("config") or [])
        time.sleep(self.setup_settle_s)
        return self._observe()

    def _observe(self) -> Observation:
        assert self.client is not None and self.task is not None
        img = self.client.screenshot()
        self.observed_size = img.size  # remote desktops report their own size
        return Observation(img, self.task.instruction, img.size)

    def step(self, actions: list[Action]) -> StepResult:
        """Send the actions as pyautogui code (decision "VM server protocol"); a FAIL/DONE marker ends the
        episode."""
        assert self.client is not None and self.task is not None
        self.steps += 1
        info: dict[str, Any] = {}
        action_errors: list[str] = []
        done = False
        try:
            for action in actions:
                try:
                    (code,) = to_pyautogui([action], self.observed_size)
                except ValueError as e:  # an invalid action is the policy's mistake, not an env fault
                    action_errors.append(f"{action.kind}: {e}")
                    continue
                self.history.append(action)
                if code in PYAUTOGUI_MARKERS:
                    if code == "WAIT":
                        time.sleep(self.wait_s)
                        continue
                    done = True
                    break
                res = self.client.execute(["python", "-c", PYAUTOGUI_PREFIX + code])
                if res.get("returncode", 0) != 0:
                    action_errors.append(f"{action.kind}: {(res.get('error') or '').strip()[-300:]}")
            time.sleep(self.settle_s)
            obs = self._observe()
        except DesktopError as e:
            info.update(error=f"desktop fault: {e}", fatal=True)
            blank = Image.new("RGB", self.observed_size)
            return StepResult(Observation(blank, self.task.instruction, self.observed_size), True, info)
        if action_errors:
            info["action_errors"] = action_errors
        info["last_action_kind"] = self.last_action_kind
        return StepResult(obs, done or any(a.kind in TERMINAL_KINDS for a in actions), info)

    @property
    def last_action_kind(self) -> str | None:
        return self.history[-1].kind if self.history else None

    def evaluate(self) -> float:
        """Task score in [0, 1] (decision "OSWorld scoring"); an exception scores 0 and is kept in
        `last_eval_error`."""
        score, self.last_eval_error = score_or_error(self._score)
        return score

    def _score(self) -> float:
        assert self.task is not None and self.cache_dir is not None
        ev = self.task.config["task"]["evaluator"]
        last = self.last_action_kind
        if ev.get("func") == "infeasible":
            score = infeasible_score(last)
        elif last in FAIL_ACTIONS:
            score = 0.0
        else:
            self.run_steps(ev.get("postconfig") or [])
            assert self.client is not None
            score = evaluate_task(ev, self.client, self.cache_dir)
        if self.osworld_hard_scoring and self.max_steps is not None:
            score = osworld_hard(score, self.steps >= self.max_steps, last)
        return score

    def dom_elements(self) -> None:
        """A desktop serves no DOM (MiniWoB's envs do): None, so callers such as the demos' recovery
        misses (arpo_core/offline/demonstrations.py) skip what needs one instead of failing the worker."""
        return None

    def _oracle_replies(self) -> list[str]:
        assert self.task is not None
        return list(self.task.config.get("oracle") or self.task.config["task"].get("oracle") or [])

    def oracle_actions(self) -> list[Action] | None:
        """The oracle's actions for the current step in SCREEN pixels; None without an oracle or once its
        replies are used up. Oracle replies are written in 0-1000 relative screen coordinates (so they
        hold at any screen size) and come from the suite entry's `config.oracle` or the JSON's `oracle`."""
        replies = self._oracle_replies()
        if self.steps >= len(replies):
            return None
        w, h = self.observed_size
        actions = parse_response(replies[self.steps]).actions
        return [
            replace(a, point=rel1000_to_screen(a.point, w, h), end_point=rel1000_to_screen(a.end_point, w, h))
            for a in actions
        ]

    def oracle_reply(self, min_pixels: int | None = None, max_pixels: int | None = None) -> str | None:
        """The oracle's UI-TARS reply for the current step with coordinates in the model-image frame
        (smart_resize of the screen with min/max_pixels, what the policy sees), ready to be parsed and
        mapped back by the normal rollout code; None when there is no (further) oracle reply."""
        from arpo_core.envs.miniwob.oracles import MODEL_MAX_PIXELS, MODEL_MIN_PIXELS, model_size

        actions = self.oracle_actions()
        if actions is None:
            return None
        thought = parse_response(self._oracle_replies()[self.steps]).thought
        screen = self.observed_size
        size = model_size(screen, min_pixels or MODEL_MIN_PIXELS, max_pixels or MODEL_MAX_PIXELS)

        def m(p: tuple[float, float] | None) -> tuple[float, float] | None:
            return None if p is None else to_model(p, size, screen)

        mapped = [replace(a, point=m(a.point), end_point=m(a.end_point)) for a in actions]
        return format_response(thought, mapped)

    def close(self) -> None:
        if self.desktop is not None:
            self.desktop.stop()
            self.desktop = None
        self.client = None
        if self._claim is not None:
            with contextlib.suppress(OSError):
                self._claim.close()
            self._claim = None
        if self.cache_dir:
            shutil.rmtree(self.cache_dir, ignore_errors=True)
            self.cache_dir = None


def rel1000_to_screen(p: tuple[float, float] | None, w: int, h: int) -> tuple[float, float] | None:
    """0-1000 relative coordinates -> screen pixels (clamped to the last pixel)."""
    if p is None:
        return None
    return (min(p[0] * w / 1000.0, w - 1.0), min(p[1] * h / 1000.0, h - 1.0))


def make_osworld_env(**kwargs: Any) -> OSWorldEnv:
    """Picklable factory for EnvPool: `functools.partial(make_osworld_env, provider="local")`."""
    return OSWorldEnv(**kwargs)
