"""GUI environments: the `GuiEnv` interface and suites (base), MiniWoB++ in headless Chromium
(miniwob), scripted DOM oracles (oracles) and the parallel env pool (pool).

Only the light modules are re-exported here; import `arpo_core.envs.miniwob` (Selenium) and
`arpo_core.envs.oracles` explicitly where a browser is needed.
"""

from arpo_core.envs.base import GuiEnv, Observation, StepResult, TaskSpec, load_suite
from arpo_core.envs.pool import EnvPool, EnvResult

__all__ = ["EnvPool", "EnvResult", "GuiEnv", "Observation", "StepResult", "TaskSpec", "load_suite"]
