"""MiniWoB++ in headless Debian Chromium, driven by screen-pixel actions only.

Design decisions:
- **Debian Chromium driver.** We subclass miniwob's `SeleniumInstance` (Farama miniwob 1.1.0) and replace only
  `create_driver`: its hard-coded flags and driver lookup do not work with Debian's packages. We start the
  real binary `/usr/lib/chromium/chromium` (`/usr/bin/chromium` is a shell wrapper) through an explicit
  `Service('/usr/bin/chromedriver')` (otherwise Selenium tries to download a driver, and there is no
  internet), with the flags of docs/method.md §6 and a fresh `--user-data-dir` per browser.
  `--window-size=500,400`: a smaller window crops the 160x210 task area.
- **Page reuse.** One browser serves any number of tasks: `reset` loads the task page only when the task
  changes (a page load ~100 ms vs a browser start ~1 s); episodes of the same task reuse the page
  (`core.endEpisode(0)` + `core.startEpisodeReal()`, exactly what miniwob's own reset does).
- **Pixels-only policy.** The policy sees pixels only: the screenshot of the 160x210 task area (query bar
  included) and the utterance. Actions are W3C pointer / key / wheel input at coordinates, never DOM clicks,
  so what the policy does is what a user could do. The DOM (`dom_elements`) exists for the scripted oracles,
  grounding data and the image-blind ceiling; it is never part of an `Observation`.
- **Episode time limit.** MiniWoB's 10 s episode clock (`core.EPISODE_MAX_TIME`) would fail a slow CPU policy
  on wall-clock time: `episode_time_limit_s` overrides it at every reset (None = effectively no limit;
  setTimeout takes at most 2^31-1 ms, a larger value would fire at once).
- **Raw-reward success.** Success = raw reward > 0 (`evaluate`). MiniWoB's `env_reward` is scaled by the
  wall-clock time spent, so it measures the speed of the machine and of the policy's inference, not
  correctness; the raw reward is -1 for a wrong answer or a timeout and positive for a right one (a few tasks
  give partial positive credit, which still means the task was answered acceptably). An episode that
  MiniWoB has not ended (e.g. the agent answered `finished` before submitting) scores 0.
- **Clamped coordinates.** Coordinates are clamped to the task area, so a wild click lands on the page edge
  instead of raising "move target out of bounds"; unknown key names are recorded in `info["action_errors"]`
  (a policy mistake, the episode goes on), while a dead browser is an env fault: `step` returns
  done with `info["error"]`, and the next `reset` starts a new browser.
- **Process hygiene.** Process hygiene: chromedriver and Chromium inherit the caller's process group (the env
  pool puts each env worker in its own group and kills the group). `close()` quits the driver and then kills
  whatever is left of the driver's process tree. Chromium's two chrome_crashpad_handler processes
  leave the tree and the group (they re-parent to init and call setsid) and name neither the env nor
  its profile; when the browser was killed rather than quit they outlived the run (a worker stopped
  by a second Ctrl-C left them >20 s). They inherit the environment, so chromedriver starts with
  `ARPO_BROWSER=<profile dir>` and `close()` also kills every process carrying it (the env pool's
  reaper does the same by the worker's TMPDIR). An env used without the pool (the ground and
  compare stages' probes) has a reaper of its own (`_BROWSER_REAPER`, outside the caller's group)
  that kills what carries the mark once the caller dies without closing it (a second Ctrl-C, a
  SIGKILL), and exits when the env is closed. `--disable-crashpad-for-testing` would start no
  handler, but with it chromedriver's page loads time out (Chromium 156, measured).
- **Parked pointer.** An episode does not see its predecessor: every reset parks the pointer outside the task
  area (`PARK_POINT`) before the episode starts. The browser keeps the pointer where the last episode
  left it, and a hover there (click-tab's tabs) changed ~1000 pixels of the next episode's first
  screenshot, so which episode had run before on the same env (timing, with several envs) changed
  what the policy saw (rollout.py, decision "Per-step sampling seeds" needs episodes independent of that).
  Likewise the first episode after a page load differed from later ones (2 pixels of click-tab), so a page
  load is followed by one throw-away episode.
- **Hidden caret.** The text caret is hidden (`caret-color: transparent`, a style added at every reset; a page
  load drops it). It blinks about 0.5 s on, 0.5 s off, so the screenshot of a focused text field depended on
  when it was taken: demonstrations collected twice from the same seeds differed in 9 of 1,290 enter-text
  screenshots, and behaviour cloning on them diverged. Playwright hides the caret in screenshots by
  default for the same reason. A focused field still shows Chromium's focus ring.
- **Few round trips.** A step costs as few WebDriver round trips as its result needs (each is Python ->
  chromedriver -> Chromium and back, ~4.3 ms of wall time on an idle machine): after the last action one
  script (`_STATE_JS`) answers both "is an animation still running" and MiniWoB's metadata, and is repeated
  only while an animation runs; "did MiniWoB end the episode" is asked between actions only when
  another action follows. A one-click step is 3 round trips (action, state, screenshot), was 5.
- **Step pause.** `step_pause_s` (default 0) sleeps after a step's actions before the screenshot, as OSWorld's
  `DesktopEnv.step(pause=...)` and this project's local desktop (`env.osworld.settle_s`) do. MiniWoB's
  local pages need no pause; the rollout benchmark uses it to stand in for envs whose step time is
  waiting (a VM on another host) rather than this machine's CPU (benchmarks/bench_rollout.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
from typing import Any

import urllib3.exceptions
from miniwob.fields import get_field_extractor
from miniwob.screenshot import get_screenshot
from miniwob.selenium_instance import DEFAULT_BASE_URL, SeleniumInstance
from PIL import Image
from selenium import webdriver
from selenium.common.exceptions import TimeoutException, WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.wait import WebDriverWait

from arpo_core.actions import Action
from arpo_core.envs.base import TERMINAL_KINDS, Observation, StepResult, TaskSpec
from arpo_core.envs.miniwob.chromium import CHROMEDRIVER, CHROMIUM_BINARY
from arpo_core.envs.miniwob.dom import SCREEN_SIZE, DomElement
from arpo_core.envs.miniwob.oracles import MODEL_MAX_PIXELS, MODEL_MIN_PIXELS, oracle_reply
from arpo_core.infra.lock import pid_alive

BROWSER_MARK = "ARPO_BROWSER"
"""The environment variable every process of one browser carries: its profile dir
(decision "Process hygiene")."""
CHROMIUM_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=500,400",
)
PARK_POINT = (SCREEN_SIZE[0] + 100, 10)
"""Where each reset leaves the pointer (decision "Parked pointer"): inside the 500x400 window, outside the
task area."""
# What a dead browser raises: Selenium errors, or urllib3's when chromedriver itself is gone.
BROWSER_ERRORS = (WebDriverException, urllib3.exceptions.HTTPError, ConnectionError)
_MAX_TIMEOUT_MS = 2**31 - 1

# UI-TARS / pyautogui key names -> WebDriver keys. Single printable characters pass through.
KEY_MAP: dict[str, str] = {
    "ctrl": Keys.CONTROL,
    "control": Keys.CONTROL,
    "shift": Keys.SHIFT,
    "alt": Keys.ALT,
    "meta": Keys.META,
    "cmd": Keys.META,
    "command": Keys.META,
    "win": Keys.META,
    "super": Keys.META,
    "enter": Keys.ENTER,
    "return": Keys.ENTER,
    "tab": Keys.TAB,
    "backspace": Keys.BACKSPACE,
    "delete": Keys.DELETE,
    "del": Keys.DELETE,
    "esc": Keys.ESCAPE,
    "escape": Keys.ESCAPE,
    "space": Keys.SPACE,
    "up": Keys.ARROW_UP,
    "down": Keys.ARROW_DOWN,
    "left": Keys.ARROW_LEFT,
    "right": Keys.ARROW_RIGHT,
    "arrowup": Keys.ARROW_UP,
    "arrowdown": Keys.ARROW_DOWN,
    "arrowleft": Keys.ARROW_LEFT,
    "arrowright": Keys.ARROW_RIGHT,
    "home": Keys.HOME,
    "end": Keys.END,
    "pageup": Keys.PAGE_UP,
    "pagedown": Keys.PAGE_DOWN,
    "insert": Keys.INSERT,
    **{f"f{i}": getattr(Keys, f"F{i}") for i in range(1, 13)},
}


def webdriver_key(name: str) -> str:
    """Map one key name as a model writes it ('ctrl', 'Enter', 'a') to a WebDriver key.

    Raises KeyError for names that are neither known keys nor a single character.
    """
    if len(name) == 1:
        return name
    low = name.lower()
    if low in KEY_MAP:
        return KEY_MAP[low]
    raise KeyError(f"unknown key {name!r}")


def episode_limit_ms(limit_s: float | None) -> int:
    """MiniWoB's episode clock in ms: None -> the largest setTimeout delay (2^31-1 ms, ~24.8 days)."""
    if limit_s is None:
        return _MAX_TIMEOUT_MS
    return max(1, min(_MAX_TIMEOUT_MS, round(limit_s * 1000)))


