"""Tests for arpo_core.actions: the UI-TARS reply parser, writers, coordinates and pyautogui rendering."""

from __future__ import annotations

import ast
import builtins
import importlib.util
import math
import os
import re
import subprocess
import sys
import types
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from arpo_core import actions as A
from arpo_core.actions import (
    ACTION_KINDS,
    KEYBOARD_KEYS,
    PYAUTOGUI_MARKERS,
    X11_TYPE_CALL,
    X11_TYPE_HELPER,
    Action,
    ActionParseError,
    ParsedResponse,
    format_action,
    format_response,
    normalize_keys,
    parse_box,
    parse_response,
    smart_resize,
    to_model,
    to_pyautogui,
    to_screen,
    validate_action,
)

# ---------------------------------------------------------------------------------------------------------
# Parsing: accepted forms
# ---------------------------------------------------------------------------------------------------------

VALID = [
    # every action kind
    ("Thought: go\nAction: click(start_box='(235,512)')", "go", [Action("click", point=(235.0, 512.0))]),
    ("Thought: t\nAction: left_double(start_box='(1,2)')", "t", [Action("left_double", point=(1.0, 2.0))]),
    ("Thought: t\nAction: right_single(start_box='(3,4)')", "t", [Action("right_single", point=(3.0, 4.0))]),
    ("Thought: t\nAction: hover(start_box='(5,6)')", "t", [Action("hover", point=(5.0, 6.0))]),
    (
        "Thought: t\nAction: drag(start_box='(1,2)', end_box='(30,40)')",
        "t",
        [Action("drag", point=(1.0, 2.0), end_point=(30.0, 40.0))],
    ),
    (
        "Thought: t\nAction: select(start_box='(1,2)', end_box='(3,4)')",
        "t",
        [Action("drag", point=(1.0, 2.0), end_point=(3.0, 4.0))],
    ),
    ("Thought: t\nAction: hotkey(key='ctrl c')", "t", [Action("hotkey", key="ctrl c")]),
    ("Thought: t\nAction: press(key='enter')", "t", [Action("press", key="enter")]),
    ("Thought: t\nAction: keydown(key='shift')", "t", [Action("keydown", key="shift")]),
    ("Thought: t\nAction: keyup(key='shift')", "t", [Action("keyup", key="shift")]),
    ("Thought: t\nAction: type(content='hello')", "t", [Action("type", content="hello")]),
    ("Thought: t\nAction: type(content='')", "t", [Action("type", content="")]),
    (
        "Thought: t\nAction: scroll(start_box='(10,20)', direction='down')",
        "t",
        [Action("scroll", point=(10.0, 20.0), direction="down")],
    ),
    ("Thought: t\nAction: scroll(direction='Left')", "t", [Action("scroll", direction="left")]),
    ("Thought: t\nAction: wait()", "t", [Action("wait")]),
    ("Thought: t\nAction: finished(content='the answer')", "t", [Action("finished", content="the answer")]),
    ("Thought: t\nAction: finished()", "t", [Action("finished")]),
    ("Thought: t\nAction: call_user()", "t", [Action("call_user")]),
    # box forms
    ("Action: click(start_box='<|box_start|>(7,8)<|box_end|>')", "", [Action("click", point=(7.0, 8.0))]),
    ("Action: click(start_box='<point>7 8</point>')", "", [Action("click", point=(7.0, 8.0))]),
    ("Action: click(start_box='(10,20,30,60)')", "", [Action("click", point=(20.0, 40.0))]),
    ("Action: click(start_box='( 1.5 , 2.25 )')", "", [Action("click", point=(1.5, 2.25))]),
    ("Action: click(start_box='[1, 2, 3, 4]')", "", [Action("click", point=(2.0, 3.0))]),
    ("Action: click(start_box='<bbox>0 0 10 20</bbox>')", "", [Action("click", point=(5.0, 10.0))]),
    (
        "Action: click(start_box='<|box_start|>(0,0,5,5)<|box_end|>')",
        "",
        [Action("click", point=(2.5, 2.5))],
    ),
    # aliases
    ("Action: click(point='<point>9 9</point>')", "", [Action("click", point=(9.0, 9.0))]),
    (
        "Action: drag(start_point='(1,1)', end_point='(2,2)')",
        "",
        [Action("drag", point=(1.0, 1.0), end_point=(2.0, 2.0))],
    ),
    # multi-action replies
    (
        "Thought: fill and submit\nAction: click(start_box='(1,2)')\n\ntype(content='abc\\n')\n\nwait()",
        "fill and submit",
        [Action("click", point=(1.0, 2.0)), Action("type", content="abc\n"), Action("wait")],
    ),
    # Reflection variants
    (
        "Reflection: it failed\nAction_Summary: try again\nAction: wait()",
        "try again",
        [Action("wait")],
    ),
    ("Reflection: only reflect\nAction: wait()", "only reflect", [Action("wait")]),
    ("Action_Summary: summary\nAction: wait()", "summary", [Action("wait")]),
    # tolerances (module docstring, actions.py, decision "Strict parsing with tolerances")
    ("Thought: same line Action: wait()", "same line", [Action("wait")]),
    ("  \n Thought:  padded  \r\nAction:   wait( )  \r\n\r\n", "padded", [Action("wait")]),
    ("Thought: mentions Action: mid-line\nAction: wait()", "mentions Action: mid-line", [Action("wait")]),
    ("Action: wait()", "", [Action("wait")]),
    ("Thought:\nAction: wait()", "", [Action("wait")]),
    ("Action: click( start_box = '(1,2)' , )", "", [Action("click", point=(1.0, 2.0))]),
    ('Action: hotkey(key="ctrl v")', "", [Action("hotkey", key="ctrl v")]),
    ("Action: wait()\ncall_user()", "", [Action("wait"), Action("call_user")]),
    ("Action: type(content='two\nlines')", "", [Action("type", content="two\nlines")]),
    ("Action: type(content='I'm here')", "", [Action("type", content="I'm here")]),
    ("Action: finished(content='it's 5')\n\n", "", [Action("finished", content="it's 5")]),
    ("Action: hotkey(key='ArrowLeft')", "", [Action("hotkey", key="ArrowLeft")]),
    ("Action: press(key=' Enter ')", "", [Action("press", key=" Enter ")]),
]


