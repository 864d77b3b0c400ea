"""Scripted demonstrations: the DOM oracles play seeded episodes through the env pool, and their
UI-TARS replies become trajectories for behaviour cloning (docs/design.md stage `demos`).

Decisions:
- **Oracle in worker.** The oracle runs inside the env worker (`oracle_reply` reads the DOM there) and writes
  its reply in the model-image frame of the policy's pixel budget; the reply travels as text and goes through
  the same parser and coordinate mapping as a policy's reply, so a demo is exactly what the policy
  should have said.
- **Successful demos only.** Only successful episodes are kept: a demo that failed teaches the wrong thing.
  Failures and env faults are counted and returned so a broken oracle is visible (the oracles reach 20/20 in
  tests).
- **Env threads.** Each env works through its own queue of jobs in a thread; calls to one env are sequential,
  envs run in parallel (the pool's per-env executors).
- **Recovery demos.** Recovery demos. The oracles succeed at once, so without them every single-click demo has
  one reply and behaviour cloning never shows the policy a prompt with history (an earlier screenshot, its own
  earlier reply, a new screenshot). In MiniWoB a click on empty space does not end the episode, so a
  policy whose first click missed meets exactly that prompt and, never trained on it, answered with
  unparseable text (a format error ends the episode with the penalty). With probability
  `recovery_rate` per episode the oracle therefore first makes 1..`max_misses` (uniform) deliberate
  misses - its own Thought for the state with the click moved to an empty point of the task area
  (`oracles.miss_step`, computed here from the env's `dom_elements`) - and then solves the task. All
  draws (recovery or not, how many misses, where) come from one `random.Random` per episode seeded
  with `derive_seed("demo_miss", domain, task_id, env_seed)`: the same job gives the same demo with
  any number of envs, and `recovery_rate = 0` gives exactly the plain demos. Misses come first
  because that is where the policy's misses come from (a wrong first click, then the same screen);
  the multi-step tasks already show every later step with its history.
- **Untrained misses.** The miss steps are stored with `train_reply = False` (trajectory.py): behaviour
  cloning conditions the later replies on them but never trains on them (policy/sequences.py masks them out).
  Cloning the miss itself would teach the policy to click empty space with a confident Thought; what the
  demo is meant to teach is the reply AFTER a miss. Masking whole replies rather than only their
  action keeps one rule (a step is a target or it is context) that every consumer of trajectories
  applies the same way.
- **Miss conditions.** A miss is only possible where the env serves a DOM (MiniWoB) and the oracle's next
  action is a single click onto a page that has empty space; otherwise the episode is played without (further)
  misses. A miss that ended the episode is reported as an error (it would mean the empty point was not empty).
- **Misses beyond limit.** The misses come on top of the step limit: after them the oracle still has
  `max_steps` steps, so a recovery demo of a long task (login-user: 5 oracle steps) never fails for lack of
  steps. Counting the misses against the limit (8) instead failed 57 of the default 840 episodes with up to 6
  misses, against 5 without misses: the long tasks' recovery demos with many misses were dropped, and with
  them deep-history contexts of the tasks that need them most.
- **Fault replays.** A demo hit by an env fault (a reset, call, step or evaluation that failed: a crashed
  browser or worker) is played again from the start, up to `ENV_RETRIES` times, with the same seed and the
  same misses, so it is the demo an undisturbed run records (the soak, benchmarks/soak.py, found demos lost
  to kills). A demo that fails by itself (the oracle's reply does not parse, a miss ended the episode)
  is not played again.
- **Brief thoughts.** `thoughts="brief"` (params' `demos.thoughts`) rewrites every demo reply, misses
  included, as `format_response(BRIEF_THOUGHT, actions)` with the oracle's parsed actions: the same actions
  (the reply goes through the parser again), one fixed Thought. A tiny policy garbles the oracles' free-text
  thoughts (target names copied from the instruction) and the garbling spills into the action; with a
  fixed thought the reply is a fixed prefix plus the action. `oracle` keeps the oracles' replies as
  they are.
- **Demos in the policy's grammar.** The demos speak the policy's own grammar (`DemoGrammar`: params'
  `policy.action_format` and `coord_mode`, and the checkpoint's resize factor; docs/models.md). The oracles
  write UI-TARS replies in a Qwen2.5-VL frame (factor 28, absolute pixels); for any other grammar each oracle
  reply is parsed there, its actions mapped to the screen, from the screen into the policy's frame (0-1000
  units, or the pixels of a factor-32 Qwen3-VL model image) and written in the policy's grammar with the same
  thought (the oracle's or the brief one). That text is then parsed and mapped back like a policy's reply, and
  those actions are what the env steps and `actions_json` holds (decision "Oracle in worker"), so behaviour cloning teaches a
  Qwen3-VL policy its tool calls, never UI-TARS calls. The default grammar (UI-TARS, absolute, 28) keeps the
  oracle's text as it is, byte for byte.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from arpo_core.actions import (
    ActionParseError,
    format_reply,
    format_response,
    parse_reply,
    parse_response,
    smart_resize,
    to_model,
    to_screen,
)
from arpo_core.algorithm.rollout import EpisodeJob, RolloutConfig
from arpo_core.envs.miniwob.oracles import MODEL_MAX_PIXELS, MODEL_MIN_PIXELS, miss_step, render_reply
from arpo_core.envs.pool import EnvPool
from arpo_core.infra.seeds import derive_seed
from arpo_core.trajectory import Step, Trajectory, png_bytes

__all__ = [
    "BRIEF_THOUGHT",
    "ENV_RETRIES",
    "THOUGHT_STYLES",
    "DemoGrammar",
    "DemoResult",
    "miss_rng",
    "planned_misses",
    "play_oracle_episodes",
]

ENV_RETRIES = RolloutConfig.env_retries
"""Decision "Fault replays": plays of a demo hit by an env fault before it is given up (the rollouts'
default)."""
THOUGHT_STYLES = ("oracle", "brief")
BRIEF_THOUGHT = "I act on the screen."
"""Decision "Brief thoughts": the one Thought of every demo reply with `thoughts="brief"`."""


@dataclasses.dataclass(frozen=True)
class DemoGrammar:
    """The grammar and frame the demo replies are written in (decision "Demos in the policy's grammar")."""

    action_format: str = "uitars"
    """params' `policy.action_format`."""
    coord_mode: str = "absolute"
    """params' `policy.coord_mode`."""
    patch_factor: int = 28
    """smart_resize factor of the policy's model image (`Policy.patch_factor`)."""

    @property
    def is_oracles(self) -> bool:
        """The oracles' own grammar: their text is used as it is."""
        return (self.action_format, self.coord_mode, self.patch_factor) == ("uitars", "absolute", 28)


