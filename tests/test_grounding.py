"""Grounding data, training loop and image-dependence measures."""

import dataclasses
import math
import random
import sys
import unittest.mock
from pathlib import Path

import pytest
import torch

from arpo_core.actions import parse_response
from arpo_core.config.sections import OptimizerConfig
from arpo_core.offline.grounding import (
    LEVELS,
    NAMES,
    WORDS,
    GroundConfig,
    best_constant_click,
    click_reply,
    coord_pattern,
    element_kind,
    first_click,
    grounding_metrics,
    has_names,
    lr_factor,
    make_grounding_examples,
    miniwob_examples,
    name_key,
    name_vocab,
    name_window,
    pearson,
    point_spans,
    quote_name,
    read_aloud,
    read_score,
    spell_targets,
    spelled,
    synthetic_example,
    synthetic_examples,
    train_grounding,
    window_tokens,
)
from arpo_core.policy.model import build_tiny_policy
from arpo_core.policy.prompt import PromptSpec

# ---------------------------------------------------------------------------------------------- data


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_synthetic_targets_lie_inside_their_box_and_replies_parse(level):
    rng = random.Random(3)
    for _ in range(40):
        ex = synthetic_example(rng, level)
        x0, y0, x1, y1 = ex.bbox
        assert ex.image.size == (160, 210)
        assert 0 <= x0 < ex.target[0] < x1 <= 168 and 0 <= y0 < ex.target[1] < y1 <= 224
        (action,) = parse_response(ex.reply).actions
        assert action.kind == "click"
        # The reply rounds the centre to integer model pixels, which stays inside the box.
        assert x0 <= action.point[0] <= x1 and y0 <= action.point[1] <= y1
        assert abs(action.point[0] - ex.target[0]) <= 0.5 and abs(action.point[1] - ex.target[1]) <= 0.5


def test_synthetic_box_target_is_where_its_colour_is_drawn():
    """The target box in model pixels maps back onto pixels of the named colour on the 160x210 screen."""
    from arpo_core.offline.grounding import COLORS

    rng = random.Random(0)
    for _ in range(20):
        ex = synthetic_example(rng, "box4")
        colour = ex.instruction.split()[2]
        sx, sy = 160 / 168, 210 / 224  # model -> screen
        cx, cy = ex.target[0] * sx, ex.target[1] * sy
        assert ex.image.getpixel((int(cx), int(cy))) == COLORS[colour]


def test_synthetic_examples_are_deterministic_and_follow_the_mix():
    a = synthetic_examples(30, {"box1": 1.0, "widget4": 1.0}, seed=5)
    b = synthetic_examples(30, {"box1": 1.0, "widget4": 1.0}, seed=5)
    assert [e.reply for e in a] == [e.reply for e in b]
    assert {e.source for e in a} == {"synthetic/box1", "synthetic/widget4"}
    assert {e.source for e in synthetic_examples(10, {"box4": 1.0}, seed=1)} == {"synthetic/box4"}


def test_make_grounding_examples_without_env_is_the_synthetic_set():
    a = make_grounding_examples(12, {"widget1": 1.0}, seed=4)
    b = synthetic_examples(12, {"widget1": 1.0}, seed=4)
    assert [e.reply for e in a] == [e.reply for e in b] and len(a) == 12


def test_click_reply_rounds_to_model_pixels():
    assert click_reply("Go.", (10.5, 11.49)) == "Thought: Go.\nAction: click(start_box='(10,11)')"
    assert first_click(click_reply("Go.", (7, 9))) == (7.0, 9.0)
    assert first_click("Thought: no action here") is None


# ---------------------------------------------------------------------------------------------- measures


def test_pearson_hand_computed():
    # a = [1, 2, 3], b = [2, 4, 7]: cov = 5, var_a = 2, var_b = 12.667 -> 5 / sqrt(25.333) = 0.99340
    assert pearson([1, 2, 3], [2, 4, 7]) == pytest.approx(0.993399, abs=1e-6)
    assert pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert pearson([5, 5, 5], [1, 2, 3]) == 0.0
    with pytest.raises(ValueError):
        pearson([1.0], [1.0])


def test_best_constant_click_counts_the_most_covered_point():
    boxes = [(0, 0, 10, 10), (5, 5, 20, 20), (8, 8, 30, 30), (50, 50, 60, 60)]
    point, rate = best_constant_click(boxes)
    assert rate == 0.75  # (8..10, 8..10) lies in the first three boxes
    assert all(b[0] <= point[0] <= b[2] and b[1] <= point[1] <= b[3] for b in boxes[:3])


def test_grounding_metrics_hand_computed():
    targets = [(10.0, 20.0), (30.0, 40.0), (50.0, 60.0)]
    boxes = [(5, 15, 15, 25), (25, 35, 35, 45), (45, 55, 55, 65)]
    clicks = [(10.0, 23.0), (34.0, 40.0), None]  # third reply unparsable -> counted at the image centre
    m = grounding_metrics(clicks, targets, boxes, image_size=(100, 100))
    assert m.n == 3 and m.parse_rate == pytest.approx(2 / 3)
    # errors 3, 4 and dist((50, 50), (50, 60)) = 10
    assert m.mean_err_px == pytest.approx(17 / 3)
    assert m.hit_rate == pytest.approx(2 / 3)
    px, py = [10, 34, 50], [23, 40, 50]
    assert m.corr_x == pytest.approx(pearson(px, [10, 30, 50]))
    assert m.corr_y == pytest.approx(pearson(py, [20, 40, 60]))
    var = sum((x - 94 / 3) ** 2 for x in px) / 3 + sum((y - 113 / 3) ** 2 for y in py) / 3
    assert m.spread_px == pytest.approx(math.sqrt(var))
    # Blind: the mean target (30, 40) is 28.28 px from the outer two, 0 from the middle one.
    assert m.blind_err_px == pytest.approx(2 * math.dist((30, 40), (10, 20)) / 3)
    assert m.blind_hit_rate == pytest.approx(1 / 3)


def test_a_click_on_another_target_is_a_wrong_pick_and_a_click_between_them_is_neither():
    boxes = [(0, 0, 10, 10)] * 4
    others = [[(20, 0, 30, 10), (0, 20, 10, 30)]] * 3 + [[]]
    clicks = [(5.0, 5.0), (25.0, 5.0), (15.0, 15.0), (25.0, 5.0)]  # named, other, between, no others
    m = grounding_metrics(clicks, [(5.0, 5.0)] * 4, boxes, image_size=(40, 40), others=others)
    assert (m.hit_rate, m.other_hit_rate) == (0.25, 0.25)
    assert grounding_metrics(clicks, [(5.0, 5.0)] * 4, boxes, image_size=(40, 40)).other_hit_rate == 0.0


@pytest.mark.parametrize("level", ["boxes8", "buttons8", "checks8", "widget4", "box4"])
def test_synthetic_examples_list_the_other_look_alikes_in_the_model_frame(level):
    for ex in synthetic_examples(20, {level: 1.0}, seed=5, model_size=(168, 224)):
        assert ex.bbox not in ex.lookalikes and len(ex.lookalikes) >= 1
        assert all(0 <= b[0] < b[2] <= 168 and 50 * 224 / 210 <= b[1] < b[3] <= 224 for b in ex.lookalikes)
        # the target's centre is inside no other look-alike: a click on it is never counted a wrong pick
        assert not any(b[0] <= ex.target[0] <= b[2] and b[1] <= ex.target[1] <= b[3] for b in ex.lookalikes)
    assert synthetic_examples(1, {"box1": 1.0})[0].lookalikes == ()


def test_constant_clicks_have_zero_spread_and_correlation():
    targets = [(10.0, 20.0), (30.0, 40.0), (50.0, 60.0)]
    boxes = [(0, 0, 100, 100)] * 3
    m = grounding_metrics([(30.0, 40.0)] * 3, targets, boxes, image_size=(100, 100))
    assert m.spread_px == 0.0 and m.corr_x == 0.0 and m.corr_y == 0.0 and m.hit_rate == 1.0


def test_lr_factor_warmup_then_cosine():
    assert [lr_factor(s, 2, 6, 0.0) for s in range(2)] == [0.5, 1.0]
    assert lr_factor(5, 2, 6, 0.1) == pytest.approx(0.1)
    assert lr_factor(3, 2, 6, 0.0) == pytest.approx(0.75)


def test_curriculum_phases_switch_the_mix():
    cfg = GroundConfig(mix={"box1": 1.0}, curriculum=((1, {"box1": 1.0}), (10, {"box4": 1.0})))
    assert cfg.mix_at(1) == {"box1": 1.0} and cfg.mix_at(9) == {"box1": 1.0}
    assert cfg.mix_at(10) == {"box4": 1.0} and cfg.mix_at(500) == {"box4": 1.0}


# ---------------------------------------------------------------------------------------------- training


def tiny_config(**changes) -> GroundConfig:
    base = {"steps": 30, "batch_size": 8, "optimizer": OptimizerConfig(lr=3e-3), "warmup_steps": 5}
    return GroundConfig(**{**base, "mix": {"box1": 1.0}, **changes})


def test_training_lowers_the_loss_and_reports_measures(tmp_path, one_thread):
    policy = build_tiny_policy(tmp_path / "p", size="xs", rope_theta=5.0, mrope=[2, 7, 7])
    heldout = synthetic_examples(8, {"box1": 1.0}, seed=99)
    hist = train_grounding(policy, tiny_config(), system="compact", max_new_tokens=48, heldout=heldout)
    loss = hist["loss"]
    assert len(loss) == 30
    assert sum(loss[-5:]) / 5 < 0.5 * sum(loss[:5]) / 5
    (ev,) = hist["evals"]  # evaluated once, at the last step
    assert ev["step"] == 30 and ev["n"] == 8
    assert 0.0 <= ev["hit_rate"] <= 1.0 and ev["blind_err_px"] > 0


def test_element_kind_names_miniwob_elements():
    assert element_kind("button", "") == "button"
    assert element_kind("span", "alink") == "link"
    assert element_kind("label", "") == "label"
    assert element_kind("div", "") == "text"


