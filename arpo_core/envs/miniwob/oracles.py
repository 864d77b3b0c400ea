"""Scripted MiniWoB++ oracles: read the DOM, answer like UI-TARS (Thought + Action) in model-image pixels.

They produce the demonstrations that bootstrap the embedded base policy (docs/design.md stage `demos`) and
the grounding targets; they are never part of what the policy sees.

Design decisions:
- **Stateless oracles.** An oracle is a pure function of (utterance, current DOM) -> the next reply. No hidden
  memory: progress in multi-step tasks is read back from the page (field values, focus, checked states), so
  the same function replays any prefix of an episode, and a demo generator only needs
  reset -> (oracle_reply -> parse -> to_screen -> step)*.
- **Screen-level actions.** Only screen-level actions: coordinate clicks, typing into the focused element,
  keys. Never DOM clicks: a demo must be something the pixel policy can imitate.
- **One reply per step.** One reply per step, normally with one action, like the reference agent's typical
  turns, e.g. enter-text = click field / type / click Submit. The only two-action reply (`hotkey ctrl a` then
  `type`) replaces wrong text in a field, which a stateless oracle could not split across steps.
  Waiting for something that appears late (autocomplete suggestions) is an explicit `wait()`.
- **Model-image coordinates.** Coordinates are written in the frame of the image the model sees: the
  screenshot after Qwen2.5-VL's `smart_resize` (160x210 -> 168x224 with min_pixels = 3136), via
  `arpo_core.actions.to_model`, and the reply is written with `format_response`, so it parses with
  `parse_response`.
- **Unoccluded click points.** Click points are the centre of the target's box unless something drawn later
  overlaps it (click-test-2 / click-button-sequence place two buttons at random): then the point of the box
  farthest from the overlapping boxes is used.
- **Deliberate misses.** Deliberate misses for recovery demonstrations (arpo_core/offline/demonstrations.py):
  `miss_step` keeps the oracle's Thought for the current state and replaces its click by a click on empty
  space, so the reply reads like a first attempt whose grounding was off. Empty space (`empty_points`) is a
  point of the task area below the query bar that lies, with a margin, outside the box of every visible DOM
  element but the page frame (<body>, #wrap, #area): no handler of an in-domain task listens there, so MiniWoB
  does not end the episode and the page does not change (tests/test_demos.py plays it on every task). The
  point is drawn by the caller's seeded RNG among those grid points; when the current step is not a
  click, or no empty point exists, there is no miss (None).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable

from arpo_core.actions import Action, format_response, smart_resize, to_model
from arpo_core.envs.miniwob.dom import SCREEN_SIZE, DomElement

MODEL_MIN_PIXELS = 56 * 56
MODEL_MAX_PIXELS = 28 * 28 * 1280

# (thought, actions in SCREEN pixels)
OracleStep = tuple[str, list[Action]]
Oracle = Callable[[str, list[DomElement]], OracleStep]

# CSS colour names used by click-color -> computed 'rgb(r, g, b)'.
COLOR_RGB = {
    "red": "rgb(255, 0, 0)",
    "blue": "rgb(0, 0, 255)",
    "olive": "rgb(128, 128, 0)",
    "lime": "rgb(0, 255, 0)",
    "black": "rgb(0, 0, 0)",
    "white": "rgb(255, 255, 255)",
    "grey": "rgb(128, 128, 128)",
    "purple": "rgb(128, 0, 128)",
    "orange": "rgb(255, 165, 0)",
    "yellow": "rgb(255, 255, 0)",
    "cyan": "rgb(0, 255, 255)",
    "pink": "rgb(255, 192, 203)",
    "magenta": "rgb(255, 0, 255)",
}


class OracleError(RuntimeError):
    """The page is not in a state the oracle understands (e.g. the target element is missing)."""


def model_size(
    screen_size: tuple[int, int] = SCREEN_SIZE,
    min_pixels: int = MODEL_MIN_PIXELS,
    max_pixels: int = MODEL_MAX_PIXELS,
) -> tuple[int, int]:
    """(w', h') of the image the model sees for a screen of (w, h); 160x210 -> (168, 224)."""
    h, w = smart_resize(screen_size[1], screen_size[0], min_pixels=min_pixels, max_pixels=max_pixels)
    return w, h


# ---------------------------------------------------------------------------------------------------------
# DOM helpers
# ---------------------------------------------------------------------------------------------------------


def quoted(text: str) -> list[str]:
    """The "..." substrings of an utterance, in order."""
    return re.findall(r'"([^"]*)"', text)


def find(
    dom: list[DomElement],
    *,
    tag: str | None = None,
    id: str | None = None,
    text: str | None = None,
    cls: str | None = None,
    visible: bool = True,
) -> list[DomElement]:
    """Elements matching all given criteria (cls: one of the space-separated classes)."""
    out = []
    for e in dom:
        if visible and not e.visible:
            continue
        if tag is not None and e.tag != tag:
            continue
        if id is not None and e.id != id:
            continue
        if text is not None and e.text != text:
            continue
        if cls is not None and cls not in e.classes.split():
            continue
        out.append(e)
    return out


def one(found: list[DomElement], what: str) -> DomElement:
    if not found:
        raise OracleError(f"no element for {what}")
    return found[0]


def free_point(target: DomElement, others: list[DomElement], margin: float = 2.0) -> tuple[float, float]:
    """A point inside target's box (margin px from its edge) outside every box in `others`.

    The box centre when it is free; otherwise, on a 1-px grid, the free point farthest from all the
    other boxes. Falls back to the centre when the target is fully covered.
    """
    left, top, w, h = target.bbox

    def dist_out(x: float, y: float) -> float:
        d = float("inf")
        for o in others:
            ol, ot, ow, oh = o.bbox
            dx = max(ol - x, 0.0, x - (ol + ow))
            dy = max(ot - y, 0.0, y - (ot + oh))
            d = min(d, max(dx, dy))
        return d

    cx, cy = target.center
    if not others or dist_out(cx, cy) > margin:
        return cx, cy
    best, best_d = (cx, cy), 0.0
    y = top + margin
    while y <= top + h - margin:
        x = left + margin
        while x <= left + w - margin:
            d = dist_out(x, y)
            if d > best_d:
                best, best_d = (x, y), d
            x += 1.0
        y += 1.0
    return best


FRAME_IDS = frozenset({"wrap", "area"})
"""Ids of the page frame that contains every task's widgets; with <body> the only boxes a miss may hit."""