def clamp_point(x: float, y: float, size: tuple[int, int] = SCREEN_SIZE) -> tuple[int, int]:
    """Round a screen point to integer pixels inside [0, w-1] x [0, h-1]."""
    w, h = size
    return min(max(round(x), 0), w - 1), min(max(round(y), 0), h - 1)


# Flat DOM dump for oracles / grounding: every element of the page but MiniWoB's own overlays, with its box, own text and whether
# it can be seen (non-empty box inside the task area, not hidden by CSS, and the topmost element at
# its centre is itself or one of its descendants).
_DOM_JS = """
var W = %d, H = %d;
var skip = '#reward-display, #sync-task-cover, #click-canvas, #attention-canvas, script, style';
var els = [document.body].concat(Array.prototype.slice.call(document.body.querySelectorAll('*')))
  .filter(function (el) { return !el.closest(skip); });
var out = [];
for (var i = 0; i < els.length; i++) {
  var el = els[i];
  var r = el.getBoundingClientRect();
  var own = '';
  el.childNodes.forEach(function (c) { if (c.nodeType === 3) own += ' ' + c.data; });
  own = own.replace(/\\s+/g, ' ').trim();
  var cs = window.getComputedStyle(el);
  var onScreen = r.width > 0 && r.height > 0 && r.right > 0 && r.bottom > 0 && r.left < W && r.top < H;
  var shown = cs.visibility !== 'hidden' && cs.display !== 'none' && parseFloat(cs.opacity) > 0;
  var top = false;
  if (onScreen) {
    var cx = Math.min(Math.max(r.left + r.width / 2, 0), W - 1);
    var cy = Math.min(Math.max(r.top + r.height / 2, 0), H - 1);
    var hit = document.elementFromPoint(cx, cy);
    top = hit !== null && (hit === el || el.contains(hit));
  }
  var tag = el.tagName.toLowerCase();
  var value = null;
  if (el instanceof HTMLInputElement) {
    tag += '_' + el.type;
    value = (el.type === 'checkbox' || el.type === 'radio') ? (el.checked ? 'true' : 'false') : el.value;
  } else if (el instanceof HTMLTextAreaElement || el instanceof HTMLSelectElement) {
    value = el.value;
  }
  out.push({tag: tag, text: own, full_text: (el.textContent || '').replace(/\\s+/g, ' ').trim(),
            id: el.id || '', classes: (typeof el.className === 'string') ? el.className : '',
            left: r.left, top: r.top, width: r.width, height: r.height,
            visible: onScreen && shown, topmost: top, value: value,
            focused: document.activeElement === el,
            bg: cs.backgroundColor, fg: cs.color, parent: els.indexOf(el.parentElement)});
}
return out;
"""


