"""Reply grammars -> Thought + Actions (UI-TARS calls, Qwen3-VL tool calls); coordinates; pyautogui rendering.

A policy reply looks like ``Thought: <plan>\\nAction: click(start_box='(235,512)')`` (docs/method.md §3).
This module turns such text into typed `Action`s, writes the canonical text back (for oracles and the
prompt), maps coordinates between the image the model saw and the screen, and renders pyautogui code.

Decisions:
- **Untrusted model text.** Model text is untrusted input. The reference parser calls `eval` on it; here a
  small hand-written scanner reads the call syntax ``name(key='value', ...)`` and nothing in this module ever
  evaluates, compiles or imports anything derived from model text. All regexes are compiled at import time.
- **Strict parsing with tolerances.** Strict by default, with a short, documented list of tolerances. A reply
  that is not accepted raises `ActionParseError` whose message says what is wrong and where; the rollout turns
  it into the format penalty (docs/method.md §1). Accepted beyond the canonical form:
  a. leading/trailing whitespace, CRLF line ends, spaces around ``(``, ``=``, ``,`` and ``)``, and one
     trailing comma in the argument list;
  b. a missing thought (the reply starts with ``Action:``) -> thought ``""``; ``Action:`` on the same
     line as the thought (then the first ``Action:`` preceded by whitespace splits; a line that starts
     with ``Action:`` always wins over a mid-line one, so a thought may mention "Action:" mid-line);
  c. ``Reflection: R\\nAction_Summary: S`` -> thought S (as the reference parser: the summary is the
     thought), ``Reflection: R`` alone -> R, ``Action_Summary: S`` -> S;
  d. actions separated by any whitespace that contains a newline (canonical: one blank line);
  e. single or double quotes; raw newlines inside a quoted string are kept;
  f. in ``type``/``finished`` content, an unescaped quote of the delimiting kind (``content='I'm
     here'``, common in real UI-TARS output) when the strict reading fails: the content then ends at
     the first such quote followed by ``)`` and the end of the line or reply;
  g. scroll direction in any letter case; scroll without start_box (scroll at the current pointer);
     ``finished()`` without content (content None); ``type(content='')``.
  Anything else is an error: text before the first label, unknown action or argument names, positional
  or duplicate arguments, missing required arguments, unknown key names (checked against pyautogui's
  key list after normalisation), a bad scroll direction, negative / NaN / infinite coordinates, and
  any trailing text after the last action.
- **Python string escapes.** Escapes inside quoted strings follow Python for the sequences UI-TARS is told to
  use: ``\\\\``, ``\\'``, ``\\"``, ``\\n``, ``\\t``, ``\\r``. Any other backslash pair is kept literally (as
  Python keeps unknown escapes); ``\\x``/``\\u`` escapes are NOT decoded. `format_action` escapes exactly
  these, so ``parse_response(format_response(t, a))`` returns ``(t.strip(), a)`` for every content.
- **Box forms.** Box forms ``'(x,y)'``, ``'[x,y]'``, ``'<|box_start|>(x,y)<|box_end|>'``, ``'<point>x
  y</point>'``, ``'<bbox>x1 y1 x2 y2</bbox>'`` and any 4-number box (its centre) are accepted, ints or floats.
  `Action.point` is always a float pair. The canonical written form is ``'(x,y)'`` with integer
  coordinates (a special-token-free form survives decoding with ``skip_special_tokens``); the other
  forms are available through ``box_style``.
- **Key names.** `Action.key` keeps the key string as written; `normalize_keys` maps it to pyautogui names
  (lower case, ``arrowleft`` -> ``left``, ``control`` -> ``ctrl``, ``cmd`` -> ``command``, ...). The
  key list is copied from pyautogui 0.9.54 (`KEYBOARD_KEYS`): importing pyautogui needs a display.
- **Coordinate modes.** Coordinates: UI-TARS-1.5 / Qwen2.5-VL answer in absolute pixels of the smart_resized
  image (mode ``"absolute"``: x * W / w'); UI-TARS-1.0 answered in 0-1000 relative units (mode
  ``"relative1000"``: x * W / 1000). Sizes are always (width, height) except `smart_resize`, which
  keeps Qwen's (height, width) order. `to_screen` clamps to the screen; `to_model` clamps its
  input to the screen, so its output lies inside the model frame.
- **pyautogui rendering.** `to_pyautogui` returns one string per action, each either pyautogui code (for
  non-ASCII text also a fixed X11 typing helper, decision "X11 typing helper") or one of the OSWorld markers
  ``"DONE"`` (finished), ``"FAIL"`` (call_user) and ``"WAIT"`` (wait): a caller executes the
  code strings in order and stops at DONE/FAIL (``cmd in PYAUTOGUI_MARKERS`` tells them apart). This
  is the list of actions OSWorld's UI-TARS agent hands to ``DesktopEnv.step``. All user text is
  emitted with `repr()` of a str, so quotes, backslashes, newlines and code in content are typed
  literally; horizontal scrolls use ``pyautogui.hscroll`` (the reference silently drops them).
- **X11 typing helper.** `type` text with any non-ASCII character (accents, CJK, emoji: pyautogui.write has no
  key for them and drops them silently on X11, as it drops control characters) is rendered as the fixed helper
  `X11_TYPE_HELPER` followed by one call whose only argument is `ascii()` of the text: the rendered code
  stays pure ASCII, the text is a single string literal (never code, never a shell word), and the
  helper types it through XTEST with keycodes bound to the characters' keysyms. Pure-ASCII text keeps
  `pyautogui.write`. A trailing newline is still `pyautogui.press('enter')`.
- **Qwen3-VL tool calls.** The Qwen3-VL / GUI-Owl-1.5 grammar (`action_format` "qwen3vl_tool_call",
  docs/models.md): a reply is ``Action: <one-line summary>`` and one ``<tool_call>{"name": "computer_use",
  "arguments": {"action": ..., ...}}</tool_call>`` block per action, parsed into the same `Action`s: a. The
  JSON goes through `json.loads` and nothing else (the published agents use `ast.literal_eval`; here a single-
  quoted pseudo-JSON is a format error). NaN/Infinity, duplicate keys, deep nesting, huge numbers, unknown
  functions, actions or arguments, missing arguments and wrong types are format errors, each an
  `ActionParseError` naming the tool call. b. Accepted beyond the canonical form: surrounding whitespace; no
  ``Action:`` line (thought ""); a leading ``<think>...</think>`` / ``<thinking>...</thinking>`` block
  (thinking variants; its text is the thought when there is no ``Action:`` line); any whitespace between
  blocks. Anything else outside the blocks, or an unclosed block, is an error. c. Mapping: left_click ->
  click, double_click -> left_double, right_click -> right_single, mouse_move -> hover, key with one key ->
  press, with several -> hotkey (each key checked like UI-TARS keys), type -> type, answer ->
  finished(content), terminate success -> finished(), terminate failure -> call_user (OSWorld's FAIL), wait ->
  wait (`time` accepted, not used). triple_click, middle_click and interact have no counterpart here: format
  errors. d. left_click_drag must name both ends (`start_coordinate` and `coordinate`): the published tool
  drags from wherever the pointer is, which a stateless `Action` cannot express. e. scroll / hscroll: the sign
  of `pixels` gives the direction (scroll: + up, - down; hscroll: + right, - left); the amount is not kept
  (the renderer's `scroll_amount` decides), so the writer puts `TOOL_SCROLL_PIXELS`. f. Writing
  (`format_tool_call_response`) gives coordinates as integers and is read back exactly for every kind it can
  write; keydown and keyup have no tool call (ValueError), a one-key hotkey reads back as press. Coordinates
  are in the frame the prompt announces: GUI-Owl-1.5 answers in 0-1000 units of the screenshot (its README:
  "outputs relative coordinates (0-1000) by default"), i.e. `to_screen` mode "relative1000"; the config ties
  this format to that mode.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

ACTION_KINDS = (
    "click",
    "left_double",
    "right_single",
    "hover",
    "drag",
    "hotkey",
    "press",
    "keydown",
    "keyup",
    "type",
    "scroll",
    "wait",
    "finished",
    "call_user",
)


class ActionParseError(ValueError):
    """A model reply that does not follow the UI-TARS grammar; the message says what is wrong."""


@dataclass(frozen=True)
class Action:
    """One GUI action.

    Coordinates are in whatever frame the producer used: `parse_response` yields model-image pixels
    (the smart_resized image the model saw); `to_screen` maps them to screen pixels, which is what
    `GuiEnv.step` takes.
    """

    kind: str
    """One of ACTION_KINDS (`select` is normalised to `drag`)."""
    point: tuple[float, float] | None = None
    """start_box / point as (x, y); the centre for 4-number boxes."""
    end_point: tuple[float, float] | None = None
    """end_box for drag."""
    key: str | None = None
    """hotkey/press/keydown/keyup: space-separated key names as written by the model, e.g. 'ctrl c'."""
    content: str | None = None
    """type / finished text, unescaped (a trailing '\\n' in type means press Enter after)."""
    direction: str | None = None
    """scroll: up, down, left or right."""


@dataclass(frozen=True)
class ParsedResponse:
    thought: str
    actions: list[Action]


# ---------------------------------------------------------------------------------------------------------
# Constants
# ---------------------------------------------------------------------------------------------------------

# fmt: off
KEYBOARD_KEYS: tuple[str, ...] = (
    '\t', '\n', '\r', ' ', '!', '"', '#', '$', '%', '&', "'", '(', ')', '*', '+', ',', '-', '.', '/', '0',
    '1', '2', '3', '4', '5', '6', '7', '8', '9', ':', ';', '<', '=', '>', '?', '@', '[', '\\', ']', '^',
    '_', '`', 'a', 'b', 'c', 'd', 'e', 'f', 'g', 'h', 'i', 'j', 'k', 'l', 'm', 'n', 'o', 'p', 'q', 'r',
    's', 't', 'u', 'v', 'w', 'x', 'y', 'z', '{', '|', '}', '~', 'accept', 'add', 'alt', 'altleft',
    'altright', 'apps', 'backspace', 'browserback', 'browserfavorites', 'browserforward', 'browserhome',
    'browserrefresh', 'browsersearch', 'browserstop', 'capslock', 'clear', 'convert', 'ctrl', 'ctrlleft',
    'ctrlright', 'decimal', 'del', 'delete', 'divide', 'down', 'end', 'enter', 'esc', 'escape', 'execute',
    'f1', 'f10', 'f11', 'f12', 'f13', 'f14', 'f15', 'f16', 'f17', 'f18', 'f19', 'f2', 'f20', 'f21', 'f22',
    'f23', 'f24', 'f3', 'f4', 'f5', 'f6', 'f7', 'f8', 'f9', 'final', 'fn', 'hanguel', 'hangul', 'hanja',
    'help', 'home', 'insert', 'junja', 'kana', 'kanji', 'launchapp1', 'launchapp2', 'launchmail',
    'launchmediaselect', 'left', 'modechange', 'multiply', 'nexttrack', 'nonconvert', 'num0', 'num1',
    'num2', 'num3', 'num4', 'num5', 'num6', 'num7', 'num8', 'num9', 'numlock', 'pagedown', 'pageup',
    'pause', 'pgdn', 'pgup', 'playpause', 'prevtrack', 'print', 'printscreen', 'prntscrn', 'prtsc',
    'prtscr', 'return', 'right', 'scrolllock', 'select', 'separator', 'shift', 'shiftleft', 'shiftright',
    'sleep', 'space', 'stop', 'subtract', 'tab', 'up', 'volumedown', 'volumemute', 'volumeup', 'win',
    'winleft', 'winright', 'yen', 'command', 'option', 'optionleft', 'optionright',
)
# fmt: on
"""pyautogui 0.9.54's `KEYBOARD_KEYS`, copied (importing pyautogui needs an X display)."""