def _rewrite(
    thought: str,
    screen_actions: Sequence,
    screen: tuple[int, int],
    grammar: DemoGrammar,
    min_pixels: int,
    max_pixels: int,
) -> tuple[str, list]:
    """Decision "Demos in the policy's grammar": screen actions -> (the reply in the policy's grammar and frame, the screen actions
    that reply means when parsed and mapped back like a policy's)."""
    w, h = screen
    ph, pw = smart_resize(h, w, factor=grammar.patch_factor, min_pixels=min_pixels, max_pixels=max_pixels)
    mode = grammar.coord_mode

    def frame(p):
        return None if p is None else to_model(p, (pw, ph), screen, mode)

    model_actions = [
        dataclasses.replace(a, point=frame(a.point), end_point=frame(a.end_point)) for a in screen_actions
    ]
    text = format_reply(thought, model_actions, grammar.action_format)
    parsed = parse_reply(text, grammar.action_format)
    return text, to_screen(parsed.actions, (pw, ph), screen, mode=mode)


@dataclasses.dataclass
class DemoResult:
    trajectories: list[Trajectory]
    """Successful demos, in job order."""
    n_failed: int
    """Episodes the oracle played to the end without success."""
    errors: list[str]
    """Env faults / missing oracles, one line each."""


def miss_rng(job: EpisodeJob) -> random.Random:
    """The episode's own RNG for its misses (decision "Recovery demos")."""
    return random.Random(derive_seed("demo_miss", job.task.domain, job.task.task_id, job.seed))


