"""Real MiniWoB screens kept on disk, so that a grounding run that resumes does not render them again.

Design decisions:
- **Screen cache.** A ground stage with real screens reads every (task, env seed) it trains on before its
  first step: for presets/ground-reading-2x-lorem.yaml 2,000 seeds of the 4 in-domain tasks, which its
  two phases read as 10,400 screens (the first phase's 600 seeds twice), 10-25 minutes of browser time
  that every resume of an hours-long run paid again (and `arpo snapshot ground`, which renders them to
  check a checkpoint's fingerprint). `ScreenCache` stands in for the env that `miniwob_examples`
  reads (`reset`, `screenshot`, `dom_elements`): each (task, seed)'s screenshot (PNG), utterance and DOM
  elements are one JSON file, `<root>/<key>/<task>/<data mode>-<seed>.json`, written atomically the
  first time and read every time after. The browser starts at the first miss, so a stage whose screens
  are all on disk starts none. Measured before it was built: the same seeds read by two browsers gave
  byte-identical screenshots and element lists (but for `<body>`'s full text, which carries MiniWoB's
  episode counter and is never a target), so a cached screen is the screen a browser would read.
- **What the key holds.** Everything that decides those bytes: this file's format, the MiniWoB package's
  version and pages (its core, common and task files), Chromium's binary (path, size and modification
  time: another version or a reinstall) and flags, the installed fonts (each file's path, size and
  time), the env's own code (miniwob_env.py and dom.py: how a reset draws the page, e.g. the parked
  pointer and the hidden caret, and how the elements are read) and the screen size. A change to any of
  them is another folder, so a stale screen is never read; old folders are left for the user to remove.
  No browser runs to make the key (not `chromium --version`: no browser process outside an env's care).
- **Never fatal.** A file that does not read (truncated, another format, another task's) is read again
  from the browser and rewritten, with a warning; a cache that cannot be written (a full disk, a
  read-only folder) is given up for the rest of the call with one warning, and the screens come from
  the browser as before the cache existed. A screen with no seed (a random episode) is not cached.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.metadata
import io
import json
import logging
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from arpo_core.envs.base import Observation, TaskSpec
from arpo_core.envs.miniwob.dom import SCREEN_SIZE, DomElement
from arpo_core.infra.fileio import atomic_write_text

log = logging.getLogger("arpo.envs")

FORMAT = 1
"""The files' layout; a change makes another key."""
NAMED = 5
"""Damaged files named one warning each; the rest are counted (`ScreenCache.damaged`)."""