_KEY_SET = frozenset(KEYBOARD_KEYS)

KEY_ALIASES: dict[str, str] = {
    "arrowleft": "left",
    "arrowright": "right",
    "arrowup": "up",
    "arrowdown": "down",
    "control": "ctrl",
    "cmd": "command",
    "meta": "win",
    "super": "win",
    "windows": "win",
    "spacebar": "space",
    "page_up": "pageup",
    "page_down": "pagedown",
    "caps_lock": "capslock",
}
"""Model spellings -> pyautogui key names (the reference maps arrow* -> left/right/up/down)."""

SCROLL_DIRECTIONS = ("up", "down", "left", "right")
COORD_MODES = ("absolute", "relative1000")
BOX_STYLES = ("plain", "box_tokens", "point")
PYAUTOGUI_MARKERS = ("DONE", "FAIL", "WAIT")
"""Non-code commands of OSWorld's `DesktopEnv.step`: finished -> DONE, call_user -> FAIL, wait -> WAIT."""

_ARG_ALIASES = {"point": "start_box", "start_point": "start_box", "end_point": "end_box"}
# kind -> (required arguments, optional arguments), after aliasing.
_ARG_SPEC: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "click": (frozenset({"start_box"}), frozenset()),
    "left_double": (frozenset({"start_box"}), frozenset()),
    "right_single": (frozenset({"start_box"}), frozenset()),
    "hover": (frozenset({"start_box"}), frozenset()),
    "drag": (frozenset({"start_box", "end_box"}), frozenset()),
    "hotkey": (frozenset({"key"}), frozenset()),
    "press": (frozenset({"key"}), frozenset()),
    "keydown": (frozenset({"key"}), frozenset()),
    "keyup": (frozenset({"key"}), frozenset()),
    "type": (frozenset({"content"}), frozenset()),
    "scroll": (frozenset({"direction"}), frozenset({"start_box"})),
    "wait": (frozenset(), frozenset()),
    "finished": (frozenset(), frozenset({"content"})),
    "call_user": (frozenset(), frozenset()),
}
_ACTION_NAMES = (*ACTION_KINDS, "select")
_KEY_KINDS = frozenset({"hotkey", "press", "keydown", "keyup"})
_CONTENT_KINDS = frozenset({"type", "finished"})

