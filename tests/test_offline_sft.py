"""Behaviour cloning: loss goes down, the tiny model then reproduces the demos greedily; checkpoints load."""

import json
from dataclasses import replace

import pytest
import torch
from PIL import Image, ImageDraw

from arpo_core.config.sections import OptimizerConfig
from arpo_core.offline.behaviour_cloning import SFTConfig, clicks, masked_mean_nll, sft
from arpo_core.policy.generate import HFGenerator
from arpo_core.policy.heads import HeadWeights, click_targets, image_runs
from arpo_core.policy.model import build_tiny_policy, load_policy
from arpo_core.policy.prompt import PromptInput, PromptSpec, Reply
from arpo_core.policy.sequences import (
    collate,
    encode_trajectory,
    encode_trajectory_windows,
    sequence_logprobs,
)
from arpo_core.trajectory import Step, Trajectory, png_bytes

COLORS = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 30, 220), "black": (0, 0, 0)}
CENTRES = {"red": (30, 40), "green": (120, 60), "blue": (70, 150), "black": (130, 190)}


def screen(color: str, done: bool = False) -> Image.Image:
    im = Image.new("RGB", (160, 210), "white")
    if not done:
        x, y = CENTRES[color]
        ImageDraw.Draw(im).rectangle([x - 12, y - 10, x + 12, y + 10], fill=COLORS[color])
    return im


def demos() -> list[Trajectory]:
    """Four oracle-style demos: click the coloured box (model-image coordinates), then finish (two of them)."""
    out = []
    for i, color in enumerate(COLORS):
        x, y = CENTRES[color]
        mx, my = round(x * 168 / 160), round(y * 224 / 210)
        steps = [
            Step(
                0,
                png_bytes(screen(color)),
                160,
                210,
                f"Thought: The {color} box.\nAction: click(start_box='({mx},{my})')",
            )
        ]
        if i % 2 == 0:
            steps.append(
                Step(
                    1,
                    png_bytes(screen(color, done=True)),
                    160,
                    210,
                    "Thought: Done.\nAction: finished(content='')",
                )
            )
        out.append(Trajectory("demo", "demos", 0, "miniwob", "click-color", f"Click the {color} box.", steps))
    return out


def test_masked_mean_nll_hand_computed():
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]])
    mask = torch.tensor([[False, True, True], [True, False, False]])
    assert float(masked_mean_nll(logps, mask)) == pytest.approx((2 + 3 + 4) / 3)
    assert float(masked_mean_nll(logps, torch.zeros_like(mask))) == 0.0


def _eval_loss(policy, trajs) -> float:
    seqs = [encode_trajectory(policy, t, spec=PromptSpec("compact", None)) for t in trajs]
    with torch.no_grad():
        logps, mask = sequence_logprobs(policy.model, collate(seqs, policy.pad_id, policy.image_token_id))
    return float(masked_mean_nll(logps, mask))


@pytest.mark.slow
def test_sft_learns_demos_and_reproduces_them_greedily(tmp_path, one_thread):
    policy = build_tiny_policy(tmp_path / "init", size="xs", seed=0)
    trajs = demos()
    before = _eval_loss(policy, trajs)
    cfg = SFTConfig(
        steps=100, batch_size=4, optimizer=OptimizerConfig(lr=5e-3), warmup_steps=10, checkpoint_every=50
    )
    history = sft(
        policy,
        trajs,
        cfg,
        checkpoint_dir=tmp_path / "ckpt",
        progress=False,
        spec=PromptSpec("compact", None),
    )
    after = _eval_loss(policy, trajs)
    print(
        f"sft loss: first {history[0]:.3f} last {history[-1]:.4f}; eval before {before:.3f} after {after:.4f}"
    )
    assert len(history) == 100
    assert after < 0.05 * before
    assert sum(history[-10:]) / 10 < 0.1 * sum(history[:10]) / 10

    # Greedy replay of every demo step, with the demo's own history, reproduces the demo reply.
    gen = HFGenerator(policy, spec=PromptSpec("compact", None))
    for t in trajs:
        for k, step in enumerate(t.steps):
            prompt = PromptInput(
                t.instruction,
                tuple(s.image() for s in t.steps[: k + 1]),
                tuple(Reply(s.response_text) for s in t.steps[:k]),
            )
            out = gen.generate([prompt], temperature=0.0, top_p=1.0, max_new_tokens=40)[0]
            assert out.text == step.response_text
            assert out.finish_reason == "stop"

    # Checkpoints are normal policy directories with optimizer state and the loss log.
    for name in ("step-50", "final"):
        d = tmp_path / "ckpt" / name
        assert (d / "optimizer.pt").exists()
        state = json.loads((d / "sft_state.json").read_text())
        assert state["step"] == (50 if name == "step-50" else 100)
    reloaded = load_policy(tmp_path / "ckpt" / "final")
    assert _eval_loss(reloaded, trajs) == pytest.approx(after, abs=1e-5)


