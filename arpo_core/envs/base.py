"""The GUI environment interface every backend implements, and task suites.

Design decisions:
- **One env protocol.** One small protocol (`GuiEnv`: reset / step / evaluate / close) for every backend
  (MiniWoB++ in headless Chromium now, OSWorld desktops later), so the rollout loop and the env pool never
  know which backend they drive.
- **Screen-pixel actions.** Actions reach `step` in SCREEN pixels (the frame of `Observation.screen_size`);
  the mapping from the model-image frame is the caller's job (`arpo_core.actions`), so an env never sees model
  output.
- **Faults are data.** Env faults are data, not exceptions: `StepResult.info["error"]` carries the message and
  the pool reports the episode as an env error (not a policy failure).
- **Suites in config.** Tasks and suites (`TaskSpec`, `load_suite`) live in `arpo_core/config/suites.py` (YAML
  only, so params can validate suites without importing env code) and are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from PIL import Image

from arpo_core.actions import Action
from arpo_core.config.suites import SuiteError, TaskSpec, load_suite

__all__ = [
    "TERMINAL_KINDS",
    "GuiEnv",
    "Observation",
    "StepResult",
    "SuiteError",
    "TaskSpec",
    "load_suite",
]

# Action kinds that end an episode from the agent's side (finished -> DONE, call_user -> FAIL).
TERMINAL_KINDS = ("finished", "call_user")


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
    browser replaced during a reset): the pool counts each one (pool.py, decision "Fault counting")."""


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