# Decision "Few round trips": "does a jQuery animation run" and miniwob's `get_metadata` in one round trip.
_STATE_JS = """
return {busy: !!(window.jQuery && jQuery.timers && jQuery.timers.length),
        meta: {done: WOB_DONE_GLOBAL, env_reward: WOB_REWARD_GLOBAL,
               raw_reward: WOB_RAW_REWARD_GLOBAL, reason: WOB_REWARD_REASON}};
"""
# Decision "Hidden caret": no blinking caret in any screenshot (idempotent: the style is added once per page).
_NO_CARET_JS = """
if (!document.getElementById('arpo-no-caret')) {
  var s = document.createElement('style');
  s.id = 'arpo-no-caret';
  s.textContent = '* { caret-color: transparent !important; }';
  document.head.appendChild(s);
}
"""


class ChromiumInstance(SeleniumInstance):
    """miniwob's SeleniumInstance on Debian Chromium (see design decision "Debian Chromium driver"), any task
    per browser."""

    def __init__(
        self,
        subdomain: str,
        chromium_binary: str = CHROMIUM_BINARY,
        chromedriver: str = CHROMEDRIVER,
        extra_flags: tuple[str, ...] = (),
        page_load_timeout_s: float = 20.0,
    ):
        if subdomain.startswith("flight."):
            raise ValueError("FlightWoB tasks need an HTTP server; not supported by this env")
        super().__init__(index=0, subdomain=subdomain, headless=True, threading=False)
        self.subdomain = subdomain
        self.chromium_binary = chromium_binary
        self.chromedriver = chromedriver
        self.extra_flags = extra_flags
        self.page_load_timeout_s = page_load_timeout_s
        self.user_data_dir: str | None = None

    def create_driver(self) -> None:
        """Start chromedriver + Chromium with the Debian paths and flags, then load the task page."""
        assert not hasattr(self, "driver"), "driver already created"
        self.user_data_dir = tempfile.mkdtemp(prefix="arpo-chromium-")
        options = webdriver.ChromeOptions()
        options.binary_location = self.chromium_binary
        for flag in (*CHROMIUM_FLAGS, *self.extra_flags):
            options.add_argument(flag)
        options.add_argument(f"--user-data-dir={self.user_data_dir}")
        service = Service(self.chromedriver, env={**os.environ, BROWSER_MARK: self.user_data_dir})
        subprocess.Popen(  # decision "Process hygiene": nothing of the browser outlives its owner
            [sys.executable, "-S", "-c", _BROWSER_REAPER, str(os.getpid()), BROWSER_MARK, self.user_data_dir],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.driver = webdriver.Chrome(service=service, options=options)
        self.driver.set_page_load_timeout(self.page_load_timeout_s)
        self._load_page()

    def load_task(self, subdomain: str) -> None:
        """Switch the browser to another MiniWoB task page."""
        if subdomain == self.subdomain:
            return
        if subdomain.startswith("flight."):
            raise ValueError("FlightWoB tasks need an HTTP server; not supported by this env")
        self.subdomain = subdomain
        self.url = urllib.parse.urljoin(DEFAULT_BASE_URL, f"{subdomain}.html")
        self.field_extractor = get_field_extractor(subdomain)
        self._load_page()

    def _load_page(self) -> None:
        self.driver.get(self.url)
        try:
            WebDriverWait(self.driver, self.page_load_timeout_s).until(
                EC.presence_of_element_located((By.ID, self.SYNC_SCREEN_ID))
            )
        except TimeoutException as e:
            raise RuntimeError(f"MiniWoB page {self.url} did not load") from e
        self.inner_width, self.inner_height = self.driver.execute_script(
            "return [window.innerWidth, window.innerHeight];"
        )
        # Decision "Parked pointer": the first episode after a page load rendered differently from later ones
        # (2 edge pixels of click-tab); one throw-away episode makes every real episode a later one.
        self.begin_task(seed=0)
        self.force_stop()

    def driver_pid(self) -> int | None:
        """Pid of chromedriver (Chromium runs below it), or None before the driver starts."""
        driver = getattr(self, "driver", None)
        proc = getattr(getattr(driver, "service", None), "process", None)
        return proc.pid if proc is not None else None

    def alive(self) -> bool:
        """chromedriver and at least one Chromium process below it are running (not zombies)."""
        pid = self.driver_pid()
        if not pid or not pid_alive(pid):
            return False
        return any(pid_alive(p) for p in _descendants(pid) if p != pid)

    def close(self) -> bool:
        """Quit the driver, kill any leftover of its process tree, remove the profile dir. Returns whether
        the driver quit cleanly (False: the browser or chromedriver had died or failed on the way)."""
        pid = self.driver_pid()
        leftovers = _descendants(pid) if pid else []
        clean = True
        if hasattr(self, "driver"):
            try:
                self.driver.quit()
            except Exception:
                clean = False
            del self.driver
        if self.user_data_dir:
            # decision "Process hygiene": the crash handlers, outside the tree, carry the mark
            leftovers += pids_with_env(BROWSER_MARK, self.user_data_dir)
        for p in leftovers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGKILL)
        if self.user_data_dir:
            shutil.rmtree(self.user_data_dir, ignore_errors=True)
            self.user_data_dir = None
        self.died = True
        return clean


