"""The GUI environment interface every backend implements, and task suites.

Design decisions:
1. One small protocol (`GuiEnv`: reset / step / evaluate / close) for every backend (MiniWoB++ in
   headless Chromium now, OSWorld desktops later), so the rollout loop and the env pool never know
   which backend they drive.
2. Actions reach `step` in SCREEN pixels (the frame of `Observation.screen_size`); the mapping from the
   model-image frame is the caller's job (`arpo_core.actions`), so an env never sees model output.
3. Env faults are data, not exceptions: `StepResult.info["error"]` carries the message and the pool
   reports the episode as an env error (not a policy failure).
4. A task is identified by `(domain, task_id)` (`TaskSpec.key`): OSWorld ids repeat across domains
   (docs/method.md §1), so the id alone is not a key.
5. Suites are YAML files under `data/suites/` (in git): a header with defaults and the list of tasks;
   `load_suite` rejects unknown keys, naming the key and the file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import yaml
from PIL import Image

from arpo_core.actions import Action

# Action kinds that end an episode from the agent's side (finished -> DONE, call_user -> FAIL).
TERMINAL_KINDS = ("finished", "call_user")


@dataclass(frozen=True)
class TaskSpec:
    """One task of a suite; hashable so it can key dicts and sets."""

    domain: str
    """Task family, e.g. "miniwob" or an OSWorld domain such as "chrome"."""
    task_id: str
    """Task name inside the domain, e.g. "click-button"."""
    instruction: str = ""
    """Fixed instruction; "" when the env supplies it per episode (MiniWoB's utterance)."""
    split: str = "in_domain"
    """Suite split: "in_domain", "out_of_domain", ..."""
    feasible: bool = True
    """False for tasks whose right answer is to give up (OSWorld `infeasible`)."""
    backend: str = "miniwob"
    """Which env implementation runs the task ("miniwob", later "osworld")."""
    config: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    """Backend-specific settings (e.g. MiniWoB data_mode); not part of the identity."""

    @property
    def key(self) -> tuple[str, str]:
        """(domain, task_id): the replay-buffer / statistics key."""
        return (self.domain, self.task_id)


@dataclass
class Observation:
    """What the policy sees after a reset or a step."""

    screenshot: Image.Image
    """RGB image of size screen_size (MiniWoB: the 160x210 task area)."""
    instruction: str
    """The task instruction (MiniWoB: this episode's utterance)."""
    screen_size: tuple[int, int]
    """(width, height) of the screen in pixels; actions are given in this frame."""
    faults: tuple[str, ...] = ()
    """Env faults the env recovered from on its own while producing this observation (e.g. a dead
    browser replaced during a reset): the pool counts each one (pool.py decision 7)."""


@dataclass
class StepResult:
    """Outcome of one `GuiEnv.step` call."""

    observation: Observation
    done: bool
    """The episode ended (task end, agent finished/call_user, time limit, or env error)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Backend details; "error" holds an env-fault message, and "fatal": True says the env cannot go
    on without a restart (e.g. its browser died)."""


@runtime_checkable
class GuiEnv(Protocol):
    """A GUI environment driven by screen-pixel actions."""

    def reset(self, task: TaskSpec, seed: int | None = None) -> Observation:
        """Start an episode of `task` (deterministic for a given seed where the backend allows)."""
        ...

    def step(self, actions: list[Action]) -> StepResult:
        """Apply the actions of one policy turn in order, then observe."""
        ...

    def evaluate(self) -> float:
        """Task success in [0, 1]; called once after the episode ends."""
        ...

    def close(self) -> str | None:
        """Release the browser / desktop; idempotent. Returns a note when a fault is found while closing
        (e.g. the browser had died since the last call), which the pool counts; else None."""
        ...


_SUITE_KEYS = {"domain", "backend", "split", "feasible", "rationale", "config", "tasks"}
_TASK_KEYS = {"task_id", "instruction", "feasible", "split", "domain", "backend", "config", "note"}


def load_suite(path: str | Path) -> list[TaskSpec]:
    """Read a suite YAML into TaskSpecs.

    The file holds defaults (`domain`, `backend`, `split`, `feasible`, `config`), a free-text
    `rationale`, and `tasks`: a list of task ids or mappings that override the defaults per task.
    """
    path = Path(path)
    doc = yaml.safe_load(path.read_text())
    if not isinstance(doc, dict) or "tasks" not in doc:
        raise ValueError(f"{path}: a suite is a mapping with a 'tasks' list")
    unknown = set(doc) - _SUITE_KEYS
    if unknown:
        raise ValueError(f"{path}: unknown suite key(s) {sorted(unknown)}")
    defaults = {
        "domain": doc.get("domain", "miniwob"),
        "backend": doc.get("backend", "miniwob"),
        "split": doc.get("split", "in_domain"),
        "feasible": bool(doc.get("feasible", True)),
        "config": dict(doc.get("config") or {}),
    }
    specs: list[TaskSpec] = []
    for i, item in enumerate(doc["tasks"]):
        entry = {"task_id": item} if isinstance(item, str) else dict(item)
        unknown = set(entry) - _TASK_KEYS
        if unknown:
            raise ValueError(f"{path}: task #{i}: unknown key(s) {sorted(unknown)}")
        if "task_id" not in entry:
            raise ValueError(f"{path}: task #{i} has no task_id")
        entry.pop("note", None)
        merged = {**defaults, **entry, "config": {**defaults["config"], **(entry.get("config") or {})}}
        specs.append(TaskSpec(**merged))
    keys = [s.key for s in specs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"{path}: duplicate task keys")
    return specs
