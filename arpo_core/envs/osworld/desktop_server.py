"""The project's own OSWorld-protocol server for a local Xvfb desktop, and the `LocalDesktop` that runs it.

SECURITY: this server EXECUTES ARBITRARY COMMANDS ON THE HOST it runs on, as the user that started it
(that is the OSWorld protocol: `/execute` runs whatever it is sent). Run it only on disposable machines or
in containers. It binds to 127.0.0.1 only and refuses every request without its per-session token, but any
process of the same user can still read the token from the server's environment, and the X display has
no access control beyond being local. `sudo` inside the desktop is a shim without privileges
(decision "Unchanged OSWorld tasks").

Design decisions:
- **OSWorld server protocol.** Written from scratch with the standard library (`http.server`), speaking the
  OSWorld VM server's HTTP protocol (docs/method.md §5): GET /screenshot (PNG, with a drawn cursor like
  OSWorld's), POST /execute and /setup/execute (`{"command": [...] | "...", "shell": bool}` -> `{status,
  output, error, returncode}`), /setup/launch, /setup/open_file, /setup/activate_window, /setup/close_window,
  /setup/upload (multipart `file_path` + `file_data`), POST /file (form `file_path` -> raw bytes),
  /list_directory (-> `{"directory_tree": ...}`), /screen_size, /run_python, /run_bash_script, GET
  /platform, /cursor_position, /terminal. /accessibility is answered 501: there is no AT-SPI tree on a
  bare X desktop.
- **Token authentication.** Authentication: header `Authorization: Bearer <token>`, Basic auth carrying the
  token (so a client that only takes a host, like the official `desktop-env` controllers, can be given
  `<token>@127.0.0.1`), or the token as the first path segment (`/t/<token>/screenshot`). Compared in
  constant time; anything else is 401.
- **Xvfb desktop.** The desktop is Xvfb (free display chosen by Xvfb itself with `-displayfd`, no race) +
  openbox (EWMH, so xdotool can activate and close windows) + xterm. Ctrl+Alt+T opens a terminal titled
  "Terminal" (what OSWorld tasks press and then `activate_window` by name); `gnome-terminal` and `x-terminal-
  emulator` on the desktop's PATH start the same xterm.
- **Three cleanup nets.** Every process the desktop runs dies with it, also one that left the desktop's
  process group or session (`setsid`, a double-forking daemon; issue 34 item 7). Three nets, because each
  alone has a hole: (a) `LocalDesktop` starts the server with `start_new_session=True`, and Xvfb, openbox and
  every executed or launched command inherit that group, which `stop()` signals (TERM, then KILL); (b) the
  server is a child subreaper (`PR_SET_CHILD_SUBREAPER`), so a process that detaches is re-parented to
  the server instead of init and stays in its process tree, which the server kills whole on SIGTERM and
  when its owner dies (a watchdog polls the parent pid); it reaps the zombies of such adopted processes
  (never those of its own subprocesses, whose exit codes it reports); (c) every process of the desktop
  carries the environment marker `ARPO_DESKTOP_SESSION=<random id>`, and `stop()` kills every live
  process holding it after the server is gone (what (b) cannot reach once the server itself was
  SIGKILLed). A process that both detaches and clears its environment (`env -i setsid ...`) escapes (c)
  but not (b) while the server lives. cgroups would be tighter still, but an unprivileged user in a
  container usually cannot create one, so they are not relied on.
- **Fresh desktop per reset.** A reset is a fresh desktop: new display, new home directory (with Desktop/
  Documents/ Downloads/), no process of the previous episode left. Starting one costs well under a second
  (Xvfb + openbox), less than reverting a VM snapshot and far more certain than cleaning up an old session.
- **Unchanged OSWorld tasks.** OSWorld tasks run unchanged where possible: commands run in the home directory
  with HOME set to it; file paths given to /file, /setup/upload, /setup/open_file and /list_directory under
  `/home/user` (the OSWorld VM's home) are mapped into the session's home; the desktop's PATH starts with a
  shim folder holding `python` (this interpreter, which has pyautogui), `sudo` (drops its options, consumes
  the password line of `-S`, runs the command unprivileged) and the terminal launchers. Commands inside
  shell strings are not rewritten: a literal `/home/user/...` in a shell command stays as written.
  Shell commands run under /bin/bash (OSWorld's Ubuntu image runs them under /bin/sh = dash; every
  POSIX command means the same in both).
- **Terminal text.** /terminal returns the text of the most recently started terminal: each xterm logs its
  output (`xterm -l`), and the server strips escape sequences. OSWorld reads gnome-terminal's accessibility
  text instead; both give the commands and their output.
- **Bounded requests.** Requests are bounded and checked (issue 18): the file endpoints (/file, /setup/upload,
  /setup/open_file, /list_directory) resolve their path (symlinks, `..`) and refuse with 403 anything
  outside the session home; /list_directory never follows links and stops at LIST_MAX_DEPTH levels,
  LIST_MAX_ENTRIES entries or LIST_MAX_S seconds (400 naming the bound); a body over MAX_BODY_BYTES is
  refused with 413 unread; malformed JSON, a missing field or a bad value is a 400, never a 500. (The
  command endpoints still run whatever they are sent: the token is the boundary, as in OSWorld's VM.)
- **Bounded connections.** Connections are bounded in time and number (issue 34 item 7). The server is
  `http.server`, so its own knobs are used: the handler's socket timeout; on top, a whole request (line,
  headers, body) must arrive within `request_timeout_s` (a client trickling one byte at a time never resets
  it, unlike a per-read timeout), a connection that sends nothing for `idle_timeout_s` is closed, and a
  response must be taken within `request_timeout_s` (HTTP/1.0 as before: one request per connection). Requests
  are served by at most `max_workers` threads (a pool instead of `ThreadingHTTPServer`'s thread per
  connection): while all are busy the server stops accepting, so further clients wait in the listen backlog
  instead of each holding a thread. Before, 30 idle connections without a token held 30 threads for as long as
  they stayed open.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import email.parser
import email.policy
import hmac
import io
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

TOKEN_ENV = "ARPO_DESKTOP_TOKEN"
MARKER_ENV = "ARPO_DESKTOP_SESSION"
"""Decision "Three cleanup nets" (c): the environment marker every process of one desktop carries."""
IDLE_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 120.0
MAX_WORKERS = 16
"""Decision "Bounded connections": idle keep-alive timeout, the time a whole request (or a response) may take,
threads."""
OSWORLD_HOME = "/home/user"
"""The home directory of OSWorld's VM user; paths under it are mapped into the session home."""
TERMINAL_TITLE = "Terminal"
_WATCHDOG_PERIOD_S = 0.2
_ANSI_RE = re.compile(
    r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[()][0-9A-Za-z]|\x1b[=>]"
)

