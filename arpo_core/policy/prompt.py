"""The agent's prompt: system prompt, instruction, and the history of screenshots and replies, laid out as
Qwen2.5-VL chat turns exactly as UI-TARS-1.5 expects them.

Decisions:
- **Prompt segments.** The prompt is a list of `Segment`s (text, image, reply) rather than one string, so that
  the generator (`generate.py`) and the trainer (`sequences.py`) tokenise exactly the same pieces: a reply is
  always its own segment (its sampled token ids when known), so the prompt prefix the generator saw is a
  prefix of the training sequence token for token.
- **Chat layout.** Layout (Qwen chat markup): optional system turn, one user turn holding the task prompt with
  the instruction, then per step a user turn with the screenshot and an assistant turn with the reply;
  the current step ends with `<|im_start|>assistant\\n`. This is how UI-TARS-1.5's computer-use agent
  feeds its history (docs/method.md §1).
- **History window.** History window: only the last `history_images` screenshots (K) are shown as images;
  older steps keep their reply text only (their user turn is dropped). K = None keeps every screenshot, which
  the ARPO reference does (all up to 15, docs/method.md §2) and which makes one training sequence reproduce
  every step's context exactly (see sequences.py).
- **Two system prompts.** Two system prompts, selected by name: "uitars" (the full computer-use prompt, in our
  own words, with the complete action space of arpo_core/actions.py and the `Thought:`/`Action:` format) and
  "compact" (a few lines: a long prompt costs the tiny CPU model most of its sequence length). The name and K
  are required arguments of every function that builds a prompt: params' `policy` section is their one
  source (a default here once silently gave the trainer one prompt and the generator another).
- **Model-image coordinates.** Coordinates in UI-TARS replies are absolute pixels of the model image, i.e. the
  screenshot after `smart_resize(h, w, factor, min_pixels, max_pixels)` with the model's factor (28 for
  Qwen2.5-VL, 32 for Qwen3-VL; `Policy.patch_factor`) (docs/method.md §3); `model_image_size` gives that size
  so that env code can map clicks back to the screen.
- **Qwen3-VL prompts.** Two Qwen3-VL prompts (docs/models.md) for the tool-call grammar: "qwen3vl" puts the
  `computer_use` function in the system turn inside Qwen's tool markup (the `# Tools` / `<tools>` /
  `<tool_call>` scaffold of Qwen's chat template, which the model is trained on, kept as it is; the function's
  description in this project's words, its action and argument names those of GUI-Owl-1.5's tool) and the
  instruction in the first user turn, as GUI-Owl-1.5's agents do; it announces a 1000x1000 screen, so
  coordinates are 0-1000 units. "qwen3vl_compact" is the few-line form for tiny CPU models. `PROMPT_FORMATS`
  says which grammar each prompt asks for; the config checks it against `policy.action_format`. Not reproduced
  from GUI-Owl-1.5's agents: they fold the replies of steps outside the image window into a "Previous actions"
  list in the user turn; here older steps keep their assistant turns (decision "History window"), for every prompt alike.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from PIL import Image

__all__ = [
    "PROMPT_FORMATS",
    "SYSTEM_PROMPTS",
    "PromptInput",
    "Reply",
    "Segment",
    "build_segments",
    "kept_image_steps",
    "model_image_size",
    "render_text",
    "system_turns",
]

_UITARS_PROMPT = """You are an agent that operates a graphical user interface. You get a task, the \
screenshots seen so far and your own earlier replies. Decide on the next action that brings the task \
closer to completion.

## Reply format
```
Thought: ...
Action: ...
```

## Actions
click(start_box='(x,y)')
left_double(start_box='(x,y)')
right_single(start_box='(x,y)')
hover(start_box='(x,y)')
drag(start_box='(x1,y1)', end_box='(x2,y2)')
hotkey(key='ctrl c') # keys in lowercase, separated by one space, at most three keys
press(key='enter') # a single key
keydown(key='shift')
keyup(key='shift')
type(content='text') # escape quotes as \\' and \\", newlines as \\n; end with \\n to submit the text
scroll(start_box='(x,y)', direction='down') # direction is one of up, down, left, right
wait() # pause five seconds, then look at a new screenshot
finished(content='answer') # the task is done; content may carry the answer
call_user() # the task cannot be done without help from the user

## Notes
- (x,y) are pixel coordinates in the screenshot as you see it, x to the right and y downwards.
- Write the Thought in English: a short plan, then one sentence naming the next action and its target.