# Escapes UI-TARS is told to use in content (decision "Python string escapes"); anything else keeps its
# backslash.
_UNESCAPE = {"\\": "\\", "'": "'", '"': '"', "n": "\n", "t": "\t", "r": "\r"}
_ESCAPE = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\t": "\\t", "\r": "\\r"}

_IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LINE_ACTION_RE = re.compile(r"^[ \t\r\f\v]*Action:", re.MULTILINE)
_INLINE_ACTION_RE = re.compile(r"(?:^|(?<=\s))Action:")
_SUMMARY_RE = re.compile(r"Action_Summary:")
# A loose content string ends at a quote followed by ')' and then the end of the line or reply (2f).
_LOOSE_OPEN_RE = re.compile(r"\s*\(\s*content\s*=\s*(['\"])")
_LOOSE_CLOSE_RE = re.compile(r"\s*\)[^\S\n]*(?:\n|\Z)")
_BOX_TOKENS_RE = re.compile(r"<\|box_start\|>(.*)<\|box_end\|>", re.DOTALL)
_TAG_RE = re.compile(r"<(point|bbox)>(.*)</\1>", re.DOTALL)
_NUM_RE = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_TAG_SEP_RE = re.compile(r"[\s,]+")
_COMMA_RE = re.compile(r"\s*,\s*")


# ---------------------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------------------


def _snippet(text: str, pos: int, width: int = 40) -> str:
    """The text at `pos` for error messages: repr of at most `width` characters."""
    part = text[pos : pos + width]
    return repr(part + "...") if len(text) > pos + width else repr(part)


def normalize_keys(key: str) -> list[str]:
    """Split a model key string ('ctrl c', 'ArrowLeft') into pyautogui key names ['ctrl', 'c'].

    Raises ActionParseError naming the first key that is not in pyautogui's KEYBOARD_KEYS.
    """
    names = key.split()
    if not names:
        raise ActionParseError(f"empty key string {key!r}")
    out = []
    for name in names:
        low = name.lower()
        low = KEY_ALIASES.get(low, low)
        if low not in _KEY_SET:
            raise ActionParseError(
                f"unknown key {name!r} in {key!r} (keys are pyautogui names separated by spaces, "
                "e.g. 'ctrl c', 'enter', 'left')"
            )
        out.append(low)
    return out


def _parse_number(token: str, box: str) -> float:
    if not _NUM_RE.fullmatch(token):
        raise ActionParseError(f"bad coordinate {token!r} in box {box!r}")
    value = float(token)
    if not math.isfinite(value):
        raise ActionParseError(f"coordinate {token!r} in box {box!r} is not finite")
    if value < 0:
        raise ActionParseError(f"negative coordinate {token!r} in box {box!r}")
    return value


def parse_box(box: str) -> tuple[float, float]:
    """A box string in any accepted form (decision "Box forms") -> (x, y); the centre for 4-number boxes."""
    inner = box.strip()
    m = _BOX_TOKENS_RE.fullmatch(inner)
    if m:
        inner = m.group(1).strip()
    m = _TAG_RE.fullmatch(inner)
    if m:
        tokens = [t for t in _TAG_SEP_RE.split(m.group(2).strip()) if t]
    elif len(inner) >= 2 and (inner[0], inner[-1]) in {("(", ")"), ("[", "]")}:
        body = inner[1:-1].strip()
        tokens = _COMMA_RE.split(body) if body else []
    else:
        raise ActionParseError(
            f"bad box {box!r} (expected '(x,y)', '<|box_start|>(x,y)<|box_end|>', '<point>x y</point>' "
            "or a 4-number box)"
        )
    nums = [_parse_number(t, box) for t in tokens]
    if len(nums) not in (2, 4):
        raise ActionParseError(f"box {box!r} has {len(nums)} numbers (expected 2 or 4)")
    if len(nums) == 4:
        return ((nums[0] + nums[2]) / 2, (nums[1] + nums[3]) / 2)
    return (nums[0], nums[1])


def _unescape(raw: str) -> str:
    """Decode the escapes of decision "Python string escapes" in the body of a quoted string."""
    out = []
    i, n = 0, len(raw)
    while i < n:
        c = raw[i]
        if c == "\\" and i + 1 < n:
            e = raw[i + 1]
            out.append(_UNESCAPE.get(e, "\\" + e))
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _skip_ws(text: str, pos: int) -> int:
    n = len(text)
    while pos < n and text[pos].isspace():
        pos += 1
    return pos


def _scan_string(text: str, pos: int, where: str) -> tuple[str, int]:
    """Read the quoted string starting at text[pos] (a quote) -> (decoded value, position after it)."""
    quote = text[pos]
    i, n = pos + 1, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
        elif c == quote:
            return _unescape(text[pos + 1 : i]), i + 1
        else:
            i += 1
    raise ActionParseError(f"{where}: unterminated string starting at {_snippet(text, pos)}")


