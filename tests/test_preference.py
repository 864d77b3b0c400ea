"""DPO and KTO losses with hand-computed values, pairing / partner / selection logic, and tiny-model
training runs (DPO raises the chosen-minus-rejected log-ratio margin; KTO separates the classes; RFT
runs SFT on the successes)."""

from __future__ import annotations

import math

import pytest
import torch
from PIL import Image, ImageDraw

from arpo_core.config.sections import OptimizerConfig
from arpo_core.offline.behaviour_cloning import SFTConfig
from arpo_core.offline.preference import (
    DPOConfig,
    KTOConfig,
    RFTConfig,
    dpo,
    dpo_loss,
    dpo_pairs,
    kl_partners,
    kto,
    kto_class_weights,
    kto_loss,
    kto_reference_point,
    mismatched_trajectory,
    rft,
    rft_select,
    sequence_logp_sums,
)
from arpo_core.policy.model import build_tiny_policy, load_policy
from arpo_core.policy.prompt import PromptSpec
from arpo_core.trajectory import Step, Trajectory, png_bytes


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# ------------------------------------------------------------------------------------------------ DPO loss


def test_dpo_loss_hand_values():
    # pair 1: logits = (-1 - -3) - (-2 - -2) = 2; beta*logits = 1 -> loss = log(1 + e^-1) = 0.313262
    # pair 2: logits = (-2 - -2) - (-1 - -2) = -1; beta*logits = -0.5 -> loss = log(1 + e^0.5) = 0.974077
    out = dpo_loss(
        torch.tensor([-1.0, -2.0]),
        torch.tensor([-3.0, -2.0]),
        torch.tensor([-2.0, -1.0]),
        torch.tensor([-2.0, -2.0]),
        beta=0.5,
        label_smoothing=0.0,
    )
    assert float(out.loss) == pytest.approx((0.313262 + 0.974077) / 2, abs=1e-6)
    assert out.chosen_rewards.tolist() == pytest.approx([0.5, -0.5])  # 0.5 * (pi_c - ref_c)
    assert out.rejected_rewards.tolist() == pytest.approx([-0.5, 0.0])
    assert float(out.margin) == pytest.approx((1.0 + -0.5) / 2)
    assert float(out.accuracy) == 0.5


def test_dpo_loss_label_smoothing_and_gradient():
    pc = torch.tensor([-1.0], requires_grad=True)
    # cDPO, eps = 0.1: 0.9 * log(1 + e^-1) + 0.1 * log(1 + e^1) = 0.9 * 0.313262 + 0.1 * 1.313262
    smooth = dpo_loss(pc, torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0]), 0.5, 0.1)
    assert float(smooth.loss.detach()) == pytest.approx(0.413262, abs=1e-6)
    out = dpo_loss(pc, torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0]), 0.5, 0.0)
    out.loss.backward()
    # dL/dpi_c = -beta * sigma(-beta * logits) = -0.5 * (1 - sigma(1)) = -0.134471: raising the chosen
    # log-prob lowers the loss.
    assert float(pc.grad) == pytest.approx(-0.5 * (1 - sig(1.0)), abs=1e-6)
    assert out.chosen_rewards.requires_grad is False


def test_sequence_logp_sums_uses_mask_only():
    logps = torch.tensor([[0.0, -1.0, -2.0, -4.0], [0.0, -0.5, -9.0, 0.0]])
    mask = torch.tensor([[False, True, False, True], [False, True, False, False]])
    assert sequence_logp_sums(logps, mask).tolist() == [-5.0, -0.5]


# ------------------------------------------------------------------------------------------------ KTO loss


