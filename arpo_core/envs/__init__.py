"""GUI environments: the `GuiEnv` interface (base) and the parallel env pool (pool), shared by every
kind; MiniWoB++ in headless Chromium (`miniwob/`) and OSWorld desktops (`osworld/`).

Only the light modules are re-exported here; import `arpo_core.envs.miniwob.miniwob_env` (Selenium) and
`arpo_core.envs.miniwob.oracles` explicitly where a browser is needed.
"""

from arpo_core.envs.base import GuiEnv, Observation, StepResult, TaskSpec, load_suite
from arpo_core.envs.pool import EnvPool, EnvResult

__all__ = ["EnvPool", "EnvResult", "GuiEnv", "Observation", "StepResult", "TaskSpec", "load_suite"]