def _scan_call(text: str, pos: int, where: str) -> tuple[str, list[tuple[str, str]], int]:
    """Read `name(key='value', ...)` at text[pos] -> (name, [(key, value)], position after ')')."""
    m = _IDENT_RE.match(text, pos)
    if not m:
        raise ActionParseError(f"{where}: expected an action name, got {_snippet(text, pos)}")
    name = m.group(0)
    if name not in _ACTION_NAMES:
        raise ActionParseError(
            f"{where}: unknown action {name!r} at {_snippet(text, pos)} (known: {', '.join(_ACTION_NAMES)})"
        )
    i = _skip_ws(text, m.end())
    if i >= len(text) or text[i] != "(":
        raise ActionParseError(f"{where}: expected '(' after {name!r}, got {_snippet(text, i)}")
    i = _skip_ws(text, i + 1)
    args: list[tuple[str, str]] = []
    while True:
        if i >= len(text):
            raise ActionParseError(f"{where}: {name}(...) is not closed with ')'")
        if text[i] == ")":
            return name, args, i + 1
        km = _IDENT_RE.match(text, i)
        if not km:
            raise ActionParseError(
                f"{where}: expected a keyword argument like key='value' in {name}(...), got {_snippet(text, i)}"
            )
        key = km.group(0)
        i = _skip_ws(text, km.end())
        if i >= len(text) or text[i] != "=":
            raise ActionParseError(f"{where}: expected '=' after argument {key!r}, got {_snippet(text, i)}")
        i = _skip_ws(text, i + 1)
        if i >= len(text) or text[i] not in "'\"":
            raise ActionParseError(
                f"{where}: value of {key!r} must be a quoted string, got {_snippet(text, i)}"
            )
        value, i = _scan_string(text, i, where)
        args.append((key, value))
        i = _skip_ws(text, i)
        if i < len(text) and text[i] == ",":
            i = _skip_ws(text, i + 1)
        elif i < len(text) and text[i] != ")":
            raise ActionParseError(
                f"{where}: expected ',' or ')' after the value of {key!r}, got {_snippet(text, i)}"
            )


def _scan_loose_content(text: str, pos: int) -> tuple[str, list[tuple[str, str]], int] | None:
    """Tolerance 2f: `type(content='I'm here')` -> ('type', [('content', "I'm here")], end) or None."""
    m = _IDENT_RE.match(text, pos)
    if not m or m.group(0) not in _CONTENT_KINDS:
        return None
    om = _LOOSE_OPEN_RE.match(text, m.end())
    if not om:
        return None
    quote = om.group(1)
    i, n = om.end(), len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == quote:
            cm = _LOOSE_CLOSE_RE.match(text, i + 1)
            if cm:
                close = text.index(")", i + 1)
                return m.group(0), [("content", _unescape(text[om.end() : i]))], close + 1
        i += 1
    return None


def _build_action(name: str, args: list[tuple[str, str]], where: str) -> Action:
    kind = "drag" if name == "select" else name
    required, optional = _ARG_SPEC[kind]
    values: dict[str, str] = {}
    for key, value in args:
        canon = _ARG_ALIASES.get(key, key)
        if canon not in required and canon not in optional:
            allowed = ", ".join(sorted(required | optional)) or "none"
            raise ActionParseError(f"{where}: unknown argument {key!r} for {name} (allowed: {allowed})")
        if canon in values:
            raise ActionParseError(f"{where}: argument {canon!r} given twice in {name}(...)")
        values[canon] = value
    missing = sorted(required - values.keys())
    if missing:
        raise ActionParseError(f"{where}: {name} needs {', '.join(missing)}")

    def box(arg: str) -> tuple[float, float] | None:
        if arg not in values:
            return None
        try:
            return parse_box(values[arg])
        except ActionParseError as e:
            raise ActionParseError(f"{where}: {arg} of {name}: {e}") from None

    key = values.get("key")
    if key is not None:
        try:
            keys = normalize_keys(key)
        except ActionParseError as e:
            raise ActionParseError(f"{where}: {e}") from None
        if kind != "hotkey" and len(keys) != 1:
            raise ActionParseError(
                f"{where}: {name} takes one key, got {key!r} (use hotkey for combinations)"
            )
    direction = values.get("direction")
    if direction is not None:
        direction = direction.strip().lower()
        if direction not in SCROLL_DIRECTIONS:
            raise ActionParseError(
                f"{where}: bad scroll direction {values['direction']!r} (expected one of "
                f"{', '.join(SCROLL_DIRECTIONS)})"
            )
    return Action(
        kind=kind,
        point=box("start_box"),
        end_point=box("end_box"),
        key=key,
        content=values.get("content"),
        direction=direction,
    )


def _split_thought(text: str) -> tuple[str, int]:
    """-> (thought, index where the action section starts, just after 'Action:')."""
    m = _LINE_ACTION_RE.search(text) or _INLINE_ACTION_RE.search(text)
    if not m:
        raise ActionParseError(f"no 'Action:' in reply {_snippet(text, 0)}")
    head = text[: m.start()].strip()
    if not head:
        return "", m.end()
    for label in ("Thought:", "Action_Summary:"):
        if head.startswith(label):
            return head[len(label) :].strip(), m.end()
    if head.startswith("Reflection:"):
        sm = _SUMMARY_RE.search(head)
        body = head[sm.end() :] if sm else head[len("Reflection:") :]
        return body.strip(), m.end()
    raise ActionParseError(
        f"reply must start with 'Thought:', 'Reflection:', 'Action_Summary:' or 'Action:', "
        f"got {_snippet(head, 0)}"
    )


MAX_ACTIONS_PER_REPLY = 16
"""A reply with more actions is a format error (docs/method.md §3): UI-TARS writes one to three per step;
an unbounded count would let one reply run thousands of GUI events (a 50,000-action reply was accepted)."""


def parse_response(text: str, max_actions: int = MAX_ACTIONS_PER_REPLY) -> ParsedResponse:
    """Parse a UI-TARS reply into its thought and actions (coordinates in model-image pixels).

    Raises ActionParseError with a message saying what is wrong; see the module docstring for the
    accepted forms and tolerances. More than `max_actions` actions is an error too (checked before the
    next action is parsed, so a huge reply costs no more than `max_actions` actions). Never evaluates
    any part of `text`.
    """
    if not isinstance(text, str):
        raise ActionParseError(f"reply must be a str, got {type(text).__name__}")
    thought, pos = _split_thought(text)
    pos = _skip_ws(text, pos)
    if pos >= len(text):
        raise ActionParseError("no action after 'Action:'")
    actions: list[Action] = []
    while True:
        if len(actions) >= max_actions:
            raise ActionParseError(
                f"more than {max_actions} actions in one reply (the limit per reply; "
                f"next at {_snippet(text, pos)})"
            )
        where = f"action {len(actions) + 1}"
        start = pos
        try:
            name, args, pos = _scan_call(text, start, where)
            after = _skip_ws(text, pos)
            if after < len(text) and "\n" not in text[pos:after]:
                raise ActionParseError(
                    f"{where}: unexpected text after {name}(...): {_snippet(text, pos)} "
                    "(actions are separated by a blank line)"
                )
        except ActionParseError:
            loose = _scan_loose_content(text, start)
            if loose is None:
                raise
            name, args, pos = loose
        actions.append(_build_action(name, args, where))
        next_pos = _skip_ws(text, pos)
        if next_pos >= len(text):
            return ParsedResponse(thought=thought, actions=actions)
        pos = next_pos


# ---------------------------------------------------------------------------------------------------------
# Writing the canonical text
# ---------------------------------------------------------------------------------------------------------


