"""grounding.py, decision "Resumable training": a grounding run killed mid-way and restarted from its
checkpoint file trains the same weights and loss curve as one that never stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from arpo_core.config.sections import OptimizerConfig
from arpo_core.offline.grounding import GroundConfig, synthetic_examples, train_grounding
from arpo_core.policy.model import build_tiny_policy, load_policy

ROOT = Path(__file__).resolve().parents[1]
STEPS = 40
CFG = GroundConfig(
    steps=STEPS,
    batch_size=4,
    optimizer=OptimizerConfig(lr=3e-3),
    warmup_steps=3,
    mix={"box1": 1.0, "box4": 1.0},
    eval_every=0,
    seed=7,
    name_weight=0.5,  # the naming head and its optimizer state have to survive the kill too
    vision_lr_scale=0.5,  # and the tower's own parameter group
)
FIXED_SEED = 5  # a fixed example list as well, so its pending order has to survive the kill


def fixed():
    return synthetic_examples(6, {"widget4": 1.0}, seed=FIXED_SEED)


def run(policy_dir: Path, checkpoint: Path | None, cfg: GroundConfig = CFG):
    policy = load_policy(policy_dir)
    kw = {"checkpoint": checkpoint, "checkpoint_every_s": 0.0} if checkpoint else {}
    hist = train_grounding(policy, cfg, system="compact", max_new_tokens=32, examples=fixed(), **kw)
    return policy, hist


def saved_step(path: Path) -> int:
    try:
        return int(torch.load(path, weights_only=False)["step"])
    except (FileNotFoundError, EOFError, RuntimeError):
        return 0


CHILD = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import torch
    torch.set_num_threads(1)
    sys.path.insert(0, {tests!r})
    import test_grounding_resume as t
    t.run(Path({policy!r}), Path({ckpt!r}))
    """
)


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    out = tmp_path_factory.mktemp("ground-start") / "p"
    build_tiny_policy(out, size="xs", rope_theta=5.0, mrope=[2, 7, 7])
    return out


def test_a_killed_run_resumes_to_the_same_weights_and_losses(start, tmp_path, one_thread):
    ref, ref_hist = run(start, None)
    assert len(ref_hist["loss"]) == STEPS

    ckpt = tmp_path / "ground.pt"
    code = CHILD.format(tests=str(ROOT / "tests"), policy=str(start), ckpt=str(ckpt))
    child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while saved_step(ckpt) < 8:
            assert child.poll() is None, f"the child ended (rc {child.returncode}) before it was killed"
            assert time.monotonic() < deadline, "no checkpoint at step 8 within 300 s"
            time.sleep(0.05)
        os.killpg(child.pid, signal.SIGKILL)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    killed_at = saved_step(ckpt)
    assert 8 <= killed_at < STEPS, killed_at  # killed mid-run, not after the end

    resumed, hist = run(start, ckpt)
    assert hist["loss"] == ref_hist["loss"]  # the same examples in the same order, the same updates
    assert hist["name_loss"] == ref_hist["name_loss"] and len(hist["name_loss"]) == STEPS
    assert hist["steps"] == STEPS
    for (name, a), (_, b) in zip(
        ref.model.state_dict().items(), resumed.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert saved_step(ckpt) == STEPS

    # A finished checkpoint returns at once with the trained weights (a multi-phase caller resumes phase by phase).
    again, hist2 = run(start, ckpt)
    assert hist2["loss"] == ref_hist["loss"]
    assert all(
        torch.equal(a, b) for a, b in zip(ref.model.parameters(), again.model.parameters(), strict=True)
    )


def test_a_checkpoint_of_another_config_is_refused_naming_it(start, tmp_path, one_thread):
    ckpt = tmp_path / "ground.pt"
    short = GroundConfig(**{**CFG.__dict__, "steps": 2})
    run(start, ckpt, short)
    other = GroundConfig(**{**CFG.__dict__, "steps": 2, "seed": 8})
    with pytest.raises(ValueError, match=r"^grounding checkpoint .*ground\.pt was made with another config"):
        run(start, ckpt, other)
    with pytest.raises(ValueError, match="checkpoint and checkpoint_every_s together"):
        train_grounding(load_policy(start), CFG, system="compact", max_new_tokens=8, checkpoint=ckpt)
