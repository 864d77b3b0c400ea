"""The local desktop server: pure helpers, then a real Xvfb desktop (started and stopped by the tests)."""

import base64
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from PIL import Image
from proctools import _stat, alive, group_pids, wait_until

from arpo_core.envs.osworld import desktop_server as ds
from arpo_core.envs.osworld.osworld_env import DesktopClient

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ pure helpers
@pytest.mark.parametrize(
    ("path", "want"),
    [
        ("/home/user", "/h"),
        ("/home/user/Desktop/a.txt", "/h/Desktop/a.txt"),
        ("/home/username/x", "/home/username/x"),
        ("~/x", "/h/x"),
        ("~", "/h"),
        ("rel/x.sh", "/h/rel/x.sh"),
        ("/tmp/x", "/tmp/x"),
    ],
)
def test_map_path(path, want):
    assert ds.map_path(path, "/h") == want


def test_strip_terminal():
    raw = "\x1b[?2004hroot@vm:~# ls\r\n\x1b[01;34mdir\x1b[0m\r\n\x1b]0;title\x07$ \r"
    assert ds.strip_terminal(raw) == "root@vm:~# ls\ndir\n$ "


def test_token_checks():
    assert ds.token_ok("abc", "abc")
    assert not ds.token_ok("abd", "abc")
    assert not ds.token_ok("", "")
    assert not ds.token_ok(None, "abc")
    assert ds.token_from_header("Bearer tok") == "tok"
    assert ds.token_from_header("Basic " + base64.b64encode(b"tok:").decode()) == "tok"
    assert ds.token_from_header("Basic " + base64.b64encode(b"user:tok").decode()) == "tok"
    assert ds.token_from_header("Basic !!!") is None
    assert ds.token_from_header("") is None
    assert ds.split_token_path("/t/tok/setup/execute?x=1") == ("tok", "/setup/execute")
    assert ds.split_token_path("/screenshot?x=1") == (None, "/screenshot")


