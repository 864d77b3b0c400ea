"""The Qwen3-VL / GUI-Owl-1.5 tool-call grammar (arpo_core/actions.py, decision "Qwen3-VL tool calls"): valid replies, errors,
fuzzing (whatever the text, a format error or valid actions, never another exception), the round trip,
and model text that never runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import arpo_core.actions as A
from arpo_core.actions import (
    ACTION_FORMATS,
    ACTION_KINDS,
    KEYBOARD_KEYS,
    Action,
    ActionParseError,
    ParsedResponse,
    format_reply,
    format_tool_call_response,
    parse_reply,
    parse_tool_call_response,
    to_model,
    to_screen,
    validate_action,
)


def call(**arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": "computer_use", "arguments": arguments}) + "\n</tool_call>"


VALID = [
    (
        "Action: Click the OK button.\n" + call(action="left_click", coordinate=[512, 384]),
        "Click the OK button.",
        [Action("click", point=(512.0, 384.0))],
    ),
    (call(action="double_click", coordinate=[1, 2.5]), "", [Action("left_double", point=(1.0, 2.5))]),
    (call(action="right_click", coordinate=[0, 0]), "", [Action("right_single", point=(0.0, 0.0))]),
    (call(action="mouse_move", coordinate=[10, 20]), "", [Action("hover", point=(10.0, 20.0))]),
    (
        call(action="left_click_drag", start_coordinate=[1, 2], coordinate=[3, 4]),
        "",
        [Action("drag", point=(1.0, 2.0), end_point=(3.0, 4.0))],
    ),
    (call(action="key", keys=["ctrl", "c"]), "", [Action("hotkey", key="ctrl c")]),
    (call(action="key", keys=["Enter"]), "", [Action("press", key="Enter")]),
    (call(action="type", text='it\'s "quoted"\n'), "", [Action("type", content='it\'s "quoted"\n')]),
    (call(action="scroll", pixels=-3), "", [Action("scroll", direction="down")]),
    (
        call(action="scroll", pixels=5, coordinate=[7, 8]),
        "",
        [Action("scroll", point=(7.0, 8.0), direction="up")],
    ),
    (call(action="hscroll", pixels=2), "", [Action("scroll", direction="right")]),
    (call(action="hscroll", pixels=-2.5), "", [Action("scroll", direction="left")]),
    (call(action="wait"), "", [Action("wait")]),
    (call(action="wait", time=2), "", [Action("wait")]),
    (call(action="answer", text="42"), "", [Action("finished", content="42")]),
    (call(action="terminate", status="success"), "", [Action("finished")]),
    (call(action="terminate", status="failure"), "", [Action("call_user")]),
    (  # several blocks, any whitespace between, surrounding whitespace
        "  \r\nAction: Type and submit.\r\n"
        + call(action="type", text="hi")
        + "\n\n  "
        + call(action="key", keys=["enter"])
        + "\n",
        "Type and submit.",
        [Action("type", content="hi"), Action("press", key="enter")],
    ),
    (  # the canonical JSON spacing is not required
        '<tool_call>{"name":"computer_use","arguments":{"action":"left_click","coordinate":[5,6]}}</tool_call>',
        "",
        [Action("click", point=(5.0, 6.0))],
    ),
    (  # a thinking variant's block first: its text is the thought when no Action line follows
        "<think>\nThe button is top left.\n</think>\n" + call(action="left_click", coordinate=[9, 9]),
        "The button is top left.",
        [Action("click", point=(9.0, 9.0))],
    ),
    (
        "<thinking>plan</thinking>\nAction: Click it.\n" + call(action="left_click", coordinate=[9, 9]),
        "Click it.",
        [Action("click", point=(9.0, 9.0))],
    ),
]


@pytest.mark.parametrize(("text", "thought", "actions"), VALID)
def test_parse_valid(text: str, thought: str, actions: list[Action]) -> None:
    assert parse_tool_call_response(text) == ParsedResponse(thought, actions)
    assert parse_reply(text, "qwen3vl_tool_call") == ParsedResponse(thought, actions)


def test_every_action_kind_but_keydown_keyup_is_covered() -> None:
    kinds = {a.kind for _, _, acts in VALID for a in acts}
    assert kinds == set(ACTION_KINDS) - {"keydown", "keyup"}


ERRORS = [
    ("", "no <tool_call>"),
    ("Action: click(start_box='(1,2)')", "no <tool_call>"),
    ("I will click.\n" + call(action="left_click", coordinate=[1, 2]), "must start with 'Action:'"),
    (call(action="left_click", coordinate=[1, 2]) + "\nDone.", "text after the tool calls"),
    ("<tool_call>\n" + '{"name": "computer_use", "arguments": {"action": "wait"}}', "an unclosed <tool_call>"),
    ("<tool_call>{'name': 'computer_use', 'arguments': {'action': 'wait'}}</tool_call>", "not valid JSON"),
    ("<tool_call>[1, 2]</tool_call>", 'must be {"name"'),
    ('<tool_call>{"name": "computer_use"}</tool_call>', 'must be {"name"'),
    ('<tool_call>{"name": "mobile_use", "arguments": {"action": "wait"}}</tool_call>', "unknown function"),
    ('<tool_call>{"name": "computer_use", "arguments": "wait"}</tool_call>', "arguments must be a JSON object"),
    ('<tool_call>{"name": "computer_use", "arguments": {"x": 1}}</tool_call>', "need an 'action' string"),
    (call(action="fly"), "unknown action 'fly'"),
    (call(action="triple_click", coordinate=[1, 1]), "not in this project's action space"),
    (call(action="middle_click", coordinate=[1, 1]), "not in this project's action space"),
    (call(action="left_click"), "left_click needs coordinate"),
    (call(action="left_click", coordinate=[1, 2], button="left"), "unknown argument 'button'"),
    (call(action="left_click_drag", coordinate=[1, 2]), "needs start_coordinate"),
    (call(action="left_click", coordinate=[1]), r"must be a list \[x, y\]"),
    (call(action="left_click", coordinate="(1,2)"), r"must be a list \[x, y\]"),
    (call(action="left_click", coordinate=[-1, 2]), "negative coordinate"),
    (call(action="left_click", coordinate=[True, 2]), "must be a number"),
    ('<tool_call>{"name": "computer_use", "arguments": {"action": "left_click", "coordinate": [NaN, 1]}}</tool_call>', "NaN is not a number"),
    ('<tool_call>{"name": "computer_use", "arguments": {"action": "left_click", "coordinate": [1e999, 1]}}</tool_call>', "not finite"),
    ('<tool_call>{"name": "computer_use", "arguments": {"action": "wait", "action": "wait"}}</tool_call>', "names one key twice"),
    (call(action="key", keys=[]), "keys must be a list of 1 to 8"),
    (call(action="key", keys="ctrl c"), "keys must be a list of 1 to 8"),
    (call(action="key", keys=["ctrl c"]), "holds whitespace"),
    (call(action="key", keys=["hyperspace"]), "unknown key 'hyperspace'"),
    (call(action="type", text=5), "text must be a string"),
    (call(action="scroll", pixels=0), "needs non-zero pixels"),
    (call(action="scroll", pixels="down"), "pixels must be a number"),
    (call(action="wait", time=-1), "time must be >= 0"),
    (call(action="terminate", status="done"), "status must be 'success' or 'failure'"),
    ("<tool_call>" + "[" * 100_000 + "</tool_call>", "not valid JSON"),
    ('<tool_call>{"name": "computer_use", "arguments": {"action": "wait", "time": 1' + "0" * 5000 + "}}</tool_call>", "not valid JSON"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "message"), ERRORS)
def test_parse_errors(text: str, message: str) -> None:
    with pytest.raises(ActionParseError, match=message):
        parse_tool_call_response(text)


def test_parse_rejects_non_str_and_bounds_the_actions() -> None:
    with pytest.raises(ActionParseError, match="must be a str"):
        parse_tool_call_response(None)  # type: ignore[arg-type]
    many = "\n".join([call(action="wait")] * 17)
    with pytest.raises(ActionParseError, match="more than 16 actions"):
        parse_tool_call_response(many)
    assert len(parse_tool_call_response(many, max_actions=17).actions) == 17


def test_dispatch_by_format() -> None:
    assert ACTION_FORMATS == ("uitars", "qwen3vl_tool_call")
    ui = "Thought: t\nAction: click(start_box='(1,2)')"
    assert parse_reply(ui, "uitars").actions == [Action("click", point=(1.0, 2.0))]
    with pytest.raises(ActionParseError):
        parse_reply(ui, "qwen3vl_tool_call")
    with pytest.raises(ValueError, match="unknown action format"):
        parse_reply(ui, "json")
    with pytest.raises(ValueError, match="unknown action format"):
        format_reply("t", [Action("wait")], "json")
    assert format_reply("t", [Action("wait")], "uitars") == "Thought: t\nAction: wait()"


# ---------------------------------------------------------------------------------------------------------
# Fuzzing: a format error or valid actions, nothing else
# ---------------------------------------------------------------------------------------------------------

_TOKENS = st.sampled_from(
    [
        "<tool_call>", "</tool_call>", "<think>", "</think>", "Action:", "{", "}", "[", "]", ",", ":", '"',
        "'", "\\", "\n", " ", '"name"', '"computer_use"', '"arguments"', '"action"', '"left_click"',
        '"coordinate"', '"keys"', '"ctrl"', '"text"', '"pixels"', '"status"', '"success"', "1", "-1",
        "1e999", "NaN", "true", "null", '"key"', '"scroll"', '"terminate"', '"left_click_drag"',
    ]
)  # fmt: skip


def _outcome(text: str) -> ParsedResponse | None:
    try:
        out = parse_tool_call_response(text)
    except ActionParseError:
        return None
    assert out.actions and all(isinstance(a, Action) and a.kind in ACTION_KINDS for a in out.actions)
    for a in out.actions:
        validate_action(a)  # whatever the parser accepts, the writers accept too
    return out


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_fuzz_arbitrary_text(text: str) -> None:
    _outcome(text)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_TOKENS, max_size=40))
def test_fuzz_token_soup(tokens: list[str]) -> None:
    _outcome("".join(tokens))
    _outcome('<tool_call>{"name": "computer_use", "arguments": {"action": ' + "".join(tokens))


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(["left_click", "key", "scroll", "type", "terminate", "left_click_drag", "wait", "x"]),
    st.dictionaries(
        st.sampled_from(["coordinate", "start_coordinate", "keys", "text", "pixels", "time", "status", "y"]),
        _JSON,
        max_size=3,
    ),
)
def test_fuzz_argument_values(action: str, args: dict) -> None:
    try:
        text = call(action=action, **args)
    except ValueError:  # json.dumps of NaN keys etc.: nothing to parse
        return
    _outcome(text)


# ---------------------------------------------------------------------------------------------------------
# The round trip and the coordinate frame
# ---------------------------------------------------------------------------------------------------------

_COORD = st.integers(min_value=0, max_value=1000).map(float)
_POINT = st.tuples(_COORD, _COORD)
_KEY = st.sampled_from([k for k in KEYBOARD_KEYS if not k.isspace()])


@st.composite
def writable_actions(draw: st.DrawFn) -> Action:
    """Every action the tool-call grammar writes (actions.py, decision "Qwen3-VL tool calls": no keydown/keyup; hotkeys of 2+ keys)."""
    kind = draw(st.sampled_from([k for k in ACTION_KINDS if k not in ("keydown", "keyup")]))
    if kind in ("click", "left_double", "right_single", "hover"):
        return Action(kind, point=draw(_POINT))
    if kind == "drag":
        return Action(kind, point=draw(_POINT), end_point=draw(_POINT))
    if kind == "hotkey":
        return Action(kind, key=" ".join(draw(st.lists(_KEY, min_size=2, max_size=4))))
    if kind == "press":
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


_THOUGHT = st.text().filter(
    lambda t: "<tool_call>" not in t and "</tool_call>" not in t and not t.strip().startswith("<think")
)


@settings(max_examples=400, deadline=None)
@given(_THOUGHT, st.lists(writable_actions(), min_size=1, max_size=4))
def test_round_trip(thought: str, actions: list[Action]) -> None:
    text = format_tool_call_response(thought, actions)
    assert parse_tool_call_response(text) == ParsedResponse(thought.strip(), actions)
    assert (
        parse_reply(format_reply(thought, actions, "qwen3vl_tool_call"), "qwen3vl_tool_call").actions
        == actions
    )


def test_writer_output_and_refusals() -> None:
    text = format_tool_call_response(" Click OK. ", [Action("click", point=(12.4, 33.6))])
    assert text == (
        "Action: Click OK.\n<tool_call>\n"
        '{"name": "computer_use", "arguments": {"action": "left_click", "coordinate": [12, 34]}}\n</tool_call>'
    )
    assert format_tool_call_response("", [Action("wait")]).startswith("<tool_call>")
    with pytest.raises(ValueError, match="no computer_use tool call"):
        format_tool_call_response("t", [Action("keydown", key="shift")])
    with pytest.raises(ValueError, match="at least one action"):
        format_tool_call_response("t", [])
    with pytest.raises(ValueError, match="tool-call or think markup"):
        format_tool_call_response("a <tool_call> b", [Action("wait")])
    with pytest.raises(ValueError):
        format_tool_call_response("t", [Action("click")])  # invalid action: no point
    # a one-key hotkey reads back as press (actions.py, decision "Qwen3-VL tool calls")
    assert parse_tool_call_response(
        format_tool_call_response("", [Action("hotkey", key="enter")])
    ).actions == [Action("press", key="enter")]


@pytest.mark.parametrize(("screen", "point"), [((160, 210), (80.0, 105.0)), ((1920, 1080), (1919.0, 0.0))])
def test_relative_coordinates_map_to_the_screen(screen, point) -> None:
    """GUI-Owl-1.5's 0-1000 frame: x * W / 1000 (its agents' rescale), whatever the model image size."""
    rel = to_model(point, None, screen, "relative1000")
    text = format_tool_call_response("", [Action("click", point=rel)])
    back = to_screen(parse_tool_call_response(text).actions, None, screen, mode="relative1000")[0].point
    assert (
        abs(back[0] - point[0]) <= screen[0] / 2000 + 1e-9
        and abs(back[1] - point[1]) <= screen[1] / 2000 + 1e-9
    )
    centre = parse_tool_call_response(call(action="left_click", coordinate=[500, 500])).actions
    assert to_screen(centre, None, screen, mode="relative1000")[0].point == (screen[0] / 2, screen[1] / 2)


# ---------------------------------------------------------------------------------------------------------
# Security: model text never runs code or touches the filesystem
# ---------------------------------------------------------------------------------------------------------


def test_payloads_never_execute(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "pwned"
    payloads = [
        f"<tool_call>{{'name': __import__('os').system('touch {target}')}}</tool_call>",
        f'<tool_call>{{"name": "computer_use", "arguments": {{"action": "type", "text": "__import__(\'os\').system(\'touch {target}\')"}}}}</tool_call>',
        f"<tool_call>open('{target}', 'w')</tool_call>",
        f'Action: x\n<tool_call>{{"name": "computer_use", "arguments": {{"action": "answer", "text": "{{{{open(\'{target}\', \'w\')}}}}"}}}}</tool_call>',
    ]  # fmt: skip
    import builtins

    def trap(*a, **k):
        raise AssertionError("model text reached eval/exec/compile")

    for name in ("eval", "exec", "compile"):
        monkeypatch.setattr(builtins, name, trap)
    results = []
    for p in payloads:
        try:
            results.append(parse_tool_call_response(p))
        except ActionParseError as e:
            results.append(e)
    monkeypatch.undo()
    assert not target.exists()
    assert isinstance(results[0], ActionParseError) and isinstance(results[2], ActionParseError)
    assert results[1].actions[0].content == f"__import__('os').system('touch {target}')"  # typed, as text
    assert results[3].actions[0].kind == "finished"


def test_the_prompts_ask_for_the_grammar_the_config_pairs_them_with():
    """prompt.py, decision "Qwen3-VL prompts": each prompt names its grammar; the config's rule (qwen3vl* prompts <->
    qwen3vl_tool_call) is that mapping; the qwen3vl tool schema lists exactly the actions the parser
    reads, with the argument names it reads."""
    import typing

    from arpo_core.config import PolicyConfig
    from arpo_core.policy.prompt import _SYSTEM_TURN, PROMPT_FORMATS, SYSTEM_PROMPTS

    names = typing.get_args(typing.get_type_hints(PolicyConfig)["system_prompt"])
    assert set(PROMPT_FORMATS) == set(SYSTEM_PROMPTS) == set(names)
    assert set(PROMPT_FORMATS.values()) == set(ACTION_FORMATS)
    for name, fmt in PROMPT_FORMATS.items():
        assert name.startswith("qwen3vl") == (fmt == "qwen3vl_tool_call")
    turn = _SYSTEM_TURN["qwen3vl"]
    schema = json.loads(turn.split("<tools>\n")[1].split("\n</tools>")[0])
    props = schema["function"]["parameters"]["properties"]
    assert schema["function"]["name"] == A.TOOL_NAME
    assert props["action"]["enum"] == list(A._TOOL_SPEC)
    assert set(props) - {"action"} == {a for _, req, opt in A._TOOL_SPEC.values() for a in req | opt}
    assert "1000x1000" in turn and "1000x1000" in SYSTEM_PROMPTS["qwen3vl_compact"]