def empty_points(
    dom: list[DomElement],
    screen_size: tuple[int, int] = SCREEN_SIZE,
    margin: float = 3.0,
    grid: float = 2.0,
) -> list[tuple[float, float]]:
    """Points of the task area that lie on no DOM element (decision "Deliberate misses"), on a `grid`-px
    lattice.

    The task area is the screen below the query bar (#query; the whole screen without one); a point is
    empty when it is at least `margin` px inside the screen and at least `margin` px away from the box of
    every visible element except <body>, #wrap and #area (`FRAME_IDS`).
    """
    w, h = screen_size
    query = [e for e in dom if e.id == "query"]
    top = query[0].bbox[1] + query[0].bbox[3] if query else 0.0
    boxes = [
        (left - margin, t - margin, left + bw + margin, t + bh + margin)
        for left, t, bw, bh in (
            e.bbox for e in dom if e.visible and e.tag != "body" and e.id not in FRAME_IDS
        )
    ]
    out = []
    y = top + margin
    while y <= h - 1 - margin:
        x = margin
        while x <= w - 1 - margin:
            if not any(x0 < x < x1 and y0 < y < y1 for x0, y0, x1, y1 in boxes):
                out.append((x, y))
            x += grid
        y += grid
    return out


def click(point: tuple[float, float]) -> list[Action]:
    return [Action("click", point=(float(point[0]), float(point[1])))]


def fill_fields(
    dom: list[DomElement], fields: list[tuple[DomElement, str]], submit: DomElement
) -> OracleStep:
    """Focus and type each field whose value differs from the wanted text, then click submit."""
    for el, want in fields:
        if (el.value or "") == want:
            continue
        label = el.id or el.tag
        if not el.focused:
            return f'I need to type "{want}" into the {label} field, so I click it first.', click(el.center)
        if el.value:
            return f'The {label} field holds the wrong text; I select it all and type "{want}".', [
                Action("hotkey", key="ctrl a"),
                Action("type", content=want),
            ]
        return f'The {label} field is focused; I type "{want}".', [Action("type", content=want)]
    return f'Everything is filled in; I click the "{submit.text}" button.', click(submit.center)


# ---------------------------------------------------------------------------------------------------------
# Oracles, one per task
# ---------------------------------------------------------------------------------------------------------