# Decision "Process hygiene": waits while the owner lives and the profile dir exists (close() removes it),
# then kills every process carrying the mark until three sweeps in a row find none (a browser still starting,
# a close() cut short) and removes the profile. In its own session, so the signal or group kill that took
# the owner does not take it.
_BROWSER_REAPER = (
    "import os, shutil, signal, sys, time\n"
    "owner, key, profile = int(sys.argv[1]), sys.argv[2], sys.argv[3]\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "def alive(pid):\n"
    "    try:\n"
    "        return open('/proc/%d/stat' % pid).read().rsplit(')', 1)[1].split()[0] != 'Z'\n"
    "    except OSError:\n"
    "        return False\n"
    "while alive(owner) and os.path.isdir(profile):\n"
    "    time.sleep(0.2)\n"
    "mark = (key + '=' + profile).encode()\n"
    "for i in range(50):\n"
    "    found = []\n"
    "    for pid in os.listdir('/proc'):\n"
    "        try:\n"
    "            if pid.isdigit() and mark in open('/proc/' + pid + '/environ', 'rb').read().split(bytes(1)):\n"
    "                found.append(int(pid))\n"
    "                os.kill(int(pid), signal.SIGKILL)\n"
    "        except OSError:\n"
    "            pass\n"
    "    if not found and i >= 2:\n"
    "        break\n"
    "    time.sleep(0.2)\n"
    "shutil.rmtree(profile, ignore_errors=True)\n"
)