@pytest.mark.parametrize(("text", "thought", "actions"), VALID)
def test_parse_valid(text: str, thought: str, actions: list[Action]) -> None:
    assert parse_response(text) == ParsedResponse(thought=thought, actions=actions)


def test_every_action_kind_is_covered_by_valid_cases() -> None:
    kinds = {a.kind for _, _, acts in VALID for a in acts}
    assert kinds == set(ACTION_KINDS)


@pytest.mark.parametrize(
    ("literal", "expected"),
    [
        (r"'it\'s'", "it's"),
        (r"'say \"hi\"'", 'say "hi"'),
        (r'"say \"hi\""', 'say "hi"'),
        (r'"it\'s"', "it's"),
        (r"'a\nb'", "a\nb"),
        (r"'tab\there'", "tab\there"),
        (r"'cr\r'", "cr\r"),
        (r"'back\\slash'", "back\\slash"),
        (r"'C:\\new'", "C:\\new"),  # \\ then n: a backslash and an 'n', not a newline
        (r"'\\n'", "\\n"),
        (r"'keep \d'", "keep \\d"),  # unknown escapes keep their backslash, as in Python
        (r"'\x41'", "\\x41"),  # \x is not decoded (actions.py, decision "Python string escapes")
        ("'both \\' and \"'", "both ' and \""),
        (r"'end\\'", "end\\"),
    ],
)
def test_content_escapes(literal: str, expected: str) -> None:
    for kind in ("type", "finished"):
        reply = parse_response(f"Thought: t\nAction: {kind}(content={literal})")
        assert reply.actions == [Action(kind, content=expected)]


# ---------------------------------------------------------------------------------------------------------
# Parsing: errors
# ---------------------------------------------------------------------------------------------------------

ERRORS = [
    ("", "no 'Action:'"),
    ("Thought: I will click", "no 'Action:'"),
    ("Thought: t\nAction:", "no action after"),
    ("Thought: t\nAction:   \n\n", "no action after"),
    ("blah\nAction: wait()", "must start with 'Thought:'"),
    ("Thought: t\nAction: clik(start_box='(1,2)')", "unknown action 'clik'"),
    ("Thought: t\nAction: open_app(name='x')", "unknown action 'open_app'"),
    ("Thought: t\nAction: 42", "expected an action name"),
    ("Thought: t\nAction: click", "expected '(' after 'click'"),
    ("Thought: t\nAction: click()", "click needs start_box"),
    ("Thought: t\nAction: left_double()", "left_double needs start_box"),
    ("Thought: t\nAction: drag(start_box='(1,2)')", "drag needs end_box"),
    ("Thought: t\nAction: type()", "type needs content"),
    ("Thought: t\nAction: scroll(start_box='(1,2)')", "scroll needs direction"),
    ("Thought: t\nAction: scroll(direction='sideways')", "bad scroll direction 'sideways'"),
    ("Thought: t\nAction: hotkey()", "hotkey needs key"),
    ("Thought: t\nAction: hotkey(key='')", "empty key string"),
    ("Thought: t\nAction: hotkey(key='ctrl+c')", "unknown key 'ctrl+c'"),
    ("Thought: t\nAction: press(key='ctrl c')", "press takes one key"),
    ("Thought: t\nAction: press(key='banana')", "unknown key 'banana'"),
    ("Thought: t\nAction: click(start_box='(-1,2)')", "negative coordinate '-1'"),
    ("Thought: t\nAction: click(start_box='(nan,2)')", "bad coordinate 'nan'"),
    ("Thought: t\nAction: click(start_box='(inf,2)')", "bad coordinate 'inf'"),
    ("Thought: t\nAction: click(start_box='(1e999,2)')", "is not finite"),
    ("Thought: t\nAction: click(start_box='(1,2,3)')", "has 3 numbers"),
    ("Thought: t\nAction: click(start_box='1,2')", "bad box '1,2'"),
    ("Thought: t\nAction: click(start_box='(1;2)')", "bad coordinate '1;2'"),
    ("Thought: t\nAction: click(start_box='(1,2)', foo='3')", "unknown argument 'foo' for click"),
    ("Thought: t\nAction: wait(x='1')", "unknown argument 'x' for wait (allowed: none)"),
    ("Thought: t\nAction: click(start_box='(1,2)', point='(3,4)')", "'start_box' given twice"),
    ("Thought: t\nAction: click('(1,2)')", "expected a keyword argument"),
    ("Thought: t\nAction: click(start_box=(1,2))", "must be a quoted string"),
    ("Thought: t\nAction: click(start_box '(1,2)')", "expected '=' after argument 'start_box'"),
    ("Thought: t\nAction: click(start_box='(1,2)'", "is not closed with ')'"),
    ("Thought: t\nAction: click(start_box='(1,2)' x)", "expected ',' or ')'"),
    ("Thought: t\nAction: click(start_box='(1,2)", "unterminated string"),
    ("Thought: t\nAction: type(content='abc)", "unterminated string"),
    ("Thought: t\nAction: click(start_box='(1,2)') and more", "unexpected text after click(...)"),
    ("Thought: t\nAction: wait() wait()", "unexpected text after wait(...)"),
    ("Thought: t\nAction: wait()\n\nI hope this works", "action 2: unknown action 'I'"),
    ("Thought: t\nAction: wait()\n\nAction: wait()", "action 2: unknown action 'Action'"),
    ("Thought: t\nAction: scroll(direction='down', start_box='(1,x)')", "start_box of scroll"),
]


@pytest.mark.parametrize(("text", "message"), ERRORS)
def test_parse_errors(text: str, message: str) -> None:
    with pytest.raises(ActionParseError) as info:
        parse_response(text)
    assert message in str(info.value)