# Openbox configuration: Ctrl+Alt+T opens the terminal (as on Ubuntu), Alt+F4 closes, new windows get
# focus. Written per session so the user's own ~/.config/openbox never matters.
_OPENBOX_RC = """<?xml version="1.0" encoding="UTF-8"?>
<openbox_config xmlns="http://openbox.org/3.4/rc">
  <focus><focusNew>yes</focusNew><followMouse>no</followMouse></focus>
  <placement><policy>Smart</policy><center>yes</center></placement>
  <desktops><number>1</number></desktops>
  <keyboard>
    <keybind key="C-A-t"><action name="Execute"><command>x-terminal-emulator</command></action></keybind>
    <keybind key="A-F4"><action name="Close"/></keybind>
    <keybind key="A-Tab"><action name="NextWindow"/></keybind>
    <keybind key="W-Up"><action name="Maximize"/></keybind>
    <keybind key="W-Down"><action name="Unmaximize"/></keybind>
  </keyboard>
  <mouse><context name="Client"><mousebind button="Left" action="Press">
    <action name="Focus"/><action name="Raise"/></mousebind></context>
  <context name="Titlebar"><mousebind button="Left" action="Drag"><action name="Move"/></mousebind>
    <mousebind button="Left" action="Press"><action name="Focus"/><action name="Raise"/></mousebind>
  </context></mouse>
</openbox_config>
"""

_SUDO_SHIM = """#!/bin/sh
# Local-desktop sudo: no privileges. Drops sudo's options; with -S it consumes the password line.
read_pw=0
while [ $# -gt 0 ]; do
  case "$1" in
    -S) read_pw=1; shift ;;
    -u|-g|-p|-C|-h) shift 2 ;;
    --) shift; break ;;
    -*) shift ;;
    *) break ;;
  esac
done
[ $read_pw = 1 ] && read -r _pw
[ $# -eq 0 ] && exit 0
exec env "$@"
"""

_TERMINAL_SHIM = """#!/bin/sh
# The desktop's terminal: an xterm titled "Terminal" whose output is logged for GET /terminal.
mkdir -p "$ARPO_TERMINAL_LOGS"
log="$ARPO_TERMINAL_LOGS/$(date +%s%N).log"
exec xterm -T {title} -fa 'DejaVu Sans Mono' -fs 11 -geometry 100x30 -l -lf "$log" "$@"
"""


# ---------------------------------------------------------------------------------------------------------
# Pure helpers (tested directly)
# ---------------------------------------------------------------------------------------------------------


def map_path(path: str, home: str) -> str:
    """Map an OSWorld VM path into the session: `/home/user[/x]` -> `<home>[/x]`, `~` -> home, a relative
    path -> under home; any other absolute path is returned unchanged."""
    if path == OSWORLD_HOME or path.startswith(OSWORLD_HOME + "/"):
        return home + path[len(OSWORLD_HOME) :]
    if path == "~" or path.startswith("~/"):
        return home + path[1:]
    if not os.path.isabs(path):
        return os.path.join(home, path)
    return path


def strip_terminal(text: str) -> str:
    """Terminal log -> plain text: escape sequences removed, CRLF -> LF, lone CR dropped."""
    text = _ANSI_RE.sub("", text)
    return text.replace("\r\n", "\n").replace("\r", "")


def token_ok(given: str | None, expected: str) -> bool:
    """Constant-time token check; an empty or missing token never matches."""
    if not given or not expected:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