def _quote(value: str) -> str:
    """A single-quoted string literal that `_scan_string` decodes back to exactly `value`."""
    return "'" + "".join(_ESCAPE.get(c, c) for c in value) + "'"


def _check_point(point: object, what: str) -> tuple[float, float]:
    if not (isinstance(point, tuple) and len(point) == 2):
        raise ValueError(f"{what} must be an (x, y) tuple, got {point!r}")
    x, y = point
    for v in (x, y):
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{what} must hold finite non-negative numbers, got {point!r}")
    return (float(x), float(y))


def validate_action(action: Action) -> None:
    """Raise ValueError if `action` could not have come from `parse_response` (wrong or extra fields).

    Used by the writers (`format_action`, `to_pyautogui`) so that a bad action from an oracle or a
    caller fails loudly instead of being rendered half.
    """
    if action.kind not in _ARG_SPEC:
        raise ValueError(f"unknown action kind {action.kind!r} (expected one of {', '.join(ACTION_KINDS)})")
    required, optional = _ARG_SPEC[action.kind]
    allowed = required | optional
    fields = {
        "start_box": action.point,
        "end_box": action.end_point,
        "key": action.key,
        "content": action.content,
        "direction": action.direction,
    }
    for arg, value in fields.items():
        if value is None and arg in required:
            raise ValueError(f"{action.kind} needs {arg} ({action!r})")
        if value is not None and arg not in allowed:
            raise ValueError(f"{action.kind} takes no {arg} ({action!r})")
    if action.point is not None:
        _check_point(action.point, "point")
    if action.end_point is not None:
        _check_point(action.end_point, "end_point")
    if action.content is not None and not isinstance(action.content, str):
        raise ValueError(f"content must be a str, got {type(action.content).__name__}")
    if action.key is not None:
        if not isinstance(action.key, str):
            raise ValueError(f"key must be a str, got {type(action.key).__name__}")
        try:
            keys = normalize_keys(action.key)
        except ActionParseError as e:
            raise ValueError(str(e)) from None
        if action.kind != "hotkey" and len(keys) != 1:
            raise ValueError(f"{action.kind} takes one key, got {action.key!r}")
    if action.direction is not None and action.direction not in SCROLL_DIRECTIONS:
        raise ValueError(f"bad scroll direction {action.direction!r}")


def _format_box(point: tuple[float, float], box_style: str) -> str:
    x, y = round(point[0]), round(point[1])
    if box_style == "plain":
        return f"'({x},{y})'"
    if box_style == "box_tokens":
        return f"'<|box_start|>({x},{y})<|box_end|>'"
    if box_style == "point":
        return f"'<point>{x} {y}</point>'"
    raise ValueError(f"unknown box_style {box_style!r} (expected one of {', '.join(BOX_STYLES)})")


def format_action(action: Action, box_style: str = "plain") -> str:
    """Write one action in canonical UI-TARS syntax, e.g. ``click(start_box='(235,512)')``.

    Coordinates are written as integers (rounded half to even); `parse_response` reads the text back.
    box_style: "plain" -> '(x,y)', "box_tokens" -> '<|box_start|>(x,y)<|box_end|>', "point" ->
    '<point>x y</point>'.
    """
    validate_action(action)
    args = []
    if action.point is not None:
        args.append(f"start_box={_format_box(action.point, box_style)}")
    if action.end_point is not None:
        args.append(f"end_box={_format_box(action.end_point, box_style)}")
    if action.key is not None:
        args.append(f"key={_quote(action.key)}")
    if action.content is not None:
        args.append(f"content={_quote(action.content)}")
    if action.direction is not None:
        args.append(f"direction={_quote(action.direction)}")
    return f"{action.kind}({', '.join(args)})"


def format_response(thought: str, actions: Sequence[Action], box_style: str = "plain") -> str:
    """Write a full reply ``Thought: ...\\nAction: a1\\n\\na2``; parse_response reads back (thought.strip(), actions).

    Raises ValueError for an empty action list or a thought with a line that starts with 'Action:'
    (the parser would split the reply there).
    """
    if not actions:
        raise ValueError("a reply needs at least one action")
    if _LINE_ACTION_RE.search(thought):
        raise ValueError(f"thought has a line starting with 'Action:': {thought!r}")
    body = "\n\n".join(format_action(a, box_style) for a in actions)
    return f"Thought: {thought.strip()}\nAction: {body}"


# ---------------------------------------------------------------------------------------------------------
# The Qwen3-VL tool-call grammar (decision "Qwen3-VL tool calls")
# ---------------------------------------------------------------------------------------------------------

ACTION_FORMATS = ("uitars", "qwen3vl_tool_call")
"""Reply grammars (params' `policy.action_format`): UI-TARS calls (`parse_response`) or Qwen3-VL /
GUI-Owl-1.5 `computer_use` tool calls (`parse_tool_call_response`)."""
TOOL_NAME = "computer_use"
"""The function every tool call names (Qwen3-VL's and GUI-Owl-1.5's desktop tool)."""
TOOL_SCROLL_PIXELS = 5
"""`pixels` written for a scroll: the project's Action has a direction, no amount (decision "Qwen3-VL tool calls")."""
TOOL_WAIT_SECONDS = 5
"""`time` written for wait (UI-TARS's wait() is five seconds)."""

_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_THINK_RE = re.compile(r"\A<(think|thinking)>(.*?)</\1>", re.DOTALL)
# tool action -> (project kind, required arguments, optional arguments); "action" is always required
_TOOL_SPEC: dict[str, tuple[str, frozenset[str], frozenset[str]]] = {
    "left_click": ("click", frozenset({"coordinate"}), frozenset()),
    "double_click": ("left_double", frozenset({"coordinate"}), frozenset()),
    "right_click": ("right_single", frozenset({"coordinate"}), frozenset()),
    "mouse_move": ("hover", frozenset({"coordinate"}), frozenset()),
    "left_click_drag": ("drag", frozenset({"start_coordinate", "coordinate"}), frozenset()),
    "key": ("hotkey", frozenset({"keys"}), frozenset()),
    "type": ("type", frozenset({"text"}), frozenset()),
    "scroll": ("scroll", frozenset({"pixels"}), frozenset({"coordinate"})),
    "hscroll": ("scroll", frozenset({"pixels"}), frozenset({"coordinate"})),
    "wait": ("wait", frozenset(), frozenset({"time"})),
    "answer": ("finished", frozenset({"text"}), frozenset()),
    "terminate": ("finished", frozenset({"status"}), frozenset()),
}
_TOOL_UNSUPPORTED = ("triple_click", "middle_click", "interact")
"""Actions of the published tool with no counterpart in this project's action space (an error)."""


def _reject_constant(name: str) -> float:
    raise ActionParseError(f"{name} is not a number a tool call may hold")


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ActionParseError("a JSON object names one key twice")
    return out