## Task
{instruction}"""

_COMPACT_PROMPT = """Operate the GUI. Reply "Thought: ..." then "Action: ..." with click(start_box='(x,y)'), \
type(content='...'), press(key='...'), hotkey(key='...'), scroll(start_box='(x,y)', direction='...'), \
drag(start_box='(x,y)', end_box='(x,y)'), wait(), finished(content='...') or call_user().
Task: {instruction}"""


def _computer_use_schema() -> str:
    """The `computer_use` function as one JSON line (decision "Qwen3-VL prompts"): the action names and argument names are
    the interface GUI-Owl-1.5 and Qwen3-VL are trained on; the descriptions are this project's words."""
    actions = {
        "left_click": "click the left button at coordinate",
        "double_click": "double-click the left button at coordinate",
        "right_click": "click the right button at coordinate",
        "mouse_move": "move the pointer to coordinate",
        "left_click_drag": "press at start_coordinate, drag to coordinate, release",
        "key": 'press the keys together, e.g. ["ctrl", "c"], or one key, e.g. ["enter"]',
        "type": "type text (end it with \\n to submit it)",
        "scroll": "turn the wheel: pixels > 0 up, < 0 down, at coordinate if given",
        "hscroll": "scroll sideways: pixels > 0 right, < 0 left",
        "wait": "wait time seconds, then look at a new screenshot",
        "answer": "the task is done; text is the answer",
        "terminate": "end the task: status success (done) or failure (impossible without the user)",
    }
    description = (
        "Operate a graphical user interface with mouse and keyboard.\n* The screen's resolution is "
        "1000x1000: x and y run from 0 (left, top) to 1000 (right, bottom) over the screenshot as you "
        "see it.\n* Aim at the centre of the element you act on."
    )
    schema = {
        "type": "function",
        "function": {
            "name": "computer_use",
            "description": description,
            "parameters": {
                "properties": {
                    "action": {
                        "description": "The action:\n"
                        + "\n".join(f"* `{k}`: {v}" for k, v in actions.items()),
                        "enum": list(actions),
                        "type": "string",
                    },
                    "coordinate": {"description": "(x, y) on the 1000x1000 screen", "type": "array"},
                    "start_coordinate": {"description": "(x, y) where a drag starts", "type": "array"},
                    "keys": {"description": "key names, for action=key", "type": "array"},
                    "text": {"description": "for action=type and action=answer", "type": "string"},
                    "pixels": {"description": "scroll amount and sign", "type": "number"},
                    "time": {"description": "seconds, for action=wait", "type": "number"},
                    "status": {
                        "description": "for action=terminate",
                        "type": "string",
                        "enum": ["success", "failure"],
                    },
                },
                "required": ["action"],
                "type": "object",
            },
        },
    }
    return json.dumps(schema, ensure_ascii=False)


_QWEN3VL_SYSTEM = f"""# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{_computer_use_schema()}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>

# Reply format

Every reply has two parts, in this order and nothing else:
1) Action: one short sentence saying what you do next in the interface.
2) One <tool_call>...</tool_call> block per action, holding only the JSON of the call.
When the task is done, call action=answer or action=terminate."""

_QWEN3VL_PROMPT = """Decide the next action from the screenshot, the instruction and the actions so far.

Instruction: {instruction}"""

_QWEN3VL_COMPACT_PROMPT = """Operate the GUI; the screen is 1000x1000. Reply "Action: ..." then \
<tool_call>{{"name": "computer_use", "arguments": {{"action": "left_click", "coordinate": [x, y]}}}}</tool_call> \
with action left_click, double_click, right_click, mouse_move, left_click_drag, key, type, scroll, wait, \
answer or terminate.
Task: {instruction}"""

SYSTEM_PROMPTS: dict[str, str] = {
    "uitars": _UITARS_PROMPT,
    "compact": _COMPACT_PROMPT,
    "qwen3vl": _QWEN3VL_PROMPT,
    "qwen3vl_compact": _QWEN3VL_COMPACT_PROMPT,
}
"""Task prompt templates by name; `{instruction}` is filled in. Shown in the first user turn."""

_SYSTEM_TURN: dict[str, str | None] = {
    "uitars": "You are a helpful assistant.",
    "compact": None,
    "qwen3vl": _QWEN3VL_SYSTEM,
    "qwen3vl_compact": None,
}
"""The system turn before the task prompt (UI-TARS uses Qwen's default; the Qwen3-VL prompt holds the
tool there, as Qwen's chat template and GUI-Owl-1.5 do; the compact ones drop it)."""

PROMPT_FORMATS: dict[str, str] = {
    "uitars": "uitars",
    "compact": "uitars",
    "qwen3vl": "qwen3vl_tool_call",
    "qwen3vl_compact": "qwen3vl_tool_call",
}
"""The reply grammar (`arpo_core.actions.ACTION_FORMATS`) each prompt asks for (decision "Qwen3-VL prompts")."""


def system_turns() -> list[str]:
    """Every prompt's text without its instruction (system turns included): the tokenizer corpus."""
    turns = [t for t in _SYSTEM_TURN.values() if t is not None]
    return [*(p.format(instruction="") for p in SYSTEM_PROMPTS.values()), *turns]