def test_parse_rejects_non_str() -> None:
    with pytest.raises(ActionParseError, match="must be a str"):
        parse_response(b"Action: wait()")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("box", "point"),
    [
        ("(1,2)", (1.0, 2.0)),
        ("  (1 , 2)  ", (1.0, 2.0)),
        ("(.5,2.)", (0.5, 2.0)),
        ("<point>1,2</point>", (1.0, 2.0)),
        ("<|box_start|><point>4 6</point><|box_end|>", (4.0, 6.0)),
        ("(0,0,3,1)", (1.5, 0.5)),
    ],
)
def test_parse_box(box: str, point: tuple[float, float]) -> None:
    assert parse_box(box) == point


@pytest.mark.parametrize(
    ("key", "names"),
    [
        ("ctrl c", ["ctrl", "c"]),
        ("Ctrl Shift T", ["ctrl", "shift", "t"]),
        ("arrowleft", ["left"]),
        ("ArrowDown", ["down"]),
        ("control alt delete", ["ctrl", "alt", "delete"]),
        ("cmd space", ["command", "space"]),
        ("  enter  ", ["enter"]),
        ("' \\", ["'", "\\"]),
    ],
)
def test_normalize_keys(key: str, names: list[str]) -> None:
    assert normalize_keys(key) == names


# ---------------------------------------------------------------------------------------------------------
# Parsing: properties (arbitrary text only ever gives a ParsedResponse or an ActionParseError)
# ---------------------------------------------------------------------------------------------------------

_TOKENS = st.sampled_from(
    [
        "click", "type", "drag", "scroll", "hotkey", "finished", "select", "wait", "(", ")", ",", "=", "'",
        '"', "\\", "\\'", "\n", "\n\n", " ", "start_box", "end_box", "point", "content", "key",
        "direction", "(1,2)", "(1,2,3,4)", "<point>", "</point>", "<|box_start|>", "<|box_end|>", "-",
        "1e999", "nan", ".", "Action:", "Thought:", "Reflection:", "Action_Summary:", "down", "ctrl c",
    ]
)  # fmt: skip


def _outcome(text: str) -> ParsedResponse | None:
    try:
        out = parse_response(text)
    except ActionParseError:
        return None
    assert isinstance(out, ParsedResponse)
    assert all(isinstance(a, Action) and a.kind in ACTION_KINDS for a in out.actions)
    assert out.actions, "a parsed reply always has at least one action"
    for a in out.actions:
        validate_action(a)  # whatever the parser accepts, the writers accept too
    return out


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_fuzz_arbitrary_text(text: str) -> None:
    _outcome(text)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(["Action: click(", "Thought: x\nAction: type(content='", "Action: ", "Action: drag("]),
    st.text(),
)
def test_fuzz_prefixed_text(prefix: str, tail: str) -> None:
    _outcome(prefix + tail)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_TOKENS, max_size=30))
def test_fuzz_token_soup(tokens: list[str]) -> None:
    _outcome("Thought: t\nAction: " + "".join(tokens))
    _outcome("".join(tokens))


# ---------------------------------------------------------------------------------------------------------
# Security: model text never runs code or touches the filesystem
# ---------------------------------------------------------------------------------------------------------

_PAYLOADS = [
    'Action: type(content=\'__import__("os").system("touch {p}")\')',
    "Action: type(content=\"__import__('os').system('touch {p}')\")",
    "Action: type(content='x'); __import__('os').system('touch {p}'); #')",
    "Action: type(content='x')\n\n__import__('os').system('touch {p}')",
    'Action: finished(content=\'{{open("{p}", "w")}}\')',
    'Action: click(start_box=\'(__import__("os").system("touch {p}"),1)\')',
    'Action: hotkey(key=\'__import__("os").system("touch {p}")\')',
    "Action: type(content='\\'); import os; os.system(\"touch {p}\"); (\\'')",
    'Action: exec(content=\'open("{p}", "w")\')',
    'Action: eval(\'open("{p}", "w")\')',
]