def test_sft_bf16_grad_accum_moves_every_parameter(tmp_path, one_thread):
    policy = build_tiny_policy(tmp_path / "init", size="xs", seed=1)
    start = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    trajs = demos()
    before = _eval_loss(policy, trajs)
    cfg = SFTConfig(steps=12, batch_size=2, grad_accum=2, optimizer=OptimizerConfig(lr=3e-3, bf16=True))
    history = sft(policy, trajs, cfg, progress=False, spec=PromptSpec("compact", None))
    assert len(history) == 12 and all(h > 0 for h in history)
    assert _eval_loss(policy, trajs) < before
    unchanged = [n for n, p in policy.model.named_parameters() if torch.equal(p, start[n])]
    assert unchanged == []
    assert not policy.model.training  # sft leaves the model in eval mode


def test_sft_rejects_empty(tmp_path):
    policy = build_tiny_policy(tmp_path / "init", size="xs", seed=0)
    with pytest.raises(ValueError, match="at least one"):
        sft(policy, [], SFTConfig(steps=1), progress=False, spec=PromptSpec("compact", None))


def recovery_demos() -> list[Trajectory]:
    """The demos with a deliberate miss in front (a recovery demo, arpo_core/offline/demonstrations.py): the miss is
    context (train_reply False), the oracle's replies after it are the targets."""
    out = []
    for t in demos():
        miss = Step(
            0,
            t.steps[0].screenshot_png,
            160,
            210,
            t.steps[0].response_text.split("\nAction:")[0] + "\nAction: click(start_box='(160,230)')",
            train_reply=False,
        )
        steps = [miss, *(Step(**{**s.__dict__, "step_idx": s.step_idx + 1}) for s in t.steps)]
        out.append(t.with_(steps=steps))
    return out


def test_sft_loss_covers_exactly_the_trained_replies(tmp_path, one_thread):
    """The first step's loss (before any update) is the token-mean NLL over the replies with
    train_reply set, with the miss in their context; training the miss too would give another number."""
    policy = build_tiny_policy(tmp_path / "init", size="xs", seed=0)
    trajs = recovery_demos()
    expected = _eval_loss(policy, trajs)
    all_trained = [
        t.with_(steps=[Step(**{**s.__dict__, "train_reply": True}) for s in t.steps]) for t in trajs
    ]
    assert _eval_loss(policy, all_trained) != pytest.approx(expected, abs=1e-4)
    history = sft(
        policy, trajs, SFTConfig(steps=1, batch_size=4), progress=False, spec=PromptSpec("compact", None)
    )
    assert history[0] == pytest.approx(expected, rel=1e-4)
    only_misses = [t.with_(steps=t.steps[:1]) for t in trajs]
    with pytest.raises(ValueError, match="at least one reply to train on"):
        sft(policy, only_misses, SFTConfig(steps=1), progress=False, spec=PromptSpec("compact", None))


def test_sft_over_history_windows_is_the_token_mean_of_every_window(tmp_path, one_thread):
    """behaviour_cloning.py, decisions "Cloned replies" and "Length-sorted forwards" at K = 1: the first
    step's loss is the token-mean NLL over every trained reply, each in its own window, although the windows
    are sorted and cut into several forwards; and it differs from the one-sequence encoding (earlier replies
    without their screenshot)."""
    from arpo_core.policy.sequences import encode_trajectory_windows

    policy = build_tiny_policy(tmp_path / "init", size="xs", seed=0)
    trajs = recovery_demos()
    seqs = [w for t in trajs for w in encode_trajectory_windows(policy, t, spec=PromptSpec("compact", 1))]
    assert len(seqs) > 4  # more rows than batch_size: several forwards
    with torch.no_grad():
        logps, mask = sequence_logprobs(policy.model, collate(seqs, policy.pad_id, policy.image_token_id))
    expected = float(masked_mean_nll(logps, mask))
    one = [encode_trajectory(policy, t, spec=PromptSpec("compact", 1)) for t in trajs]
    with torch.no_grad():
        lp1, m1 = sequence_logprobs(policy.model, collate(one, policy.pad_id, policy.image_token_id))
    assert float(masked_mean_nll(lp1, m1)) != pytest.approx(expected, abs=1e-4)
    history = sft(
        policy, trajs, SFTConfig(steps=1, batch_size=4), progress=False, spec=PromptSpec("compact", 1)
    )
    assert history[0] == pytest.approx(expected, rel=1e-4)