def _tool_number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ActionParseError(f"{what} must be a number, got {value!r:.40}")
    if not math.isfinite(value):
        raise ActionParseError(f"{what} is not finite")
    return float(value)


def _tool_point(value: object, what: str) -> tuple[float, float]:
    if not isinstance(value, list) or len(value) != 2:
        raise ActionParseError(f"{what} must be a list [x, y], got {value!r:.40}")
    x, y = (_tool_number(v, what) for v in value)
    if x < 0 or y < 0:
        raise ActionParseError(f"{what} has a negative coordinate: {value!r:.40}")
    return (x, y)


def _tool_text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise ActionParseError(f"{what} must be a string, got {value!r:.40}")
    return value


def _tool_action(call: object, where: str) -> Action:
    """One decoded `{"name": ..., "arguments": {...}}` object -> Action (decision "Qwen3-VL tool calls")."""
    if not isinstance(call, dict) or set(call) != {"name", "arguments"}:
        raise ActionParseError(f'{where}: a tool call must be {{"name": ..., "arguments": {{...}}}}')
    if call["name"] != TOOL_NAME:
        raise ActionParseError(f"{where}: unknown function {call['name']!r:.40} (expected {TOOL_NAME!r})")
    args = call["arguments"]
    if not isinstance(args, dict):
        raise ActionParseError(f"{where}: arguments must be a JSON object")
    name = args.get("action")
    if not isinstance(name, str):
        raise ActionParseError(f"{where}: arguments need an 'action' string")
    if name in _TOOL_UNSUPPORTED:
        raise ActionParseError(f"{where}: action {name!r} is not in this project's action space")
    if name not in _TOOL_SPEC:
        known = ", ".join(_TOOL_SPEC)
        raise ActionParseError(f"{where}: unknown action {name!r:.40} (known: {known})")
    kind, required, optional = _TOOL_SPEC[name]
    given = set(args) - {"action"}
    if unknown := sorted(given - required - optional):
        allowed = ", ".join(sorted(required | optional)) or "none"
        raise ActionParseError(
            f"{where}: unknown argument {unknown[0]!r:.40} for {name} (allowed: {allowed})"
        )
    if missing := sorted(required - given):
        raise ActionParseError(f"{where}: {name} needs {', '.join(missing)}")
    point = _tool_point(args["coordinate"], f"{where}: coordinate") if "coordinate" in args else None
    if name == "left_click_drag":
        start = _tool_point(args["start_coordinate"], f"{where}: start_coordinate")
        return Action("drag", point=start, end_point=point)
    if name == "key":
        keys = args["keys"]
        if not isinstance(keys, list) or not keys or len(keys) > 8:
            raise ActionParseError(f"{where}: keys must be a list of 1 to 8 key names")
        names = [_tool_text(k, f"{where}: each key") for k in keys]
        if any(not k or any(c.isspace() for c in k) for k in names):
            raise ActionParseError(f"{where}: a key name is empty or holds whitespace: {names!r:.60}")
        key = " ".join(names)
        try:
            normalize_keys(key)
        except ActionParseError as e:
            raise ActionParseError(f"{where}: {e}") from None
        return Action("hotkey" if len(names) > 1 else "press", key=key)
    if name == "type":
        return Action("type", content=_tool_text(args["text"], f"{where}: text"))
    if name in ("scroll", "hscroll"):
        pixels = _tool_number(args["pixels"], f"{where}: pixels")
        if pixels == 0:
            raise ActionParseError(f"{where}: {name} needs non-zero pixels")
        up, down = ("up", "down") if name == "scroll" else ("right", "left")
        return Action("scroll", point=point, direction=up if pixels > 0 else down)
    if name == "wait":
        if "time" in args and _tool_number(args["time"], f"{where}: time") < 0:
            raise ActionParseError(f"{where}: time must be >= 0")
        return Action("wait")
    if name == "answer":
        return Action("finished", content=_tool_text(args["text"], f"{where}: text"))
    if name == "terminate":
        status = args["status"]
        if status not in ("success", "failure"):
            raise ActionParseError(f"{where}: status must be 'success' or 'failure', got {status!r:.40}")
        return Action("finished") if status == "success" else Action("call_user")
    return Action(kind, point=point)