def _click_test(utt: str, dom: list[DomElement]) -> OracleStep:
    b = one(find(dom, tag="button", id="subbtn"), "the button")
    return "There is a single button on the page; I click it.", click(b.center)


def _click_test_2(utt: str, dom: list[DomElement]) -> OracleStep:
    want = "ONE" if "ONE" in utt else "TWO"
    target = one(find(dom, tag="button", text=want), want)
    others = [e for e in find(dom, tag="button") if e.index > target.index]
    return f"The task asks for button {want}; I click it.", click(free_point(target, others))


def _click_button(utt: str, dom: list[DomElement]) -> OracleStep:
    name = quoted(utt)[0]
    b = one(find(dom, tag="button", text=name), name)
    return f'I click the "{name}" button.', click(b.center)


def _click_link(utt: str, dom: list[DomElement]) -> OracleStep:
    name = quoted(utt)[0]
    link = one(find(dom, cls="alink", text=name), name)
    return f'The link "{name}" is in the text; I click it.', click(link.center)


def _click_dialog(utt: str, dom: list[DomElement]) -> OracleStep:
    x = one(find(dom, tag="button", cls="ui-dialog-titlebar-close"), "the dialog's close button")
    return 'I close the dialog with the "x" in its title bar.', click(x.center)


def _labelled_inputs(dom: list[DomElement], kind: str) -> list[tuple[str, DomElement]]:
    """(label text, input) pairs for <label><input type=kind>name</label> lists."""
    out = []
    for lab in find(dom, tag="label"):
        inputs = [e for e in dom if e.parent == lab.index and e.tag == f"input_{kind}"]
        if inputs:
            out.append((lab.text, inputs[0]))
    return out


def _click_checkboxes(utt: str, dom: list[DomElement]) -> OracleStep:
    m = re.match(r"Select (.*) and click Submit\.", utt)
    if not m:
        raise OracleError(f"unexpected utterance {utt!r}")
    wanted = set() if m.group(1) == "nothing" else set(m.group(1).split(", "))
    for name, box in _labelled_inputs(dom, "checkbox"):
        if (box.value == "true") != (name in wanted):
            verb = "check" if name in wanted else "uncheck"
            return f'I need to {verb} "{name}".', click(box.center)
    submit = one(find(dom, tag="button", id="subbtn"), "Submit")
    return "All boxes are set as asked; I click Submit.", click(submit.center)


def _click_option(utt: str, dom: list[DomElement]) -> OracleStep:
    m = re.match(r"Select (.*) and click Submit\.", utt)
    if not m:
        raise OracleError(f"unexpected utterance {utt!r}")
    name = m.group(1)
    for label, radio in _labelled_inputs(dom, "radio"):
        if label == name and radio.value != "true":
            return f'I select the option "{name}".', click(radio.center)
    submit = one(find(dom, tag="button", id="subbtn"), "Submit")
    return f'"{name}" is selected; I click Submit.', click(submit.center)


def _click_tab(utt: str, dom: list[DomElement]) -> OracleStep:
    m = re.search(r"Tab #(\d)", utt)
    if not m:
        raise OracleError(f"unexpected utterance {utt!r}")
    tab = one(find(dom, tag="a", text=f"Tab #{m.group(1)}"), "the tab")
    return f"I click on Tab #{m.group(1)}.", click(tab.center)


_WIDGET_TAGS = {
    "radio": "input_radio",
    "checkbox": "input_checkbox",
    "text": "input_text",
    "textarea": "textarea",
    "button": "button",
}


def _click_widget(utt: str, dom: list[DomElement]) -> OracleStep:
    kind = quoted(utt)[0]
    w = one(find(dom, tag=_WIDGET_TAGS[kind]), kind)
    return f'I click the first "{kind}" widget.', click(w.center)


def _click_color(utt: str, dom: list[DomElement]) -> OracleStep:
    m = re.match(r"Click on the (.*) colored box\.", utt)
    if not m or m.group(1) not in COLOR_RGB:
        raise OracleError(f"unexpected utterance {utt!r}")
    rgb = COLOR_RGB[m.group(1)]
    box = one([e for e in find(dom, cls="color") if e.id != "query-color" and e.bg == rgb], m.group(1))
    return f"The {m.group(1)} box is in the row of colours; I click it.", click(box.center)


