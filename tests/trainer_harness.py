"""Deterministic stand-ins for the trainer tests: an in-process env pool and a seeded reply sampler
that emits valid token ids of the real tiny policy (so the real update trains on them).

Run as a script it trains for N epochs into OUT (used by the kill-and-resume test):
    python tests/trainer_harness.py POLICY_DIR OUT EPOCHS
"""

from __future__ import annotations

import random
import sys
from concurrent.futures import Future
from pathlib import Path

from PIL import Image

from arpo_core.envs.base import Observation, TaskSpec
from arpo_core.envs.pool import EnvResult
from arpo_core.policy.generate import Generation

SCREEN = (160, 210)
TASKS = [TaskSpec(domain="fake", task_id=t, split="in_domain") for t in ("easy", "hard", "never")]


def _done(v) -> Future:
    f: Future = Future()
    f.set_result(v)
    return f


class FakePool:
    """One-step episodes. 'easy': any click left of x=80 succeeds; 'hard': only clicks left of x=20;
    'never': nothing succeeds."""

    def __init__(self, n: int = 4):
        self.n = n
        self.state: dict[int, dict] = {}

    def submit_reset(self, i, task, seed):
        self.state[i] = {"task": task.task_id, "good": False}
        img = Image.new("RGB", SCREEN, (seed % 255, 10, 10))
        return _done(EnvResult(i, observation=Observation(img, f"Click for {task.task_id}", SCREEN)))

    def submit_step(self, i, actions):
        st = self.state[i]
        limit = {"easy": 80, "hard": 20, "never": -1}[st["task"]]
        st["good"] = any(a.point is not None and a.point[0] < limit for a in actions)
        img = Image.new("RGB", SCREEN, "white")
        return _done(EnvResult(i, observation=Observation(img, "", SCREEN), done=True))

    def submit_evaluate(self, i):
        return _done(EnvResult(i, done=True, score=1.0 if self.state[i]["good"] else 0.0))


class RandomReplies:
    """Samples a click x uniformly from a few values with an RNG seeded by the prompt's own seed."""

    XS = (10, 50, 120, 150)

    def __init__(self, policy):
        self.policy = policy

    def generate(self, batch, *, temperature, top_p, max_new_tokens, seeds=None):
        out = []
        for _prompt, seed in zip(batch, seeds, strict=True):
            x = random.Random(seed).choice(self.XS)
            text = f"Thought: try {x}.\nAction: click(start_box='({x},100)')"
            ids = (*self.policy.tokenizer.encode(text, add_special_tokens=False), self.policy.im_end_id)
            out.append(Generation(text, ids, tuple(-1.0 for _ in ids), "stop"))
        return out


SEED = 3
"""The run seed (`project.seed`) of the harness runs."""


def rollout_config(cfg, policy_cfg, seed: int = SEED, min_pixels: int = 3136, max_pixels: int = 1003520):
    """The training RolloutConfig as the train stage builds it from params."""
    from arpo_core.algorithm.rollout import RolloutConfig

    return RolloutConfig(
        max_steps=cfg.max_steps,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_new_tokens=policy_cfg.max_new_tokens,
        format_penalty=cfg.loss.format_penalty,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        coord_mode=policy_cfg.coord_mode,
        seed=seed,
    )


def configs(epochs: int, **train):
    """(train section, policy section) of the harness runs: 2 tasks per iteration, groups of 4,
    one-step episodes, a small buffer; `train` overrides train-section fields."""
    from arpo_core.algorithm.replay import ReplayConfig
    from arpo_core.config import OptimizerConfig, PolicyConfig, TrainConfig

    fields = {
        "epochs": epochs,
        "tasks_per_iteration": 2,
        "group_size": 4,
        "optimizer": OptimizerConfig(lr=1e-3, weight_decay=1e-2),
        "micro_batch_size": 4,
        "mini_batch_size": 8,
        "max_steps": 1,
        "replay": ReplayConfig(capacity_per_task=3),
    }
    return TrainConfig(**(fields | train)), PolicyConfig()


def run(policy_dir, out, cfg, policy_cfg, **kw):
    """`train` on the fake pool with the seeded stand-in policy."""
    from arpo_core.algorithm.trainer import train

    kw = {"pool": FakePool(), "generator_factory": RandomReplies} | kw
    pool = kw.pop("pool")
    return train(
        policy_dir,
        TASKS,
        Path(out),
        cfg,
        policy_cfg,
        pool,
        seed=SEED,
        rollout=rollout_config(cfg, policy_cfg),
        success_threshold=0.1,
        **kw,
    )


def episodes(out) -> dict[str, list[tuple]]:
    """A run's trajectory files -> (task, group, sample, env seed % 255, click x, success, replayed) per
    trajectory: FakePool paints the seed into the screenshot's red channel, RandomReplies writes x."""
    import io

    from arpo_core.trajectory import read_trajectories

    out_rows = {}
    for f in sorted((Path(out) / "trajectories").glob("*.parquet")):
        rows = []
        for t in read_trajectories(f):
            red = Image.open(io.BytesIO(t.steps[0].screenshot_png)).getpixel((0, 0))[0]
            x = int(t.steps[0].response_text.split("try ")[1].split(".")[0])
            rows.append((t.task_id, t.group_id, t.sample_idx, red, x, t.success, t.replayed))
        out_rows[f.name] = rows
    return out_rows


def main(policy_dir: str, out: str, epochs: int) -> None:
    import torch

    torch.set_num_threads(1)
    run(policy_dir, out, *configs(epochs))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