def parse_tool_call_response(text: str, max_actions: int = MAX_ACTIONS_PER_REPLY) -> ParsedResponse:
    """Parse a Qwen3-VL / GUI-Owl-1.5 reply (decision "Qwen3-VL tool calls"): an optional ``Action: <summary>`` line (the
    thought), then one or more ``<tool_call>{json}</tool_call>`` blocks and nothing else. Coordinates
    are returned as written (0-1000 units with the prompts of this project; `to_screen` with mode
    "relative1000" maps them). Every problem is an `ActionParseError`; the JSON is read with `json.loads`
    only (no eval, no literal_eval)."""
    if not isinstance(text, str):
        raise ActionParseError(f"reply must be a str, got {type(text).__name__}")
    body = text.strip()
    thinking = ""
    if m := _THINK_RE.match(body):
        thinking, body = m.group(2).strip(), body[m.end() :].lstrip()
    first = body.find("<tool_call>")
    if first < 0:
        raise ActionParseError(f"no <tool_call> in reply {_snippet(text, 0)}")
    head = body[:first].strip()
    if head and not head.startswith("Action:"):
        raise ActionParseError(
            f"text before the first <tool_call> must start with 'Action:', got {_snippet(head, 0)}"
        )
    thought = head[len("Action:") :].strip() if head else thinking
    actions: list[Action] = []
    pos = first
    while pos < len(body):
        m = _TOOL_CALL_RE.match(body, pos)
        if m is None:
            what = "an unclosed <tool_call>" if body.startswith("<tool_call>", pos) else "text"
            raise ActionParseError(f"{what} after the tool calls: {_snippet(body, pos)}")
        if len(actions) >= max_actions:
            raise ActionParseError(f"more than {max_actions} actions in one reply (the limit per reply)")
        where = f"tool call {len(actions) + 1}"
        try:
            call = json.loads(m.group(1), parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
        except ActionParseError as e:
            raise ActionParseError(f"{where}: {e}") from None
        except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
            raise ActionParseError(f"{where}: not valid JSON ({str(e)[:80]})") from None
        actions.append(_tool_action(call, where))
        pos = _skip_ws(body, m.end())
    return ParsedResponse(thought=thought, actions=actions)


def _tool_arguments(a: Action) -> dict[str, object]:
    """The `arguments` object of one action (decision "Qwen3-VL tool calls"); ValueError for kinds the tool has no call for."""

    def xy(p: tuple[float, float] | None) -> list[int]:
        return [round(p[0]), round(p[1])]  # type: ignore[index]

    if a.kind in ("click", "left_double", "right_single", "hover"):
        name = {"click": "left_click", "left_double": "double_click", "right_single": "right_click"}.get(
            a.kind, "mouse_move"
        )
        return {"action": name, "coordinate": xy(a.point)}
    if a.kind == "drag":
        return {"action": "left_click_drag", "start_coordinate": xy(a.point), "coordinate": xy(a.end_point)}
    if a.kind in ("hotkey", "press"):
        return {"action": "key", "keys": a.key.split()}  # type: ignore[union-attr]
    if a.kind == "type":
        return {"action": "type", "text": a.content}
    if a.kind == "scroll":
        vertical = a.direction in ("up", "down")
        sign = 1 if a.direction in ("up", "right") else -1
        out: dict[str, object] = {
            "action": "scroll" if vertical else "hscroll",
            "pixels": sign * TOOL_SCROLL_PIXELS,
        }
        if a.point is not None:
            out["coordinate"] = xy(a.point)
        return out
    if a.kind == "wait":
        return {"action": "wait", "time": TOOL_WAIT_SECONDS}
    if a.kind == "finished":
        if a.content is None:
            return {"action": "terminate", "status": "success"}
        return {"action": "answer", "text": a.content}
    if a.kind == "call_user":
        return {"action": "terminate", "status": "failure"}
    raise ValueError(f"{a.kind} has no {TOOL_NAME} tool call (keydown/keyup: write a key action)")


def format_tool_call(action: Action) -> str:
    """One action as a ``<tool_call>`` block (coordinates rounded to integers)."""
    validate_action(action)
    call = {"name": TOOL_NAME, "arguments": _tool_arguments(action)}
    return f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"


def format_tool_call_response(thought: str, actions: Sequence[Action]) -> str:
    """``Action: <thought>`` and one ``<tool_call>`` block per action; `parse_tool_call_response` reads
    back (thought.strip(), actions) for every action it can write (decision "Qwen3-VL tool calls")."""
    if not actions:
        raise ValueError("a reply needs at least one action")
    summary = thought.strip()
    if "<tool_call>" in summary or "</tool_call>" in summary or _THINK_RE.match(summary):
        raise ValueError(f"thought holds tool-call or think markup: {thought!r}")
    blocks = "\n".join(format_tool_call(a) for a in actions)
    return f"Action: {summary}\n{blocks}" if summary else blocks


def parse_reply(text: str, action_format: str, max_actions: int = MAX_ACTIONS_PER_REPLY) -> ParsedResponse:
    """Parse a reply in `action_format` (one of ACTION_FORMATS)."""
    if action_format == "uitars":
        return parse_response(text, max_actions)
    if action_format == "qwen3vl_tool_call":
        return parse_tool_call_response(text, max_actions)
    raise ValueError(f"unknown action format {action_format!r} (expected one of {', '.join(ACTION_FORMATS)})")


def format_reply(thought: str, actions: Sequence[Action], action_format: str) -> str:
    """Write a reply in `action_format` (one of ACTION_FORMATS); `parse_reply` reads it back."""
    if action_format == "uitars":
        return format_response(thought, actions)
    if action_format == "qwen3vl_tool_call":
        return format_tool_call_response(thought, actions)
    raise ValueError(f"unknown action format {action_format!r} (expected one of {', '.join(ACTION_FORMATS)})")


# ---------------------------------------------------------------------------------------------------------
# Image size and coordinates
# ---------------------------------------------------------------------------------------------------------


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = 56 * 56,
    max_pixels: int = 28 * 28 * 1280,
) -> tuple[int, int]:
    """Qwen2-VL/2.5-VL's image size rule -> (height, width) of the image the model sees.

    Same arithmetic as transformers' `qwen2_vl.image_processing_qwen2_vl.smart_resize` (a test checks
    equality): round each side to a multiple of `factor` (Python's round: half to even), then if the area
    exceeds max_pixels scale both sides down (floor to the factor), or if it is below min_pixels scale
    them up (ceil). E.g. (1080, 1920) with max_pixels 2,116,800 -> (1092, 1932).
    """
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _scale(mode: str, model_size: tuple[int, int] | None) -> tuple[float, float]:
    """The model frame's extent (w', h'): the resized image, or 1000 x 1000 for relative coordinates."""
    if mode == "absolute":
        if model_size is None:
            raise ValueError("mode 'absolute' needs model_size=(w', h')")
        return float(model_size[0]), float(model_size[1])
    if mode == "relative1000":
        return 1000.0, 1000.0
    raise ValueError(f"unknown coordinate mode {mode!r} (expected one of {', '.join(COORD_MODES)})")


def _map(
    point: tuple[float, float], src: tuple[float, float], dst: tuple[float, float], hi: tuple[float, float]
) -> tuple[float, float]:
    x = point[0] * dst[0] / src[0]
    y = point[1] * dst[1] / src[1]
    return (min(max(x, 0.0), hi[0]), min(max(y, 0.0), hi[1]))


def to_screen(
    actions: Sequence[Action],
    model_size: tuple[int, int] | None,
    screen_size: tuple[int, int],
    mode: str = "absolute",
) -> list[Action]:
    """Map actions from the model's frame to screen pixels, clamped to [0, W-1] x [0, H-1].

    model_size = (w', h') of the smart_resized image (ignored for mode "relative1000");
    screen_size = (W, H). Absolute: x * W / w', y * H / h'; relative1000: x * W / 1000, y * H / 1000.
    Points stay floats (to_pyautogui rounds).
    """
    src = _scale(mode, model_size)
    dst = (float(screen_size[0]), float(screen_size[1]))
    hi = (dst[0] - 1, dst[1] - 1)
    out = []
    for a in actions:
        point = _map(a.point, src, dst, hi) if a.point is not None else None
        end = _map(a.end_point, src, dst, hi) if a.end_point is not None else None
        out.append(replace(a, point=point, end_point=end))
    return out


def to_model(
    point: tuple[float, float],
    model_size: tuple[int, int] | None,
    screen_size: tuple[int, int],
    mode: str = "absolute",
) -> tuple[float, float]:
    """Inverse of `to_screen` for one point: screen pixels -> the model's frame (for oracles' replies).

    The point is first clamped to the screen [0, W-1] x [0, H-1]; the result then lies in [0, w') x
    [0, h') (or [0, 1000) for relative1000), so rounding it to ints moves it by at most half a model pixel.
    """
    dst = _scale(mode, model_size)
    src = (float(screen_size[0]), float(screen_size[1]))
    x = min(max(point[0], 0.0), src[0] - 1)
    y = min(max(point[1], 0.0), src[1] - 1)
    return (x * dst[0] / src[0], y * dst[1] / src[1])


