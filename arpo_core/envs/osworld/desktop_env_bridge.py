"""The official OSWorld `desktop-env` package behind a loopback HTTP server, and a `GuiEnv` that uses it.

`desktop-env` pins torch~=2.5, transformers~=4.35, numpy<2 (docs/method.md §5): it cannot be imported by the
training environment. `scripts/setup_desktop_env.sh` puts it into its own virtual environment, and this
file runs there as a script (`serve`, standard library + desktop_env only) exposing `DesktopEnv` reset /
step / evaluate over HTTP on 127.0.0.1 with a per-session token. The training side (`DesktopEnvBridgeEnv`,
imported normally from arpo_core) starts that server with the other interpreter and talks to it, so users
with OSWorld VMs get the official providers (vmware, virtualbox, docker, aws, azure, ...), snapshot
reverts and ALL official evaluators, while the policy side stays the same `GuiEnv`.

SECURITY: like the desktop server, the bridge controls machines that execute arbitrary commands; it binds
to 127.0.0.1 and refuses requests without its token. Use it on disposable machines / VMs.

Design decisions:
- **Two halves.** Two halves in one file: the server half imports only the standard library at module level
  (it runs under the desktop-env venv's interpreter, where arpo_core's dependencies are absent); the client
  half imports arpo_core lazily inside its methods. The file is started by path (`python <this file> serve`),
  never imported in the other venv.
- **JSON protocol.** Protocol (JSON): POST /reset {"task": <OSWorld task dict>} -> observation; POST /step
  {"action": "<pyautogui code | DONE | FAIL | WAIT>", "pause": s} -> observation + done; POST /evaluate ->
  {"score"}; POST /close. Observations carry the screenshot as base64 PNG. Actions are exactly what
  `actions.to_pyautogui` produces, sent one by one into `DesktopEnv.step` (the official client adds its
  own `import pyautogui; import pyperclip; ...` prefix), so action history, FAIL/DONE handling and the
  infeasible rule are the official ones.
- **URL provider.** A custom provider `arpo_url` points the official client at an already-running
  OSWorld-protocol server given by URL and token (the project's own local desktop, or a VM started elsewhere):
  its `get_ip_address` returns `host:port:...`, and the bridge process adds the token as a Bearer header
  to every `requests` call to that URL (`_send_token_to`). DesktopEnv hard-codes its provider names,
  so the bridge swaps its provider factory for this one; snapshot revert is a no-op there (the local
  desktop is made fresh by restarting it instead).
- **Client-side scoring.** Scores pass through `rewards.score_or_error` on the client: a bridge or evaluator
  failure scores 0, and a dead bridge makes the step a fatal env fault so the pool restarts the worker.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hmac
import io
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

TOKEN_ENV = "ARPO_BRIDGE_TOKEN"
URL_TOKEN_ENV = "ARPO_BRIDGE_URL_TOKEN"
DEFAULT_VENV = Path.home() / ".cache" / "arpo" / "desktop-env-venv"


# ---------------------------------------------------------------------------------------------------------
# Server half (runs under the desktop-env interpreter; standard library + desktop_env only)
# ---------------------------------------------------------------------------------------------------------


def _url_provider(url: str) -> tuple[Any, Any]:
    """(VMManager, Provider) pointing DesktopEnv at a running server (decision "URL provider")."""
    from urllib.parse import urlsplit

    from desktop_env.providers.base import Provider, VMManager

    parts = urlsplit(url)
    address = f"{parts.hostname}:{parts.port or 5000}:9222:8006:8080"

    class UrlManager(VMManager):
        def initialize_registry(self, **kwargs: Any) -> None: ...
        def add_vm(self, vm_path: str, **kwargs: Any) -> None: ...
        def delete_vm(self, vm_path: str, **kwargs: Any) -> None: ...
        def occupy_vm(self, vm_path: str, pid: int, **kwargs: Any) -> None: ...
        def list_free_vms(self, **kwargs: Any) -> list:
            return [url]

        def check_and_clean(self, **kwargs: Any) -> None: ...
        def get_vm_path(self, **kwargs: Any) -> str:
            return url

    class UrlProvider(Provider):
        def start_emulator(self, path_to_vm: str, headless: bool, *args: Any) -> None: ...
        def get_ip_address(self, path_to_vm: str) -> str:
            return address

        def save_state(self, path_to_vm: str, snapshot_name: str) -> None: ...
        def revert_to_snapshot(self, path_to_vm: str, snapshot_name: str) -> str:
            return path_to_vm

        def stop_emulator(self, path_to_vm: str, *args: Any, **kwargs: Any) -> None: ...

    return UrlManager(), UrlProvider(None)


def _send_token_to(url: str, token: str) -> None:
    """Make every `requests` call of this process to `url` carry `Authorization: Bearer <token>`.

    The official controllers build plain `http://host:port` URLs and take no headers, and `requests`
    no longer turns URL user-info into Basic auth; wrapping `Session.request` (what `requests.get/post`
    use) in this bridge process is the one place that reaches all of them.
    """
    import requests

    prefix = url.rstrip("/")
    original = requests.Session.request

    # Same parameter names as Session.request: requests.get/post pass method= and url= by keyword.
    def request(self: Any, method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        if str(url).startswith(prefix):
            kwargs["headers"] = {**(kwargs.get("headers") or {}), "Authorization": f"Bearer {token}"}
        return original(self, method, url, *args, **kwargs)

    requests.Session.request = request


def _make_desktop_env(args: argparse.Namespace) -> Any:
    import desktop_env.desktop_env as dmod

    kwargs: dict[str, Any] = dict(
        action_space="pyautogui",
        screen_size=tuple(int(v) for v in args.screen.split("x")),
        headless=True,
        require_a11y_tree=False,
        require_terminal=False,
        cache_dir=args.cache_dir,
    )
    if args.provider_name == "arpo_url":
        pair = _url_provider(args.url)
        token = os.environ.get(URL_TOKEN_ENV, "")
        if token:
            _send_token_to(args.url, token)
        dmod.create_vm_manager_and_provider = lambda *a, **k: pair
        return dmod.DesktopEnv(provider_name="docker", path_to_vm=args.url, **kwargs)
    return dmod.DesktopEnv(
        provider_name=args.provider_name,
        region=args.region,
        path_to_vm=args.path_to_vm,
        snapshot_name=args.snapshot_name,
        os_type=args.os_type,
        **kwargs,
    )


def _obs_json(obs: dict) -> dict:
    shot = obs.get("screenshot")
    return {
        "screenshot_png_b64": base64.b64encode(shot).decode() if shot else None,
        "instruction": obs.get("instruction"),
    }


def serve(args: argparse.Namespace) -> None:
    """Build one DesktopEnv and serve it on 127.0.0.1 (OS-chosen port); prints `READY <port>`."""
    token = os.environ.get(TOKEN_ENV, "")
    if len(token) < 16:
        raise SystemExit(f"{TOKEN_ENV} must hold a token of at least 16 characters")
    parent = args.parent_pid

    def watch() -> None:  # die with the owner (no orphaned VM controllers)
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(1)

    if parent > 0:
        threading.Thread(target=watch, daemon=True).start()
    env = _make_desktop_env(args)
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *a: Any) -> None:
            pass

        def _reply(self, code: int, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            auth = self.headers.get("Authorization", "")
            if not (auth.startswith("Bearer ") and hmac.compare_digest(auth[7:].encode(), token.encode())):
                self._reply(401, {"error": "missing or wrong token"})
                return
            n = int(self.headers.get("Content-Length") or 0)
            req = json.loads(self.rfile.read(n) or b"{}")
            try:
                with lock:
                    if self.path == "/reset":
                        self._reply(200, _obs_json(env.reset(task_config=req["task"])))
                    elif self.path == "/step":
                        obs, _, done, info = env.step(req["action"], pause=float(req.get("pause", 0.5)))
                        self._reply(200, {**_obs_json(obs), "done": bool(done), "info": info})
                    elif self.path == "/evaluate":
                        self._reply(200, {"score": float(env.evaluate())})
                    elif self.path == "/close":
                        env.close()
                        self._reply(200, {"closed": True})
                    else:
                        self._reply(404, {"error": f"no endpoint {self.path}"})
            except Exception as e:  # reported to the client, which scores 0 / marks an env fault
                self._reply(500, {"error": f"{type(e).__name__}: {e}"})

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(f"READY {httpd.server_address[1]}", flush=True)
    httpd.serve_forever()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description="desktop-env bridge server (controls machines that run commands)"
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument(
        "--provider-name", default="docker", help='official provider, or arpo_url (decision "URL provider")'
    )
    s.add_argument("--url", default="", help="arpo_url: base URL of a running OSWorld-protocol server")
    s.add_argument("--region", default=None)
    s.add_argument("--path-to-vm", default=None)
    s.add_argument("--snapshot-name", default="init_state")
    s.add_argument("--os-type", default="Ubuntu")
    s.add_argument("--screen", default="1920x1080")
    s.add_argument("--cache-dir", default="cache")
    s.add_argument("--parent-pid", type=int, default=0)
    s.add_argument("--log-level", default="WARNING", help="logging level of desktop_env (stderr)")
    a = ap.parse_args(argv)
    import logging

    logging.basicConfig(level=a.log_level.upper(), stream=sys.stderr)
    serve(a)


# ---------------------------------------------------------------------------------------------------------
# Client half (training environment)
# ---------------------------------------------------------------------------------------------------------


class BridgeProcess:
    """Starts `serve` under the desktop-env interpreter (own process group) and posts to it."""

    def __init__(self, python: str, serve_args: list[str], env: dict[str, str] | None = None):
        self.token = secrets.token_urlsafe(24)
        self.workdir = tempfile.mkdtemp(prefix="arpo-desktop-env-bridge-")
        self.proc = subprocess.Popen(
            [python, str(Path(__file__).resolve()), "serve", "--parent-pid", str(os.getpid()), *serve_args],
            env={**os.environ, **(env or {}), TOKEN_ENV: self.token},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            cwd=self.workdir,  # DesktopEnv writes its cache/ and logs relative to the working directory
        )
        self.base_url = ""

    def wait_ready(self, timeout_s: float) -> None:
        out: list[str] = []
        t = threading.Thread(target=lambda: out.append(self.proc.stdout.readline().decode()), daemon=True)
        t.start()
        t.join(timeout_s)
        if not out or not out[0].startswith("READY "):
            self.stop()
            raise RuntimeError(f"desktop-env bridge did not start within {timeout_s:.0f} s: {out[:1]}")
        self.base_url = f"http://127.0.0.1:{out[0].split()[1]}"

    def post(self, path: str, payload: dict, timeout_s: float) -> dict:
        req = urllib.request.Request(
            self.base_url + path,
            data=json.dumps(payload).encode(),
            method="POST",
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.token}"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"bridge {path}: HTTP {e.code}: {e.read()[:300]!r}") from e

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


class DesktopEnvBridgeEnv:
    """GuiEnv whose desktop is an official `DesktopEnv` in the desktop-env venv (module docstring)."""

    def __init__(
        self,
        python: str | None = None,
        serve_args: tuple[str, ...] | list[str] = (),
        env: dict[str, str] | None = None,
        pause_s: float = 0.5,
        start_timeout_s: float = 600.0,
        call_timeout_s: float = 600.0,
    ):
        """
        Args:
            python: the desktop-env venv's interpreter (default: scripts/setup_desktop_env.sh's venv).
            serve_args: arguments of `serve`, e.g. ["--provider-name", "docker"] or ["--provider-name",
                "arpo_url", "--url", "http://127.0.0.1:5000"] (token in env ARPO_BRIDGE_URL_TOKEN).
            env: extra environment for the bridge (provider credentials, the URL token).
            pause_s: official `DesktopEnv.step` pause after each action.
            start_timeout_s / call_timeout_s: VM providers may need minutes to boot or revert.
        """
        self.python = python or str(DEFAULT_VENV / "bin" / "python")
        self.serve_args = list(serve_args)
        self.extra_env = dict(env or {})
        self.pause_s = pause_s
        self.start_timeout_s = start_timeout_s
        self.call_timeout_s = call_timeout_s
        self.bridge: BridgeProcess | None = None
        self.task: Any = None
        self.screen_size: tuple[int, int] = (0, 0)
        self.last_eval_error: str | None = None

    def _ensure(self) -> BridgeProcess:
        if self.bridge is None or self.bridge.proc.poll() is not None:
            self.bridge = BridgeProcess(self.python, self.serve_args, self.extra_env)
            self.bridge.wait_ready(self.start_timeout_s)
        return self.bridge

    def _obs(self, res: dict) -> Any:
        from PIL import Image

        from arpo_core.envs.base import Observation

        if not res.get("screenshot_png_b64"):
            raise RuntimeError("the desktop returned no screenshot")
        img = Image.open(io.BytesIO(base64.b64decode(res["screenshot_png_b64"]))).convert("RGB")
        self.screen_size = img.size
        return Observation(img, self.task.instruction, img.size)

    def reset(self, task: Any, seed: int | None = None) -> Any:
        if task.backend != "osworld" or "task" not in task.config:
            raise ValueError(f"{task.key}: not an OSWorld task")
        self.task, self.last_eval_error = task, None
        return self._obs(self._ensure().post("/reset", {"task": task.config["task"]}, self.call_timeout_s))

    def step(self, actions: list) -> Any:
        from PIL import Image

        from arpo_core.actions import to_pyautogui
        from arpo_core.envs.base import TERMINAL_KINDS, Observation, StepResult

        assert self.bridge is not None and self.task is not None
        done, res = False, None
        try:
            for code in to_pyautogui(actions, self.screen_size or None):
                res = self.bridge.post("/step", {"action": code, "pause": self.pause_s}, self.call_timeout_s)
                if res.get("done"):
                    done = True
                    break
            if res is None:  # no action: just look again
                res = self.bridge.post("/step", {"action": "WAIT", "pause": 0.0}, self.call_timeout_s)
            obs = self._obs(res)
        except (RuntimeError, OSError) as e:
            blank = Image.new("RGB", self.screen_size if self.screen_size[0] else (1, 1))
            info = {"error": f"desktop-env bridge fault: {e}", "fatal": True}
            return StepResult(Observation(blank, self.task.instruction, blank.size), True, info)
        return StepResult(obs, done or any(a.kind in TERMINAL_KINDS for a in actions), {})

    def evaluate(self) -> float:
        from arpo_core.rewards import score_or_error

        assert self.bridge is not None
        score, self.last_eval_error = score_or_error(
            lambda: self.bridge.post("/evaluate", {}, self.call_timeout_s)["score"]
        )
        return score

    def close(self) -> None:
        if self.bridge is not None:
            with contextlib.suppress(Exception):
                self.bridge.post("/close", {}, 30)
            self.bridge.stop()
            self.bridge = None


def make_desktop_env_bridge_env(**kwargs: Any) -> DesktopEnvBridgeEnv:
    """Picklable factory for EnvPool."""
    return DesktopEnvBridgeEnv(**kwargs)


if __name__ == "__main__":
    # Started by path: drop this file's folder from sys.path so that its sibling modules (base.py,
    # pool.py, ...) can never shadow a library's imports in the desktop-env venv.
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)
    main()