def test_payloads_never_execute(tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    texts = [p.format(p=target) for p in _PAYLOADS]
    called: list[str] = []

    def trap(name: str):
        def f(*args, **kwargs):
            called.append(name)
            raise RuntimeError(f"{name} called during parsing")

        return f

    # Plain setattr, not monkeypatch: monkeypatch.setattr itself imports, which the __import__ trap forbids.
    targets = [
        (builtins, n) for n in ("eval", "exec", "compile", "open", "__import__", "input", "breakpoint")
    ]
    targets += [(os, "system"), (os, "popen"), (subprocess, "Popen"), (ast, "literal_eval")]
    saved = [(obj, name, getattr(obj, name)) for obj, name in targets]
    results: list[object] = []
    try:
        for obj, name in targets:
            setattr(obj, name, trap(name))
        for text in texts:
            try:
                results.append(parse_response(text))
            except ActionParseError as e:
                results.append(e)
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
    assert called == []
    assert not target.exists()
    assert not any(tmp_path.iterdir())
    # the code-looking content is data: it comes back literally
    assert results[0] == ParsedResponse(
        "", [Action("type", content=f'__import__("os").system("touch {target}")')]
    )
    assert results[1] == ParsedResponse(
        "", [Action("type", content=f"__import__('os').system('touch {target}')")]
    )
    assert results[2] == ParsedResponse(
        "", [Action("type", content=f"x'); __import__('os').system('touch {target}'); #")]
    )
    assert isinstance(results[3], ActionParseError)
    assert results[4] == ParsedResponse("", [Action("finished", content=f'{{open("{target}", "w")}}')])
    assert isinstance(results[5], ActionParseError)
    assert isinstance(results[6], ActionParseError)
    assert results[7] == ParsedResponse(
        "", [Action("type", content=f"'); import os; os.system(\"touch {target}\"); ('")]
    )
    assert isinstance(results[8], ActionParseError) and "unknown action 'exec'" in str(results[8])
    assert isinstance(results[9], ActionParseError) and "unknown action 'eval'" in str(results[9])


def test_module_never_calls_eval_like_builtins() -> None:
    tree = ast.parse(Path(A.__file__).read_text())
    banned_names = {"eval", "exec", "compile", "__import__", "open", "getattr", "input"}
    banned_attrs = {"literal_eval", "system", "popen", "import_module", "exec_module"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            fn = node.func
            if isinstance(fn, ast.Name):
                assert fn.id not in banned_names, f"line {node.lineno} calls {fn.id}"
            if isinstance(fn, ast.Attribute):
                assert fn.attr not in banned_attrs, f"line {node.lineno} calls .{fn.attr}"
                # re.compile is fine, but only at import time on constant patterns
                if fn.attr == "compile":
                    assert isinstance(node.args[0], ast.Constant), f"line {node.lineno}"
        if isinstance(node, ast.Import | ast.ImportFrom):
            mods = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            # json: the tool-call grammar's json.loads (data only, actions.py, decision "Qwen3-VL tool calls")
            assert set(mods) <= {"__future__", "math", "re", "collections.abc", "dataclasses", "json"}, mods


# ---------------------------------------------------------------------------------------------------------
# Writers and the round trip
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("action", "text"),
    [
        (Action("click", point=(235.0, 512.0)), "click(start_box='(235,512)')"),
        (Action("click", point=(10.4, 10.6)), "click(start_box='(10,11)')"),
        (Action("drag", point=(1, 2), end_point=(3, 4)), "drag(start_box='(1,2)', end_box='(3,4)')"),
        (Action("hotkey", key="ctrl c"), "hotkey(key='ctrl c')"),
        (Action("press", key="'"), "press(key='\\'')"),
        (Action("type", content="it's\n"), "type(content='it\\'s\\n')"),
        (Action("type", content='a\\b"c'), "type(content='a\\\\b\"c')"),
        (Action("scroll", point=(5, 6), direction="up"), "scroll(start_box='(5,6)', direction='up')"),
        (Action("scroll", direction="left"), "scroll(direction='left')"),
        (Action("wait"), "wait()"),
        (Action("finished"), "finished()"),
        (Action("finished", content="42"), "finished(content='42')"),
        (Action("call_user"), "call_user()"),
    ],
)
def test_format_action(action: Action, text: str) -> None:
    assert format_action(action) == text


def test_format_action_box_styles() -> None:
    a = Action("click", point=(3, 4))
    assert format_action(a, box_style="box_tokens") == "click(start_box='<|box_start|>(3,4)<|box_end|>')"
    assert format_action(a, box_style="point") == "click(start_box='<point>3 4</point>')"
    with pytest.raises(ValueError, match="unknown box_style"):
        format_action(a, box_style="bbox")


def test_format_response_text() -> None:
    text = format_response(" plan ", [Action("click", point=(1, 2)), Action("type", content="x\n")])
    assert text == "Thought: plan\nAction: click(start_box='(1,2)')\n\ntype(content='x\\n')"


@pytest.mark.parametrize(
    ("action", "message"),
    [
        (Action("jump"), "unknown action kind"),
        (Action("select", point=(1, 2), end_point=(3, 4)), "unknown action kind"),
        (Action("click"), "click needs start_box"),
        (Action("click", point=(1, 2), content="x"), "click takes no content"),
        (Action("drag", point=(1, 2)), "drag needs end_box"),
        (Action("click", point=(-1, 2)), "finite non-negative"),
        (Action("click", point=(math.nan, 2)), "finite non-negative"),
        (Action("click", point=(1, 2, 3)), "an (x, y) tuple"),  # type: ignore[arg-type]
        (Action("hotkey", key="ctrl banana"), "unknown key 'banana'"),
        (Action("keyup", key="a b"), "keyup takes one key"),
        (Action("scroll", direction="Down"), "bad scroll direction"),
        (Action("type", content=5), "content must be a str"),  # type: ignore[arg-type]
    ],
)
def test_validate_action_errors(action: Action, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        format_action(action)


def test_format_response_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="at least one action"):
        format_response("t", [])
    with pytest.raises(ValueError, match="starting with 'Action:'"):
        format_response("line one\n  Action: fake", [Action("wait")])


_COORD = st.integers(min_value=0, max_value=4000).map(float)
_POINT = st.tuples(_COORD, _COORD)
# Keys that survive being joined with spaces (whitespace keys cannot be written in a key string).
_KEYS = [k for k in KEYBOARD_KEYS if not k.isspace()]
_KEY = st.sampled_from(_KEYS)


@st.composite
def actions_st(draw: st.DrawFn) -> Action:
    kind = draw(st.sampled_from(ACTION_KINDS))
    if kind in ("click", "left_double", "right_single", "hover"):
        return Action(kind, point=draw(_POINT))
    if kind == "drag":
        return Action(kind, point=draw(_POINT), end_point=draw(_POINT))
    if kind == "hotkey":
        return Action(kind, key=" ".join(draw(st.lists(_KEY, min_size=1, max_size=4))))
    if kind in ("press", "keydown", "keyup"):
        return Action(kind, key=draw(_KEY))
    if kind == "type":
        return Action(kind, content=draw(st.text()))
    if kind == "scroll":
        return Action(
            kind, point=draw(st.none() | _POINT), direction=draw(st.sampled_from(A.SCROLL_DIRECTIONS))
        )
    if kind == "finished":
        return Action(kind, content=draw(st.none() | st.text()))
    return Action(kind)


_THOUGHT = st.text().filter(lambda t: not A._LINE_ACTION_RE.search(t))


@settings(max_examples=400, deadline=None)
@given(_THOUGHT, st.lists(actions_st(), min_size=1, max_size=4), st.sampled_from(A.BOX_STYLES))
def test_round_trip(thought: str, actions: list[Action], box_style: str) -> None:
    text = format_response(thought, actions, box_style=box_style)
    assert parse_response(text) == ParsedResponse(thought=thought.strip(), actions=actions)


# ---------------------------------------------------------------------------------------------------------
# smart_resize and coordinates
# ---------------------------------------------------------------------------------------------------------


def test_smart_resize_reference_facts() -> None:
    # docs/method.md §2: a 1920x1080 screenshot is seen as 1932x1092 with max_pixels 2,116,800.
    assert smart_resize(1080, 1920, min_pixels=256, max_pixels=2_116_800) == (1092, 1932)
    # MiniWoB's 160x210 (w x h) frame with the embedded defaults: round(7.5) = 8 -> 224, round(5.71) = 6 -> 168.
    assert smart_resize(210, 160, min_pixels=3136) == (224, 168)
    # Too small: scaled up with ceil. 28x28 -> area 784 < 3136: beta 2 -> 56x56.
    assert smart_resize(28, 28) == (56, 56)
    # Too large with the default max (1,003,520): 1080x1920 -> beta = sqrt(2073600/1003520) = 1.4375;
    # floor(1080/1.4375/28)*28 = 26*28 = 728, floor(1920/1.4375/28)*28 = 47*28 = 1316.
    assert smart_resize(1080, 1920) == (728, 1316)


def test_smart_resize_aspect_ratio_error() -> None:
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2010)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(4020, 20)