def test_coord_pattern_blends_a_fixed_code_in_the_model_frame():
    from PIL import Image

    img = Image.new("RGB", (160, 210), (255, 255, 255))
    same = coord_pattern(img, (168, 224), 0.0)
    assert same.size == (168, 224) and same.getpixel((100, 100)) == (255, 255, 255)
    out = coord_pattern(img, (168, 224), 0.2)
    # (x, y) = (0, 0): 0.8 * 255 + 0.2 * (0, 0, 128) = (204, 204, 229.6 -> 230)
    assert out.getpixel((0, 0)) == (204, 204, 230)
    # bottom-right corner: code (255, 255, 128) -> (255, 255, 230)
    assert out.getpixel((167, 223)) == (255, 255, 230)


def test_miniwob_examples_target_the_named_element(tmp_path):
    """Real Chromium: the target centre (model pixels -> screen) lands on the element named in the
    instruction."""
    from arpo_core.envs.miniwob.miniwob_env import MiniWoBEnv

    env = MiniWoBEnv()
    try:
        exs = miniwob_examples(env, ["click-button", "click-link"], [3], max_per_screen=3)
        assert {e.source for e in exs} == {"miniwob/click-button", "miniwob/click-link"}
        checked = 0
        for e in exs:
            if e.source != "miniwob/click-link":
                continue  # the env's current screen is click-link's (the last reset)
            x, y = e.target[0] * 160 / 168, e.target[1] * 210 / 224
            text = env.instance.driver.execute_script(
                "return document.elementFromPoint(arguments[0], arguments[1]).textContent;", x, y
            )
            named = e.instruction.split('"')[1]
            assert named in text
            assert 0 <= e.bbox[0] < e.target[0] < e.bbox[2] <= 168
            assert parse_response(e.reply).actions[0].kind == "click"
            # every other unique-text element is listed as a look-alike, and none of them is the target
            assert len(e.lookalikes) >= 2 and e.bbox not in e.lookalikes
            # ... and `named` lists them all with their texts (grounding.py, decision "Lorem names"): the fixed naming
            # vocabulary names none of a real screen's, the lorem one its lorem-ipsum links
            assert (e.bbox, named) in e.named and {b for b, _ in e.named} == {e.bbox, *e.lookalikes}
            assert not has_names(e) and has_names(e, "lorem") and spelled(e, (1.05, 1.07)) == []
            assert name_key(e, named, "lorem") == named.lower().rstrip(".,:;") in name_vocab("lorem")
            for b in e.lookalikes:
                cx, cy = (b[0] + b[2]) / 2 * 160 / 168, (b[1] + b[3]) / 2 * 210 / 224
                other = env.instance.driver.execute_script(
                    "return document.elementFromPoint(arguments[0], arguments[1]).textContent;", cx, cy
                )
                assert named not in other
            checked += 1
        assert checked >= 1
    finally:
        env.close()


def test_to_trajectory_encodes_like_the_training_loop(tmp_path, one_thread):
    """A grounding example as a one-step Trajectory gives BC the same token sequence the loop trains on."""
    from arpo_core.offline.grounding import _encode, to_trajectory
    from arpo_core.policy.sequences import encode_trajectory

    policy = build_tiny_policy(tmp_path / "p", size="xs")
    ex = synthetic_example(random.Random(1), "widget4")
    traj = to_trajectory(ex)
    assert traj.task_domain == "synthetic" and traj.task_id == "widget4" and traj.steps[0].done
    a, b = (
        encode_trajectory(policy, traj, spec=PromptSpec("compact", None)),
        _encode(policy, ex, "compact"),
    )
    assert a.input_ids == b.input_ids and a.assistant_mask == b.assistant_mask
    assert torch.equal(a.pixel_values, b.pixel_values)


def test_tiny_policy_rope_options_are_saved_and_validated(tmp_path):
    """The additive build_tiny_policy(rope_theta=, mrope=) options land in the stock config and reload."""
    from arpo_core.policy.model import load_policy

    build_tiny_policy(tmp_path / "p", size="xs", rope_theta=5.0, mrope=[2, 7, 7])
    cfg = load_policy(tmp_path / "p").model.config.text_config
    assert cfg.rope_parameters["rope_theta"] == 5.0 and cfg.rope_parameters["mrope_section"] == [2, 7, 7]
    with pytest.raises(ValueError, match="head_dim / 2 = 16"):
        build_tiny_policy(tmp_path / "q", size="xs", mrope=[4, 4, 4])


# ------------------------------------------------------------------------------------ reading levels

READING = ("boxes8", "buttons8", "links8", "texts8", "checks8")
OPEN = {
    "openchecks8": "label",
    "openlinks8": "link",
    "opentexts8": "text",
    "lorem8": "link",
    "paralinks": "link",
}
"""The open-vocabulary levels (and MiniWoB's lorem-ipsum links, grounding.py, decision "Lorem names") ->
how their instruction names the target."""


@pytest.mark.parametrize("level", sorted(OPEN))
def test_open_levels_name_fresh_words_as_real_screens_name_their_targets(level):
    """grounding.py, decision "Open vocabulary": the named words are drawn fresh (not a fixed list to learn in
    place of reading), in the style of the real screens' labels, links and paragraph text, the instruction
    and thought worded as `miniwob_examples` words a real target, and no name for the naming loss's head
    (its words are listed for the spelling loss)."""
    from arpo_core.offline.grounding import LOREM, miniwob_lorem

    exs = synthetic_examples(200, {level: 1.0}, seed=5)
    noun = OPEN[level]
    names = []
    for e in exs:
        name = e.instruction.split('"')[1]
        assert (
            e.instruction == f'Click on the "{name}" {noun}.'
            and e.thought == f"I will click the {noun} {name}."
        )
        assert 1 <= len(e.lookalikes) <= (19 if level == "paralinks" else 7)
        assert len(e.named) == len(e.lookalikes) + 1
        assert (e.bbox, name) in e.named and not has_names(e)  # the spelling loss spells, the naming skips
        names.append(name)
    assert len(set(names)) > 100  # fresh on (nearly) every screen
    assert sum(n.lower() in WORDS for n in names) < 10  # not the fixed reading levels' words
    words = [w.strip(".,:").lower() for n in names for w in n.split()]
    if noun == "label":
        assert all(2 <= len(n) <= 7 and n.isalnum() and n.isascii() for n in names)
    else:
        assert all(w in (LOREM if level.startswith("open") else miniwob_lorem()) for w in words)
        assert max(len(n.split()) for n in names) == (3 if noun == "text" else 1)
    lorem = sum(has_names(e, "lorem") for e in exs)  # lorem names name the one-word lorem-ipsum words
    if noun == "label":  # none, but for a random label that happens to spell one ("et", "in")
        assert lorem < 10
    else:
        assert lorem == 200 if noun == "link" else lorem > 100


def test_open_words_are_distinct_on_a_screen():
    from arpo_core.offline.grounding import open_words

    rng = random.Random(0)
    for style in ("label", "lorem", "phrase"):
        for _ in range(200):
            ws = open_words(rng, 8, style)
            assert len(ws) == 8 and len({w.lower() for w in ws}) == 8


def _recorder(draw_call, seen: list, word: bool = False):
    def call(*args, **kw):
        seen.append(args[1] if word else tuple(args[0]))
        return draw_call(*args, **kw)

    return call


@pytest.mark.parametrize("level", READING)
def test_reading_levels_put_look_alikes_beside_the_named_target(level):
    """grounding.py, decision "Reading curriculum": 2-8 targets that differ only in what the instruction names;
    the named one's word is on the screen once (other widgets carry other words), its box is not always the
    top or left one, and screens with 1 target are absent."""
    from PIL import Image, ImageDraw

    from arpo_core.offline.grounding import _level_lookalikes

    kind = {"boxes8": "boxes", "buttons8": "button", "links8": "link", "texts8": "text", "checks8": "checks"}
    rng = random.Random(4)
    counts, tops = [], []
    for _ in range(60):
        img = Image.new("RGB", (160, 210), "white")
        draw = ImageDraw.Draw(img)
        seen: list = []
        # count the targets drawn (one rectangle per box; one text per widget's word)
        if kind[level] == "boxes":
            draw.rectangle = _recorder(draw.rectangle, seen)
        else:
            draw.text = _recorder(draw.text, seen, word=True)
        _, box, thought, listed = _level_lookalikes(rng, draw, kind[level])
        counts.append(len(seen))
        assert box in [b for b, _ in listed] and len(listed) == len(seen)  # what read_aloud reads
        if kind[level] != "boxes":
            assert sorted(w for _, w in listed) == sorted(seen)
        if kind[level] != "boxes":
            named = [w for w in seen if f" {w}" in thought]
            assert len(named) == 1 and len(set(seen)) == len(seen), (seen, thought)
        tops.append(box[1])
    assert min(counts) >= 2 and max(counts) <= 8 and len(set(counts)) >= 4
    assert len(set(tops)) > 10  # the named one sits anywhere, not always first in the column


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_read_aloud_names_every_look_alike_in_reading_order_on_the_same_screen(level):
    plain = synthetic_examples(12, {level: 1.0}, seed=3)
    aloud = synthetic_examples(12, {level: 1.0}, seed=3, aloud=True)
    for p, a in zip(plain, aloud, strict=True):
        assert a.image.tobytes() == p.image.tobytes() and (a.instruction, a.target) == (
            p.instruction,
            p.target,
        )
        read, rest = a.thought.split(". ", 1)
        assert read.startswith("I see ") and rest == p.thought
        names = read.removeprefix("I see ").split(", ")
        assert len(set(names)) == len(names) and any(f" {n}" in p.thought for n in names)
        assert first_click(a.reply) == first_click(p.reply)


def test_read_aloud_orders_top_to_bottom_then_left_to_right_and_fits_the_reply_budget():
    from transformers import AutoTokenizer

    seen = [((90, 100, 99, 110), "c"), ((70, 60, 80, 70), "b"), ((10, 60, 20, 70), "a")]
    assert read_aloud(seen, "I will click the box c.") == "I see a, b, c. I will click the box c."
    # the longest: eight long words and a 3-digit click, in the versioned policy's tokenizer
    words = sorted(WORDS, key=len)[-8:]
    thought = read_aloud(
        [((0, i, 1, i + 1), w) for i, w in enumerate(words)], f"I will click the checkbox {words[0]}."
    )
    tok = AutoTokenizer.from_pretrained(Path(__file__).parents[1] / "assets/checkpoints/grounded-xs")
    assert len(tok(click_reply(thought, (150.0, 210.0))).input_ids) < 64  # params' policy.max_new_tokens