def _click_button_sequence(utt: str, dom: list[DomElement]) -> OracleStep:
    one_btn = one(find(dom, tag="button", id="subbtn"), "ONE")
    two_btn = one(find(dom, tag="button", id="subbtn2"), "TWO")
    # Chromium focuses a button it clicks: ONE focused means it was pressed already.
    if one_btn.focused:
        return "Button ONE is done; now I click button TWO.", click(free_point(two_btn, []))
    return "I click button ONE first.", click(free_point(one_btn, [two_btn]))


def _click_collapsible(utt: str, dom: list[DomElement]) -> OracleStep:
    content = find(dom, cls="ui-accordion-content")
    if not content:
        header = one(find(dom, tag="h3"), "the section header")
        return "The section is collapsed; I click its header to expand it.", click(header.center)
    submit = one(find(dom, tag="button", id="subbtn"), "Submit")
    return "The section is open; I click Submit.", click(submit.center)


def _focus_text(utt: str, dom: list[DomElement]) -> OracleStep:
    box = one(find(dom, tag="input_text", id="tt"), "the textbox")
    return "I click into the textbox to focus it.", click(box.center)


def _focus_text_2(utt: str, dom: list[DomElement]) -> OracleStep:
    m = re.search(r"the (\d)(?:st|nd|rd) input", utt)
    if not m:
        raise OracleError(f"unexpected utterance {utt!r}")
    box = one(find(dom, tag="input_text", id=f"tt{m.group(1)}"), "the textbox")
    return f"I click into textbox number {m.group(1)}.", click(box.center)


def _identify_shape(utt: str, dom: list[DomElement]) -> OracleStep:
    shapes = [e for e in dom if e.tag in ("text", "rect", "circle", "polygon")]
    if not shapes:
        raise OracleError("no shape drawn")
    s = shapes[0]
    if s.tag == "text":
        kind = "Number" if s.full_text.isdigit() else "Letter"
    else:
        kind = {"rect": "Rectangle", "circle": "Circle", "polygon": "Triangle"}[s.tag]
    b = one(find(dom, tag="button", text=kind), kind)
    return f"The figure is a {kind.lower()}; I click the {kind} button.", click(b.center)


def _enter_text(utt: str, dom: list[DomElement]) -> OracleStep:
    field = one(find(dom, tag="input_text", id="tt"), "the text field")
    return fill_fields(dom, [(field, quoted(utt)[0])], one(find(dom, id="subbtn"), "Submit"))


def _enter_text_2(utt: str, dom: list[DomElement]) -> OracleStep:
    text = quoted(utt)[0]
    want = text.upper() if "upper case" in utt else text.lower()
    field = one(find(dom, tag="input_text", id="tt"), "the text field")
    return fill_fields(dom, [(field, want)], one(find(dom, id="subbtn"), "Submit"))


def _enter_password(utt: str, dom: list[DomElement]) -> OracleStep:
    pw = quoted(utt)[0]
    fields = [one(find(dom, id=i), i) for i in ("password", "verify")]
    return fill_fields(dom, [(f, pw) for f in fields], one(find(dom, id="subbtn"), "Submit"))


def _login_user(utt: str, dom: list[DomElement]) -> OracleStep:
    user, pw = quoted(utt)[:2]
    fields = [(one(find(dom, id="username"), "username"), user), (one(find(dom, id="password"), "pw"), pw)]
    return fill_fields(dom, fields, one(find(dom, id="subbtn"), "Login"))


def _choose_list(utt: str, dom: list[DomElement]) -> OracleStep:
    m = re.match(r"Select (.*) from the list and click Submit\.", utt)
    if not m:
        raise OracleError(f"unexpected utterance {utt!r}")
    name = m.group(1)
    sel = one(find(dom, tag="select", id="options"), "the list")
    if sel.value == name:
        submit = one(find(dom, tag="button", text="Submit"), "Submit")
        return f'"{name}" is selected; I click Submit.', click(submit.center)
    if not sel.focused:
        return "I click the drop-down list to focus it.", click(sel.center)
    # A focused <select> selects the option whose text is typed (type-ahead); Enter confirms it.
    return f'The list is focused; I type "{name}" to pick it.', [Action("type", content=name + "\n")]