@pytest.fixture(scope="module")
def hf_smart_resize():
    # The torchvision module (image_processing_qwen2_vl) holds the same function, "Copied from" into the
    # PIL one; torchvision is not installed here, so take the PIL copy.
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf

    return hf


def test_smart_resize_matches_transformers_grid(hf_smart_resize) -> None:
    sizes = [1, 7, 14, 27, 28, 29, 42, 55, 56, 100, 160, 210, 333, 720, 1080, 1092, 1920, 2160, 3840, 5000]
    limits = [(56 * 56, 28 * 28 * 1280), (3136, 2_116_800), (256, 2_116_800), (4 * 28 * 28, 16384 * 28 * 28)]
    n = 0
    for h in sizes:
        for w in sizes:
            for lo, hi in limits:
                if max(h, w) / min(h, w) > 200:
                    continue
                assert smart_resize(h, w, 28, lo, hi) == hf_smart_resize(h, w, 28, lo, hi), (h, w, lo, hi)
                n += 1
    assert n > 1000


@settings(max_examples=500, deadline=None)
@given(
    st.integers(1, 8000),
    st.integers(1, 8000),
    st.sampled_from([14, 28, 32]),
    st.integers(1, 5000),
    st.integers(1000, 20_000_000),
)
def test_smart_resize_matches_transformers_random(hf_smart_resize, h, w, factor, lo, hi) -> None:
    if max(h, w) / min(h, w) > 200:
        with pytest.raises(ValueError):
            smart_resize(h, w, factor, lo, hi)
        return
    assert smart_resize(h, w, factor, lo, hi) == hf_smart_resize(h, w, factor, lo, hi)


def test_to_screen_absolute() -> None:
    acts = [
        Action("click", point=(966.0, 546.0)),
        Action("drag", point=(0.0, 0.0), end_point=(1932.0, 1092.0)),
        Action("type", content="x"),
    ]
    out = to_screen(acts, model_size=(1932, 1092), screen_size=(1920, 1080))
    # 966 * 1920 / 1932 = 960, 546 * 1080 / 1092 = 540; the far corner clamps to (1919, 1079).
    assert out[0] == Action("click", point=(960.0, 540.0))
    assert out[1] == Action("drag", point=(0.0, 0.0), end_point=(1919.0, 1079.0))
    assert out[2] == acts[2]


def test_to_screen_relative1000() -> None:
    out = to_screen([Action("hover", point=(500.0, 250.0))], None, (160, 210), mode="relative1000")
    assert out == [Action("hover", point=(80.0, 52.5))]  # 500 * 160 / 1000, 250 * 210 / 1000


def test_to_screen_small_model_frame() -> None:
    # MiniWoB: 160x210 screen seen as 168x224; x = 84 * 160 / 168 = 80, y = 112 * 210 / 224 = 105.
    assert to_screen([Action("click", point=(84.0, 112.0))], (168, 224), (160, 210)) == [
        Action("click", point=(80.0, 105.0))
    ]


def test_to_model_inverse() -> None:
    assert to_model((960.0, 540.0), (1932, 1092), (1920, 1080)) == (966.0, 546.0)
    assert to_model((80.0, 52.5), None, (160, 210), mode="relative1000") == (500.0, 250.0)
    # Clamped to the screen first: (159, 209) -> (159 * 168 / 160, 209 * 224 / 210).
    assert to_model((5000.0, -3.0), (168, 224), (160, 210)) == (166.95, 0.0)
    assert to_model((5000.0, 5000.0), (168, 224), (160, 210)) == pytest.approx((166.95, 222.9333333))


def test_coordinate_mode_errors() -> None:
    with pytest.raises(ValueError, match="unknown coordinate mode"):
        to_screen([Action("wait")], (1, 1), (1, 1), mode="relative")
    with pytest.raises(ValueError, match="needs model_size"):
        to_model((1.0, 1.0), None, (10, 10))


@settings(max_examples=200, deadline=None)
@given(
    st.integers(20, 4000),
    st.integers(20, 4000),
    st.floats(0, 1),
    st.floats(0, 1),
    st.sampled_from(A.COORD_MODES),
)
def test_oracle_point_survives_model_frame(w: int, h: int, fx: float, fy: float, mode: str) -> None:
    """An oracle writes a screen point in the model's frame as ints; the parse maps back within a pixel."""
    if max(w, h) / min(w, h) > 200:
        return
    mh, mw = smart_resize(h, w, min_pixels=3136, max_pixels=2_116_800)
    sx, sy = fx * (w - 1), fy * (h - 1)
    mx, my = to_model((sx, sy), (mw, mh), (w, h), mode)
    text = format_response("t", [Action("click", point=(mx, my))])
    back = to_screen(parse_response(text).actions, (mw, mh), (w, h), mode)[0].point
    # Rounding to an int in the model frame moves the point by <= 0.5 model px = 0.5 * W / w' screen px.
    span = (1000, 1000) if mode == "relative1000" else (mw, mh)
    assert abs(back[0] - sx) <= 0.5 * w / span[0] + 1e-9
    assert abs(back[1] - sy) <= 0.5 * h / span[1] + 1e-9