def test_long_replies_counts_demo_replies_the_policy_cannot_finish(tmp_path):
    """A demo reply longer than policy.max_new_tokens is always cut off when sampled (a format error): the
    sft stage counts them (and warns) by the tokenizer's count plus the closing <|im_end|>."""
    from arpo_core.pipeline.sft import long_replies

    policy = build_tiny_policy(tmp_path / "p")
    trajs = demos()
    lengths = sorted(
        len(policy.tokenizer.encode(s.response_text, add_special_tokens=False)) + 1
        for t in trajs
        for s in t.steps
    )
    assert long_replies(policy, trajs, lengths[-1]) == (0, 6, lengths[-1])
    cut = lengths[-1] - 1
    assert long_replies(policy, trajs, cut) == (sum(n > cut for n in lengths), 6, lengths[-1])
    assert long_replies(policy, trajs, 1) == (6, 6, lengths[-1])


def test_sft_is_deterministic_given_demos_and_seed(tmp_path, one_thread):
    """Two behaviour-cloning runs on the same demos from the same start give the same weights, bit for bit
    (so a difference between two main-job bases comes from their demos, not from training)."""
    cfg = SFTConfig(steps=6, batch_size=2, optimizer=OptimizerConfig(lr=5e-3), warmup_steps=2, seed=3)
    weights = []
    for run in ("a", "b"):
        policy = build_tiny_policy(tmp_path / run, size="xs", seed=0)
        sft(policy, demos(), cfg, progress=False, spec=PromptSpec("compact", None))
        weights.append({k: v.clone() for k, v in policy.model.state_dict().items()})
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    policy = build_tiny_policy(tmp_path / "c", size="xs", seed=0)  # another seed orders the batches otherwise
    sft(policy, demos(), replace(cfg, seed=4), progress=False, spec=PromptSpec("compact", None))
    assert not all(torch.equal(weights[0][k], v) for k, v in policy.model.state_dict().items())


def two_clicks() -> Trajectory:
    """A demo that clicks the red box, then the blue one on the next screen (model-image coordinates)."""
    steps = []
    for k, color in enumerate(("red", "blue")):
        x, y = CENTRES[color]
        mx, my = round(x * 168 / 160), round(y * 224 / 210)
        reply = f"Thought: The {color} box.\nAction: click(start_box='({mx},{my})')"
        steps.append(Step(k, png_bytes(screen(color)), 160, 210, reply))
    return Trajectory("demo", "demos", 0, "miniwob", "click-color", "Click red, then blue.", steps)