def planned_misses(rng: random.Random, recovery_rate: float, max_misses: int) -> int:
    """How many misses an episode starts with: 0 with probability 1 - recovery_rate, else uniform in
    1..max_misses (the first draws of the episode's `miss_rng`)."""
    if recovery_rate <= 0.0:
        return 0
    if rng.random() >= recovery_rate:
        return 0
    return rng.randint(1, max_misses)


class _EnvFault(Exception):
    """An env call failed while planning a miss (decision "Fault replays")."""


def _miss_reply(
    pool: EnvPool,
    env_idx: int,
    job: EpisodeJob,
    utterance: str,
    screen_size: tuple[int, int],
    rng: random.Random,
    min_pixels: int | None,
    max_pixels: int | None,
) -> str | None:
    """A deliberate miss for the env's current state in model-image pixels, or None
    (decision "Miss conditions"). Raises _EnvFault when the env could not give its DOM
    (decision "Fault replays": the demo is played again)."""
    dom = pool.submit_call(env_idx, "dom_elements").result()
    if dom.error:
        raise _EnvFault(f"{job.task.task_id} seed {job.seed}: dom_elements: {dom.error}")
    if not dom.value:
        return None
    step = miss_step(job.task.task_id, utterance, dom.value, rng)
    if step is None:
        return None
    return render_reply(step, screen_size, min_pixels or MODEL_MIN_PIXELS, max_pixels or MODEL_MAX_PIXELS)


def _play(
    pool: EnvPool,
    env_idx: int,
    job: EpisodeJob,
    max_steps: int,
    min_pixels: int | None,
    max_pixels: int | None,
    misses: int,
    rng: random.Random,
    thoughts: str = "oracle",
    grammar: DemoGrammar = DemoGrammar(),
):
    """One oracle episode: (trajectory, None, False), or (None, error, env_fault) - env_fault True when
    the env failed (decision "Fault replays": the episode is played again), False when the episode itself
    failed."""
    res = pool.submit_reset(env_idx, job.task, job.seed).result()
    if res.error or res.observation is None:
        return None, f"{job.task.task_id} seed {job.seed}: reset: {res.error}", True
    obs = res.observation
    instruction = obs.instruction or job.task.instruction
    steps: list[Step] = []
    for k in range(max_steps + misses):  # decision "Misses beyond limit"
        text = None
        if k < misses:  # decision "Recovery demos": misses first, while the page offers empty space
            try:
                text = _miss_reply(
                    pool, env_idx, job, obs.instruction, obs.screen_size, rng, min_pixels, max_pixels
                )
            except _EnvFault as e:
                return None, str(e), True
            if text is None:
                misses = k
        is_miss = text is not None
        if text is None:
            reply = pool.submit_call(env_idx, "oracle_reply", min_pixels, max_pixels).result()
            if reply.error or not reply.value:
                msg = f"{job.task.task_id} seed {job.seed}: no oracle reply ({reply.error})"
                return None, msg, bool(reply.error)
            text = reply.value
        try:
            parsed = parse_response(text)
        except ActionParseError as e:
            return None, f"{job.task.task_id}: oracle reply does not parse: {e}", False
        if thoughts == "brief":  # decision "Brief thoughts"
            text = format_response(BRIEF_THOUGHT, parsed.actions)
        w, h = obs.screen_size
        lo, hi = min_pixels or MODEL_MIN_PIXELS, max_pixels or MODEL_MAX_PIXELS
        mh, mw = smart_resize(h, w, min_pixels=lo, max_pixels=hi)
        actions = to_screen(parsed.actions, (mw, mh), (w, h))
        if not grammar.is_oracles:  # decision "Demos in the policy's grammar"
            thought = BRIEF_THOUGHT if thoughts == "brief" else parsed.thought
            try:
                text, actions = _rewrite(thought, actions, (w, h), grammar, lo, hi)
            except (ActionParseError, ValueError) as e:
                return (
                    None,
                    f"{job.task.task_id}: the oracle's reply has no {grammar.action_format} form: {e}",
                    False,
                )
        step = Step(
            step_idx=k,
            screenshot_png=png_bytes(obs.screenshot),
            screen_w=w,
            screen_h=h,
            response_text=text,
            actions_json=json.dumps([dataclasses.asdict(a) for a in actions]),
            train_reply=not is_miss,
        )
        steps.append(step)
        out = pool.submit_step(env_idx, actions).result()
        if out.error:
            return None, f"{job.task.task_id} seed {job.seed}: step: {out.error}", True
        if out.done:
            if is_miss:
                msg = f"{job.task.task_id} seed {job.seed}: the miss at step {k} ended the episode"
                return None, msg, False
            step.done = True
            break
        obs = out.observation
    score = pool.submit_evaluate(env_idx).result()
    if score.error:
        return None, f"{job.task.task_id} seed {job.seed}: evaluate: {score.error}", True
    traj = Trajectory(
        run_id="demos",
        stage="demos",
        epoch=0,
        task_domain=job.task.domain,
        task_id=job.task.task_id,
        instruction=instruction,
        steps=steps,
        group_id=job.group_id,
        sample_idx=job.sample_idx,
        success=float(score.score or 0.0),
        reward=float(score.score or 0.0),
    )
    return traj, None, False