def test_directory_tree(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b.txt").write_text("")
    (tmp_path / "a.txt").write_text("")
    tree = ds.directory_tree(str(tmp_path))
    assert tree["type"] == "directory"
    assert tree["children"] == [
        {"type": "file", "name": "a.txt"},
        {"type": "directory", "name": "d", "children": [{"type": "file", "name": "b.txt"}]},
    ]


def test_draw_cursor_marks_pixels_at_the_tip():
    img = Image.new("RGB", (40, 40))
    ds.draw_cursor(img, 10, 10)
    # arrow (10,10)-(10,26)-(14,22)-(17,28)-(19,27)-(16,21)-(21,21): (12,18) is inside, (25,12) outside
    assert img.getpixel((12, 18)) == (255, 255, 255)
    assert img.getpixel((25, 12)) == (0, 0, 0)


# ------------------------------------------------------------------ a real desktop
@pytest.fixture(scope="module")
def desktop():
    d = ds.LocalDesktop(screen_size=(640, 480), command_timeout_s=20)
    info = d.start()
    yield d, info, DesktopClient(info.base_url, info.token, timeout_s=30)
    d.stop()


def raw(url: str, method: str = "GET", body: bytes | None = None, headers: dict | None = None) -> int:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_requests_without_the_token_are_refused(desktop):
    _d, info, _ = desktop
    cmd = json.dumps({"command": "touch ~/pwned", "shell": True}).encode()
    json_h = {"Content-Type": "application/json"}
    assert raw(info.base_url + "/screenshot") == 401
    assert raw(info.base_url + "/execute", "POST", cmd, json_h) == 401
    assert raw(info.base_url + "/execute", "POST", cmd, {**json_h, "Authorization": "Bearer wrong"}) == 401
    assert raw(info.base_url + "/t/wrong/execute", "POST", cmd, json_h) == 401
    assert raw(info.base_url + "/setup/upload", "POST", b"x", {"Content-Type": "text/plain"}) == 401
    assert not os.path.exists(os.path.join(info.home, "pwned"))
    # the token opens it, in each accepted form
    assert raw(info.base_url + "/platform", headers={"Authorization": f"Bearer {info.token}"}) == 200
    assert raw(info.base_url + f"/t/{info.token}/platform") == 200
    basic = "Basic " + base64.b64encode(f"{info.token}:".encode()).decode()
    assert raw(info.base_url + "/platform", headers={"Authorization": basic}) == 200


def test_binds_loopback_only(desktop):
    _, info, _ = desktop
    assert info.base_url.startswith("http://127.0.0.1:")


def test_screenshot_execute_and_screen_size(desktop):
    _, info, c = desktop
    img = c.screenshot()
    assert img.size == (640, 480)
    assert c.screen_size() == {"width": 640, "height": 480}
    res = c.execute("echo $HOME; pwd", shell=True)
    assert res["output"] == f"{info.home}\n{info.home}\n" and res["returncode"] == 0
    res = c.execute(["python", "-c", "import pyautogui; print(pyautogui.size())"])
    assert res["returncode"] == 0 and "640" in res["output"]
    res = c.execute(["sh", "-c", "echo err >&2; exit 3"])
    assert (res["error"], res["returncode"]) == ("err\n", 3)


def test_pyautogui_moves_the_real_pointer(desktop):
    _, _, c = desktop
    c.execute(["python", "-c", "import pyautogui; pyautogui.moveTo(123, 45)"])
    code, body = c.request("GET", "/cursor_position")
    assert (code, json.loads(body)) == (200, [123, 45])


def test_upload_file_list_directory_with_osworld_paths(desktop):
    _, info, c = desktop
    c.upload("/home/user/Documents/up/a.bin", b"\x00\x01data")
    assert Path(info.home, "Documents/up/a.bin").read_bytes() == b"\x00\x01data"
    assert c.get_file("/home/user/Documents/up/a.bin") == b"\x00\x01data"
    assert c.get_file("/home/user/Documents/up/missing") is None
    tree = c.list_directory("/home/user/Documents/up")
    assert tree == {"type": "directory", "name": "up", "children": [{"type": "file", "name": "a.bin"}]}
    assert c.list_directory("/home/user/nope") is None


def test_sudo_shim_consumes_the_password_and_runs_unprivileged(desktop):
    _, info, c = desktop
    res = c.execute("echo 'password' | sudo -S mkdir ~/Desktop/by_sudo && echo ok", shell=True)
    assert res["output"] == "ok\n"
    assert os.path.isdir(os.path.join(info.home, "Desktop/by_sudo"))


def test_terminal_window_activate_close_and_terminal_output(desktop):
    _, _, c = desktop
    code, _ = c.request("GET", "/terminal")
    assert code == 404  # no terminal yet
    code, _ = c.post_json("/setup/launch", {"command": ["x-terminal-emulator"], "shell": False})
    assert code == 200
    assert wait_until(
        lambda: c.execute("xdotool search --onlyvisible --name '^Terminal$'", True)["output"].strip()
    )
    code, _ = c.post_json("/setup/activate_window", {"window_name": "Terminal", "strict": True})
    assert code == 200
    c.execute(
        ["python", "-c", "import pyautogui; pyautogui.write('echo MARK$((6*7))'); pyautogui.press('enter')"]
    )
    assert wait_until(lambda: "MARK42" in (c.terminal_output() or ""))
    code, _ = c.post_json("/setup/close_window", {"window_name": "Terminal", "strict": True})
    assert code == 200
    assert wait_until(
        lambda: not c.execute("xdotool search --onlyvisible --name '^Terminal$'", True)["output"]
    )
    assert c.post_json("/setup/activate_window", {"window_name": "Nope"})[0] == 404


def test_type_action_delivers_non_ascii_text_to_a_real_window(desktop):
    """Issue 16: the rendered `type` code, sent as OSWorld does (`python -c` with its prefix through
    /execute), reaches an xterm exactly - accents, CJK, a symbol, an emoji; more distinct characters
    than the keyboard has spare keycodes; ASCII lines - and a trailing newline still presses Enter.
    (`cat` in the terminal writes each line to a file; echo is off so only typed keys reach it.)"""
    from arpo_core.actions import Action, to_pyautogui
    from arpo_core.envs.osworld.osworld_env import PYAUTOGUI_PREFIX

    _, info, c = desktop
    out = Path(info.home, "typed.txt")
    cmd = ["x-terminal-emulator", "-T", "TypeTarget", "-e", "sh", "-c", "stty -echo; cat > ~/typed.txt"]
    assert c.post_json("/setup/launch", {"command": cmd, "shell": False})[0] == 200

    def visible() -> str:
        return c.execute("xdotool search --onlyvisible --name '^TypeTarget$'", True)["output"].strip()

    assert wait_until(visible)
    try:
        assert c.post_json("/setup/activate_window", {"window_name": "TypeTarget", "strict": True})[0] == 200
        lines = [
            "café naïve 日本語 ✓",
            "plain ASCII: echo $HOME 'q' \"dq\" \\ {}",
            "".join(chr(0x4E00 + 7 * i) for i in range(24)) + " Ωμέγα Größe 😀",
            "café naïve 日本語 ✓",
        ]
        for line in lines:
            (code,) = to_pyautogui([Action("type", content=line + "\n")])
            res = c.execute(["python", "-c", PYAUTOGUI_PREFIX + code])
            assert res["returncode"] == 0, res
        want = "".join(line + "\n" for line in lines)
        assert wait_until(lambda: out.exists() and out.read_bytes().count(b"\n") == len(lines))
        time.sleep(0.2)
        assert out.read_text(encoding="utf-8") == want
    finally:
        c.post_json("/setup/close_window", {"window_name": "TypeTarget", "strict": True})
        wait_until(lambda: not visible())


def test_unknown_endpoint_and_no_accessibility(desktop):
    _, _, c = desktop
    assert c.request("GET", "/nope")[0] == 404
    assert c.request("GET", "/accessibility")[0] == 501


def test_command_timeout_is_reported_not_hung(desktop):
    _, _, c = desktop
    t0 = time.monotonic()
    code, res = c.post_json("/execute", {"command": "sleep 30", "shell": True, "timeout": 1})
    assert code == 500 and "timed out" in res["error"] and time.monotonic() - t0 < 10


def test_stop_kills_the_whole_desktop_and_removes_its_files():
    d = ds.LocalDesktop(screen_size=(320, 240))
    info = d.start()
    c = DesktopClient(info.base_url, info.token)
    c.post_json("/setup/launch", {"command": "sleep 300", "shell": True})
    assert wait_until(lambda: len(group_pids(info.pid)) >= 4)  # server, Xvfb, openbox, sleep
    runtime = Path(info.home).parent
    d.stop()
    assert wait_until(lambda: not group_pids(info.pid), 5)
    assert not runtime.exists()
    d.stop()  # idempotent


def test_desktop_dies_with_its_parent(tmp_path):
    """A SIGKILLed owner leaves nothing behind: the server's watchdog kills its own group."""
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from arpo_core.envs.osworld.desktop_server import LocalDesktop
        info = LocalDesktop(screen_size=(320, 240)).start()
        print(info.pid, info.home, flush=True)
        time.sleep(60)
        """
    )
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid, home = owner.stdout.readline().split()
        pgid = int(pid)
        assert group_pids(pgid) and os.path.isdir(home)
        owner.send_signal(signal.SIGKILL)
        owner.wait(5)
        assert wait_until(lambda: not group_pids(pgid), 5)
        assert wait_until(lambda: not os.path.exists(Path(home).parent), 5)  # its files are gone too
    finally:
        owner.kill()
        owner.wait()


def test_screenshot_is_png_with_the_cursor_drawn(desktop):
    _, _, c = desktop
    c.execute(["python", "-c", "import pyautogui; pyautogui.moveTo(300, 200)"])
    _code, body = c.request("GET", "/screenshot")
    img = Image.open(io.BytesIO(body)).convert("RGB")
    assert body[:8] == b"\x89PNG\r\n\x1a\n"
    # the root window is black; the drawn cursor is white just below/right of the tip
    assert img.getpixel((302, 206)) == (255, 255, 255)


# ------------------------------------------------------------------ confinement and bounds (issue 18)
def test_confine_keeps_paths_in_the_session_home(tmp_path):
    home = tmp_path / "home"
    (home / "Documents").mkdir(parents=True)
    (home / "link_out").symlink_to("/etc")
    h = str(home)
    assert ds.confine("/home/user/Documents/a.txt", h) == str(home / "Documents" / "a.txt")
    assert ds.confine("~", h) == str(home) and ds.confine("rel/x", h) == str(home / "rel" / "x")
    for bad in ("/etc/passwd", "~/../../..", "/home/user/../../etc/shadow", "link_out/passwd", "/proc/self"):
        with pytest.raises(ds.HTTPError) as ei:
            ds.confine(bad, h)
        assert ei.value.code == 403, bad
    for bad in (None, 3, "", ["x"], "a\0b"):
        with pytest.raises(ds.HTTPError) as ei:
            ds.confine(bad, h)
        assert ei.value.code == 400


def test_directory_tree_is_bounded_and_never_follows_links(tmp_path):
    (tmp_path / "loop").symlink_to(tmp_path)
    (tmp_path / "root").symlink_to("/")
    tree = ds.directory_tree(str(tmp_path))
    assert tree["children"] == [{"type": "file", "name": "loop"}, {"type": "file", "name": "root"}]
    deep = tmp_path / "d"
    for i in range(5):
        deep = deep / str(i)
    deep.mkdir(parents=True)
    with pytest.raises(ds.TreeTooLarge, match="deeper than 3 levels"):
        ds.directory_tree(str(tmp_path), max_depth=3)
    for i in range(30):
        (tmp_path / f"f{i}").write_text("")
    with pytest.raises(ds.TreeTooLarge, match="more than 10 entries"):
        ds.directory_tree(str(tmp_path), max_entries=10)
    with pytest.raises(ds.TreeTooLarge, match="took more than"):
        ds.directory_tree(str(tmp_path), max_s=0.0)


def _post(info, endpoint: str, body: bytes, ctype: str = "application/json", headers: dict | None = None):
    req = urllib.request.Request(
        f"{info.base_url}/t/{info.token}{endpoint}",
        data=body,
        method="POST",
        headers={"Content-Type": ctype, **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_file_endpoints_refuse_paths_outside_the_home(desktop):
    _, info, c = desktop
    outside = Path(info.home).parent / "outside.txt"  # the session's runtime dir, beside the home
    for path in ("/etc/passwd", "~/../../../etc/passwd", "/home/user/../../etc/hostname", str(outside)):
        code, body = _post(info, "/file", json.dumps({"file_path": path}).encode())
        assert code == 403 and b"outside the session home" in body, (path, code, body)
        form = urllib.parse.urlencode({"file_path": path, "file_data": "x"}).encode()
        code, _ = _post(info, "/setup/upload", form, "application/x-www-form-urlencoded")
        assert code == 403, path
        code, _ = _post(info, "/list_directory", json.dumps({"path": path}).encode())
        assert code == 403, path
        code, _ = _post(info, "/setup/open_file", json.dumps({"path": path}).encode())
        assert code == 403, path
    assert not outside.exists()
    os.symlink("/", os.path.join(info.home, "slash"))
    assert _post(info, "/file", json.dumps({"file_path": "~/slash/etc/passwd"}).encode())[0] == 403
    assert c.list_directory("/") is None  # 403 -> the client's "not found"
    # inside the home all still works, and a link loop is listed, not followed
    os.symlink(info.home, os.path.join(info.home, "Documents", "loop"))
    t0 = time.monotonic()
    tree = c.list_directory("/home/user")
    assert time.monotonic() - t0 < 10 and tree["type"] == "directory"


def test_malformed_requests_get_4xx_not_500(desktop):
    _, info, _ = desktop
    j = "application/json"
    cases = [
        ("/execute", b"{not json", j, 400),
        ("/execute", b"[1, 2]", j, 400),
        ("/execute", b"{}", j, 400),  # no command
        ("/file", b"{}", j, 400),
        ("/file", json.dumps({"file_path": 7}).encode(), j, 400),
        ("/list_directory", json.dumps({"path": None}).encode(), j, 400),
        ("/setup/upload", b"file_path=\xff\xfe&file_data=x", "application/x-www-form-urlencoded", 400),
        ("/setup/upload", b"--x\r\nbroken", "multipart/form-data; boundary=x", 400),
        ("/setup/activate_window", b"{}", j, 400),
        ("/run_python", b"\xff\xfe", j, 400),
        ("/setup/open_file", b'{"path": {"a": 1}}', j, 400),
    ]
    for endpoint, body, ctype, want in cases:
        code, resp = _post(info, endpoint, body, ctype)
        assert code == want, (endpoint, body, code, resp)
    # a body over the bound is refused unread with 413
    req = f"POST /t/{info.token}/setup/upload HTTP/1.1\r\nHost: x\r\nContent-Length: {ds.MAX_BODY_BYTES + 1}\r\n"
    import socket

    host, port = info.base_url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(req.encode() + b"Content-Type: application/json\r\n\r\n{")
        assert sock.recv(100).startswith(b"HTTP/1.0 413")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST /t/{info.token}/file HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n".encode())
        assert sock.recv(100).startswith(b"HTTP/1.0 400")
    # the server is still serving
    assert raw(f"{info.base_url}/t/{info.token}/platform") == 200


# ------------------------------------------------------------------ nothing outlives it, nobody holds it (issue 34)
def _pids_running(text: str) -> list[int]:
    """Live processes whose command line contains `text` (a unique sleep duration)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmd and alive(int(entry)):
                out.append(int(entry))
    return out


def _execed(pids: list[int], comm: str) -> list[int]:
    """Those of `pids` whose program is `comm` (/proc/<pid>/comm: set by exec)."""
    out = []
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == comm:
                out.append(pid)
        except OSError:
            continue
    return out


@pytest.mark.parametrize("how", ["setsid", "setsid_env_cleared", "server_sigkilled"])
def test_a_process_that_left_the_session_dies_with_the_desktop(how):
    """desktop_server.py, decision "Three cleanup nets": `setsid` (own session, its parent gone) does not get
    a command out of the desktop; nor does clearing the environment while the server lives; nor a SIGKILLed
    server."""
    d = ds.LocalDesktop(screen_size=(320, 240))
    info = d.start()
    tag = f"{time.monotonic_ns() % 10**6}.5"  # a unique duration names the test's sleep
    try:
        c = DesktopClient(info.base_url, info.token)
        prefix = "env -i /usr/bin/setsid" if how == "setsid_env_cleared" else "setsid"
        res = c.execute(f"{prefix} -f sleep {tag} </dev/null >/dev/null 2>&1", shell=True)
        assert res["returncode"] == 0, res
        # `setsid -f` returns once it has forked: until its child has called setsid() and exec'd, the child
        # is `setsid` still in the desktop's session (seen under load); its comm is `sleep` after the exec
        assert wait_until(lambda: _execed(_pids_running(f"sleep {tag}"), "sleep"), 5)
        (pid,) = _execed(_pids_running(f"sleep {tag}"), "sleep")
        assert int(_stat(pid)[3]) == pid  # its own session: out of the desktop's group
        if how == "server_sigkilled":
            os.kill(info.pid, signal.SIGKILL)  # no cleanup by the server: the marker is what is left
        d.stop()
        assert wait_until(lambda: not _pids_running(f"sleep {tag}"), 5), _stat(pid)
    finally:
        d.stop()
        for pid in _pids_running(f"sleep {tag}"):  # only if the desktop failed: the test's own sleep
            os.kill(pid, signal.SIGKILL)


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_idle_and_slow_connections_time_out_and_threads_are_bounded():
    """desktop_server.py, decision "Bounded connections": 30 idle TCP connections (no token) hold at most
    `max_workers` threads, and only for `idle_timeout_s`; a client trickling a request is cut at
    `request_timeout_s`; the desktop serves again once they are gone."""
    import socket

    d = ds.LocalDesktop(screen_size=(320, 240), idle_timeout_s=1.0, request_timeout_s=3.0, max_workers=4)
    info = d.start()
    socks: list[socket.socket] = []
    try:
        c = DesktopClient(info.base_url, info.token, timeout_s=30)
        assert c.execute("true", shell=True)["returncode"] == 0
        base = _threads(info.pid)
        port = int(info.base_url.rsplit(":", 1)[1])
        for _ in range(30):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        time.sleep(0.5)
        assert _threads(info.pid) <= base + 4  # the pool's threads, not one per connection
        # each idle connection is closed by the server (EOF) after about idle_timeout_s, in turns of 4
        t0 = time.monotonic()
        for s in socks:
            assert s.recv(1) == b""
        took = time.monotonic() - t0
        assert took < 30, took
        # a trickle never idle for 1 s is cut at the 3 s request deadline
        slow = socket.create_connection(("127.0.0.1", port), timeout=10)
        socks.append(slow)
        t0 = time.monotonic()
        closed = False
        for ch in b"GET /platform HTTP/1.0\r\nX-Slow: " + b"a" * 100:
            try:
                slow.send(bytes([ch]))
            except OSError:
                closed = True
                break
            time.sleep(0.3)
            if time.monotonic() - t0 > 10:
                break
        if not closed:
            slow.settimeout(5)
            try:
                closed = slow.recv(1) == b""
            except ConnectionResetError:
                closed = True
        assert closed and time.monotonic() - t0 < 8, time.monotonic() - t0
        assert c.execute("echo ok", shell=True)["output"] == "ok\n"
        assert _threads(info.pid) <= base + 4
    finally:
        for s in socks:
            s.close()
        d.stop()