# ---------------------------------------------------------------------------------------------------------
# pyautogui rendering
# ---------------------------------------------------------------------------------------------------------


def test_keyboard_keys_match_pyautogui() -> None:
    # Read pyautogui's source instead of importing it (the import needs an X display).
    spec = importlib.util.find_spec("pyautogui")
    assert spec is not None and spec.origin is not None, "pyautogui is a project dependency"
    tree = ast.parse(Path(spec.origin).read_text())
    lists = {
        t.id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
        and t.id in ("KEY_NAMES", "KEYBOARD_KEYS")
        and isinstance(node.value, ast.List)
    }
    assert lists, "pyautogui defines its key list as a list literal"
    (value,) = lists.values()
    assert tuple(ast.literal_eval(value)) == KEYBOARD_KEYS


@pytest.mark.parametrize(
    ("action", "code"),
    [
        (Action("click", point=(10.4, 20.6)), "pyautogui.click(10, 21, button='left')"),
        (Action("left_double", point=(1, 2)), "pyautogui.doubleClick(1, 2, button='left')"),
        (Action("right_single", point=(1, 2)), "pyautogui.click(1, 2, button='right')"),
        (Action("hover", point=(1, 2)), "pyautogui.moveTo(1, 2)"),
        (
            Action("drag", point=(1, 2), end_point=(30, 40)),
            "pyautogui.moveTo(1, 2)\npyautogui.dragTo(30, 40, duration=0.5, button='left')",
        ),
        (Action("hotkey", key="ctrl c"), "pyautogui.hotkey('ctrl', 'c')"),
        (Action("hotkey", key="Ctrl ArrowLeft"), "pyautogui.hotkey('ctrl', 'left')"),
        (Action("hotkey", key="ctrl space"), "pyautogui.hotkey('ctrl', 'space')"),
        (Action("press", key="Enter"), "pyautogui.press('enter')"),
        (Action("press", key="'"), 'pyautogui.press("\'")'),
        (Action("keydown", key="shift"), "pyautogui.keyDown('shift')"),
        (Action("keyup", key="shift"), "pyautogui.keyUp('shift')"),
        (Action("type", content="hi"), "pyautogui.write('hi')"),
        (Action("type", content="hi\n"), "pyautogui.write('hi')\npyautogui.press('enter')"),
        (Action("type", content="\n"), "pyautogui.press('enter')"),
        (Action("type", content=""), "pyautogui.write('')"),
        (Action("type", content="a\nb"), "pyautogui.write('a\\nb')"),
        (
            Action("type", content="café\n"),
            X11_TYPE_HELPER + "_arpo_type('caf\\xe9')\npyautogui.press('enter')",
        ),
        (Action("type", content="日"), X11_TYPE_HELPER + "_arpo_type('\\u65e5')"),
        (Action("scroll", point=(5, 6), direction="up"), "pyautogui.scroll(5, x=5, y=6)"),
        (Action("scroll", point=(5, 6), direction="down"), "pyautogui.scroll(-5, x=5, y=6)"),
        (Action("scroll", point=(5, 6), direction="right"), "pyautogui.hscroll(5, x=5, y=6)"),
        (Action("scroll", direction="left"), "pyautogui.hscroll(-5)"),
        (Action("wait"), "WAIT"),
        (Action("finished", content="x"), "DONE"),
        (Action("finished"), "DONE"),
        (Action("call_user"), "FAIL"),
    ],
)
def test_to_pyautogui(action: Action, code: str) -> None:
    assert to_pyautogui([action]) == [code]


def test_to_pyautogui_options_and_clamp() -> None:
    acts = [
        Action("drag", point=(0, 0), end_point=(500, 500)),
        Action("scroll", point=(2000, 3), direction="down"),
    ]
    assert to_pyautogui(acts, screen_size=(160, 210), drag_duration=1, scroll_amount=3) == [
        "pyautogui.moveTo(0, 0)\npyautogui.dragTo(159, 209, duration=1.0, button='left')",
        "pyautogui.scroll(-3, x=159, y=3)",
    ]


def test_to_pyautogui_rejects_invalid() -> None:
    with pytest.raises(ValueError, match="unknown key"):
        to_pyautogui([Action("hotkey", key="ctrl nope")])
    with pytest.raises(ValueError, match="needs start_box"):
        to_pyautogui([Action("click")])


def test_markers_are_not_code_prefixes() -> None:
    assert set(PYAUTOGUI_MARKERS) == {"DONE", "FAIL", "WAIT"}
    out = to_pyautogui([Action("click", point=(1, 2)), Action("wait"), Action("finished")])
    assert [c in PYAUTOGUI_MARKERS for c in out] == [False, True, True]