@dataclass(frozen=True)
class Screen:
    """One (task, seed)'s first screen as `miniwob_examples` reads it."""

    screenshot: Image.Image
    instruction: str
    elements: tuple[DomElement, ...]

    def to_json(self) -> str:
        png = io.BytesIO()
        self.screenshot.save(png, format="PNG")
        return json.dumps(
            {
                "format": FORMAT,
                "instruction": self.instruction,
                "png": base64.b64encode(png.getvalue()).decode("ascii"),
                "elements": [asdict(e) for e in self.elements],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Screen:
        d = json.loads(text)
        if d.get("format") != FORMAT:
            raise ValueError(f"format {d.get('format')!r}, not {FORMAT}")
        image = Image.open(io.BytesIO(base64.b64decode(d["png"], validate=True)))
        image.load()
        elements = tuple(DomElement(**(e | {"bbox": tuple(e["bbox"])})) for e in d["elements"])
        return cls(image.convert("RGB"), str(d["instruction"]), elements)


def _first_line(exc: BaseException) -> str:
    """The first line of an error's message, or its type's name when it has none (the warnings quote it)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _tree_digest(h: Any, root: Path, patterns: tuple[str, ...]) -> None:
    for pattern in patterns:
        for f in sorted(root.glob(pattern)):
            if f.is_file():
                h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())


def _command(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


@functools.cache
def render_key(chromium_binary: str, flags: tuple[str, ...]) -> str:
    """What decides a screen's bytes, hashed (decision "What the key holds"): 16 hex digits."""
    import miniwob

    from arpo_core.envs.miniwob import dom, miniwob_env

    h = hashlib.sha256()
    h.update(f"format {FORMAT}\0{SCREEN_SIZE}\0{flags}\0".encode())
    for module in (miniwob_env, dom):  # how a reset draws the page and reads its elements
        h.update(Path(module.__file__).read_bytes() + b"\0")
    h.update(importlib.metadata.version("miniwob").encode() + b"\0")
    _tree_digest(h, Path(miniwob.__file__).parent / "html", ("core/**/*", "common/**/*", "miniwob/*"))
    h.update(_stat(chromium_binary).encode() + b"\0")  # not `chromium --version`: no browser process here
    for font in sorted(_command(["fc-list", "--format", "%{file}\n"]).split("\n")):
        h.update(_stat(font).encode() if font else b"")
    return h.hexdigest()[:16]


def _stat(path: str) -> str:
    """A file's path, size and modification time (another build or a reinstall changes them); "" when
    it is not there."""
    try:
        st = Path(path).stat()
    except OSError:
        return ""
    return f"{path}:{st.st_size}:{st.st_mtime_ns}\n"


class ScreenCache:
    """An env for `miniwob_examples` (reset, screenshot, dom_elements) whose screens come from `folder`
    where they are there and from `make_env()`'s browser, started at the first miss, where they are not
    (decision "Screen cache"). `close()` closes that browser; `hits`, `misses` and `damaged` count the
    screens."""

    def __init__(self, folder: str | Path, make_env: Callable[[], Any]):
        self.folder = Path(folder)
        self._make_env = make_env
        self._env: Any = None
        self._screen: Screen | None = None
        self._writable = True
        self.hits = 0
        self.misses = 0
        self.damaged = 0

    def _path(self, task: TaskSpec, seed: int) -> Path:
        mode = str(task.config.get("data_mode", "train"))
        return self.folder / task.family / f"{mode}-{seed}.json"

    def _read(self, path: Path) -> Screen | None:
        try:
            text = path.read_text(encoding="utf-8")
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (OSError, UnicodeDecodeError) as e:
            return self._damaged(path, e)
        try:
            return Screen.from_json(text)
        except (ValueError, KeyError, TypeError, OSError) as e:  # PIL's errors are OSError / ValueError
            return self._damaged(path, e)

    def _damaged(self, path: Path, e: BaseException) -> None:
        """A file that does not read: named in a warning (the first `NAMED` of them), then read again."""
        self.damaged += 1
        if self.damaged <= NAMED:
            log.warning(
                "screen cache: %s is damaged (%s); reading the screen again", path, _first_line(e)[:200]
            )
        if self.damaged == NAMED:
            log.warning(
                "screen cache: more damaged files in %s are read again without a warning each", self.folder
            )
        return None

    def _write(self, path: Path, screen: Screen) -> None:
        if not self._writable:
            return
        try:
            atomic_write_text(path, screen.to_json())
        except OSError as e:
            self._writable = False
            log.warning(
                "screen cache: not writing to %s any more (%s); screens come from the browser",
                self.folder,
                _first_line(e),
            )

    def env(self) -> Any:
        """The browser env, started on first use."""
        if self._env is None:
            self._env = self._make_env()
        return self._env

    def reset(self, task: TaskSpec, seed: int | None = None) -> Observation:
        if task.pinned:  # a pinned instance is its own seed, as MiniWoBEnv.reset plays it
            seed = task.seed
        path = self._path(task, seed) if seed is not None else None
        screen = self._read(path) if path is not None else None
        if screen is None:
            env = self.env()
            obs = env.reset(task, seed=seed)
            screen = Screen(obs.screenshot, obs.instruction, tuple(env.dom_elements()))
            self.misses += 1
            if path is not None:
                self._write(path, screen)
        else:
            self.hits += 1
        self._screen = screen
        return Observation(
            screenshot=screen.screenshot, instruction=screen.instruction, screen_size=SCREEN_SIZE
        )

    def screenshot(self) -> Image.Image:
        assert self._screen is not None, "reset first"
        return self._screen.screenshot

    def dom_elements(self) -> list[DomElement]:
        assert self._screen is not None, "reset first"
        return list(self._screen.elements)

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None