def test_kto_loss_hand_values():
    # A desirable: r = -1 - -2 = 1, loss = 1 - sigma(0.5 * (1 - 0.4)) = 1 - sigma(0.3) = 0.425557, x 2
    # B undesirable: r = -3 - -2 = -1, loss = 1 - sigma(0.5 * (0.4 + 1)) = 1 - sigma(0.7) = 0.331812
    out = kto_loss(
        torch.tensor([-1.0, -3.0]),
        torch.tensor([-2.0, -2.0]),
        torch.tensor([True, False]),
        torch.tensor(0.4),
        beta=0.5,
        desirable_weight=2.0,
        undesirable_weight=1.0,
    )
    assert out.losses.tolist() == pytest.approx([2 * 0.425557, 0.331812], abs=1e-6)
    assert float(out.loss) == pytest.approx((2 * 0.425557 + 0.331812) / 2, abs=1e-6)
    assert out.rewards.tolist() == pytest.approx([0.5, -0.5])
    assert 2 * (1 - sig(0.3)) == pytest.approx(2 * 0.425557, abs=1e-6)


def test_kto_gradients_push_classes_apart_and_ignore_z0():
    pol = torch.tensor([-1.0, -3.0], requires_grad=True)
    z0 = torch.tensor(0.4, requires_grad=True)
    kto_loss(pol, torch.tensor([-2.0, -2.0]), torch.tensor([True, False]), z0, 0.5, 1.0, 1.0).loss.backward()
    # d/dpi of mean(1 - sigma(b(r - z))) = -b sigma'(b(r - z)) / N; for undesirable +b sigma'(b(z - r)) / N
    assert pol.grad.tolist() == pytest.approx(
        [-0.5 * sig(0.3) * (1 - sig(0.3)) / 2, 0.5 * sig(0.7) * (1 - sig(0.7)) / 2], abs=1e-6
    )
    assert z0.grad is None  # the reference point is detached


@pytest.mark.parametrize(
    ("pol", "ref", "z0"),
    [
        ([-1.0, -2.0, -3.0], [-2.0, -2.0, -2.0], 0.0),  # diffs 1, 0, -1 -> mean 0
        ([0.0, -1.5], [-2.0, -2.0], 1.25),  # diffs 2, 0.5
        ([-3.0, -4.0], [-2.0, -2.0], 0.0),  # mean -1.5 clamped at 0
    ],
)
def test_kto_reference_point(pol, ref, z0):
    assert float(kto_reference_point(torch.tensor(pol), torch.tensor(ref))) == pytest.approx(z0)


@pytest.mark.parametrize(
    ("n_d", "n_u", "weights"),
    [
        (2, 6, (3.0, 1.0)),  # ratio 3 * 2 / 6 = 1
        (6, 2, (1.0, 2.25)),  # ratio 6 / (2.25 * 2) = 4/3
        (4, 3, (1.0, 1.0)),  # ratio 4/3 already
        (3, 3, (1.0, 1.0)),
        (0, 5, (1.0, 1.0)),
    ],
)
def test_kto_class_weights(n_d, n_u, weights):
    assert kto_class_weights(n_d, n_u) == pytest.approx(weights)


# ------------------------------------------------------------------------------------------------ data


def screen(color=(200, 0, 0), box=(30, 40, 60, 70)) -> Image.Image:
    img = Image.new("RGB", (160, 210), "white")
    ImageDraw.Draw(img).rectangle(box, fill=color)
    return img


def traj(task_id: str, success: float, reply: str = "r", n_steps: int = 1, color=(200, 0, 0)) -> Trajectory:
    steps = [
        Step(i, png_bytes(screen(color)), 160, 210, response_text=f"{reply}{i}" if n_steps > 1 else reply)
        for i in range(n_steps)
    ]
    return Trajectory("r", "baseline", 0, "miniwob", task_id, f"Do {task_id}.", steps, success=success)


def test_dpo_pairs_cycle_the_shorter_side_within_each_task():
    trajs = [
        traj("a", 1.0),  # 0
        traj("a", 1.0),  # 1
        traj("a", 0.0),  # 2
        traj("a", 0.0),  # 3
        traj("a", 0.0),  # 4
        traj("b", 1.0),  # 5: only successes -> no pair
        traj("c", 0.7),  # 6
        traj("c", 0.2),  # 7 (below the 0.5 threshold)
    ]
    pairs, unpaired = dpo_pairs(trajs, success_threshold=0.5, seed=3)
    a_pairs = [p for p in pairs if trajs[p[0]].task_id == "a"]
    assert len(a_pairs) == 3  # max(2 successes, 3 failures)
    assert sorted(r for _, r in a_pairs) == [2, 3, 4]  # every failure exactly once
    assert {c for c, _ in a_pairs} == {0, 1}  # successes cycled
    assert (6, 7) in pairs and len(pairs) == 4
    assert unpaired == 1
    assert all(trajs[c].key == trajs[r].key for c, r in pairs)
    assert dpo_pairs(trajs, 0.5, seed=3) == (pairs, unpaired)  # seeded
    capped, _ = dpo_pairs(trajs, 0.5, max_pairs_per_task=2, seed=3)
    assert sum(trajs[c].task_id == "a" for c, _ in capped) == 2