def token_from_header(auth: str) -> str | None:
    """The token of an `Authorization` header: `Bearer <token>`, or Basic auth whose user name or password
    is the token (what HTTP clients send for a base URL `http://<token>@127.0.0.1:<port>`)."""
    if auth.startswith("Bearer "):
        return auth[7:].strip()
    if auth.startswith("Basic "):
        try:
            user, _, password = base64.b64decode(auth[6:].strip(), validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return None
        return password or user or None
    return None


def split_token_path(path: str) -> tuple[str | None, str]:
    """'/t/<token>/screenshot?x=1' -> ('<token>', '/screenshot'); other paths -> (None, path sans query)."""
    path = urllib.parse.urlsplit(path).path
    if path.startswith("/t/"):
        rest = path[3:]
        token, _, tail = rest.partition("/")
        return token, "/" + tail
    return None, path


def _stat(pid: int | str) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name ([state, ppid, pgrp, ...]); None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def marked_pids(marker: str) -> list[int]:
    """Decision "Three cleanup nets" (c): live processes (of this user) whose environment holds
    MARKER_ENV=marker."""
    needle = f"{MARKER_ENV}={marker}".encode()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
        except OSError:  # gone, or another user's
            continue
        stat = _stat(entry)
        if needle in env.split(b"\0") and stat is not None and stat[0] != "Z":
            out.append(int(entry))
    return out


def descendants(root: int) -> list[int]:
    """Decision "Three cleanup nets" (b): live processes below `root` in the process tree (children, theirs,
    ...)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(entry)
            if stat is not None and stat[0] != "Z":
                children.setdefault(int(stat[1]), []).append(int(entry))
    out, todo = [], list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def kill_desktop_processes(marker: str, root: int | None = None, rounds: int = 20) -> int:
    """SIGKILL every process of the desktop: those carrying its marker and, with `root`, every
    descendant of `root` (decision "Three cleanup nets"); again until none is left (a process may fork while
    it is being killed). Never this process. Returns how many were signalled."""
    me, killed = os.getpid(), 0
    for _ in range(rounds):
        pids = set(marked_pids(marker)) if marker else set()
        if root is not None:
            pids |= set(descendants(root))
        pids.discard(me)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        time.sleep(0.05)
    return killed


def become_subreaper() -> bool:
    """Decision "Three cleanup nets" (b): PR_SET_CHILD_SUBREAPER for this process (Linux); False where
    unavailable."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER = 36
    except (OSError, AttributeError):
        return False


MAX_BODY_BYTES = 512 << 20
"""Largest request body accepted (an upload of a task file); more is refused with 413 before reading."""
LIST_MAX_DEPTH = 16
LIST_MAX_ENTRIES = 20_000
LIST_MAX_S = 5.0
"""Bounds of /list_directory: nesting depth, entries in all and wall time; beyond any: 400 naming it."""


class HTTPError(Exception):
    """A request the server refuses with a 4xx status and a message (never a 500)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def confine(path: Any, home: str) -> str:
    """`map_path`, then the resolved path (symlinks and `..` followed) must lie in the session home:
    file endpoints never reach outside it (403 otherwise; 400 for a path that is not a string)."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise HTTPError(HTTPStatus.BAD_REQUEST, f"path must be a non-empty string, got {path!r:.80}")
    real_home = os.path.realpath(home)
    real = os.path.realpath(map_path(path, home))
    if real != real_home and not real.startswith(real_home + os.sep):
        raise HTTPError(HTTPStatus.FORBIDDEN, f"path {path!r} is outside the session home")
    return real


class TreeTooLarge(Exception):
    """`directory_tree` passed one of its bounds; the message says which."""


def directory_tree(
    path: str,
    max_depth: int = LIST_MAX_DEPTH,
    max_entries: int = LIST_MAX_ENTRIES,
    max_s: float = LIST_MAX_S,
) -> dict[str, Any]:
    """OSWorld's /list_directory shape: {"type": "directory", "name", "children": [...]} / {"type": "file"}.
    Symbolic links are listed as files, never followed (a link to / or /proc/self would never end);
    raises `TreeTooLarge` past `max_depth` levels, `max_entries` entries or `max_s` seconds."""
    deadline = time.monotonic() + max_s
    count = [0]

    def walk(p: Path, depth: int) -> dict[str, Any]:
        count[0] += 1
        if count[0] > max_entries:
            raise TreeTooLarge(f"more than {max_entries} entries")
        if time.monotonic() > deadline:
            raise TreeTooLarge(f"listing took more than {max_s:g} s")
        if p.is_dir() and not p.is_symlink():
            if depth >= max_depth:
                raise TreeTooLarge(f"deeper than {max_depth} levels")
            try:
                entries = sorted(p.iterdir(), key=lambda c: c.name)
            except OSError:
                entries = []
            return {"type": "directory", "name": p.name, "children": [walk(c, depth + 1) for c in entries]}
        return {"type": "file", "name": p.name}

    return walk(Path(path), 0)


def draw_cursor(image: Any, x: int, y: int) -> None:
    """Draw a small arrow cursor with its tip at (x, y), in place (OSWorld screenshots show the pointer)."""
    from PIL import ImageDraw

    pts = [
        (x, y),
        (x, y + 16),
        (x + 4, y + 12),
        (x + 7, y + 18),
        (x + 9, y + 17),
        (x + 6, y + 11),
        (x + 11, y + 11),
    ]
    d = ImageDraw.Draw(image)
    d.polygon(pts, fill=(255, 255, 255), outline=(0, 0, 0))


# ---------------------------------------------------------------------------------------------------------
# The desktop session (inside the server process)
# ---------------------------------------------------------------------------------------------------------


class Session:
    """Xvfb + openbox + shims for one desktop; commands are run with `env()` in `home`."""

    def __init__(self, runtime_dir: str, width: int, height: int, command_timeout_s: float):
        self.runtime = Path(runtime_dir)
        self.home = str(self.runtime / "home")
        self.width, self.height = width, height
        self.command_timeout_s = command_timeout_s
        self.bin = self.runtime / "bin"
        self.term_logs = self.runtime / "terminals"
        self.display = ""
        self._xlock = threading.Lock()
        self._xdisplay: Any = None
        self.procs: list[subprocess.Popen] = []
        self._own: set[int] = set()
        """Pids of the subprocesses this server started itself (decision "Three cleanup nets" (b): never
        reaped by `reap_adopted`, their Popen waits for them)."""
        self._own_lock = threading.Lock()

    def popen(self, *args: Any, **kwargs: Any) -> subprocess.Popen:
        """subprocess.Popen, its pid registered as the server's own before the reaper can look."""
        with self._own_lock:
            proc = subprocess.Popen(*args, **kwargs)
            self._own.add(proc.pid)
        return proc

    def reap_adopted(self) -> int:
        """Decision "Three cleanup nets" (b): wait for the zombies of processes re-parented to this subreaper
        (not its own subprocesses); returns how many."""
        me, n = os.getpid(), 0
        with self._own_lock:
            self._own = {pid for pid in self._own if _stat(pid) is not None}
            for entry in os.listdir("/proc"):
                if entry.isdigit() and int(entry) not in self._own:
                    stat = _stat(entry)
                    if stat is not None and stat[0] == "Z" and int(stat[1]) == me:
                        with contextlib.suppress(ChildProcessError):
                            os.waitpid(int(entry), os.WNOHANG)
                            n += 1
        return n

    def prepare(self) -> None:
        for d in ("Desktop", "Documents", "Downloads"):
            os.makedirs(os.path.join(self.home, d), exist_ok=True)
        self.bin.mkdir(parents=True, exist_ok=True)
        self.term_logs.mkdir(parents=True, exist_ok=True)
        # A wrapper, not a symlink: a venv's interpreter finds its site-packages (pyautogui) only when
        # started through its own path.
        py = f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n'
        shims = {
            "python": py,
            "python3": py,
            "sudo": _SUDO_SHIM,
            "x-terminal-emulator": _TERMINAL_SHIM.format(title=TERMINAL_TITLE),
            "gnome-terminal": _TERMINAL_SHIM.format(title=TERMINAL_TITLE),
        }
        for name, text in shims.items():
            f = self.bin / name
            f.write_text(text)
            f.chmod(0o755)
        (self.runtime / "openbox-rc.xml").write_text(_OPENBOX_RC)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
        env.update(
            DISPLAY=self.display,
            HOME=self.home,
            PATH=f"{self.bin}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            ARPO_TERMINAL_LOGS=str(self.term_logs),
            XDG_CONFIG_HOME=os.path.join(self.home, ".config"),
            PWD=self.home,
        )
        return env

    def start_x(self, timeout_s: float = 10.0) -> None:
        r, w = os.pipe()
        xvfb = self.popen(
            [
                "Xvfb",
                "-displayfd",
                str(w),
                "-screen",
                "0",
                f"{self.width}x{self.height}x24",
                "-nolisten",
                "tcp",
            ],
            pass_fds=[w],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(w)
        self.procs.append(xvfb)
        buf = b""
        deadline = time.monotonic() + timeout_s
        while not buf.endswith(b"\n"):
            if time.monotonic() > deadline or xvfb.poll() is not None:
                raise RuntimeError("Xvfb did not start")
            chunk = os.read(r, 64)
            if not chunk:
                raise RuntimeError("Xvfb exited before reporting its display")
            buf += chunk
        os.close(r)
        self.display = ":" + buf.decode().strip()
        from Xlib import display as xdisplay

        self._xdisplay = xdisplay.Display(self.display)
        wm = self.popen(
            ["openbox", "--config-file", str(self.runtime / "openbox-rc.xml")],
            env={**self.env(), "XDG_CACHE_HOME": str(self.runtime / "cache")},  # keep home clean
            cwd=self.home,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.procs.append(wm)
        # openbox owns the WM selection once it manages the root window; wait for it (EWMH check).
        atom = self._xdisplay.intern_atom("_NET_SUPPORTING_WM_CHECK")
        while time.monotonic() < deadline:
            root = self._xdisplay.screen().root
            if root.get_full_property(atom, 0) is not None:
                return
            time.sleep(0.02)
        raise RuntimeError("openbox did not start")

    # ------------------------------------------------------------------ capabilities
    def cursor(self) -> tuple[int, int]:
        with self._xlock:
            p = self._xdisplay.screen().root.query_pointer()
            return int(p.root_x), int(p.root_y)

    def screenshot_png(self) -> bytes:
        from PIL import ImageGrab

        img = ImageGrab.grab(xdisplay=self.display)
        x, y = self.cursor()
        draw_cursor(img, x, y)
        buf = io.BytesIO()
        img.save(buf, format="PNG", compress_level=1)
        return buf.getvalue()

    def run(self, command: Any, shell: bool, timeout_s: float | None = None, cwd: str | None = None) -> dict:
        if shell and isinstance(command, list):
            command = " ".join(command)
        if not shell and isinstance(command, str):
            command = shlex.split(command)
        timeout = timeout_s or self.command_timeout_s
        try:
            p = self.popen(
                command,
                shell=shell,
                env=self.env(),
                cwd=cwd or self.home,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                errors="replace",
                executable="/bin/bash" if shell else None,
            )
        except OSError as e:
            return {"status": "error", "output": "", "error": str(e), "returncode": -1}
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # as subprocess.run does; what it started stays in the tree (decision "Three cleanup nets")
            p.kill()
            p.communicate()
            return {
                "status": "error",
                "output": "",
                "error": f"timed out after {timeout} s",
                "returncode": -1,
            }
        return {"status": "success", "output": out, "error": err, "returncode": p.returncode}

    def launch(self, command: Any, shell: bool) -> None:
        if not shell and isinstance(command, str):
            command = shlex.split(command)
        if shell and isinstance(command, list):
            command = " ".join(command)
        self.popen(
            command,
            shell=shell,
            env=self.env(),
            cwd=self.home,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def find_windows(self, name: str, strict: bool, by_class: bool) -> list[str]:
        pattern = f"^{re.escape(name)}$" if strict else re.escape(name)
        flag = "--class" if by_class else "--name"
        r = self.run(["xdotool", "search", "--onlyvisible", flag, pattern], shell=False, timeout_s=10)
        return r["output"].split()

    def terminal_output(self) -> str | None:
        logs = sorted(self.term_logs.glob("*.log"))
        if not logs:
            return None
        return strip_terminal(logs[-1].read_text(errors="replace"))


# ---------------------------------------------------------------------------------------------------------
# HTTP layer
# ---------------------------------------------------------------------------------------------------------


class _DeadlineReader(io.RawIOBase):
    """Decision "Bounded connections": the connection's reads, each bounded by the idle timeout and all of a
    request's by its deadline (`handler.deadline`), so a client trickling bytes cannot hold a thread."""

    def __init__(self, handler: _Handler):
        self.handler = handler

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        h = self.handler
        left = h.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"request not received within {h.request_timeout_s:g} s")
        h.connection.settimeout(min(h.idle_timeout_s, left))
        return h.connection.recv_into(buf)


class _BoundedHTTPServer(HTTPServer):
    """Decision "Bounded connections": at most `max_workers` connection threads; when all are busy the accept
    loop waits, so new clients queue in the listen backlog instead of each getting a thread."""

    request_queue_size = 64

    def __init__(self, address: tuple[str, int], handler: type, max_workers: int):
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max_workers)
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="desktop-http")

    def process_request(self, request: Any, client_address: Any) -> None:
        self._slots.acquire()
        try:
            self._pool.submit(self._serve_one, request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def _serve_one(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # a timed-out or broken connection: nothing to report, the client is gone
            pass
        finally:
            self.shutdown_request(request)
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # never a traceback on stderr: it is a pipe nobody reads while the desktop runs


class _Handler(BaseHTTPRequestHandler):
    server_version = "arpo-desktop/1"
    session: Session
    token: str
    idle_timeout_s: float = IDLE_TIMEOUT_S
    request_timeout_s: float = REQUEST_TIMEOUT_S
    deadline: float = 0.0

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the env records what matters
        pass

    def setup(self) -> None:
        super().setup()
        self.rfile = io.BufferedReader(_DeadlineReader(self))  # decision "Bounded connections"

    def handle_one_request(self) -> None:
        self.deadline = time.monotonic() + self.request_timeout_s
        try:
            super().handle_one_request()
        except TimeoutError:  # while reading the headers (the request line's timeout is handled above)
            self.close_connection = True

    # ------------------------------------------------------------------ plumbing
    def _reply(self, code: int, body: bytes | str | dict | list, ctype: str | None = None) -> None:
        if isinstance(body, (dict, list)):
            body, ctype = json.dumps(body).encode(), "application/json"
        elif isinstance(body, str):
            body, ctype = body.encode(), ctype or "text/plain; charset=utf-8"
        # sendall: the whole reply (decision "Bounded connections")
        self.connection.settimeout(self.request_timeout_s)
        self.send_response(code)
        self.send_header("Content-Type", ctype or "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _body(self) -> bytes:
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self.close_connection = True
            raise HTTPError(HTTPStatus.BAD_REQUEST, "bad Content-Length") from None
        if n < 0:
            self.close_connection = True
            raise HTTPError(HTTPStatus.BAD_REQUEST, "bad Content-Length")
        if n > MAX_BODY_BYTES:
            self.close_connection = True  # the body is not read: the connection cannot be reused
            raise HTTPError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body of {n} bytes > {MAX_BODY_BYTES}")
        try:
            return self.rfile.read(n) if n else b""
        except TimeoutError:
            self.close_connection = True  # the rest of the body may still come: never reuse it
            raise HTTPError(
                HTTPStatus.REQUEST_TIMEOUT, f"body not received within {self.request_timeout_s:g} s"
            ) from None

    def _json(self, raw: bytes) -> dict:
        try:
            req = json.loads(raw or b"{}")
        except (ValueError, RecursionError) as e:
            raise HTTPError(HTTPStatus.BAD_REQUEST, f"malformed JSON body: {e}") from None
        if not isinstance(req, dict):
            raise HTTPError(HTTPStatus.BAD_REQUEST, f"JSON body must be an object, got {type(req).__name__}")
        return req

    def _form(self, raw: bytes) -> dict[str, Any]:
        """Form fields of a urlencoded or multipart body (multipart file parts as (filename, bytes))."""
        ctype = self.headers.get("Content-Type", "")
        if ctype.startswith("multipart/form-data"):
            msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
                b"Content-Type: " + ctype.encode() + b"\r\n\r\n" + raw
            )
            out: dict[str, Any] = {}
            for part in msg.iter_parts():
                name = part.get_param("name", header="content-disposition")
                data = part.get_payload(decode=True) or b""
                fname = part.get_filename()
                out[name] = (fname, data) if fname is not None else data.decode()
            return out
        if ctype.startswith("application/json"):
            return self._json(raw)
        return {k: v[0] for k, v in urllib.parse.parse_qs(raw.decode()).items()}

    def _route(self, method: str) -> None:
        given, path = split_token_path(self.path)
        if given is None:
            given = token_from_header(self.headers.get("Authorization", ""))
        if not token_ok(given, self.token):
            self._reply(HTTPStatus.UNAUTHORIZED, {"status": "error", "message": "missing or wrong token"})
            return
        fn = getattr(self, f"_{method}_{path.strip('/').replace('/', '_')}", None)
        if fn is None:
            self._reply(HTTPStatus.NOT_FOUND, {"status": "error", "message": f"no endpoint {method} {path}"})
            return
        try:
            fn()
        except HTTPError as e:
            self._reply(e.code, {"status": "error", "message": str(e)})
        except KeyError as e:  # a required field of the request is missing
            self._reply(HTTPStatus.BAD_REQUEST, {"status": "error", "message": f"missing field {e}"})
        except (ValueError, TypeError, UnicodeDecodeError) as e:  # a malformed value
            self._reply(HTTPStatus.BAD_REQUEST, {"status": "error", "message": f"{type(e).__name__}: {e}"})
        except Exception as e:  # a bad request must not kill the server thread silently
            self._reply(
                HTTPStatus.INTERNAL_SERVER_ERROR, {"status": "error", "message": f"{type(e).__name__}: {e}"}
            )

    def do_GET(self) -> None:
        self._route("get")

    def do_POST(self) -> None:
        self._route("post")

    # ------------------------------------------------------------------ endpoints
    def _get_screenshot(self) -> None:
        self._reply(200, self.session.screenshot_png(), "image/png")

    def _get_platform(self) -> None:
        self._reply(200, "Linux")

    def _get_cursor_position(self) -> None:
        self._reply(200, list(self.session.cursor()))

    def _get_terminal(self) -> None:
        out = self.session.terminal_output()
        if out is None:
            self._reply(404, {"status": "error", "message": "no terminal has been opened"})
        else:
            self._reply(200, {"output": out})

    def _get_accessibility(self) -> None:
        self._reply(501, {"status": "error", "message": "no accessibility tree on the local desktop"})

    def _post_screen_size(self) -> None:
        self._body()
        self._reply(200, {"width": self.session.width, "height": self.session.height})

    def _post_execute(self) -> None:
        req = self._json(self._body())
        res = self.session.run(req["command"], bool(req.get("shell", False)), req.get("timeout"))
        self._reply(200 if res["status"] == "success" else 500, res)

    _post_setup_execute = _post_execute

    def _post_run_python(self) -> None:
        req = self._json(self._body())
        res = self.session.run([sys.executable, "-c", req["code"]], shell=False)
        res["message"] = "executed" if res["returncode"] == 0 else "error"
        if res["returncode"] != 0:
            res["status"] = "error"
        self._reply(200, res)

    def _post_run_bash_script(self) -> None:
        req = self._json(self._body())
        cwd = req.get("working_dir")
        res = self.session.run(
            ["/bin/bash", "-c", req["script"]],
            shell=False,
            timeout_s=float(req.get("timeout") or 30),
            cwd=map_path(cwd, self.session.home) if cwd else None,
        )
        if res["returncode"] != 0:
            res["status"] = "error"
        self._reply(200, res)

    def _post_setup_launch(self) -> None:
        req = self._json(self._body())
        self.session.launch(req["command"], bool(req.get("shell", False)))
        self._reply(200, f"{req['command']} launched successfully")

    def _post_setup_open_file(self) -> None:
        req = self._json(self._body())
        path = confine(req["path"], self.session.home)
        if not os.path.exists(path):
            self._reply(404, {"status": "error", "message": f"file not found: {req['path']}"})
            return
        if os.path.isdir(path) or shutil.which("xdg-open") is None:
            # A folder (or no opener): a terminal in that folder is the bare desktop's "file manager".
            folder = path if os.path.isdir(path) else os.path.dirname(path)
            self.session.launch(f"cd {shlex.quote(folder)} && exec x-terminal-emulator", shell=True)
        else:
            self.session.launch(["xdg-open", path], shell=False)
        self._reply(200, f"{req['path']} opened successfully")

    def _window_op(self, op: str) -> None:
        req = self._json(self._body())
        wins = self.session.find_windows(
            req["window_name"], bool(req.get("strict")), bool(req.get("by_class"))
        )
        if not wins:
            self._reply(404, {"status": "error", "message": f"window {req['window_name']!r} not found"})
            return
        for w in wins[-1:] if op == "windowactivate" else wins:
            args = ["xdotool", op, "--sync", w] if op == "windowactivate" else ["xdotool", op, w]
            self.session.run(args, shell=False, timeout_s=10)
        self._reply(200, f"window {req['window_name']} {op} done")

    def _post_setup_activate_window(self) -> None:
        self._window_op("windowactivate")

    def _post_setup_close_window(self) -> None:
        self._window_op("windowclose")

    def _post_setup_upload(self) -> None:
        form = self._form(self._body())
        path = confine(form["file_path"], self.session.home)
        if os.path.isdir(path):
            raise HTTPError(HTTPStatus.BAD_REQUEST, f"{form['file_path']!r} is a directory")
        data = form["file_data"]
        data = data[1] if isinstance(data, tuple) else str(data).encode()
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        self._reply(200, "File uploaded successfully")

    def _post_file(self) -> None:
        form = self._form(self._body())
        path = confine(form["file_path"], self.session.home)
        if not os.path.isfile(path):
            self._reply(404, {"status": "error", "message": f"file not found: {form['file_path']}"})
            return
        self._reply(200, Path(path).read_bytes(), "application/octet-stream")

    def _post_list_directory(self) -> None:
        req = self._json(self._body())
        path = confine(req["path"], self.session.home)
        if not os.path.isdir(path):
            self._reply(404, {"status": "error", "message": f"directory not found: {req['path']}"})
            return
        try:
            tree = directory_tree(path)
        except TreeTooLarge as e:
            raise HTTPError(
                HTTPStatus.BAD_REQUEST, f"directory {req['path']!r} is too large to list: {e}"
            ) from None
        self._reply(200, {"directory_tree": tree})


def _end_desktop(code: int) -> None:
    """Decision "Three cleanup nets": kill everything of the desktop (tree, marker, group), then exit."""
    kill_desktop_processes(os.environ.get(MARKER_ENV, ""), os.getpid())
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(os.getpgid(0), signal.SIGKILL)  # this process too, if it leads the group
    os._exit(code)


def _watch_parent(parent_pid: int, runtime_dir: str) -> None:
    """Once the owner is gone: remove the session's files (home, logs), then kill the whole desktop."""
    while os.getppid() == parent_pid:
        time.sleep(_WATCHDOG_PERIOD_S)
    shutil.rmtree(runtime_dir, ignore_errors=True)
    _end_desktop(1)


def _reap_loop(session: Session) -> None:
    while True:
        session.reap_adopted()
        time.sleep(1.0)


def serve(
    runtime_dir: str,
    width: int,
    height: int,
    parent_pid: int,
    command_timeout_s: float,
    idle_timeout_s: float = IDLE_TIMEOUT_S,
    request_timeout_s: float = REQUEST_TIMEOUT_S,
    max_workers: int = MAX_WORKERS,
) -> None:
    """Start the desktop and serve it on 127.0.0.1 (port chosen by the OS) until killed.

    Prints one line `READY <port> <display>` on stdout once the desktop is up.
    """
    token = os.environ.get(TOKEN_ENV, "")
    if len(token) < 16:
        raise SystemExit(f"{TOKEN_ENV} must hold a token of at least 16 characters")
    become_subreaper()  # decision "Three cleanup nets" (b), before anything is started
    signal.signal(signal.SIGTERM, lambda *_: _end_desktop(0))
    if parent_pid > 0:
        threading.Thread(target=_watch_parent, args=(parent_pid, runtime_dir), daemon=True).start()
    session = Session(runtime_dir, width, height, command_timeout_s)
    threading.Thread(target=_reap_loop, args=(session,), daemon=True).start()
    session.prepare()
    session.start_x()
    attrs = {
        "session": session,
        "token": token,
        "idle_timeout_s": idle_timeout_s,
        "request_timeout_s": request_timeout_s,
    }
    httpd = _BoundedHTTPServer(("127.0.0.1", 0), type("Handler", (_Handler,), attrs), max_workers)
    print(f"READY {httpd.server_address[1]} {session.display}", flush=True)
    httpd.serve_forever()


# ---------------------------------------------------------------------------------------------------------
# Host side: start / stop one desktop
# ---------------------------------------------------------------------------------------------------------


@dataclass
class DesktopInfo:
    base_url: str
    token: str
    display: str
    home: str
    pid: int
    """Server pid = process-group id of everything the desktop runs."""


class LocalDesktop:
    """Starts and stops one local desktop server (its own process group; see the module docstring)."""

    def __init__(
        self,
        screen_size: tuple[int, int] = (1920, 1080),
        command_timeout_s: float = 60.0,
        python_executable: str | None = None,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        max_workers: int = MAX_WORKERS,
    ):
        """python_executable: interpreter of the server, and so of `python` on the desktop (it needs
        pyautogui, python-xlib and Pillow); default: this one. The timeouts and `max_workers`:
        decision "Bounded connections"."""
        self.screen_size = screen_size
        self.python_executable = python_executable or sys.executable
        self.command_timeout_s = command_timeout_s
        self.idle_timeout_s, self.request_timeout_s = idle_timeout_s, request_timeout_s
        self.max_workers = max_workers
        self.proc: subprocess.Popen | None = None
        self.info: DesktopInfo | None = None
        self._runtime: str | None = None
        self._marker = ""

    def start(self, timeout_s: float = 20.0) -> DesktopInfo:
        """Start a fresh desktop (new display, new home); returns how to reach it."""
        self.stop()
        self._runtime = tempfile.mkdtemp(prefix="arpo-desktop-")
        token = secrets.token_urlsafe(24)
        self._marker = secrets.token_hex(12)  # decision "Three cleanup nets" (c)
        env = {**os.environ, TOKEN_ENV: token, MARKER_ENV: self._marker, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [
                self.python_executable,
                str(Path(__file__).resolve()),  # run as a script: no package import, any venv works
                "--runtime-dir",
                self._runtime,
                "--width",
                str(self.screen_size[0]),
                "--height",
                str(self.screen_size[1]),
                "--parent-pid",
                str(os.getpid()),
                "--command-timeout-s",
                str(self.command_timeout_s),
                "--idle-timeout-s",
                str(self.idle_timeout_s),
                "--request-timeout-s",
                str(self.request_timeout_s),
                "--max-workers",
                str(self.max_workers),
            ],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        line = _readline_with_timeout(self.proc, timeout_s)
        if not line.startswith("READY "):
            with contextlib.suppress(Exception):
                self.stop()
            raise RuntimeError(f"desktop server did not start: {line}")
        _, port, display = line.split()
        self.info = DesktopInfo(
            base_url=f"http://127.0.0.1:{port}",
            token=token,
            display=display,
            home=os.path.join(self._runtime, "home"),
            pid=self.proc.pid,
        )
        return self.info

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """Kill every process of the desktop and remove its files; idempotent. The group gets TERM (the
        server then kills its whole tree), then KILL; then whatever still carries the desktop's marker
        is killed (decision "Three cleanup nets")."""
        if self.proc is not None:
            pgid = self.proc.pid
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=2)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=2)
            for stream in (self.proc.stdout, self.proc.stderr):
                if stream is not None:
                    stream.close()
            self.proc = None
        if self._marker:
            # decision "Three cleanup nets" (c): what left the group and the tree
            kill_desktop_processes(self._marker)
            self._marker = ""
        self.info = None
        if self._runtime is not None:
            shutil.rmtree(self._runtime, ignore_errors=True)
            self._runtime = None


def _readline_with_timeout(proc: subprocess.Popen, timeout_s: float) -> str:
    """First stdout line of `proc`, or a description of why there is none within `timeout_s`."""
    result: list[str] = []
    t = threading.Thread(target=lambda: result.append(proc.stdout.readline().decode()), daemon=True)
    t.start()
    t.join(timeout_s)
    if not result:
        return f"no READY line within {timeout_s:.0f} s"
    if not result[0]:
        err = proc.stderr.read().decode(errors="replace")[-2000:] if proc.poll() is not None else ""
        return f"server exited (code {proc.poll()}): {err}"
    return result[0].strip()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description="OSWorld-protocol server for a local Xvfb desktop (runs commands!)"
    )
    ap.add_argument("--runtime-dir", required=True, help="folder for the session (home/, shims, logs)")
    ap.add_argument("--width", type=int, default=1920)
    ap.add_argument("--height", type=int, default=1080)
    ap.add_argument("--parent-pid", type=int, default=0, help="kill the desktop when this process dies")
    ap.add_argument("--command-timeout-s", type=float, default=60.0)
    ap.add_argument("--idle-timeout-s", type=float, default=IDLE_TIMEOUT_S)
    ap.add_argument("--request-timeout-s", type=float, default=REQUEST_TIMEOUT_S)
    ap.add_argument("--max-workers", type=int, default=MAX_WORKERS)
    a = ap.parse_args(argv)
    serve(
        a.runtime_dir,
        a.width,
        a.height,
        a.parent_pid,
        a.command_timeout_s,
        a.idle_timeout_s,
        a.request_timeout_s,
        a.max_workers,
    )


if __name__ == "__main__":
    # Started by path (LocalDesktop does so, from any venv): drop this file's folder from sys.path so its
    # sibling modules cannot shadow library imports.
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)
    main()