@pytest.mark.parametrize("level", ["boxes8", "buttons8", "checks8", "widget4", "box1h"])
def test_a_reading_example_asks_to_read_the_click_examples_screen_in_reading_order(level):
    clicks = synthetic_examples(10, {level: 1.0}, seed=7)
    reads = synthetic_examples(10, {level: 1.0}, seed=7, read=True)
    for c, r in zip(clicks, reads, strict=True):
        below = (0, 50, 160, 210)  # the instruction strip differs: it shows the instruction
        assert r.image.crop(below).tobytes() == c.image.crop(below).tobytes()
        assert r.instruction.startswith("Read the ") and r.instruction.endswith(" from top to bottom.")
        (action,) = parse_response(r.reply).actions
        assert action.kind == "finished" and action.content == r.answer
        names = r.answer.split(", ")
        assert len(names) == len(c.lookalikes) + 1 and len(set(names)) == len(names)
        assert read_score(r.reply, r.answer) == 1.0
        tops = sorted([c.bbox, *c.lookalikes], key=lambda b: (b[1], b[0]))
        assert r.bbox == tops[0]  # the first item read is the top one


def test_read_score_counts_items_at_their_place():
    reply = "Thought: I read the buttons.\nAction: finished(content='{}')"
    assert read_score(reply.format("ok, next, back"), "ok, next, back") == 1.0
    assert read_score(reply.format("ok, back"), "ok, next, back") == pytest.approx(1 / 3)
    assert read_score(reply.format("ok, next, back, yes"), "ok, next, back") == 0.75
    assert read_score("Thought: x\nAction: click(start_box='(1,2)')", "ok") == 0.0
    assert read_score("no reply", "ok") == 0.0


def test_read_share_zero_keeps_the_stream_and_a_share_mixes_reading_into_training(
    tmp_path, one_thread, monkeypatch
):
    import arpo_core.offline.grounding as g

    policy = build_tiny_policy(tmp_path / "p", size="xs")
    base = dict(
        steps=2, batch_size=4, warmup_steps=1, mix={"boxes8": 1.0}, optimizer=OptimizerConfig(lr=1e-3)
    )
    seen: list = []
    real = g.synthetic_example
    monkeypatch.setattr(g, "synthetic_example", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    train_grounding(policy, GroundConfig(**base), system="compact", max_new_tokens=8)
    plain = [e.instruction for e in seen]
    seen.clear()
    train_grounding(policy, GroundConfig(**base, read_share=0.5), system="compact", max_new_tokens=8)
    assert plain == [e.instruction for e in synthetic_examples(8, {"boxes8": 1.0}, seed=0)]  # the old stream
    assert 0 < sum(e.answer is not None for e in seen) < len(seen)


def test_without_a_gate_the_hit_rate_is_the_click_sets_lowest_and_reading_sets_get_a_read_score(
    tmp_path, one_thread
):
    policy = build_tiny_policy(tmp_path / "p", size="xs")
    heldout = {
        "box1h": synthetic_examples(2, {"box1h": 1.0}, seed=1),
        "boxes8": synthetic_examples(2, {"boxes8": 1.0}, seed=2),
        "read-boxes8": synthetic_examples(2, {"boxes8": 1.0}, seed=2, read=True),
    }
    cfg = GroundConfig(steps=1, batch_size=2, warmup_steps=0, eval_every=1, mix={"box1h": 1.0})
    ev = train_grounding(policy, cfg, system="compact", max_new_tokens=8, heldout=heldout)["evals"][-1]
    assert 0.0 <= ev["read-boxes8/read_score"] <= 1.0 and "read-boxes8/hit_rate" not in ev
    assert ev["hit_rate"] == min(ev["box1h/hit_rate"], ev["boxes8/hit_rate"])


def test_column_layout_puts_the_named_checkbox_at_any_row():
    rng = random.Random(9)
    rows = {round(synthetic_example(rng, "checks8").target[1]) for _ in range(200)}
    assert max(rows) - min(rows) > 80  # model pixels: from near the strip to far down the column


def _heldout_policy(tmp_path):
    torch.manual_seed(0)
    return build_tiny_policy(tmp_path / "m", size="xs", seed=0, rope_theta=5.0, mrope=[2, 7, 7])


def test_named_held_out_sets_and_until_hit_end_a_phase_early_and_resume_finished(tmp_path, one_thread):
    """`until_hit` stops at the first evaluation whose gate sets reach it (the measures are scripted here:
    box1h reaches 0.5 at step 4, box4, measured but not in the gate, never does), every named set is
    measured, the start (step 0) too, and the checkpoint of an early stop resumes as finished; a start that
    already reaches it trains no step."""
    from arpo_core.offline import grounding as g

    policy = _heldout_policy(tmp_path)
    sets = {lv: synthetic_examples(3, {lv: 1.0}, seed=50 + i) for i, lv in enumerate(("box1h", "box4"))}
    cfg = tiny_config(steps=6, batch_size=2, warmup_steps=1, eval_every=2, until_hit=0.5)
    calls = []

    def fake_measure(policy, heldout, system, max_new_tokens, pattern, gate=None, read=False):
        calls.append(sorted(heldout))
        hits = {"box1h": 0.0 if len(calls) < 3 else 0.5, "box4": 0.0}
        out = {f"{k}/hit_rate": v for k, v in hits.items()}
        out["hit_rate"] = min(hits[k] for k in (gate or hits))
        return out

    import unittest.mock

    ckpt = tmp_path / "phase.pt"
    kw = {"system": "compact", "max_new_tokens": 8, "heldout": sets, "gate": ["box1h"]}
    kw |= {"checkpoint": ckpt, "checkpoint_every_s": 1e9}
    with unittest.mock.patch.object(g, "_measure", fake_measure):
        hist = train_grounding(policy, cfg, **kw)
    assert calls == [["box1h", "box4"]] * 3  # the start, steps 2 and 4
    assert hist["stopped_at"] == 4 and hist["steps"] == 4 and [e["step"] for e in hist["evals"]] == [0, 2, 4]
    assert "loss" not in hist["evals"][0] and "loss" in hist["evals"][1]
    assert hist["evals"][-1]["box1h/hit_rate"] == 0.5
    again = train_grounding(_heldout_policy(tmp_path / "b"), cfg, **kw)
    assert again["steps"] == 4 and again["stopped_at"] == 4  # finished: not one step more
    mastered = {"hit_rate": 1.0, "box1h/hit_rate": 1.0}
    with unittest.mock.patch.object(g, "_measure", lambda *a, **k: dict(mastered)):
        start = train_grounding(
            _heldout_policy(tmp_path / "c"), cfg, **{**kw, "checkpoint": tmp_path / "c.pt"}
        )
    assert start["steps"] == 0 and start["stopped_at"] == 0 and (tmp_path / "c.pt").exists()


def test_named_held_out_sets_measure_each_set(tmp_path, one_thread):
    from arpo_core.offline.grounding import _measure

    policy = _heldout_policy(tmp_path)
    sets = {lv: synthetic_examples(2, {lv: 1.0}, seed=60) for lv in ("box1h", "boxes8")}
    m = _measure(policy, sets, "compact", 8, 0.0, gate=["boxes8"])
    assert {"box1h/hit_rate", "boxes8/hit_rate", "box1h/corr_x", "boxes8/n"} <= set(m)
    assert m["hit_rate"] == m["boxes8/hit_rate"] and m["boxes8/n"] == 2


def test_until_hit_needs_measurements():
    cfg = GroundConfig(steps=2, batch_size=1, optimizer=OptimizerConfig(lr=1e-3), until_hit=0.5)
    with pytest.raises(ValueError, match="until_hit needs held-out examples and eval_every > 0"):
        train_grounding(None, cfg, system="compact", max_new_tokens=8)


# ------------------------------------------------------------------------------------- lorem names


def test_the_lorem_vocabulary_is_the_installed_miniwobs_list_after_the_fixed_names():
    """grounding.py, decision "Lorem names": `fixed` is `NAMES`; `lorem` keeps `NAMES` at their indices and
    adds MiniWoB's lorem-ipsum words (read from the installed package) and `LOREM`, each once."""
    from arpo_core.offline.grounding import LOREM, miniwob_lorem

    words = miniwob_lorem()
    assert len(words) > 150 and {"lorem", "ipsum", "amet", "pharetra", "vulputate"} <= set(words)
    assert all(w == w.lower().strip(".,:;") for w in words)
    lorem = name_vocab("lorem")
    assert name_vocab("fixed") == NAMES and lorem[: len(NAMES)] == NAMES and len(set(lorem)) == len(lorem)
    assert set(lorem[len(NAMES) :]) == set(words) | set(LOREM)
    with pytest.raises(ValueError, match="'greek' is not 'fixed' or 'lorem'"):
        name_vocab("greek")


def test_lorem_names_train_the_head_on_real_and_open_words(tmp_path, one_thread):
    """With `name_vocab: lorem` the naming loss names a real screen's lorem-ipsum words (the fixed list's
    screens) and the open links' (a class each: the head has `name_vocab("lorem")` outputs), and the
    held-out real set gets its `name_acc`, each screen once; `fixed` names neither, as before."""
    from arpo_core.offline import grounding as g
    from arpo_core.policy.model import load_policy

    build_tiny_policy(tmp_path / "p", size="xs")
    # real-screen stand-ins: open links' screens as `miniwob_examples` gives them (source, kind, `named`),
    # each screen twice (two targets of one screen share its image)
    screens = synthetic_examples(3, {"openlinks8": 1.0}, seed=8)
    real = [dataclasses.replace(e, source="miniwob/click-link", kind="link") for e in screens for _ in (0, 1)]
    heldout = {"real": real, "openlinks8": synthetic_examples(2, {"openlinks8": 1.0}, seed=9)}
    base = {"steps": 2, "batch_size": 4, "warmup_steps": 0, "eval_every": 2, "name_weight": 1.0}
    kw = {"system": "compact", "max_new_tokens": 8, "heldout": heldout, "examples": real}
    named = []
    logits = g._name_logits

    def recording(policy, head, examples, vocab="fixed"):
        out = logits(policy, head, examples, vocab)
        named.append((vocab, head.linear.out_features, [e.source for e in examples], out[1].tolist()))
        return out

    runs = {}
    for vocab in ("lorem", "fixed"):
        cfg = GroundConfig(**base, mix={"openlinks8": 1.0, "buttons8": 1.0}, name_vocab=vocab)
        named.clear()
        with unittest.mock.patch.object(g, "_name_logits", recording):
            runs[vocab] = train_grounding(
                load_policy(tmp_path / "p"),
                cfg,
                **kw,
                checkpoint=tmp_path / f"{vocab}.pt",
                checkpoint_every_s=1e9,
            )
        runs[vocab]["named"] = list(named)
    lorem, fixed = runs["lorem"], runs["fixed"]
    assert len(lorem["name_loss"]) == 2 and all(
        v == "lorem" and n == len(name_vocab("lorem")) for v, n, *_ in lorem["named"]
    )
    sources = {s for _, _, srcs, _ in lorem["named"] for s in srcs}
    assert "miniwob/click-link" in sources and "synthetic/openlinks8" in sources
    assert any(i >= len(NAMES) for *_, labels in lorem["named"] for i in labels)  # lorem classes are trained
    ev = lorem["evals"][-1]
    assert 0.0 <= ev["real/name_acc"] <= 1.0 and 0.0 <= ev["openlinks8/name_acc"] <= 1.0
    # fixed: only the fixed names of synthetic screens (buttons8), nothing real or open; no such measures
    assert all(n == len(NAMES) for _, n, *_ in fixed["named"])
    assert {s for _, _, srcs, _ in fixed["named"] for s in srcs} <= {"synthetic/buttons8"}
    assert "real/name_acc" not in fixed["evals"][-1] and "openlinks8/name_acc" not in fixed["evals"][-1]
    heads = {v: torch.load(tmp_path / f"{v}.pt", weights_only=False)["head"]["linear.weight"] for v in runs}
    assert heads["lorem"].shape[0] == len(name_vocab("lorem")) and heads["fixed"].shape[0] == len(NAMES)


def test_a_real_screen_is_named_once_for_the_held_out_name_accuracy(tmp_path, one_thread):
    from arpo_core.offline import grounding as g

    screens = synthetic_examples(2, {"openlinks8": 1.0}, seed=8)
    real = [dataclasses.replace(e, source="miniwob/click-link") for e in screens for _ in (0, 1, 2)]
    seen = []
    with unittest.mock.patch.object(
        g,
        "_name_logits",
        lambda p, h, exs, v: seen.extend(exs) or (torch.zeros(1, 2), torch.zeros(1, dtype=torch.long)),
    ):
        out = g._name_accuracy(None, None, {"real": real}, "lorem")
    assert (
        len(seen) == 2
        and {id(e.image) for e in seen} == {id(e.image) for e in screens}
        and "real/name_acc" in out
    )


# ------------------------------------------------------------------- spelling loss and quoted names


def test_the_spelling_loss_trains_its_head_on_quoted_replies_resumes_and_leaves_a_plain_policy(
    tmp_path, one_thread
):
    """grounding.py, decisions "Spelling loss" and "Quoted names": `spell_weight` adds the head's loss
    (history "spell_loss", about 36 characters' log 2 at first) and the held-out `<set>/spell_f1`; with
    `quote_names` every training reply whose instruction quotes the name quotes it too, the fixed list's
    included; a run stopped after its first step and resumed from its checkpoint ends where an unbroken
    run does, the head included; the saved policy gains no weight."""
    import unittest.mock

    from arpo_core.offline import grounding as g
    from arpo_core.policy.model import load_policy

    build_tiny_policy(tmp_path / "p", size="xs")
    heldout = {"openchecks8": synthetic_examples(2, {"openchecks8": 1.0}, seed=5)}
    fixed = synthetic_examples(4, {"opentexts8": 1.0}, seed=6)
    cfg = GroundConfig(
        steps=4,
        batch_size=4,
        warmup_steps=0,
        eval_every=4,
        mix={"openchecks8": 1.0, "texts8": 1.0, "boxes8": 1.0},
        optimizer=OptimizerConfig(lr=1e-2),
        spell_weight=0.2,
        quote_names=True,
    )
    thoughts = []
    encode = g._encode

    def recording(policy, ex, *a, **k):
        thoughts.append((ex.instruction, ex.thought))
        return encode(policy, ex, *a, **k)

    kw = {"system": "compact", "max_new_tokens": 8, "heldout": heldout, "examples": fixed}
    with unittest.mock.patch.object(g, "_encode", recording):
        policy = load_policy(tmp_path / "p")
        keys0 = set(policy.model.state_dict())
        whole = train_grounding(policy, cfg, **kw, checkpoint=tmp_path / "a.pt", checkpoint_every_s=1e9)
    quoted = [(i, t) for i, t in thoughts if i.count('"') >= 2]
    assert quoted and all(t.endswith(f'"{i.split(chr(34))[1]}".') for i, t in quoted)
    assert any(i.startswith("Click on the") and "text" in i for i, _ in quoted)  # the fixed list's too
    assert len(whole["spell_loss"]) == 4 and 15 < whole["spell_loss"][0] < 40
    assert 0.0 <= whole["evals"][-1]["openchecks8/spell_f1"] <= 1.0
    assert 0.0 <= whole["evals"][-1]["openchecks8/copy_rate"] <= 1.0
    assert set(policy.model.state_dict()) == keys0

    broken = load_policy(tmp_path / "p")
    ckpt = tmp_path / "b.pt"
    first = train_grounding(broken, cfg, **kw, checkpoint=ckpt, checkpoint_every_s=1e9, time_limit_s=0.0)
    assert first["steps"] == 1
    broken = load_policy(tmp_path / "p")
    rest = train_grounding(broken, cfg, **kw, checkpoint=ckpt, checkpoint_every_s=1e9)
    assert rest["spell_loss"] == whole["spell_loss"]
    done = torch.load(ckpt, weights_only=False)
    assert all(
        torch.equal(v, torch.load(tmp_path / "a.pt", weights_only=False)["speller"][k])
        for k, v in done["speller"].items()
    )
    want = policy.model.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in broken.model.state_dict().items())