def test_success_is_strictly_above_the_threshold():
    trajs = [traj("d", 0.1), traj("d", 0.0), traj("e", 0.11), traj("e", 0.1)]
    pairs, unpaired = dpo_pairs(trajs, 0.1)  # the params' threshold, as selection.py / replay.py
    assert pairs == [(2, 3)] and unpaired == 1
    assert rft_select(trajs, 0.1) == [trajs[2]]


def test_kl_partners_prefer_another_task():
    trajs = [traj("a", 1.0), traj("a", 0.0), traj("b", 0.0), traj("c", 1.0)]
    partners = kl_partners(trajs, seed=0)
    assert all(j != i and trajs[j].key != trajs[i].key for i, j in enumerate(partners))
    same = [traj("a", 1.0), traj("a", 0.0)]
    assert kl_partners(same) == [1, 0]  # no other task: any other trajectory
    with pytest.raises(ValueError):
        kl_partners(same[:1])


def test_mismatched_trajectory_takes_prompt_of_x_and_replies_of_y():
    x = traj("a", 1.0, reply="x", n_steps=3, color=(0, 0, 200))
    y = traj("b", 0.0, reply="y", n_steps=2)
    m = mismatched_trajectory(x, y)
    assert m.instruction == "Do a." and len(m.steps) == 2
    assert [s.response_text for s in m.steps] == ["y0", "y1"]
    assert [s.screenshot_png for s in m.steps] == [s.screenshot_png for s in x.steps[:2]]


def test_rft_select_keeps_capped_successes_in_order():
    trajs = [traj("a", 1.0), traj("a", 0.0), traj("a", 1.0), traj("a", 1.0), traj("b", 0.6), traj("b", 0.4)]
    assert rft_select(trajs, 0.5) == [trajs[0], trajs[2], trajs[3], trajs[4]]
    capped = rft_select(trajs, 0.5, max_per_task=2, seed=1)
    assert len(capped) == 3 and trajs[4] in capped
    assert all(t.success > 0.5 for t in capped)


# ------------------------------------------------------------------------------------------------ tiny model

POS = "Thought: The red box.\nAction: click(start_box='(45,58)')"
NEG = "Thought: Somewhere else.\nAction: click(start_box='(150,200)')"


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    build_tiny_policy(d, size="xs", seed=0)
    return d


def pref_data() -> list[Trajectory]:
    return [
        traj("click-test", 1.0, POS),
        traj("click-test", 0.0, NEG),
        traj("click-button", 1.0, POS, color=(0, 150, 0)),
        traj("click-button", 0.0, NEG, color=(0, 150, 0)),
        traj("click-button", 0.0, NEG + " ", color=(0, 150, 0)),
    ]


PROMPT = {"spec": PromptSpec("compact", None), "success_threshold": 0.1}
"""The prompt of params' policy section and project.success_threshold, as the offline stages pass them."""


def logp_sums(policy, trajs, system="compact"):
    from arpo_core.algorithm.update import compute_logps, encode_trajectories

    seqs = encode_trajectories(policy, trajs, spec=PromptSpec(system, None))
    return torch.stack([lp.sum() for lp in compute_logps(policy, seqs, micro_batch_size=4, bf16=False)])


