"""Prompt layout: history window, chat markup, snapshot of the full UI-TARS-style prompt, model-image size."""

from pathlib import Path

import pytest
from PIL import Image

from arpo_core.actions import ACTION_KINDS
from arpo_core.policy.prompt import (
    SYSTEM_PROMPTS,
    PromptInput,
    PromptSpec,
    Reply,
    build_segments,
    kept_image_steps,
    model_image_size,
    render_text,
)

SNAPSHOTS = Path(__file__).parent / "snapshots"
REPLIES = [
    "Thought: The username field is empty, so I click it first.\nAction: click(start_box='(84,40)')",
    "Thought: Now I type the name and submit.\nAction: type(content='alice\\n')",
]


@pytest.mark.parametrize(
    ("n", "k", "expected"),
    [(5, 2, [3, 4]), (2, 5, [0, 1]), (3, None, [0, 1, 2]), (1, 1, [0]), (4, 1, [3])],
)
def test_kept_image_steps(n, k, expected):
    assert list(kept_image_steps(n, k)) == expected


def test_kept_image_steps_rejects_zero():
    with pytest.raises(ValueError, match="history_images"):
        kept_image_steps(3, 0)


@pytest.mark.parametrize(("system", "k"), [("uitars", 2), ("compact", None)])
def test_prompt_snapshot(system, k):
    """The full rendered prompt for step 3 of an episode (3 screenshots, 2 earlier replies)."""
    segs = build_segments("Log in as alice with password 1234.", 3, REPLIES, spec=PromptSpec(system, k))
    expected = (SNAPSHOTS / f"prompt_{system}_k{k}.txt").read_text()
    assert render_text(segs) == expected


def test_window_drops_images_but_keeps_reply_text():
    segs = build_segments("Do it.", 3, REPLIES, spec=PromptSpec("compact", 1))
    images = [s.step for s in segs if s.kind == "image"]
    replies = [s.reply.text for s in segs if s.kind == "reply"]
    assert images == [2]
    assert replies == REPLIES
    text = render_text(segs)
    assert text.count("<|im_start|>user\n<|vision_start|>") == 1
    assert text.endswith("<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n")


def test_generation_prompt_is_prefix_of_trajectory():
    """prompt.py, decision "Prompt segments": the step-2 prompt is a prefix of the 2-step trajectory's
    segments."""
    prompt = build_segments("Do it.", 2, REPLIES[:1], spec=PromptSpec("uitars", None))
    traj = build_segments("Do it.", 2, REPLIES, spec=PromptSpec("uitars", None))
    assert traj[: len(prompt)] == prompt
    assert [s.kind for s in traj[len(prompt) :]] == ["reply", "text"]
    assert render_text(traj).endswith(REPLIES[1] + "<|im_end|>\n")


def test_uitars_prompt_lists_every_action_kind_and_format():
    text = SYSTEM_PROMPTS["uitars"]
    for kind in ACTION_KINDS:
        assert f"\n{kind}(" in text, kind
    assert "Thought: ...\nAction: ..." in text
    assert len(SYSTEM_PROMPTS["compact"]) < len(text) / 3


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown system prompt"):
        build_segments("x", 1, [], spec=PromptSpec("nope", None))
    with pytest.raises(ValueError, match="replies"):
        build_segments("x", 3, ["a"], spec=PromptSpec("compact", None))
    im = Image.new("RGB", (10, 10))
    with pytest.raises(ValueError, match="one reply per earlier screenshot"):
        PromptInput("x", (im, im), ())
    assert PromptInput("x", (im, im), (Reply("a"),)).replies[0].text == "a"


@pytest.mark.parametrize(
    ("w", "h", "expected"),
    [(160, 210, (168, 224)), (1920, 1080, (1932, 1092)), (28, 28, (56, 56))],
)
def test_model_image_size(w, h, expected):
    # 1920x1080 under UI-TARS's max_pixels (docs/method.md §2); 28x28 is lifted to min_pixels 56*56.
    assert model_image_size(w, h, min_pixels=56 * 56, max_pixels=2116800) == expected