def test_what_is_spelled_and_what_is_quoted():
    """Words that fit their window are spelled, by the letters (case folded) and digits they hold; colours
    and words wider than the window are not; a quoted instruction's name is quoted in the thought."""
    ex = synthetic_examples(1, {"openchecks8": 1.0}, seed=3)[0]
    words = spelled(ex, (168 / 160, 224 / 210))
    assert words and {n for _, n in words} <= {n for _, n in ex.named}
    t = spell_targets([n for _, n in words])
    assert t.shape == (len(words), 36) and all(
        t[i].sum() == len(set(n.lower())) for i, (_, n) in enumerate(words)
    )
    boxes = synthetic_examples(1, {"boxes8": 1.0}, seed=3)[0]
    assert spelled(boxes, (1.05, 1.07)) == [] and has_names(boxes)
    name = ex.instruction.split('"')[1]
    assert quote_name(ex).thought == f'I will click the label "{name}".' and quote_name(
        quote_name(ex)
    ) == quote_name(ex)
    link = synthetic_examples(1, {"links8": 1.0}, seed=3)[0]  # its instruction quotes nothing
    assert quote_name(link) == link


# ------------------------------------------------------------------------------------- naming loss


@pytest.mark.parametrize("level", sorted(set(LEVELS) - set(OPEN)))
def test_a_synthetic_screen_names_every_look_alike_with_its_label(level):
    """grounding.py, decision "Naming loss": `named` is the target and every look-alike, each box with its
    colour ("red box") or word; the target's box is the click's box."""
    ex = synthetic_example(random.Random(4), level)
    boxes = [b for b, _ in ex.named]
    assert ex.bbox in boxes and set(boxes) - {ex.bbox} == set(ex.lookalikes)
    labels = [n for _, n in ex.named]
    assert all(n in NAMES for n in labels) and len(set(labels)) == len(labels)
    colours = level.startswith(("big", "box"))
    assert all(n.endswith(" box") == colours for n in labels)


def test_the_name_window_is_the_token_block_nearest_to_centring_the_box():
    # a word centred at screen (80, 105) = model (84, 112) = token (3.0, 4.0) in the 168x224 frame (tokens
    # of 28 px): the 2 x 3 window of whole tokens nearest to centring it, rows 3-4, columns 1-3
    sx, sy = 168 / 160, 224 / 210
    assert name_window((70 * sx, 100 * sy, 90 * sx, 110 * sy), (sx, sy), 28) == (3, 1, 2, 3)
    assert name_window((0, 0, 4, 4), (sx, sy), 28) == (-1, -2, 2, 3)  # at a corner: one row, one column on it