class FakePyAutoGui:
    """Records calls; `typed` is the text a keyboard would produce from write/press('enter')."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []
        self.typed = ""

    def __getattr__(self, name: str):
        def record(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            if name == "write":
                self.typed += args[0]
            elif name == "press" and args == ("enter",):
                self.typed += "\n"

        return record


class FakeX:
    """python-xlib as X11_TYPE_HELPER uses it, over a keyboard like Xvfb's (keycodes 8-255, 7 keysyms per
    keycode, 19 empty keycodes) and a virtual clock. A key press appends the character of the keysym its
    keycode has at level 0 *now* to `fake.typed`; re-binding a keycode pressed less than `min_rebind_s`
    earlier counts as a lost key (a client could still be reading it)."""

    EMPTY = (*range(93, 97), *range(120, 128), 190, *range(250, 256))

    def __init__(self, fake: FakePyAutoGui, min_rebind_s: float = 0.3) -> None:
        self.fake, self.min_rebind_s = fake, min_rebind_s
        self.rows = {kc: [0] * 7 if kc in self.EMPTY else [0xFF00 + kc] * 2 + [0] * 5 for kc in range(8, 256)}
        self.rows[65] = [0x20, 0, 0x20, 0, 0, 0, 0]  # space: an ASCII keysym at level 0
        self.now, self.slept = 100.0, 0.0
        self.pressed: dict[int, float] = {}
        self.rebinds: list[int] = []
        self.lost: list[int] = []
        self.X = types.SimpleNamespace(KeyPress=2, KeyRelease=3)
        self.display = types.SimpleNamespace(Display=self._display)
        self.xtest = types.SimpleNamespace(fake_input=self._fake_input)
        self.time = types.SimpleNamespace(sleep=self._sleep, monotonic=lambda: self.now)

    def _sleep(self, s: float) -> None:
        assert s >= 0
        self.now += s
        self.slept += s

    def _display(self):
        info = types.SimpleNamespace(min_keycode=8, max_keycode=255)

        def change_keyboard_mapping(first, keysyms):
            for kc, syms in enumerate(keysyms, first):
                if self.now - self.pressed.get(kc, -1e9) < self.min_rebind_s:
                    self.lost.append(kc)
                self.rebinds.append(kc)
                self.rows[kc] = list(syms) + [0] * (7 - len(syms))

        return types.SimpleNamespace(
            display=types.SimpleNamespace(info=info),
            get_keyboard_mapping=lambda first, n: [list(self.rows[kc]) for kc in range(first, first + n)],
            change_keyboard_mapping=change_keyboard_mapping,
            sync=lambda: None,
            close=lambda: None,
        )

    def _fake_input(self, d, event_type, kc):
        if event_type == self.X.KeyPress:
            keysym = self.rows[kc][0]
            assert keysym, f"keycode {kc} has no keysym"
            self.fake.typed += chr(keysym & 0xFFFFFF if keysym >= 0x1000000 else keysym)
            self.pressed[kc] = self.now
            self.now += 0.001

    def modules(self) -> dict[str, types.ModuleType]:
        xlib, ext = types.ModuleType("Xlib"), types.ModuleType("Xlib.ext")
        xlib.X, xlib.display, ext.xtest = self.X, self.display, self.xtest
        return {
            "Xlib": xlib,
            "Xlib.ext": ext,
            "Xlib.X": self.X,
            "Xlib.display": self.display,
            "Xlib.ext.xtest": self.xtest,
        }


def _run(code: str, x: FakeX | None = None) -> FakePyAutoGui:
    # exec of OUR rendered code (never model text) in a namespace without builtins, to check its effect;
    # X11_TYPE_HELPER code (its shape checked by _check_code_shape) runs with builtins and a fake Xlib.
    fake = FakePyAutoGui()
    if not code.startswith(X11_TYPE_HELPER):
        exec(code, {"__builtins__": {}, "pyautogui": fake})
        return fake
    x = x or FakeX(fake)
    x.fake = fake
    with mock.patch.dict(sys.modules, x.modules()):
        exec(code, {"__builtins__": builtins, "pyautogui": fake, "time": x.time})
    assert not x.lost, f"keycodes re-bound while a client could still read them: {x.lost}"
    return fake


PYAUTOGUI_TYPABLE = frozenset(map(chr, range(0x20, 0x7F))) | {"\t", "\n", "\r"}
"""What pyautogui.write types on X11 (it drops every other character)."""


def _typed(content: str) -> str:
    """What typing `content` produces: every character but control characters (pyautogui drops them)."""
    return "".join(c for c in content if c in PYAUTOGUI_TYPABLE or ord(c) >= 0xA0)


_ALLOWED_NODES = (
    ast.Module, ast.Expr, ast.Call, ast.Attribute, ast.Name, ast.Load, ast.Constant, ast.keyword,
    ast.UnaryOp, ast.USub,
)  # fmt: skip


def _check_code_shape(code: str) -> None:
    """Valid Python made only of `pyautogui.<fn>(constants...)` / `time.sleep(constant)` statements; or
    the fixed X11_TYPE_HELPER, then one `_arpo_type(<str constant>)`, then such statements."""
    if code.startswith(X11_TYPE_HELPER):
        code = code[len(X11_TYPE_HELPER) :]
        assert code.isascii(), code
        first = ast.parse(code).body[0]
        assert isinstance(first, ast.Expr) and isinstance(first.value, ast.Call), code
        call = first.value
        assert isinstance(call.func, ast.Name) and call.func.id == X11_TYPE_CALL and not call.keywords, code
        assert len(call.args) == 1 and isinstance(call.args[0], ast.Constant), code
        assert type(call.args[0].value) is str, code
        code = code.split("\n", 1)[1] if "\n" in code else ""
    tree = ast.parse(code)
    for node in ast.walk(tree):
        assert isinstance(node, _ALLOWED_NODES), f"{type(node).__name__} in {code!r}"
        if isinstance(node, ast.Name):
            assert node.id in ("pyautogui", "time"), code
        if isinstance(node, ast.Call):
            fn = node.func
            assert isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name), code
            assert fn.value.id == "pyautogui" or (fn.value.id, fn.attr) == ("time", "sleep"), code
    for stmt in tree.body:
        assert isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call), code


@pytest.mark.parametrize(
    "content",
    [
        "it's",
        'say "hi"',
        "back\\slash and \\n literal",
        "line1\nline2\n",
        "'''; import os; os.system('touch /tmp/pwned') #",
        '"); __import__("os").system("id"); ("',
        "{0} %s \\x41 \\u0041 \t tab",
        "\n\n",
        "",
    ],
)
def test_typed_text_is_exact(content: str) -> None:
    reply = format_response("t", [Action("type", content=content)])
    parsed = parse_response(reply).actions
    (code,) = to_pyautogui(parsed)
    _check_code_shape(code)
    assert _run(code).typed == content


@pytest.mark.parametrize(
    "content",
    [
        "café naïve 日本語 ✓",
        "café naïve 日本語 ✓\n",
        "Größe: 3 €\nzweite Zeile\n",
        "😀 emoji and \U0001f680",
        "é'''; import os; os.system('touch /tmp/pwned') #",
        'ü"); __import__("os").system("id"); ("',
        "\\xe9 is not é; \\u65e5 is not 日",
        "tab\tand\rCR with ñ",
        "non\xa0breaking\u3000spaces",
    ],
)
def test_non_ascii_text_goes_through_the_x11_helper_exactly(content: str) -> None:
    """Issue 16: pyautogui.write drops what it has no key for; non-ASCII text is typed by the X11 helper
    (actions.py, decision "X11 typing helper") with the text as one ASCII string literal, a trailing newline
    still pressing Enter."""
    reply = format_response("t", [Action("type", content=content)])
    (code,) = to_pyautogui(parse_response(reply).actions)
    assert code.startswith(X11_TYPE_HELPER) and code.isascii()
    _check_code_shape(code)
    assert code.endswith("\npyautogui.press('enter')") == content.endswith("\n")
    fake = _run(code)
    assert fake.typed == content
    # pyautogui still types the ASCII runs: only the other characters go through bound keycodes
    written = "".join(args[0] for name, args, _ in fake.calls if name == "write")
    assert written == "".join(c for c in content.removesuffix("\n") if c.isascii())


def test_x11_helper_reuses_keycodes_without_losing_keys() -> None:
    """More distinct characters than spare keycodes: bindings are reused round-robin, never within
    0.3 s of their last press (FakeX fails the run otherwise), and four empty keycodes stay free; the
    next call finds the characters still bound and re-binds nothing."""
    x = FakeX(FakePyAutoGui())
    text = "".join(chr(0x4E00 + i) for i in range(40)) + " ok é"
    (code,) = to_pyautogui([Action("type", content=text)])
    assert _run(code, x).typed == text
    assert len(set(x.rebinds)) == 15 and sum(not any(r) for r in x.rows.values()) == 4
    assert x.slept > 0.3  # it waited before re-binding keycodes pressed in this call
    rebinds = len(x.rebinds)
    (code,) = to_pyautogui([Action("type", content=text[-14:])])  # the last 12 CJK characters, " ok é"
    assert _run(code, x).typed == text[-14:] and len(x.rebinds) == rebinds


def test_pyautogui_types_printable_ascii_and_newlines() -> None:
    """The characters pyautogui's X11 keyboard mapping has: KEYBOARD_KEYS plus upper case (with shift)."""
    singles = {k for k in KEYBOARD_KEYS if len(k) == 1}
    assert singles | set("ABCDEFGHIJKLMNOPQRSTUVWXYZ") == PYAUTOGUI_TYPABLE