# ---------------------------------------------------------------------------------------------------------
# pyautogui rendering
# ---------------------------------------------------------------------------------------------------------


X11_TYPE_CALL = "_arpo_type"
X11_TYPE_HELPER = f"""from Xlib import X, display; from Xlib.ext import xtest
def {X11_TYPE_CALL}(text, interval=0.01):
    d = display.Display()
    lo = d.display.info.min_keycode
    rows = d.get_keyboard_mapping(lo, d.display.info.max_keycode - lo + 1)
    keycode = {{r[0]: lo + i for i, r in enumerate(rows) if len(r) and r[0]}}
    ours = [lo + i for i, r in enumerate(rows) if len(r) > 1 and r[0] == r[1] and (0xA0 <= r[0] <= 0xFF or r[0] >= 0x1000100)]
    spare = [lo + i for i, r in enumerate(rows) if not any(r)][:-4] + ours
    pressed, run = {{}}, ""
    for ch in text:
        if ch.isascii() and (ch.isprintable() or ch in "\\t\\n\\r"):
            run += ch
            continue
        if run:
            pyautogui.write(run)
            run = ""
        if ord(ch) < 0xA0:
            continue
        keysym = ord(ch) if ord(ch) <= 0xFF else 0x1000000 | ord(ch)
        kc = keycode.get(keysym)
        if kc is None:
            kc = spare.pop(0)
            spare.append(kc)
            time.sleep(max(0.0, pressed.get(kc, -1.0) + 0.3 - time.monotonic()))
            d.change_keyboard_mapping(kc, [(keysym, keysym)])
            d.sync()
            keycode = {{k: c for k, c in keycode.items() if c != kc}}
            keycode[keysym] = kc
        xtest.fake_input(d, X.KeyPress, kc)
        xtest.fake_input(d, X.KeyRelease, kc)
        d.sync()
        pressed[kc] = time.monotonic()
        time.sleep(interval)
    if run:
        pyautogui.write(run)
    d.close()
"""
"""Decision "X11 typing helper": the code that types text with characters pyautogui has no key for. It runs on
the desktop after OSWorld's prefix (`import pyautogui; import time; ...; ` - hence the first line is a simple
statement) and needs only pyautogui's own X library (python-xlib with XTEST). pyautogui writes the
ASCII runs; every other character is typed through a spare keycode bound to its keysym (Latin-1, or
0x1000000 + code point) that STAYS bound, so no client can look a key up after its keycode was re-bound
(xdotool type re-binds one scratch keycode per character and lost about one character in two on the
loaded test desktop). Bound keycodes (both levels the same Latin-1 or Unicode keysym) are reused
round-robin after the empty ones (four empty ones stay free for other tools); re-binding one pressed
less than 0.3 s ago waits first. Control characters are dropped, as pyautogui.write drops them."""


def _xy(point: tuple[float, float], screen_size: tuple[int, int] | None) -> tuple[int, int]:
    x, y = round(point[0]), round(point[1])
    if screen_size is not None:
        x = min(max(x, 0), screen_size[0] - 1)
        y = min(max(y, 0), screen_size[1] - 1)
    return x, y


def to_pyautogui(
    actions: Sequence[Action],
    screen_size: tuple[int, int] | None = None,
    drag_duration: float = 0.5,
    scroll_amount: int = 5,
) -> list[str]:
    """Render screen-pixel actions as pyautogui commands: one string per action
    (decision "pyautogui rendering").

    Each entry is either Python code calling only `pyautogui.*` (non-ASCII type() text: the fixed
    X11_TYPE_HELPER and one call of it on the text), or a marker from PYAUTOGUI_MARKERS
    ("DONE" for finished, "FAIL" for call_user, "WAIT" for wait); test `cmd in PYAUTOGUI_MARKERS`.
    Coordinates are rounded to ints and, given screen_size = (W, H), clamped to the screen.
    A scroll is `scroll_amount` wheel clicks: up +N / down -N with pyautogui.scroll, right +N / left -N
    with pyautogui.hscroll. type() content is written with repr() and a trailing newline becomes
    pyautogui.press('enter'); non-ASCII content goes through X11_TYPE_HELPER (decision "X11 typing helper").
    Raises ValueError for an invalid action.
    """
    out = []
    for a in actions:
        validate_action(a)
        if a.kind in ("click", "left_double", "right_single", "hover"):
            x, y = _xy(a.point, screen_size)  # type: ignore[arg-type]  # validated above
            out.append(
                {
                    "click": f"pyautogui.click({x}, {y}, button='left')",
                    "left_double": f"pyautogui.doubleClick({x}, {y}, button='left')",
                    "right_single": f"pyautogui.click({x}, {y}, button='right')",
                    "hover": f"pyautogui.moveTo({x}, {y})",
                }[a.kind]
            )
        elif a.kind == "drag":
            x1, y1 = _xy(a.point, screen_size)  # type: ignore[arg-type]
            x2, y2 = _xy(a.end_point, screen_size)  # type: ignore[arg-type]
            out.append(
                f"pyautogui.moveTo({x1}, {y1})\n"
                f"pyautogui.dragTo({x2}, {y2}, duration={float(drag_duration)!r}, button='left')"
            )
        elif a.kind in _KEY_KINDS:
            keys = ", ".join(repr(k) for k in normalize_keys(a.key))  # type: ignore[arg-type]
            fn = {"hotkey": "hotkey", "press": "press", "keydown": "keyDown", "keyup": "keyUp"}[a.kind]
            out.append(f"pyautogui.{fn}({keys})")
        elif a.kind == "type":
            text = a.content or ""
            enter = text.endswith("\n")
            if enter:
                text = text[:-1]
            lines = []
            if text.isascii():
                if text or not enter:
                    lines.append(f"pyautogui.write({text!r})")
            else:  # decision "X11 typing helper"
                lines.append(f"{X11_TYPE_HELPER}{X11_TYPE_CALL}({text!a})")
            if enter:
                lines.append("pyautogui.press('enter')")
            out.append("\n".join(lines))
        elif a.kind == "scroll":
            n = int(scroll_amount)
            fn, clicks = {
                "up": ("scroll", n),
                "down": ("scroll", -n),
                "right": ("hscroll", n),
                "left": ("hscroll", -n),
            }[a.direction]  # type: ignore[index]
            if a.point is None:
                out.append(f"pyautogui.{fn}({clicks})")
            else:
                x, y = _xy(a.point, screen_size)
                out.append(f"pyautogui.{fn}({clicks}, x={x}, y={y})")
        elif a.kind == "wait":
            out.append("WAIT")
        elif a.kind == "finished":
            out.append("DONE")
        else:  # call_user
            out.append("FAIL")
    return out