@dataclass(frozen=True)
class Reply:
    """An earlier assistant reply. `token_ids` are the ids the generator sampled (ending with
    `<|im_end|>` when it stopped on it); empty when unknown (demos), then `text` is tokenised."""

    text: str
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class PromptInput:
    """What the policy sees at one step of one episode."""

    instruction: str
    screenshots: tuple[Image.Image, ...]
    """Every screenshot of the episode so far, oldest first; the last one is the current screen."""
    replies: tuple[Reply, ...] = ()
    """The replies to all but the last screenshot (len(screenshots) - 1 of them)."""

    def __post_init__(self) -> None:
        if len(self.replies) != len(self.screenshots) - 1:
            raise ValueError(
                f"PromptInput needs one reply per earlier screenshot: {len(self.screenshots)} screenshots, "
                f"{len(self.replies)} replies"
            )


class PromptSpec(NamedTuple):
    """What a prompt is made of besides the episode: the system prompt's name (a key of `SYSTEM_PROMPTS`)
    and the history window K (decision "History window"). One value travels through every function that
    builds a prompt, whatever builds it (generation, training sequences, cloning, the offline methods);
    params' `policy` section is its one source (`PromptSpec.of(p.policy)`)."""

    system: str
    history_images: int | None

    @classmethod
    def of(cls, policy_cfg: Any) -> PromptSpec:
        """From params' `policy` section (`system_prompt`, `history_images`)."""
        return cls(policy_cfg.system_prompt, policy_cfg.history_images)


@dataclass(frozen=True)
class Segment:
    """One piece of a prompt: literal chat text, the screenshot of step `step`, or the reply of `step`."""

    kind: Literal["text", "image", "reply"]
    text: str = ""
    step: int = -1
    reply: Reply | None = None


def kept_image_steps(n_screens: int, history_images: int | None) -> range:
    """Steps whose screenshot is shown as an image: the last K of n (all when K is None).

    >>> list(kept_image_steps(5, 2)), list(kept_image_steps(2, 5)), list(kept_image_steps(3, None))
    ([3, 4], [0, 1], [0, 1, 2])
    """
    if history_images is not None and history_images < 1:
        raise ValueError(f"history_images must be >= 1 (the current screen) or None, got {history_images}")
    k = n_screens if history_images is None else min(history_images, n_screens)
    return range(n_screens - k, n_screens)


def build_segments(
    instruction: str,
    n_screens: int,
    replies: Sequence[Reply | str],
    *,
    spec: PromptSpec,
) -> list[Segment]:
    """Chat layout for `n_screens` screenshots and their replies, with the system prompt `spec.system` (a
    key of `SYSTEM_PROMPTS`) and the last `spec.history_images` screenshots as images
    (decision "History window").

    With `len(replies) == n_screens - 1` the result is a generation prompt ending in
    `<|im_start|>assistant\\n`; with `len(replies) == n_screens` it is a whole trajectory (for training)
    whose every reply is followed by `<|im_end|>` (part of the reply segment) and `\\n`.
    """
    system, history_images = spec
    if system not in SYSTEM_PROMPTS:
        raise ValueError(f"unknown system prompt {system!r}; choose one of {sorted(SYSTEM_PROMPTS)}")
    if len(replies) not in (n_screens - 1, n_screens) or n_screens < 1:
        raise ValueError(
            f"{n_screens} screenshots need {n_screens - 1} or {n_screens} replies, got {len(replies)}"
        )
    replies = [r if isinstance(r, Reply) else Reply(text=r) for r in replies]
    kept = kept_image_steps(n_screens, history_images)
    segs: list[Segment] = []
    if (sys_turn := _SYSTEM_TURN[system]) is not None:
        segs.append(Segment("text", f"<|im_start|>system\n{sys_turn}<|im_end|>\n"))
    segs.append(
        Segment("text", f"<|im_start|>user\n{SYSTEM_PROMPTS[system].format(instruction=instruction)}")
    )
    segs.append(Segment("text", "<|im_end|>\n"))
    for step in range(n_screens):
        if step in kept:
            segs.append(Segment("text", "<|im_start|>user\n<|vision_start|>"))
            segs.append(Segment("image", step=step))
            segs.append(Segment("text", "<|vision_end|><|im_end|>\n"))
        segs.append(Segment("text", "<|im_start|>assistant\n"))
        if step < len(replies):
            segs.append(Segment("reply", step=step, reply=replies[step]))
            segs.append(Segment("text", "\n"))
    return segs


def render_text(segments: Sequence[Segment]) -> str:
    """The prompt as one string, each image as a single `<|image_pad|>` and each reply as its text plus
    `<|im_end|>` (the processor-style form; used for snapshots and logging)."""
    out = []
    for s in segments:
        if s.kind == "text":
            out.append(s.text)
        elif s.kind == "image":
            out.append("<|image_pad|>")
        else:
            out.append(s.reply.text + "<|im_end|>")
    return "".join(out)


def model_image_size(
    screen_w: int, screen_h: int, min_pixels: int, max_pixels: int, factor: int = 28
) -> tuple[int, int]:
    """(width, height) of the image the model sees for a screen of (screen_w, screen_h): the frame its
    coordinates refer to. E.g. MiniWoB's 160x210 -> (168, 224)."""
    from arpo_core.actions import smart_resize  # filled in by the actions helper; imported on use

    h, w = smart_resize(screen_h, screen_w, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    return w, h