def play_oracle_episodes(
    pool: EnvPool,
    jobs: Sequence[EpisodeJob],
    *,
    max_steps: int,
    recovery_rate: float,
    max_misses: int,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    thoughts: str = "oracle",
    grammar: DemoGrammar = DemoGrammar(),
    progress=None,
) -> DemoResult:
    """Play every job with the oracle, at most `max_steps` oracle steps each (params own the limit); keep
    the successes (decision "Successful demos only"). A share `recovery_rate` of the episodes starts with
    1..`max_misses` untrained misses, which do not count against `max_steps` (decisions "Recovery demos",
    "Untrained misses" and "Misses beyond limit"; params' `demos` section). `min_pixels`/`max_pixels`: the
    policy's pixel budget (None: the oracles'). `grammar`: the policy's reply grammar and frame
    (decision "Demos in the policy's grammar")."""
    if not 0.0 <= recovery_rate <= 1.0:
        raise ValueError(f"recovery_rate must be in [0, 1], got {recovery_rate}")
    if max_misses < 1:
        raise ValueError(f"max_misses must be >= 1, got {max_misses}")
    if thoughts not in THOUGHT_STYLES:
        raise ValueError(f"thoughts must be one of {', '.join(THOUGHT_STYLES)}, got {thoughts!r}")
    queues: list[list[tuple[int, EpisodeJob]]] = [[] for _ in range(pool.n)]
    for i, job in enumerate(jobs):
        queues[i % pool.n].append((i, job))
    results: dict[int, Trajectory] = {}
    errors: list[str] = []
    n_failed = 0

    def work(env_idx: int) -> None:
        nonlocal n_failed
        for i, job in queues[env_idx]:
            for _ in range(ENV_RETRIES + 1):
                # decision "Fault replays": an env fault plays the same episode again
                rng = miss_rng(job)
                misses = planned_misses(rng, recovery_rate, max_misses)
                traj, err, env_fault = _play(
                    pool, env_idx, job, max_steps, min_pixels, max_pixels, misses, rng, thoughts, grammar
                )
                if not env_fault:
                    break
            if err:
                errors.append(err)
            elif traj.success > 0:
                results[i] = traj
            else:
                n_failed += 1
            if progress is not None:
                progress.update(1)

    with ThreadPoolExecutor(pool.n) as ex:
        list(ex.map(work, range(pool.n)))
    return DemoResult([results[i] for i in sorted(results)], n_failed, errors)