def _use_autocomplete(utt: str, dom: list[DomElement]) -> OracleStep:
    parts = quoted(utt)
    start, end = parts[0], (parts[1] if len(parts) > 1 else "")
    field = one(find(dom, id="tags"), "the input")
    value = field.value or ""
    items = [e for e in find(dom, cls="ui-menu-item-wrapper") if e.full_text]
    fits = value.startswith(start) and value.endswith(end) and len(value) > len(start)
    if fits and not items:
        submit = one(find(dom, tag="button", id="subbtn"), "Submit")
        return f'"{value}" fits; I click Submit.', click(submit.center)
    if fits:
        return f'"{value}" fits; I press Enter to take it.', [Action("press", key="enter")]
    if not items:
        if not field.focused:
            return "I click the input to type the beginning of the item.", click(field.center)
        if value == start:
            return "The suggestions have not appeared yet; I wait.", [Action("wait")]
        if value:
            return f'The input holds other text; I replace it with "{start}".', [
                Action("hotkey", key="ctrl a"),
                Action("type", content=start),
            ]
        return f'I type "{start}" and let the autocomplete suggest items.', [Action("type", content=start)]
    # Items may hang below the 210-px task area: click the part of an item that is on screen.
    on_screen = [e for e in items if e.bbox[1] <= SCREEN_SIZE[1] - 6]
    match = [e for e in on_screen if e.full_text.startswith(start) and e.full_text.endswith(end)]
    if match:
        left, top, w, h = match[0].bbox
        point = (left + w / 2, (top + min(top + h, SCREEN_SIZE[1] - 1)) / 2)
        return f'The suggestion "{match[0].full_text}" fits; I click it.', click(point)
    return "No suggestion on screen fits yet; I move down the list.", [Action("press", key="down")]


ORACLES: dict[str, Oracle] = {
    "click-test": _click_test,
    "click-test-2": _click_test_2,
    "click-button": _click_button,
    "click-link": _click_link,
    "click-dialog": _click_dialog,
    "click-checkboxes": _click_checkboxes,
    "click-option": _click_option,
    "click-tab": _click_tab,
    "click-widget": _click_widget,
    "click-color": _click_color,
    "click-button-sequence": _click_button_sequence,
    "click-collapsible": _click_collapsible,
    "focus-text": _focus_text,
    "focus-text-2": _focus_text_2,
    "identify-shape": _identify_shape,
    "enter-text": _enter_text,
    "enter-text-2": _enter_text_2,
    "enter-password": _enter_password,
    "login-user": _login_user,
    "choose-list": _choose_list,
    "use-autocomplete": _use_autocomplete,
}


def oracle_step(task_id: str, utterance: str, dom: list[DomElement]) -> OracleStep | None:
    """(thought, actions in screen pixels) for the current state, or None for tasks without an oracle."""
    fn = ORACLES.get(task_id)
    return None if fn is None else fn(utterance, dom)


def miss_step(task_id: str, utterance: str, dom: list[DomElement], rng: random.Random) -> OracleStep | None:
    """A deliberate miss (decision "Deliberate misses"): the oracle's Thought for this state with its click
    moved to an empty point drawn by `rng`; None without an oracle, when the oracle's next action is not a
    single click, or when no empty point exists."""
    step = oracle_step(task_id, utterance, dom)
    if step is None:
        return None
    thought, actions = step
    if len(actions) != 1 or actions[0].kind != "click":
        return None
    points = empty_points(dom)
    if not points:
        return None
    return thought, click(rng.choice(points))


def render_reply(
    step: OracleStep,
    screen_size: tuple[int, int] = SCREEN_SIZE,
    min_pixels: int = MODEL_MIN_PIXELS,
    max_pixels: int = MODEL_MAX_PIXELS,
) -> str:
    """An oracle step (screen pixels) as a UI-TARS reply in model-image pixels
    (decision "Model-image coordinates")."""
    thought, actions = step
    size = model_size(screen_size, min_pixels, max_pixels)

    def m(p: tuple[float, float] | None) -> tuple[float, float] | None:
        return None if p is None else to_model(p, size, screen_size)

    mapped = [Action(a.kind, m(a.point), m(a.end_point), a.key, a.content, a.direction) for a in actions]
    return format_response(thought, mapped)


def oracle_reply(
    task_id: str,
    utterance: str,
    dom: list[DomElement],
    screen_size: tuple[int, int] = SCREEN_SIZE,
    min_pixels: int = MODEL_MIN_PIXELS,
    max_pixels: int = MODEL_MAX_PIXELS,
) -> str | None:
    """The oracle's UI-TARS reply with coordinates in model-image pixels
    (decision "Model-image coordinates")."""
    step = oracle_step(task_id, utterance, dom)
    return None if step is None else render_reply(step, screen_size, min_pixels, max_pixels)