def test_dpo_raises_the_log_ratio_margin(policy_dir, one_thread, tmp_path):
    policy = load_policy(policy_dir)
    data = pref_data()
    before = logp_sums(policy, data)
    cfg = DPOConfig(steps=6, batch_size=3, micro_batch_size=2, optimizer=OptimizerConfig(lr=2e-3), beta=0.1)
    res = dpo(policy, data, cfg, checkpoint_dir=tmp_path / "ckpt", progress=False, **PROMPT)
    after = logp_sums(policy, data)
    ratio = after - before  # log pi / ref per trajectory
    margin = ratio[[0, 2]].mean() - ratio[[1, 3, 4]].mean()
    assert margin > 0.5, f"chosen-minus-rejected log-ratio margin {float(margin):.3f}"
    assert res.n_examples == 3 and res.n_skipped_tasks == 0  # max(1,1) + max(1,2)
    assert res.history[0]["rewards/margin"] == pytest.approx(0.0, abs=1e-4)  # policy == reference
    assert res.history[-1]["rewards/margin"] > res.history[0]["rewards/margin"]
    assert res.history[-1]["loss/dpo"] < math.log(2)
    assert (tmp_path / "ckpt" / "final" / "preference_state.json").exists()


class RecordingEngine:
    accumulates = True

    def __init__(self, model):
        self.model = self.module = model
        self.grads: list[dict[str, torch.Tensor]] = []

    def backward(self, loss, boundary=True):
        loss.backward()

    def step(self) -> float:
        self.grads.append({n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None})
        self.model.zero_grad(set_to_none=True)
        return 0.0


@pytest.mark.parametrize("method", ["dpo", "kto"])
def test_micro_batching_is_exact(policy_dir, one_thread, method):
    """One optimizer step's gradient does not depend on micro_batch_size (preference.py,
    decision "Training loops")."""
    data = pref_data()
    grads = []
    for mb in (4, 1):
        policy = load_policy(policy_dir)
        eng = RecordingEngine(policy.model)
        if method == "dpo":
            dpo(
                policy,
                data,
                DPOConfig(steps=1, batch_size=3, micro_batch_size=mb),
                engine=eng,
                progress=False,
                **PROMPT,
            )
        else:
            kto(
                policy,
                data,
                KTOConfig(steps=1, batch_size=5, micro_batch_size=mb),
                engine=eng,
                progress=False,
                **PROMPT,
            )
        grads.append(eng.grads[0])
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-4, msg=name)


def test_engine_without_accumulation_needs_whole_batch_micro_batches(policy_dir):
    policy = load_policy(policy_dir)
    eng = RecordingEngine(policy.model)
    eng.accumulates = False
    with pytest.raises(ValueError, match="micro_batch_size >= batch_size"):
        dpo(
            policy,
            pref_data(),
            DPOConfig(steps=1, batch_size=3, micro_batch_size=1),
            engine=eng,
            progress=False,
            **PROMPT,
        )


def test_kto_separates_desirable_from_undesirable(policy_dir, one_thread):
    policy = load_policy(policy_dir)
    data = pref_data()
    before = logp_sums(policy, data)
    cfg = KTOConfig(steps=6, batch_size=5, micro_batch_size=5, optimizer=OptimizerConfig(lr=2e-3), beta=0.1)
    res = kto(policy, data, cfg, progress=False, **PROMPT)
    ratio = logp_sums(policy, data) - before
    assert ratio[[0, 2]].mean() - ratio[[1, 3, 4]].mean() > 0.5
    assert res.info["kto/desirable"] == 2 and res.info["kto/undesirable"] == 3
    assert res.info["kto/desirable_weight"] == pytest.approx(1.5)  # balance: 1.5 * 2 / 3 = 1
    assert res.history[0]["kto/kl"] == 0.0  # policy == reference at the first step
    assert res.history[-1]["rewards/desirable"] > res.history[-1]["rewards/undesirable"]


def test_rft_runs_sft_on_successes_only(policy_dir, one_thread):
    policy = load_policy(policy_dir)
    data = pref_data()
    cfg = RFTConfig(sft=SFTConfig(steps=2, batch_size=2))
    losses = rft(policy, data, cfg, progress=False, **PROMPT)
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    with pytest.raises(ValueError, match="no trajectory"):
        rft(policy, [t for t in data if t.success == 0], cfg, progress=False, **PROMPT)
