"""The GRPO/ARPO update on fixed trajectories with the tiny policy: exact micro-batching, every parameter
trained, log-probs move with the sign of the advantage."""

from __future__ import annotations

import pytest
import torch
from PIL import Image, ImageDraw

from arpo_core.algorithm.engines import TorchEngine
from arpo_core.algorithm.update import compute_logps, encode_trajectories, ppo_update
from arpo_core.config import LossSection, TrainConfig
from arpo_core.policy.model import build_tiny_policy, load_policy
from arpo_core.policy.prompt import PromptSpec
from arpo_core.trajectory import Step, Trajectory, png_bytes


def screen(color, box) -> Image.Image:
    img = Image.new("RGB", (160, 210), "white")
    ImageDraw.Draw(img).rectangle(box, fill=color)
    return img


def traj(reply: str, color=(200, 0, 0), box=(30, 40, 60, 70), n_steps=1, sample_idx=0) -> Trajectory:
    steps = [
        Step(
            step_idx=i,
            screenshot_png=png_bytes(screen(color, box)),
            screen_w=160,
            screen_h=210,
            response_text=reply,
        )
        for i in range(n_steps)
    ]
    return Trajectory(
        "r", "train", 0, "miniwob", "click-test", "Click the box.", steps, sample_idx=sample_idx
    )


def cfg_of(micro: int = 4, mini: int = 32, ppo_epochs: int = 1, **loss) -> TrainConfig:
    """params' train section with these batch sizes and `train.loss` overrides (the rest: its defaults)."""
    return TrainConfig(
        micro_batch_size=micro, mini_batch_size=mini, ppo_epochs=ppo_epochs, loss=LossSection(**loss)
    )


def logps_of(policy, seqs, **kw):
    return compute_logps(policy, seqs, micro_batch_size=4, bf16=False, **kw)


POS = "Thought: The red box.\nAction: click(start_box='(45,58)')"
NEG = "Thought: Somewhere else.\nAction: click(start_box='(150,200)')"


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    build_tiny_policy(d, size="xs", seed=0)
    return d


class RecordingEngine:
    """Accumulates gradients and records them at each step instead of stepping."""

    accumulates = True

    def __init__(self, model):
        self.model = self.module = model
        self.grads: list[dict[str, torch.Tensor]] = []

    def backward(self, loss, boundary=True):
        loss.backward()

    def step(self) -> float:
        self.grads.append(
            {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        )
        self.model.zero_grad(set_to_none=True)
        return 0.0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batching_is_exact(policy_dir, agg):
    """Gradient with micro-batch 1 == gradient of the whole mini-batch in one forward (update.py,
    decision "Exact micro-batching")."""
    policy = load_policy(policy_dir)
    trajs = [traj(POS), traj(NEG, n_steps=2), traj(POS + " ", color=(0, 0, 200)), traj(NEG, n_steps=3)]
    seqs = encode_trajectories(policy, trajs, spec=PromptSpec("compact", None))
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2])
    old = logps_of(policy, seqs)
    old = [o - 0.05 for o in old]  # ratios != 1 so clipping paths are exercised

    grads = []
    for mb in (4, 1):
        eng = RecordingEngine(policy.model)
        cfg = cfg_of(micro=mb, mini=4, agg=agg)
        ppo_update(policy, eng, seqs, adv, cfg, seed=0, old_logps=old)
        grads.append(eng.grads[0])
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=2e-6, rtol=1e-4, msg=name)


def test_updates_train_every_parameter_and_follow_advantage_sign(policy_dir):
    policy = load_policy(policy_dir)
    trajs = [traj(POS, sample_idx=0), traj(NEG, sample_idx=1)]
    seqs = encode_trajectories(policy, trajs, spec=PromptSpec("compact", None))
    adv = torch.tensor([1.0, -1.0])
    before_params = {n: p.detach().clone() for n, p in policy.model.named_parameters()}

    def reply_logp():
        masks = [torch.tensor(s.assistant_mask) for s in seqs]
        return [float(lp[m].sum()) for lp, m in zip(logps_of(policy, seqs), masks, strict=True)]

    before = reply_logp()

    engine = TorchEngine(policy.model, lr=3e-3, weight_decay=0.0, max_grad_norm=1.0)
    cfg = cfg_of(micro=2, mini=2)
    for _ in range(4):
        stats = ppo_update(policy, engine, seqs, adv, cfg, seed=0)
    after = reply_logp()

    unchanged = [n for n, p in policy.model.named_parameters() if torch.equal(p.detach(), before_params[n])]
    assert unchanged == []
    assert after[0] > before[0] + 1.0, (before, after)
    assert after[1] < before[1] - 1.0, (before, after)
    assert stats.n_optimizer_steps == 1 and stats.n_sequences == 2
    assert stats.grad_norm > 0


