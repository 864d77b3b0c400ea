"""What several pipeline stages share about tasks: the suites, the evaluation splits, the roles of pinned
instances, a progress bar. The policy's checkpoint, pixel budget and method label are in `policies.py`;
env pools and rollout settings in `rollouts.py` (only env stages import it).

Decisions:
- **Suites by backend.** Suites are read by their own backend (`suite_tasks`): an OSWorld suite (`backend:
  osworld`) through `load_osworld_suite`, which loads each task's OSWorld JSON; any other through
  `load_suite`. One file named as both suites (`env.in_domain_suite == env.out_of_domain_suite`, e.g. the 17
  local desktop tasks) is divided by its tasks' own `split`: the in-domain suite is its `in_domain` tasks, the
  out-of-domain suite every other task, labelled `out_of_domain` (the split the metrics name). With
  `env.out_of_domain_suite: null` there is no held-out suite: every task of the in-domain file is
  in-domain (labelled so), whatever its own split says, and the out-of-domain suite is empty.
- **Evaluation splits.** Evaluation splits (`evaluation_tasks`): a suite whose tasks are families (every
  episode a fresh instance) is evaluated as `in_domain` and `out_of_domain`, each task on
  `evaluate.episodes_per_task` fresh instances. A suite of pinned instances (suites.py,
  decision "Fixed instances", the paper's protocol) is evaluated in three splits: `train`, the instances the
  train stage trains on (the selection's, when `train.use_selection`; the paper's in-domain numbers are
  these); `heldout`, the same task families on fresh instances (`evaluate.seed + k`: generalisation to unseen
  instances); and `out_of_domain`. A pinned instance plays one greedy episode (a greedy episode of a fixed
  instance is determined by it) and `evaluate.samples_per_instance` sampled ones.
- **Disjoint instance roles.** Instances are disjoint by role (`instance_roles`): per task family, the env
  seeds of demonstrations, of the pinned training instances and of held-out evaluation never meet (checked
  when params load, `Params.cross_checks`, and by a test on every preset).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from arpo_core.config import Params
from arpo_core.config.suites import families
from arpo_core.envs.base import TaskSpec, load_suite

__all__ = [
    "HELDOUT_SPLIT",
    "TRAIN_SPLIT",
    "evaluation_tasks",
    "instance_episodes",
    "progress_bar",
    "suite_tasks",
    "training_tasks",
]


def suite_tasks(p: Params, split: str) -> list[TaskSpec]:
    """Tasks of the 'in_domain' or 'out_of_domain' suite named in params, loaded by their backend
    (decision "Disjoint instance roles")."""
    path = {"in_domain": p.env.in_domain_suite, "out_of_domain": p.env.out_of_domain_suite}[split]
    if path is None:  # no held-out suite
        return []
    tasks = load_suite(path)
    if any(t.backend == "osworld" for t in tasks):
        from arpo_core.envs.osworld.osworld_env import load_osworld_suite

        tasks = load_osworld_suite(path)
    ood = p.env.out_of_domain_suite
    if ood is None:
        return [replace(t, split="in_domain") for t in tasks]
    if Path(p.env.in_domain_suite).resolve() != Path(ood).resolve():
        return tasks
    if split == "in_domain":
        tasks = [t for t in tasks if t.split == "in_domain"]
    else:
        tasks = [replace(t, split="out_of_domain") for t in tasks if t.split != "in_domain"]
    if not tasks:
        raise ValueError(
            f"{path} is both env.in_domain_suite and env.out_of_domain_suite, so its tasks are divided by "
            f"their split (in_domain or not), and none is left for {split}"
        )
    return tasks


TRAIN_SPLIT = "train"
"""Decision "Evaluation splits": the pinned instances trained on."""
HELDOUT_SPLIT = "heldout"
"""Decision "Evaluation splits": fresh instances of the pinned instances' task families."""


def training_tasks(p: Params, selected_path: str | os.PathLike | None) -> list[TaskSpec]:
    """The in-domain tasks, restricted to the selected ones when `train.use_selection`."""
    from arpo_core.algorithm.selection import read_selection

    tasks = suite_tasks(p, "in_domain")
    if p.train.use_selection and selected_path is not None:
        keep = {tuple(k) for k in read_selection(selected_path).kept}
        tasks = [t for t in tasks if t.key in keep]
        if not tasks:
            raise RuntimeError(f"task selection {selected_path} kept no task: nothing to train on")
    return tasks


def evaluation_tasks(
    p: Params, trained: list[TaskSpec] | None, *, out_of_domain: bool = True
) -> list[TaskSpec]:
    """Decision "Evaluation splits": the tasks an evaluation plays, each labelled with its split. `trained`:
    the train stage's tasks (`training_tasks`); None when there is no train stage to speak of (then every
    pinned in-domain instance is `train`)."""
    ind = suite_tasks(p, "in_domain")
    pinned = [t for t in ind if t.pinned]
    if trained is not None:
        chosen = {t.key for t in trained}
        pinned = [t for t in pinned if t.key in chosen]
    out = [replace(t, split=TRAIN_SPLIT) for t in pinned]
    out += [replace(t, split=HELDOUT_SPLIT) for t in families(t for t in ind if t.pinned)]
    out += [t for t in ind if not t.pinned]
    return out + (suite_tasks(p, "out_of_domain") if out_of_domain else [])


def instance_episodes(p: Params, temperature: float) -> int:
    """Decision "Evaluation splits": episodes per pinned instance in an evaluation at `temperature` (0:
    greedy, one)."""
    return 1 if temperature == 0 else p.evaluate.samples_per_instance


def progress_bar(total: int, desc: str) -> Any:
    """A tqdm bar that redraws at most every 2 s (logs stay short)."""
    return tqdm(total=total, desc=desc, dynamic_ncols=True, mininterval=2.0)