def pids_with_env(key: str, value: str) -> list[int]:
    """Processes (of this user) whose environment holds key=value (from /proc; Linux only)."""
    needle = f"{key}={value}".encode()
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        out.append(int(entry))
            except OSError:
                continue
    return out


def _descendants(pid: int) -> list[int]:
    """The process itself and all its descendants (from /proc; Linux only)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name may contain spaces: fields after the last ')' are well-formed.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


class MiniWoBEnv:
    """A `GuiEnv` over one headless Chromium; tasks are MiniWoB++ task names (`TaskSpec.family`; a pinned instance plays its own seed).

    `TaskSpec.instruction` is not used: MiniWoB generates each episode's utterance, which becomes
    `Observation.instruction`. `TaskSpec.config["data_mode"]` ("train" by default) picks MiniWoB's
    problem distribution. Build it with keyword arguments only, so
    `functools.partial(make_miniwob_env, ...)` is a picklable factory for the env pool.
    """

    def __init__(
        self,
        *,
        episode_time_limit_s: float | None = 60.0,
        chromium_binary: str = CHROMIUM_BINARY,
        chromedriver: str = CHROMEDRIVER,
        extra_flags: tuple[str, ...] = (),
        scroll_px: int = 50,
        wait_s: float = 0.2,
        drag_steps: int = 5,
        settle_timeout_s: float = 1.0,
        step_pause_s: float = 0.0,
    ):
        """
        Args:
            episode_time_limit_s: MiniWoB episode clock (None: no limit); MiniWoB's own default is 10.
            scroll_px: wheel delta of one `scroll` action in CSS pixels (miniwob's default 50).
            wait_s: how long `wait()` sleeps.
            drag_steps: intermediate pointer moves of a drag (jQuery UI needs movement to start one).
            settle_timeout_s: after the actions, wait up to this long for jQuery animations to end
                (accordions, dialogs), so the observation shows where things finally are.
            step_pause_s: sleep this long after a step's actions, before the screenshot
            (decision "Step pause").
        """
        if step_pause_s < 0:
            raise ValueError(f"step_pause_s must be >= 0, got {step_pause_s}")
        self.episode_time_limit_s = episode_time_limit_s
        self.chromium_binary = chromium_binary
        self.chromedriver = chromedriver
        self.extra_flags = tuple(extra_flags)
        self.scroll_px = scroll_px
        self.wait_s = wait_s
        self.drag_steps = drag_steps
        self.settle_timeout_s = settle_timeout_s
        self.step_pause_s = step_pause_s
        self.instance: ChromiumInstance | None = None
        self.task: TaskSpec | None = None
        self.utterance = ""
        self._raw_reward: float | None = None
        self._done = True
        self._t0 = 0.0

    # ---------------------------------------------------------------- lifecycle
    def _start(self, subdomain: str) -> ChromiumInstance:
        inst = ChromiumInstance(
            subdomain,
            chromium_binary=self.chromium_binary,
            chromedriver=self.chromedriver,
            extra_flags=self.extra_flags,
        )
        try:
            inst.create_driver()
        except Exception:
            inst.close()
            raise
        return inst

    def _restart(self, subdomain: str) -> None:
        if self.instance is not None:
            self.instance.close()
            self.instance = None
        self.instance = self._start(subdomain)

    def reset(self, task: TaskSpec, seed: int | None = None) -> Observation:
        """Start an episode of `task`; a dead browser is replaced once before giving up, and reported in
        the observation's `faults` (the pool counts it)."""
        if task.backend != "miniwob":
            raise ValueError(f"MiniWoBEnv cannot run backend {task.backend!r}")
        if task.pinned:  # a pinned instance is its own seed (suites.py, decision "Fixed instances")
            seed = task.seed
        faults: list[str] = []
        for attempt in range(2):
            try:
                if self.instance is None or self.instance.died:
                    self._restart(task.family)
                else:
                    self.instance.load_task(task.family)
                obs = self._begin(task, seed)
                obs.faults = tuple(faults)
                return obs
            except BROWSER_ERRORS as e:
                if attempt == 1:
                    raise
                first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
                faults.append(f"browser failed during reset ({type(e).__name__}: {first}); replaced")
                self._restart(task.family)
        raise AssertionError("unreachable")

    def _begin(self, task: TaskSpec, seed: int | None) -> Observation:
        inst = self.instance
        assert inst is not None
        inst.mode = str(task.config.get("data_mode", "train"))
        inst.force_stop()
        ActionChains(inst.driver).reset_actions()  # release keys/buttons a keydown left pressed
        park = self._chain()
        # decision "Parked pointer": no hover left over
        park.w3c_actions.pointer_action.move_to_location(*PARK_POINT)
        park.w3c_actions.perform()
        # Set every episode (a page load resets both), so changing the attribute takes effect at once; the
        # episode clock and the hidden caret (decision "Hidden caret") in one round trip to the browser.
        inst.driver.execute_script(
            f"core.EPISODE_MAX_TIME = {episode_limit_ms(self.episode_time_limit_s)};" + _NO_CARET_JS
        )
        inst.begin_task(seed=seed)
        response = inst.driver.execute_script("return core.getUtterance();")
        self.utterance = response["utterance"] if isinstance(response, dict) else str(response)
        self.task = task
        self._raw_reward = None
        self._done = False
        self._t0 = time.monotonic()
        return self._observe()

    def close(self) -> str | None:
        """Quit the browser. Returns a note when it had died since the last call (a fault the pool
        counts: nothing else would notice a browser killed after the last step)."""
        note = None
        if self.instance is not None:
            was_up = not self.instance.died
            if was_up and not self.instance.alive():
                note = "browser found dead when the env closed"
            if not self.instance.close() and was_up and note is None:
                note = "browser failed while the env closed it"
            self.instance = None
        return note

    def browser_pids(self) -> list[int]:
        """chromedriver and the Chromium processes below it (for tests and crash handling)."""
        pid = self.instance.driver_pid() if self.instance else None
        return _descendants(pid) if pid else []

    def profile_dir(self) -> str | None:
        """The browser's --user-data-dir (every Chromium process, crashpad included, names it)."""
        return self.instance.user_data_dir if self.instance else None

    # ---------------------------------------------------------------- observing
    def screenshot(self) -> Image.Image:
        inst = self.instance
        assert inst is not None
        return get_screenshot(
            inst.driver,
            true_width=inst.inner_width,
            true_height=inst.inner_height,
            crop_width=inst.task_width,
            crop_height=inst.task_height,
        )

    def _observe(self) -> Observation:
        return Observation(screenshot=self.screenshot(), instruction=self.utterance, screen_size=SCREEN_SIZE)

    def _metadata(self) -> dict[str, Any]:
        assert self.instance is not None
        return self.instance.get_metadata()

    def dom_elements(self) -> list[DomElement]:
        """All elements of the task area with boxes in screen pixels (never shown to the policy)."""
        assert self.instance is not None
        raw = self.instance.driver.execute_script(_DOM_JS % SCREEN_SIZE)
        return [
            DomElement(
                index=i,
                tag=r["tag"],
                text=r["text"],
                full_text=r["full_text"],
                id=r["id"],
                classes=r["classes"],
                bbox=(float(r["left"]), float(r["top"]), float(r["width"]), float(r["height"])),
                visible=bool(r["visible"]),
                topmost=bool(r["topmost"]),
                value=r["value"],
                focused=bool(r["focused"]),
                bg=r["bg"],
                fg=r["fg"],
                parent=int(r["parent"]),
            )
            for i, r in enumerate(raw)
        ]

    def oracle_reply(self, min_pixels: int | None = None, max_pixels: int | None = None) -> str | None:
        """The scripted oracle's UI-TARS reply for the current state (None: no oracle for the task), in
        the model-image frame of a policy with this pixel budget (default: the oracles' own)."""
        assert self.task is not None
        return oracle_reply(
            self.task.family,
            self.utterance,
            self.dom_elements(),
            min_pixels=min_pixels or MODEL_MIN_PIXELS,
            max_pixels=max_pixels or MODEL_MAX_PIXELS,
        )

    # ---------------------------------------------------------------- acting
    def step(self, actions: list[Action]) -> StepResult:
        """Run the actions in order (stopping once MiniWoB ends the episode), then observe."""
        if self._done or self.instance is None:
            return StepResult(self._blank(), True, {"error": "step() called outside an episode"})
        info: dict[str, Any] = {"action_errors": []}
        agent_end = None
        try:
            acted = False
            for i, action in enumerate(actions):
                if action.kind in TERMINAL_KINDS:
                    agent_end = action.kind
                    break
                try:
                    self._perform(action)
                    acted = True
                except (KeyError, ValueError) as e:
                    info["action_errors"].append(f"{action.kind}: {e}")
                if i + 1 < len(actions) and self._metadata()["done"]:  # decision "Few round trips"
                    break
            if acted and self.step_pause_s > 0:  # decision "Step pause"
                time.sleep(self.step_pause_s)
            meta = self._settle()
            obs = self._observe()
        except BROWSER_ERRORS as e:
            self._done = True
            if self.instance is not None:
                self.instance.died = True
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return StepResult(self._blank(), True, {"error": f"browser failure: {msg}", "fatal": True})
        if meta["done"]:
            self._raw_reward = float(meta["raw_reward"])
        self._done = bool(meta["done"]) or agent_end is not None
        info.update(
            raw_reward=self._raw_reward,
            reason=meta.get("reason"),
            miniwob_done=bool(meta["done"]),
            agent_end=agent_end,
            elapsed_s=time.monotonic() - self._t0,
        )
        return StepResult(obs, self._done, info)

    def _settle(self) -> dict[str, Any]:
        """Wait (at most settle_timeout_s) until no jQuery animation runs, so the screenshot is final;
        MiniWoB's metadata as of the last check (decision "Few round trips")."""
        assert self.instance is not None
        deadline = time.monotonic() + self.settle_timeout_s
        state = self.instance.driver.execute_script(_STATE_JS)
        while state["busy"] and time.monotonic() < deadline:
            time.sleep(0.02)
            state = self.instance.driver.execute_script(_STATE_JS)
        return state["meta"]

    def evaluate(self) -> float:
        """1.0 when MiniWoB ended the episode with a positive raw reward, else 0.0
        (decision "Raw-reward success")."""
        return 1.0 if self._raw_reward is not None and self._raw_reward > 0 else 0.0

    def _blank(self) -> Observation:
        return Observation(Image.new("RGB", SCREEN_SIZE), self.utterance, SCREEN_SIZE)

    def _chain(self) -> ActionChains:
        assert self.instance is not None
        return ActionChains(self.instance.driver, duration=0)

    def _perform(self, a: Action) -> None:
        kind = a.kind
        if kind in ("click", "left_double", "right_single", "hover", "scroll", "drag"):
            if a.point is None:
                raise ValueError("missing start point")
            x, y = clamp_point(*a.point)
            chain = self._chain()
            ptr = chain.w3c_actions.pointer_action
            ptr.move_to_location(x, y)
            if kind == "click":
                ptr.click()
            elif kind == "left_double":
                ptr.double_click()
            elif kind == "right_single":
                ptr.context_click()
            elif kind == "drag":
                if a.end_point is None:
                    raise ValueError("drag without end point")
                ex, ey = clamp_point(*a.end_point)
                ptr.click_and_hold()
                for i in range(1, self.drag_steps + 1):
                    ptr.move_to_location(
                        round(x + (ex - x) * i / self.drag_steps), round(y + (ey - y) * i / self.drag_steps)
                    )
                ptr.release()
            elif kind == "scroll":
                dx, dy = {
                    "up": (0, -1),
                    "down": (0, 1),
                    "left": (-1, 0),
                    "right": (1, 0),
                }.get(a.direction or "down", (0, 1))
                chain.w3c_actions.perform()
                chain = self._chain()
                chain.w3c_actions.wheel_action.scroll(
                    x=x, y=y, delta_x=dx * self.scroll_px, delta_y=dy * self.scroll_px, duration=0
                )
            chain.w3c_actions.perform()
        elif kind in ("hotkey", "press", "keydown", "keyup"):
            names = (a.key or "").split()
            if not names:
                raise ValueError("missing key")
            keys = [webdriver_key(n) for n in names]
            chain = self._chain()
            kb = chain.w3c_actions.key_action
            if kind in ("hotkey", "press", "keydown"):
                for k in keys:
                    kb.key_down(k)
            if kind in ("hotkey", "press", "keyup"):
                for k in reversed(keys):
                    kb.key_up(k)
            chain.w3c_actions.perform()
        elif kind == "type":
            chain = self._chain()
            kb = chain.w3c_actions.key_action
            for ch in a.content or "":
                key = Keys.ENTER if ch == "\n" else ch
                kb.key_down(key)
                kb.key_up(key)
            chain.w3c_actions.perform()
        elif kind == "wait":
            time.sleep(self.wait_s)
        else:
            raise ValueError(f"unsupported action kind {kind!r}")


def make_miniwob_env(**kwargs: Any) -> MiniWoBEnv:
    """Module-level constructor: `functools.partial(make_miniwob_env, ...)` pickles by reference."""
    return MiniWoBEnv(**kwargs)