def test_first_step_is_on_policy_ratio_one(policy_dir):
    """With old_logps recomputed from the same weights, the first forward has ratio 1: nothing clips."""
    policy = load_policy(policy_dir)
    seqs = encode_trajectories(policy, [traj(POS), traj(NEG)], spec=PromptSpec("compact", None))
    eng = RecordingEngine(policy.model)
    stats = ppo_update(policy, eng, seqs, torch.tensor([1.0, -1.0]), cfg_of(mini=2), seed=0)
    assert stats.clip_low_frac == 0 and stats.clip_high_frac == 0 and stats.clip_dual_frac == 0
    assert stats.approx_kl == pytest.approx(0.0, abs=1e-6)


def test_single_on_policy_step_skips_the_old_logp_forward_with_the_same_gradient(policy_dir, monkeypatch):
    """ppo_epochs 1 and one mini-batch: the training forward's own log-probs are the old ones (update.py,
    decision "Recomputed old log-probs"); the gradient equals the one with explicitly recomputed old
    log-probs, and no extra forward runs."""
    import arpo_core.algorithm.update as update

    policy = load_policy(policy_dir)
    seqs = encode_trajectories(
        policy, [traj(POS), traj(NEG, n_steps=2), traj(POS + " ")], spec=PromptSpec("compact", None)
    )
    adv = torch.tensor([1.0, -1.0, 0.5])
    cfg = cfg_of(micro=2, mini=3)
    ref = RecordingEngine(policy.model)
    ppo_update(policy, ref, seqs, adv, cfg, seed=0, old_logps=logps_of(policy, seqs))
    calls = []
    monkeypatch.setattr(update, "compute_logps", lambda *a, **k: calls.append(1) or compute_logps(*a, **k))
    fast = RecordingEngine(policy.model)
    stats = ppo_update(policy, fast, seqs, adv, cfg, seed=0)
    assert calls == [] and stats.approx_kl == 0.0 and stats.clip_low_frac == 0.0
    for name, g in ref.grads[0].items():
        torch.testing.assert_close(fast.grads[0][name], g, atol=1e-6, rtol=1e-5, msg=name)
    # two mini-batches (the second runs on updated weights in a real engine): old log-probs are recomputed
    ppo_update(policy, RecordingEngine(policy.model), seqs, adv, cfg_of(micro=2, mini=2), seed=0)
    assert calls == [1]


def test_zero_advantages_give_zero_gradient(policy_dir):
    policy = load_policy(policy_dir)
    seqs = encode_trajectories(policy, [traj(POS), traj(NEG)], spec=PromptSpec("compact", None))
    eng = RecordingEngine(policy.model)
    ppo_update(policy, eng, seqs, torch.zeros(2), cfg_of(mini=2), seed=0)
    assert all(float(g.abs().max()) == 0.0 for g in eng.grads[0].values())


def test_mini_batches_make_optimizer_steps(policy_dir):
    policy = load_policy(policy_dir)
    seqs = encode_trajectories(policy, [traj(POS)] * 5, spec=PromptSpec("compact", None))
    eng = RecordingEngine(policy.model)
    stats = ppo_update(policy, eng, seqs, torch.ones(5), cfg_of(micro=2, mini=2, ppo_epochs=2), seed=0)
    assert stats.n_optimizer_steps == 6 == len(eng.grads)  # ceil(5/2) = 3 per epoch, 2 epochs