def test_rendered_type_code_runs_after_the_osworld_prefix() -> None:
    from arpo_core.envs.osworld.osworld_env import PYAUTOGUI_PREFIX

    for content in ("café\n", "plain\n", "日本"):
        (code,) = to_pyautogui([Action("type", content=content)])
        compile(PYAUTOGUI_PREFIX + code, "<python -c>", "exec")


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_typed_text_is_exact_property(content: str) -> None:
    (code,) = to_pyautogui(parse_response(format_response("t", [Action("type", content=content)])).actions)
    _check_code_shape(code)
    assert _run(code).typed == (content if content.isascii() else _typed(content))


@settings(max_examples=300, deadline=None)
@given(st.lists(actions_st(), min_size=1, max_size=5), st.sampled_from([None, (160, 210), (1920, 1080)]))
def test_rendered_code_shape(actions: list[Action], screen: tuple[int, int] | None) -> None:
    cmds = to_pyautogui(actions, screen_size=screen)
    assert len(cmds) == len(actions)
    for a, cmd in zip(actions, cmds, strict=True):
        if a.kind in ("wait", "finished", "call_user"):
            assert cmd == {"wait": "WAIT", "finished": "DONE", "call_user": "FAIL"}[a.kind]
            continue
        _check_code_shape(cmd)
        fake = _run(cmd)
        assert fake.calls or fake.typed or not _typed(a.content or ""), cmd  # (control characters only)
        if a.kind == "type":
            assert fake.typed == (a.content if a.content.isascii() else _typed(a.content))
        if a.kind in ("hotkey", "press", "keydown", "keyup"):
            ((_, args, _),) = fake.calls
            assert list(args) == normalize_keys(a.key)
            assert all(k in KEYBOARD_KEYS for k in args)
        if screen is not None:
            for name, args, kwargs in fake.calls:
                if name in ("click", "doubleClick", "moveTo", "dragTo"):
                    x, y = args[:2]
                elif name in ("scroll", "hscroll") and "x" in kwargs:
                    x, y = kwargs["x"], kwargs["y"]
                else:
                    continue
                assert 0 <= x < screen[0] and 0 <= y < screen[1], cmd


def test_actions_per_reply_are_bounded_beyond_it_a_format_error():
    import time

    from arpo_core.actions import MAX_ACTIONS_PER_REPLY

    one = "click(start_box='(10,20)')"
    ok = parse_response("Thought: many\nAction: " + "\n\n".join([one] * MAX_ACTIONS_PER_REPLY))
    assert len(ok.actions) == MAX_ACTIONS_PER_REPLY == 16
    with pytest.raises(ActionParseError, match="more than 16 actions in one reply"):
        parse_response("Thought: many\nAction: " + "\n\n".join([one] * (MAX_ACTIONS_PER_REPLY + 1)))
    t0 = time.monotonic()
    with pytest.raises(ActionParseError, match="more than 16 actions"):
        parse_response("Thought: flood\nAction: " + "\n\n".join([one] * 50_000))
    assert time.monotonic() - t0 < 1.0  # stops at the bound, does not parse 50,000 actions
    assert len(parse_response("Action: " + "\n\n".join([one] * 3), max_actions=3).actions) == 3
    with pytest.raises(ActionParseError, match="more than 2 actions"):
        parse_response("Action: " + "\n\n".join([one] * 3), max_actions=2)