def test_window_tokens_are_the_merged_tokens_around_each_box_zeros_off_the_image(tmp_path, one_thread):
    from arpo_core.policy.model import image_inputs

    policy = build_tiny_policy(tmp_path / "p", size="xs")
    exs = synthetic_examples(2, {"texts8": 1.0}, seed=3)
    inner, corner = (60.0, 90.0, 100.0, 130.0), (0.0, 0.0, 6.0, 6.0)
    with torch.no_grad():
        got = window_tokens(policy, [e.image for e in exs], [[inner, corner], [inner]])
        pixels, grid = image_inputs(policy.processor.image_processor, [exs[1].image])
        tok = policy.model.model.visual(pixels, grid_thw=grid)
    tok = getattr(tok, "pooler_output", tok).reshape(8, 6, -1)  # 224 x 168 model px: 8 rows, 6 columns
    hidden = tok.shape[-1]
    assert got.shape == (3, 6 * hidden)
    r0, c0, nh, nw = name_window(inner, (168 / 160, 224 / 210), 28)
    assert torch.allclose(got[2], tok[r0 : r0 + nh, c0 : c0 + nw].reshape(-1), atol=1e-5)
    corner_win = got[1].reshape(nh, nw, hidden)
    assert corner_win[0].abs().sum() == 0 and corner_win[:, 0].abs().sum() == 0  # above and left: zeros
    assert corner_win[1, 1].abs().sum() > 0
    with torch.no_grad():
        same, inside = window_tokens(policy, [e.image for e in exs], [[inner, corner], [inner]], inside=True)
    assert torch.equal(same, got) and inside.shape == (3, 6) and inside.dtype == torch.bool
    # `inner` (x 60-100, y 90-130 model px) holds the centres (70 or 98, 98 or 126) of tokens in rows 3-4,
    # columns 2-3
    cells = [(r0 + i // nw, c0 + i % nw) for i in range(nh * nw)]
    assert [cells[i] for i in range(6) if inside[2, i]] == [(3, 2), (3, 3), (4, 2), (4, 3)]
    assert torch.equal(inside[0], inside[2])
    assert inside[1].sum() == 1  # the corner's box holds no centre: the token under its own centre


def test_the_token_naming_head_names_a_look_alike_from_its_best_token_in_its_box():
    """grounding.py, decision "Naming loss": `name_token`'s head maps each window token alone; a look-alike's
    logit for a name is its best in-box token's, so a word carried by a token outside the box is not read,
    and one carried by any single in-box token is."""
    from arpo_core.offline.grounding import TokenNameHead

    torch.manual_seed(0)
    head = TokenNameHead(8, 3)
    with torch.no_grad():
        head.linear.weight.copy_(torch.eye(3, 8) * 5.0)
        head.linear.bias.zero_()
    windows = torch.zeros(2, 4, 8)
    windows[:, :, 7] = 1.0  # every token something besides its word, so the layer norm is defined
    windows[0, 1, 2] = windows[1, 3, 2] = 3.0  # name 2, in token 1 of the first window, token 3 of the second
    windows[0, 2, 0] = 3.0  # name 0, in token 2 of the first window
    inside = torch.tensor([[False, True, False, False], [False, True, True, False]])
    logits = head(windows.reshape(2, -1), inside)
    assert logits.shape == (2, 3) and torch.isfinite(logits).all()
    one = head.linear(torch.nn.functional.layer_norm(windows[0, 1], (8,)))
    assert torch.allclose(logits[0], one) and logits[0].argmax() == 2  # token 2's name 0: outside the box
    assert torch.allclose(logits[1], logits[1, :1].expand(3))  # its word outside its box: no name stands out
    both = inside.clone()
    both[1, 3] = True
    assert head(windows.reshape(2, -1), both)[1].argmax() == 2  # any one in-box token that carries it


def test_the_naming_loss_trains_a_head_that_the_curves_score_and_the_tower_takes_its_own_lr(
    tmp_path, one_thread
):
    """`name_weight` adds the head's loss (history "name_loss", evaluations `<set>/name_acc`) and leaves
    the saved policy a plain Qwen2.5-VL; `vision_lr_scale` scales the tower's learning rate alone (here
    to ~0: the tower stays, the language model moves)."""
    policy = build_tiny_policy(tmp_path / "p", size="xs")
    tower0 = {k: v.clone() for k, v in policy.model.model.visual.state_dict().items()}
    lm0 = {k: v.clone() for k, v in policy.model.model.language_model.state_dict().items()}
    keys0 = set(policy.model.state_dict())
    heldout = {"texts8": synthetic_examples(2, {"texts8": 1.0}, seed=5)}
    cfg = GroundConfig(
        steps=3,
        batch_size=4,
        warmup_steps=0,
        eval_every=3,
        mix={"texts8": 1.0, "boxes8": 1.0},
        optimizer=OptimizerConfig(lr=1e-2),
        name_weight=1.0,
        vision_lr_scale=1e-12,
    )
    hist = train_grounding(policy, cfg, system="compact", max_new_tokens=8, heldout=heldout)
    assert len(hist["name_loss"]) == 3 and 3.5 < hist["name_loss"][0] < 4.6  # ln 56 = 4.03: chance at first
    assert 0.0 <= hist["evals"][-1]["texts8/name_acc"] <= 1.0
    tower = policy.model.model.visual.state_dict()
    assert all(torch.allclose(tower[k], v, atol=1e-8) for k, v in tower0.items())
    lm = policy.model.model.language_model.state_dict()
    assert any(not torch.equal(lm[k], v) for k, v in lm0.items())
    assert set(policy.model.state_dict()) == keys0  # no weight added: still a plain Qwen2.5-VL
    cfg_plain = GroundConfig(**{**cfg.__dict__, "name_weight": 0.0, "vision_lr_scale": 1.0})
    assert "name_loss" not in train_grounding(policy, cfg_plain, system="compact", max_new_tokens=8)


@pytest.mark.parametrize("kind", ["linear", "tied", "token"], ids=["linear-head", "tied-head", "token-head"])
def test_a_naming_only_phase_trains_the_tower_alone_on_synthetic_screens(tmp_path, one_thread, kind):
    """With a linear, a tied (`name_tied`) or a one-token head (`name_token`) the language model stays
    bit-identical, its embeddings included: the tied head's names are the embeddings, detached."""
    policy = build_tiny_policy(tmp_path / "p", size="xs")
    tower0 = {k: v.clone() for k, v in policy.model.model.visual.state_dict().items()}
    lm0 = {k: v.clone() for k, v in policy.model.model.language_model.state_dict().items()}
    fixed = synthetic_examples(4, {"box1h": 1.0}, seed=9)
    fixed = [dataclasses.replace(e, named=()) for e in fixed]  # like real screens: nothing to name
    cfg = GroundConfig(
        steps=2,
        batch_size=4,
        warmup_steps=0,
        mix={"texts8": 1.0},
        optimizer=OptimizerConfig(lr=1e-3),
        name_weight=1.0,
        name_only=True,
        name_tied=kind == "tied",
        name_token=kind == "token",
    )
    hist = train_grounding(policy, cfg, system="compact", max_new_tokens=8, examples=fixed)
    assert hist["loss"] == hist["name_loss"] and len(hist["loss"]) == 2  # every example synthetic, named
    lm = policy.model.model.language_model.state_dict()
    assert all(torch.equal(lm[k], v) for k, v in lm0.items())  # the language model untouched
    tower = policy.model.model.visual.state_dict()
    assert any(not torch.equal(tower[k], v) for k, v in tower0.items())
    with pytest.raises(ValueError, match="name_only needs name_weight > 0"):
        train_grounding(policy, dataclasses.replace(cfg, name_weight=0.0), system="compact", max_new_tokens=8)
    if kind != "linear":
        with pytest.raises(ValueError, match=f"name_{kind} needs name_weight > 0"):  # the config refuses it
            train_grounding(
                policy,
                dataclasses.replace(cfg, name_weight=0.0, name_only=False),
                system="compact",
                max_new_tokens=8,
            )


def test_carried_heads_start_where_the_previous_phase_ended_and_a_misfit_is_an_error(tmp_path, one_thread):
    """grounding.py, decision "Carried heads": with `carry_heads` a phase's naming head starts as the previous
    phase's checkpoint left it (the same weights at its first measurement), without it a fresh one; a resumed
    phase keeps its own; a file without the head, a head of another vocabulary, or a missing file is an
    error naming the head and the file."""
    from arpo_core.offline import grounding as g

    heldout = {"texts8": synthetic_examples(2, {"texts8": 1.0}, seed=7)}
    cfg = GroundConfig(
        steps=2,
        batch_size=2,
        warmup_steps=0,
        eval_every=2,
        mix={"texts8": 1.0},
        optimizer=OptimizerConfig(lr=1e-2),
        name_weight=1.0,
        name_only=True,
    )
    carry = dataclasses.replace(cfg, carry_heads=True, seed=1)
    seen: list[dict[str, torch.Tensor]] = []
    measure = g._name_accuracy

    def spy(policy, head, *a, **k):
        seen.append({n: v.clone() for n, v in head.state_dict().items()})
        return measure(policy, head, *a, **k)

    kw = {"system": "compact", "max_new_tokens": 8, "heldout": heldout, "checkpoint_every_s": 1e9}
    policy = build_tiny_policy(tmp_path / "p", size="xs")
    with unittest.mock.patch.object(g, "_name_accuracy", spy):
        train_grounding(policy, cfg, **kw, checkpoint=tmp_path / "a.pt")
        ended = seen[-1]
        train_grounding(policy, carry, **kw, checkpoint=tmp_path / "b.pt", heads_from=tmp_path / "a.pt")
        assert all(torch.equal(v, ended[n]) for n, v in seen[2].items())  # phase b's step 0: a's end
        assert any(not torch.equal(v, ended[n]) for n, v in seen[3].items())  # and it trained on
        fresh = dataclasses.replace(cfg, seed=1)
        train_grounding(policy, fresh, **kw, checkpoint=tmp_path / "c.pt")
        assert any(not torch.equal(v, ended[n]) for n, v in seen[4].items())
    head_b = torch.load(tmp_path / "b.pt", weights_only=False)["head"]
    torch.save({"head": None}, tmp_path / "none.pt")
    with unittest.mock.patch.object(g, "_carry_heads", side_effect=AssertionError("resumed: not carried")):
        again = train_grounding(
            policy, carry, **kw, checkpoint=tmp_path / "b.pt", heads_from=tmp_path / "none.pt"
        )
    assert (
        again["steps"] == 2
        and torch.load(tmp_path / "b.pt", weights_only=False)["head"].keys() == head_b.keys()
    )
    with pytest.raises(ValueError, match=r"none\.pt holds no naming head \(its phase trained none\)"):
        train_grounding(policy, carry, **kw, checkpoint=tmp_path / "d.pt", heads_from=tmp_path / "none.pt")
    lorem = dataclasses.replace(carry, name_vocab="lorem")
    with pytest.raises(
        ValueError, match=r"the naming head in .*a\.pt does not fit this phase's: .*size mismatch"
    ):
        train_grounding(policy, lorem, **kw, checkpoint=tmp_path / "e.pt", heads_from=tmp_path / "a.pt")
    with pytest.raises(ValueError, match="no checkpoint of the previous phase at"):
        train_grounding(policy, carry, **kw, checkpoint=tmp_path / "f.pt", heads_from=tmp_path / "gone.pt")
    with pytest.raises(ValueError, match=r"carry_heads and heads_from .* go together"):
        train_grounding(policy, carry, **kw, checkpoint=tmp_path / "g.pt")
    assert not any((tmp_path / f"{x}.pt").exists() for x in "defg")  # refused before any work


def test_the_tied_naming_head_names_an_image_token_by_the_language_models_own_word_embedding(
    tmp_path, one_thread
):
    """grounding.py, decision "Naming loss": `name_tied` scores each window token by its cosine with the
    model's input embedding of the name (both written forms), so a token equal to the embedding of "submit"
    is named "submit"; its one parameter is the scale (a tied naming-only phase: the test above)."""
    from arpo_core.offline.grounding import TiedNameHead, _name_token_ids, checkpoint_fingerprint

    policy = build_tiny_policy(tmp_path / "p", size="xs")
    tok = policy.processor.tokenizer
    ids = _name_token_ids(policy)
    assert len(ids) == len(NAMES)
    submit = ids[NAMES.index("submit")]
    forms = {
        tuple(tok.encode("submit", add_special_tokens=False)),
        tuple(tok.encode(" submit", add_special_tokens=False)),
    }
    assert set(submit) == {i for f in forms for i in f}
    hidden = policy.model.config.text_config.hidden_size
    head = TiedNameHead(6, hidden, ids)
    assert [n for n, _ in head.named_parameters()] == ["log_scale"] and list(head.state_dict()) == [
        "log_scale"
    ]
    emb = policy.model.get_input_embeddings().weight
    windows = torch.randn(2, 6, hidden) * 0.01
    windows[0, 4] = emb[submit].mean(0) * 7.0  # scale-free: the cosine
    windows[1, 0] = emb[ids[NAMES.index("red box")]].mean(0)
    logits = head(windows.reshape(2, -1), emb)
    assert logits.shape == (2, len(NAMES))
    assert logits.argmax(-1).tolist() == [NAMES.index("submit"), NAMES.index("red box")]
    assert torch.allclose(logits.max(-1).values, torch.full((2,), 10.0), atol=1e-3)  # cos 1 x initial scale

    cfg = GroundConfig(steps=2, name_weight=1.0, name_tied=True)
    assert checkpoint_fingerprint(cfg, "compact", None) != checkpoint_fingerprint(
        dataclasses.replace(cfg, name_tied=False), "compact", None
    )


# ------------------------------------------------------------------------------------------- pointing


def _small(**fields) -> GroundConfig:
    """A few steps of batch 4 at lr 1e-2, no warm-up: the pointing tests' training runs."""
    return GroundConfig(batch_size=4, warmup_steps=0, optimizer=OptimizerConfig(lr=1e-2), **fields)


def _control(tmp_path, cfg: GroundConfig, heldout, **off):
    """A fresh xs policy trained on `cfg` with the fields `off` (a loss switched off): the control arm."""
    control = build_tiny_policy(tmp_path / "c", size="xs", rope_theta=5.0)
    cfg = dataclasses.replace(cfg, **off)
    return control, train_grounding(control, cfg, system="compact", max_new_tokens=8, heldout=heldout)


def _pointing_examples(policy, levels=("buttons8", "boxes8", "box1h")):
    from arpo_core.offline.grounding import _encode

    rng = random.Random(4)
    exs = [synthetic_example(rng, lv) for lv in levels]
    return exs, [_encode(policy, e, "compact") for e in exs]


def test_point_spans_are_the_positions_that_predict_the_coordinates_and_the_cells_under_the_target(tmp_path):
    policy = build_tiny_policy(tmp_path / "p", size="xs")
    exs, encoded = _pointing_examples(policy)
    for ex, enc in zip(exs, encoded, strict=True):
        queries, targets = point_spans(policy, enc, ex)
        (action,) = parse_response(ex.reply).actions
        predicted = "".join(policy.tokenizer.decode([enc.input_ids[q + 1]]) for q in queries)
        assert predicted == f"{action.point[0]:.0f},{action.point[1]:.0f}"  # the digits and the comma
        assert queries == list(range(queries[0], queries[0] + len(queries)))  # in a row, in the reply
        assert all(enc.assistant_mask[q + 1] for q in queries)
        image = [i for i, t in enumerate(enc.input_ids) if t == policy.image_token_id]
        assert image == list(range(image[0], image[0] + 48)) and set(targets) <= set(image)  # 6 x 8 cells
        cells = {i - image[0] for i in targets}
        x0, y0, x1, y1 = ex.bbox
        assert int((y0 + y1) / 2 // 28) * 6 + int((x0 + x1) / 2 // 28) in cells  # the centre's cell
        for c in cells:  # every cell touches the box
            r, col = divmod(c, 6)
            assert col * 28 < x1 and (col + 1) * 28 > x0 and r * 28 < y1 and (r + 1) * 28 > y0
    read = synthetic_example(random.Random(1), "buttons8", read=True)
    from arpo_core.offline.grounding import _encode

    assert point_spans(policy, _encode(policy, read, "compact"), read) == ([], [])
    assert point_spans(policy, _encode(policy, read, "compact"), read, first=True) == ([], [])


def test_the_first_digit_spans_are_the_two_positions_before_x_and_y(tmp_path):
    """grounding.py, decision "First digits": `first` keeps, of the coordinate positions, the one whose
    next token is x's first character and the one whose next token is y's first, with the same targets."""
    policy = build_tiny_policy(tmp_path / "p", size="xs")
    exs, encoded = _pointing_examples(policy)
    for ex, enc in zip(exs, encoded, strict=True):
        queries, targets = point_spans(policy, enc, ex)
        firsts, same = point_spans(policy, enc, ex, first=True)
        (action,) = parse_response(ex.reply).actions
        x, y = f"{action.point[0]:.0f}", f"{action.point[1]:.0f}"
        assert same == targets and firsts == [queries[0], queries[len(x) + 1]], (x, y, queries, firsts)
        following = [policy.tokenizer.decode([enc.input_ids[q + 1]]) for q in firsts]
        assert following == [x[0], y[0]]


def test_attention_clicks_read_the_click_off_the_attended_cells(tmp_path, monkeypatch):
    """policy/heads.py, decision "Clicks read from the pointing head": the heads' weights are taken at the
    position before x's first character (and y's with "xy"), of the reply as given; the click is the
    attended cell's centre in model pixels (`cell`) or the mass-weighted centre of the block around it
    (`block`); a reply without a click has none."""
    from arpo_core.offline import grounding as g
    from arpo_core.policy.heads import HeadWeights

    policy = build_tiny_policy(tmp_path / "p", size="xs")
    exs, _ = _pointing_examples(policy)
    replies = [exs[0].reply, exs[1].reply, "Thought: I wait.\nAction: wait()"]
    spec = g.PromptSpec("compact", None)
    encoded = [
        g.encode_segments(policy, g.build_segments(e.instruction, 1, [t], spec=spec), [e.image])
        for e, t in zip(exs, replies, strict=True)
    ]
    asked = []

    def log_weights(self, queries):  # 3/4 of the mass on cell (row 2, column 3), 1/4 on (2, 4)
        asked.append([list(q) for q in queries])
        out = []
        for enc, q in zip(encoded, queries, strict=True):
            cells, _, cols = g.image_cells(policy, enc)
            w = torch.full((len(q), self.inputs[0].shape[1]), 1e-12)
            w[:, cells[2 * cols + 3]], w[:, cells[2 * cols + 4]] = 0.75, 0.25
            out.append(w.log())
        return out

    monkeypatch.setattr(HeadWeights, "log_weights", log_weights)
    cell = g.attention_clicks(policy, exs, replies, system="compact", readout="cell")
    block = g.attention_clicks(policy, exs, replies, system="compact", readout="block", positions="xy")
    assert cell[:2] == [pytest.approx((3.5 * 28, 2.5 * 28))] * 2 and cell[2] is None
    assert (
        block[:2] == [pytest.approx((0.75 * 3.5 * 28 + 0.25 * 4.5 * 28, 2.5 * 28))] * 2 and block[2] is None
    )
    firsts = [g.click_positions(policy, enc, first=True) for enc in encoded[:2]]
    assert asked[0] == [firsts[0][:1], firsts[1][:1], []] and asked[1] == [*firsts, []]
    following = [policy.tokenizer.decode([encoded[0].input_ids[q + 1]]) for q in firsts[0]]
    (action,) = parse_response(replies[0]).actions
    assert following == [f"{action.point[0]:.0f}"[0], f"{action.point[1]:.0f}"[0]]  # x's and y's first
    with pytest.raises(ValueError, match="positions must be 'x' or 'xy'"):
        g.attention_clicks(policy, exs, replies, system="compact", positions="y")
    with pytest.raises(
        ValueError, match="unknown click readout 'argmax'; choose one of cell, block, guarded"
    ):
        g.attention_clicks(policy, exs, replies, system="compact", readout="argmax")


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_the_pointing_heads_are_the_layers_own_attention(tmp_path, one_thread, family):
    """The weights the pointing loss trains are the last layer's heads' attention weights as the model's
    own eager attention computes them (Qwen3-VL with its q/k norms; grouped key heads), under the
    default kernel; the head count is checked against the model's."""
    from arpo_core.offline.grounding import _PointCapture
    from arpo_core.policy.sequences import collate, sequence_logprobs

    policy = build_tiny_policy(tmp_path / "p", size="xs", rope_theta=5.0, family=family)
    heads = policy.model.config.text_config.num_attention_heads
    exs, encoded = _pointing_examples(policy)
    spans = [point_spans(policy, enc, ex) for enc, ex in zip(encoded, exs, strict=True)]
    batch = collate(encoded, policy.pad_id, policy.image_token_id)
    mine = {}
    for n in (1, heads):
        with torch.no_grad(), _PointCapture(policy, n) as capture:
            sequence_logprobs(policy.model, batch)
            mine[n] = [w.exp() for w in capture.log_weights([q for q, _ in spans])]
    policy.model.set_attn_implementation("eager")
    seen = {}
    layer = policy.model.model.language_model.layers[-1].self_attn
    hook = layer.register_forward_hook(lambda m, a, out: seen.update(w=out[1]))  # returns None: output kept
    with torch.no_grad():
        sequence_logprobs(policy.model, batch)
    hook.remove()
    for n, got in mine.items():
        for b, (queries, _) in enumerate(spans):
            want = seen["w"][b, :n, queries].float().reshape(n * len(queries), -1)
            torch.testing.assert_close(got[b], want, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match=rf"point_heads must be in \[1, {heads}\] for this model, got 9"):
        _PointCapture(policy, 9)


def test_the_pointing_loss_moves_the_heads_attention_onto_the_target(tmp_path, one_thread):
    """`point_weight`: history "point_loss", evaluations `<set>/point_mass` (on the target) and
    `<set>/point_other` (on the other look-alikes), and `<set>/cell_hit` (the clicks read off the head);
    trained, the head's mass on the target rises many times, far above what the same clicks alone leave it
    at; the policy stays a plain Qwen2.5-VL."""
    policy = build_tiny_policy(tmp_path / "p", size="xs", rope_theta=5.0)
    keys0 = set(policy.model.state_dict())
    heldout = {
        "box1h": synthetic_examples(8, {"box1h": 1.0}, seed=5),
        "boxes8": synthetic_examples(4, {"boxes8": 1.0}, seed=6),
        "real": [dataclasses.replace(e, named=()) for e in synthetic_examples(2, {"box4": 1.0}, seed=7)],
    }
    cfg = _small(steps=30, eval_every=30, mix={"box1h": 1.0}, point_weight=1.0)
    hist = train_grounding(policy, cfg, system="compact", max_new_tokens=8, heldout=heldout)
    start, end = hist["evals"][0], hist["evals"][-1]
    assert len(hist["point_loss"]) == 30 and hist["point_loss"][-1] < hist["point_loss"][0]
    assert end["box1h/point_mass"] > max(0.3, 5 * start["box1h/point_mass"]), (start, end)
    assert end["box1h/point_other"] == 0.0 and 0.0 <= end["boxes8/point_other"] <= 1.0  # box1h has no other
    assert end["box1h/point_even"] == 1.0 and 0.1 < end["boxes8/point_even"] < 1.0  # all on the target's
    assert (
        0.0 <= end["box1h/point_first"] <= 1.0 and end["box1h/point_first"] > 3 * start["box1h/point_first"]
    )
    assert 0.0 <= end["real/point_mass"] <= 1.0 and "real/point_other" not in end  # no look-alikes listed
    assert all(0.0 <= end[f"{n}/cell_hit"] <= 1.0 for n in heldout)
    assert set(policy.model.state_dict()) == keys0
    from arpo_core.offline.grounding import _attention_measures

    control, plain = _control(tmp_path, cfg, heldout, point_weight=0.0)  # the same clicks, no pointing
    assert "point_loss" not in plain and "box1h/point_mass" not in plain["evals"][-1]
    assert "box1h/cell_hit" not in plain["evals"][-1]
    clicks_alone = _attention_measures(control, heldout, "compact", 0.0, 1)["box1h/point_mass"]
    assert end["box1h/point_mass"] > clicks_alone + 0.3, (clicks_alone, end)


def test_point_first_teaches_the_pointing_loss_at_the_first_digits(tmp_path, one_thread):
    """`point_first` (grounding.py, decision "First digits"): the loss reaches the update (other weights
    than the same steps on every coordinate position), and trained on it alone the held-out mass at the
    first digits' positions rises many times."""
    heldout = {"box1h": synthetic_examples(8, {"box1h": 1.0}, seed=5)}
    trained = {}
    for first in (False, True):
        policy = build_tiny_policy(tmp_path / f"p{first}", size="xs", rope_theta=5.0, seed=0)
        cfg = _small(steps=30, eval_every=30, mix={"box1h": 1.0}, point_weight=1.0, point_first=first)
        hist = train_grounding(policy, cfg, system="compact", max_new_tokens=8, heldout=heldout)
        trained[first] = policy.model.model.language_model.layers[-1].self_attn.q_proj.weight.detach().clone()
        start, end = hist["evals"][0], hist["evals"][-1]
        assert len(hist["point_loss"]) == 30
        assert end["box1h/point_first"] > max(0.3, 3 * start["box1h/point_first"]), (first, start, end)
    assert not torch.equal(trained[False], trained[True])
    with pytest.raises(ValueError, match="point_first needs point_weight > 0"):
        _small(point_first=True)


@pytest.mark.parametrize("name_weight", [0.0, 1.0], ids=["clicks", "clicks-and-naming"])
def test_the_pointing_loss_reaches_the_update_beside_every_other_loss(tmp_path, one_thread, name_weight):
    """Its weight changes the trained weights, with the naming loss on as well as off (a bug once let the
    naming loss's sum drop it); the click loss in the history is the same measure either way."""
    trained = {}
    for w in (0.0, 0.1, 1.0):
        policy = build_tiny_policy(tmp_path / f"p{w}", size="xs", rope_theta=5.0, seed=0)
        cfg = _small(steps=3, mix={"boxes8": 1.0}, name_weight=name_weight, point_weight=w)
        hist = train_grounding(policy, cfg, system="compact", max_new_tokens=8)
        trained[w] = policy.model.model.language_model.layers[-1].self_attn.q_proj.weight.detach().clone()
        assert ("point_loss" in hist) == (w > 0) and ("name_loss" in hist) == (name_weight > 0)
    assert not torch.equal(trained[0.0], trained[0.1]) and not torch.equal(trained[0.1], trained[1.0])


# ---------------------------------------------------------------------------------------------- place


def test_place_targets_are_the_screens_tokens_in_raster_order_at_their_cells_centres(tmp_path):
    from arpo_core.offline.grounding import _encode, place_targets

    policy = build_tiny_policy(tmp_path / "p", size="xs")
    _, encoded = _pointing_examples(policy)
    for enc in encoded:
        positions, places = place_targets(policy, enc)
        image = [i for i, t in enumerate(enc.input_ids) if t == policy.image_token_id]
        assert positions == image and places.shape == (48, 2)  # 8 rows x 6 columns of 28-px cells
        assert places[0].tolist() == pytest.approx([-7 / 8, -5 / 6]) and places[5, 1] == pytest.approx(5 / 6)
        assert places[6].tolist() == pytest.approx([-5 / 8, -5 / 6])  # row 1, column 0: rows of cells
        assert places[-1].tolist() == pytest.approx([7 / 8, 5 / 6])
    positions, places = place_targets(policy, dataclasses.replace(encoded[0], image_grid_thw=None))
    assert positions == [] and places.shape == (0, 2)  # a sequence without a screen
    read = synthetic_example(random.Random(1), "buttons8", read=True)  # a reading example has its screen
    assert len(place_targets(policy, _encode(policy, read, "compact"))[0]) == 48


def test_the_place_loss_writes_each_tokens_column_into_what_the_last_layer_reads(tmp_path, one_thread):
    """`place_weight`: history "place_loss", evaluations `<set>/place_row` and `<set>/place_col` (the
    phase's probe's held-out R^2); trained, an independent ridge probe (benchmarks/place_probe.py), fit on
    held-out screens, reads the column from the tokens' states, where the same clicks alone leave it
    unreadable; the phase's probe is not part of the policy."""
    heldout = {"box1h": synthetic_examples(8, {"box1h": 1.0}, seed=5)}
    probe_set = synthetic_examples(24, {"box1h": 1.0, "boxes8": 1.0}, seed=8)
    cfg = _small(steps=30, eval_every=30, mix={"box1h": 1.0}, place_weight=1.0)
    trained = build_tiny_policy(tmp_path / "p", size="xs", rope_theta=5.0)
    keys0 = set(trained.model.state_dict())
    hist = train_grounding(trained, cfg, system="compact", max_new_tokens=8, heldout=heldout)
    start, end = hist["evals"][0], hist["evals"][-1]
    assert len(hist["place_loss"]) == 30 and hist["place_loss"][-1] < hist["place_loss"][0] / 2
    assert start["box1h/place_col"] < 0.2 and end["box1h/place_col"] > 0.4, (start, end)
    assert end["box1h/place_row"] > 0.4 and set(trained.model.state_dict()) == keys0
    control, plain = _control(tmp_path, cfg, heldout, place_weight=0.0)  # the same clicks, no place loss
    assert "place_loss" not in plain and "box1h/place_col" not in plain["evals"][-1]
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from place_probe import probe

    # the column's R^2 where the last layer reads the tokens (its input: depth -2, before the final norm)
    mine, clicks_alone = (probe(p, probe_set, "compact")[-2]["col"] for p in (trained, control))
    assert mine > 0.5 and clicks_alone < 0.2, (mine, clicks_alone)  # measured 0.77-0.88; below 0


def test_the_place_loss_reaches_the_update_beside_the_pointing_loss(tmp_path, one_thread):
    trained = {}
    for w in (0.0, 1.0):
        policy = build_tiny_policy(tmp_path / f"p{w}", size="xs", rope_theta=5.0, seed=0)
        cfg = _small(steps=3, mix={"boxes8": 1.0}, point_weight=0.5, place_weight=w)
        hist = train_grounding(policy, cfg, system="compact", max_new_tokens=8)
        trained[w] = policy.model.model.language_model.layers[0].mlp.down_proj.weight.detach().clone()
        assert ("place_loss" in hist) == (w > 0) and len(hist["point_loss"]) == 3
    assert not torch.equal(trained[0.0], trained[1.0])


def test_the_match_loss_names_the_word_at_the_query_and_at_the_look_alikes_with_one_head(
    tmp_path, one_thread
):
    """grounding.py, decision "Match loss": `match_weight` trains one head (the phase's own, not part of the
    policy) to name, from the last layer's attention inputs, the target's word at the two first-digit query
    positions and each named look-alike's word from its tokens; history "match_loss" falls, the evaluations
    add `<set>/match_query`, `match_key`, `match_pick`; and the match items hold what the loss reads."""
    from arpo_core.offline import grounding as g

    heldout = {"boxes8": synthetic_examples(16, {"boxes8": 1.0}, seed=5)}
    cfg = _small(steps=40, eval_every=40, mix={"boxes8": 1.0}, match_weight=1.0)
    policy = build_tiny_policy(tmp_path / "p", size="xs", rope_theta=5.0)
    keys0 = set(policy.model.state_dict())
    exs = heldout["boxes8"][:3]
    encoded = [g._encode(policy, e, "compact") for e in exs]
    batch = g.collate(encoded, policy.pad_id, policy.image_token_id)
    with torch.no_grad(), g._PointCapture(policy, 1) as capture:
        g.sequence_logprobs(policy.model, batch)
    items = g.match_items(policy, capture.inputs[0], encoded, exs, "fixed")
    assert len(items) == 3
    for it, e, enc in zip(items, exs, encoded, strict=True):
        assert it.queries.shape[0] == 2 and len(it.keys) == len(it.names) == len(e.named)  # x's and y's first
        assert g.name_vocab()[int(it.names[it.target])] == dict((b, n) for b, n in e.named)[e.bbox]
        first = g.point_spans(policy, enc, e, first=True)[0]
        assert torch.equal(it.queries[0], capture.inputs[0][exs.index(e), first[0]].float())
    hist = train_grounding(policy, cfg, system="compact", max_new_tokens=8, heldout=heldout)
    start, end = hist["evals"][0], hist["evals"][-1]
    loss = hist["match_loss"]
    assert len(loss) == 40 and sum(loss[-10:]) < 0.85 * sum(loss[:10]), loss  # measured 3.1 -> 2.2
    assert all(0 <= end[f"boxes8/match_{k}"] <= 1 for k in ("query", "key", "pick")), end
    assert end["boxes8/match_key"] > start["boxes8/match_key"] + 0.1, (start, end)  # measured 0.18 -> 0.54
    assert set(policy.model.state_dict()) == keys0
    unnamed = [synthetic_example(random.Random(3), "openchecks8")]  # random labels: no name, no item
    enc = [g._encode(policy, unnamed[0], "compact")]
    with torch.no_grad(), g._PointCapture(policy, 1) as capture:
        g.sequence_logprobs(policy.model, g.collate(enc, policy.pad_id, policy.image_token_id))
    assert g.match_items(policy, capture.inputs[0], enc, unnamed, "lorem") == []
    assert g._match_loss(g.MatchHead(8, 3), []) is None


def test_a_listed_carry_takes_those_heads_and_starts_the_others_fresh(tmp_path, one_thread):
    """grounding.py, decision "Carried heads": `carry_heads` as a list carries the heads it names from the
    file (the place probe here, the same weights at the phase's start) and starts the others fresh (the match
    head, which the file's phase did not train); a list naming a head the phase does not train is refused."""
    from arpo_core.offline import grounding as g

    cfg = _small(steps=2, mix={"buttons8": 1.0}, place_weight=1.0)
    policy = build_tiny_policy(tmp_path / "p", size="xs", rope_theta=5.0)
    kw = {"system": "compact", "max_new_tokens": 8, "checkpoint_every_s": 1e9}
    train_grounding(policy, cfg, **kw, checkpoint=tmp_path / "a.pt")
    ended = torch.load(tmp_path / "a.pt", weights_only=False)["probe"]
    loaded: list[set[str]] = []
    carry = g._carry_heads
    with unittest.mock.patch.object(
        g, "_carry_heads", lambda path, heads: loaded.append(set(heads)) or carry(path, heads)
    ):
        listed = dataclasses.replace(cfg, match_weight=1.0, carry_heads=("probe",), seed=1, steps=1)
        train_grounding(policy, listed, **kw, checkpoint=tmp_path / "b.pt", heads_from=tmp_path / "a.pt")
        with pytest.raises(ValueError, match="holds no match head"):
            every = dataclasses.replace(listed, carry_heads=True)
            train_grounding(policy, every, **kw, checkpoint=tmp_path / "c.pt", heads_from=tmp_path / "a.pt")
    assert loaded == [{"probe"}, {"head", "speller", "probe", "matcher"}]
    b = torch.load(tmp_path / "b.pt", weights_only=False)
    assert b["matcher"] is not None and b["probe"].keys() == ended.keys()
    with pytest.raises(ValueError, match="carry_heads lists 'head', which this phase does not train"):
        dataclasses.replace(cfg, carry_heads=("head",))


def test_the_match_heads_warm_up_reads_the_states_without_moving_the_model(tmp_path, one_thread):
    """grounding.py, decision "Match loss": during `match_warmup` the match loss trains its head alone (the
    model's weights are those of a run without the loss), after it the model too; `match_lr_scale` is the
    head's learning rate; both need `match_weight`."""
    from arpo_core.offline import grounding as g

    def trained(**fields) -> tuple[dict, torch.optim.Optimizer | None]:
        policy = build_tiny_policy(tmp_path / "p", size="xs", rope_theta=5.0, seed=0)
        cfg = _small(steps=3, mix={"boxes8": 1.0}, **fields)
        hist = train_grounding(policy, cfg, system="compact", max_new_tokens=8)
        return {k: v.clone() for k, v in policy.model.state_dict().items()}, hist

    plain, _ = trained()
    warm, hist = trained(match_weight=1.0, match_warmup=3, match_lr_scale=10.0)
    assert len(hist["match_loss"]) == 3 and all(torch.equal(plain[k], warm[k]) for k in plain)
    shaped, _ = trained(match_weight=1.0, match_warmup=2)
    assert any(not torch.equal(plain[k], shaped[k]) for k in plain)  # its third step reached the model
    seen = []
    real = torch.optim.AdamW
    with unittest.mock.patch.object(
        g.torch.optim, "AdamW", lambda groups, **k: seen.append(groups) or real(groups, **k)
    ):
        trained(match_weight=1.0, match_lr_scale=10.0)
    assert seen[0][-1]["initial_lr"] == pytest.approx(10 * 1e-2)  # the head's group, last
    with pytest.raises(ValueError, match="match_warmup and match_lr_scale need match_weight"):
        GroundConfig(match_warmup=5)


def test_grown_layers_train_at_a_rate_of_their_own(tmp_path, one_thread):
    """grounding.py, decision "Grown layers' rate": with `grown_lr_scale` the parameters of a grown decoder
    layer and vision block take AdamW's first step at that multiple of their part's (the same gradients,
    ten times the move; the tower's own rate multiplies in) and every other parameter the step it takes
    without the field; without `grown` the scale is refused."""
    from arpo_core.offline import grounding as g
    from arpo_core.policy.model import grow_depth, grow_vision_depth, grown_prefixes

    def stepped(**fields) -> tuple[dict, list[str]]:
        policy = build_tiny_policy(tmp_path / "p", size="xs", rope_theta=5.0, seed=0)
        policy = grow_vision_depth(grow_depth(policy, [0], seed=1), [0], seed=1)
        before = {k: v.clone() for k, v in policy.model.state_dict().items()}
        grown = grown_prefixes(policy, [0], [0])
        train_grounding(policy, _small(steps=1, mix={"boxes8": 1.0}, **fields), system="compact",
                        max_new_tokens=8, grown=grown)  # fmt: skip
        return {k: v - before[k] for k, v in policy.model.state_dict().items()}, grown

    (one, grown), (ten, _) = stepped(), stepped(grown_lr_scale=10.0)
    assert grown == ["model.language_model.layers.1.", "model.visual.blocks.1."]
    moved = {k for k in one if k.startswith(tuple(grown)) and one[k].any()}
    assert {k.split(".")[1] for k in moved} == {"language_model", "visual"}  # both grown parts stepped
    for k in one:
        if k.startswith(tuple(grown)):
            torch.testing.assert_close(ten[k], 10 * one[k])
        else:
            assert torch.equal(ten[k], one[k]), k
    seen = []
    real = torch.optim.AdamW
    with unittest.mock.patch.object(
        g.torch.optim, "AdamW", lambda groups, **k: seen.append(groups) or real(groups, **k)
    ):
        stepped(grown_lr_scale=10.0, vision_lr_scale=0.5)
        stepped()
    rates = [grp["initial_lr"] / 1e-2 for grp in seen[0]]
    assert rates == pytest.approx([1, 10, 0.5, 5])  # LM, grown layer, tower, grown block
    assert len(seen[1]) == 1  # no scale: the one group of the runs before the field
    policy = build_tiny_policy(tmp_path / "p", size="xs", rope_theta=5.0, seed=0)
    with pytest.raises(ValueError, match="grown_lr_scale needs `grown`"):
        train_grounding(policy, _small(steps=1, grown_lr_scale=10.0), system="compact", max_new_tokens=8)


def test_the_modules_docstring_examples_hold():
    import doctest

    from arpo_core.offline import grounding
    from arpo_core.pipeline import ground
    from arpo_core.policy import heads

    result = doctest.testmod(grounding)
    assert result.failed == 0 and result.attempted >= 8, result
    for module in (heads, ground):  # cell_click; training_seeds
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted >= 1, (module.__name__, result)


def test_the_paragraph_level_draws_click_links_screen_as_chromium_does():
    """grounding.py, decision "Lorem names": `paralinks` lays a paragraph of MiniWoB's lorem-ipsum words out
    from the task area's corner in the font Chromium uses for MiniWoB's Arial (its width of click-link's
    "Pharetra" at 10 px, measured in the browser: 42.70 px), the links blue and listed once each."""
    from PIL import Image, ImageDraw

    from arpo_core.offline.grounding import chromium_font

    draw = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    assert abs(draw.textlength("Pharetra", font=chromium_font(10)) - 42.70) < 0.01
    for e in synthetic_examples(50, {"paralinks": 1.0}, seed=2):
        x0, y0, x1, y1 = (v * f for v, f in zip(e.bbox, (160 / 168, 210 / 224) * 2, strict=True))  # screen px
        inside = e.image.crop((int(x0) + 1, int(y0) + 1, int(x1) - 1, int(y1) - 1))
        assert any(b > 200 and r < 100 for _, (r, _, b) in inside.getcolors(4096))  # the named link is blue
        assert y0 >= 50 and len({n.lower() for _, n in e.named}) == len(e.named)