def test_bad_advantage_shape_and_missing_ref(policy_dir):
    policy = load_policy(policy_dir)
    seqs = encode_trajectories(policy, [traj(POS)], spec=PromptSpec("compact", None))
    with pytest.raises(ValueError, match=r"advantages must have shape \(1,\)"):
        ppo_update(policy, RecordingEngine(policy.model), seqs, torch.ones(2), cfg_of(), seed=0)
    with pytest.raises(ValueError, match="kl_coef > 0 needs ref_logps"):
        ppo_update(policy, RecordingEngine(policy.model), seqs, torch.ones(1), cfg_of(kl_coef=0.1), seed=0)


@pytest.mark.slow
def test_deepspeed_zero3_update_matches_torch(policy_dir):
    """One ARPO update through DeepSpeed ZeRO-3 (CPU, gloo) moves the tiny policy like the torch engine."""
    from arpo_core.algorithm.engines import DeepSpeedEngine

    results = []
    for make in (
        lambda m: TorchEngine(m, lr=1e-3, weight_decay=0.0, max_grad_norm=1.0),
        lambda m: DeepSpeedEngine(m, lr=1e-3, weight_decay=0.0, max_grad_norm=1.0, zero_stage=3),
    ):
        policy = load_policy(policy_dir)
        seqs = encode_trajectories(policy, [traj(POS), traj(NEG)], spec=PromptSpec("compact", None))
        engine = make(policy.model)
        stats = ppo_update(
            policy,
            engine,
            seqs,
            torch.tensor([1.0, -1.0]),
            cfg_of(micro=2, mini=2),
            seed=0,
        )
        logps = logps_of(policy, seqs, module=engine.module)
        results.append((stats, logps))
    with pytest.raises(ValueError, match="cannot accumulate gradients"):
        ppo_update(
            policy,
            engine,
            seqs,
            torch.tensor([1.0, -1.0]),
            cfg_of(micro=1, mini=2),
            seed=0,
        )
    (s1, l1), (s2, l2) = results
    assert s1.grad_norm == pytest.approx(s2.grad_norm, rel=1e-3)
    for a, b in zip(l1, l2, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_windows_keep_the_trajectory_as_the_unit(policy_dir, agg):
    """update.py, decision "Windowed trajectories": trajectories longer than the history window (K = 1) are
    encoded as one sequence per step; mini-batches still count trajectories, and the loss at ratio 1 is the
    per-trajectory aggregate: token-mean sum(-A_j N_j) / sum N_j, seq-mean-token-mean mean_j(-A_j),
    seq-mean-token-sum mean_j(-A_j N_j), for any micro-batch size."""
    policy = load_policy(policy_dir)
    trajs = [traj(POS, n_steps=3), traj(NEG, n_steps=1), traj(POS, n_steps=2), traj(NEG, n_steps=3)]
    seqs = encode_trajectories(policy, trajs, spec=PromptSpec("compact", 1))
    assert [s.source for s in seqs] == [0, 0, 0, 1, 2, 2, 3, 3, 3]
    adv_traj = torch.tensor([1.0, -0.5, 0.25, -2.0])
    adv = adv_traj[[s.source for s in seqs]]
    tokens = torch.zeros(4)
    for s in seqs:
        tokens[s.source] += sum(s.assistant_mask[1:])
    expected = {
        "token-mean": float((-adv_traj * tokens).sum() / tokens.sum()),
        "seq-mean-token-mean": float((-adv_traj).mean()),
        "seq-mean-token-sum": float((-adv_traj * tokens).mean()),
    }[agg]
    for micro in (1, 4, 16):
        engine = RecordingEngine(policy.model)
        stats = ppo_update(policy, engine, seqs, adv, cfg_of(micro=micro, mini=4, agg=agg), seed=0)
        assert stats.n_optimizer_steps == 1 and stats.n_trajectories == 4 and stats.n_sequences == 9
        assert stats.loss == pytest.approx(expected, rel=1e-5, abs=1e-6)
    two = ppo_update(policy, RecordingEngine(policy.model), seqs, adv, cfg_of(mini=2, agg=agg), seed=0)
    assert two.n_optimizer_steps == 2  # 2 trajectories per mini-batch, whatever their windows