def _cell_token(policy, enc, image: int, color: str) -> int:
    """The merged image token of screenshot `image` in `enc` whose 28-px cell holds `color`'s demo click."""
    x, y = CENTRES[color]
    mx, my = round(x * 168 / 160), round(y * 224 / 210)
    cells, _, cols = image_runs(policy, enc)[image]
    return cells[(my // 28) * cols + mx // 28]


@pytest.mark.parametrize("history", [None, 1])
def test_click_targets_are_each_replys_click_cell_on_its_own_screen(tmp_path, history):
    """Every trained click gets its x- and y-first positions and the cell under its point in the screenshot
    the reply answers: with the whole history in one sequence, reply 1's target is in image 1, not in the
    last image before the sequence's end for reply 0; with a window of one screenshot, each window's."""
    policy = build_tiny_policy(tmp_path / "init", size="xs", seed=0)
    traj = two_clicks()
    encoded = encode_trajectory_windows(policy, traj, spec=PromptSpec("compact", history))
    tok = policy.processor.tokenizer
    if history is None:
        (enc,) = encoded
        wanted = [_cell_token(policy, enc, 0, "red"), _cell_token(policy, enc, 1, "blue")]
        spans = click_targets(policy, enc)
    else:
        assert len(encoded) == 2
        wanted = [_cell_token(policy, encoded[0], 0, "red"), _cell_token(policy, encoded[1], 0, "blue")]
        spans = [span for enc in encoded for span in click_targets(policy, enc)]
    assert [targets for _, targets in spans] == [[w] for w in wanted]
    for enc, (queries, _) in zip(encoded if history else encoded * 2, spans, strict=True):
        nxt = [tok.decode([enc.input_ids[q + 1]]) for q in queries]
        assert len(queries) == 2 and all(t[:1].isdigit() for t in nxt), nxt
    # A reply with no click, a click off the screen and a click cut before its `)` have no span.
    for reply in (
        "Thought: x\nAction: finished(content='')",
        "Thought: x\nAction: click(start_box='(900,5)')",
        "Thought: x\nAction: click(start_box='(31,42",
    ):
        t = replace(traj, steps=[replace(traj.steps[0], response_text=reply)])
        assert click_targets(policy, encode_trajectory(policy, t, spec=PromptSpec("compact", None))) == []


def _first_mass(policy, trajs) -> float:
    """The first head's mean attention mass on the demo click's cell at the positions that predict x's and
    y's first characters, over every trained click of `trajs`."""
    seqs = [encode_trajectory(policy, t, spec=PromptSpec("compact", None)) for t in trajs]
    spans = [click_targets(policy, enc) for enc in seqs]
    with torch.no_grad(), HeadWeights(policy, 1) as capture:
        sequence_logprobs(policy.model, collate(seqs, policy.pad_id, policy.image_token_id))
        terms = capture.point_terms(spans)
    return float((-terms).exp().mean())


def test_sft_pointing_loss_moves_the_head_onto_the_demo_clicks(tmp_path, one_thread):
    """`point_weight` adds the pointing loss: its history falls, and the first head's mass on each demo
    click's cell rises far above what cloning alone gives it (the same seed, batches and steps)."""
    trajs = [*demos(), two_clicks()]
    cfg = SFTConfig(steps=30, batch_size=5, optimizer=OptimizerConfig(lr=5e-3), warmup_steps=3)
    masses, histories = {}, {}
    for weight in (0.0, 1.0):
        policy = build_tiny_policy(tmp_path / f"init{weight}", size="xs", seed=0)
        start = _first_mass(policy, trajs)
        points: list[float] = []
        histories[weight] = sft(
            policy,
            trajs,
            replace(cfg, point_weight=weight),
            progress=False,
            spec=PromptSpec("compact", None),
            point_history=points,
        )
        masses[weight] = (start, _first_mass(policy, trajs), points)
    print({w: m[:2] for w, m in masses.items()})
    assert masses[0.0][2] == []  # off: no pointing history
    points = masses[1.0][2]
    assert len(points) == 30 and sum(points[-5:]) < 0.5 * sum(points[:5])
    assert masses[1.0][1] > 0.5 and masses[1.0][1] > 3 * max(masses[0.0][1], masses[1.0][0])
    assert histories[1.0][-1] < 0.5 * histories[1.0][0]  # the clicks are still cloned


def test_point_one_click_teaches_the_pointing_loss_only_in_demos_that_click_once(tmp_path, one_thread):
    """`point_one_click`: a demo that clicks two targets is cloned without the pointing loss (the weights are
    those of cloning alone, with the same seed and batches), a demo that clicks once is taught it."""
    assert [clicks(t) for t in demos()] == [1, 1, 1, 1] and clicks(two_clicks()) == 2
    cfg = SFTConfig(steps=4, batch_size=2, optimizer=OptimizerConfig(lr=5e-3), warmup_steps=1)
    one = replace(cfg, point_weight=1.0, point_one_click=True)
    out = {}
    for name, config, trajs in (
        ("cloned", cfg, [two_clicks()]),
        ("two clicks", one, [two_clicks()]),
        ("one click", one, demos()[:2]),
    ):
        policy = build_tiny_policy(tmp_path / name, size="xs", seed=0)
        points: list[float] = []
        sft(policy, trajs, config, progress=False, spec=PromptSpec("compact", None), point_history=points)
        out[name] = (points, policy.model.state_dict())
    assert out["two clicks"][0] == [0.0] * 4 and all(p > 0 for p in out["one click"][0])
    cloned, taught = out["cloned"][1], out["two clicks"][1]
    assert all(torch.equal(cloned[k], taught[k]) for k in cloned)
    with pytest.raises(ValueError, match="point_one_click needs point_weight"):
        replace(cfg, point_one_click=True)
