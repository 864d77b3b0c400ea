"""Tasks and task suites: `TaskSpec`, the suite file format and its one parser (YAML only, no torch, no
browser), so params can validate every suite when they load.

Decisions:
- **Domain and id key.** A task is identified by `(domain, task_id)` (`TaskSpec.key`): OSWorld ids repeat
  across domains, so the id alone is not a key.
- **Suite files.** Suites are YAML files under `data/suites/` (in git): a header with defaults and the list of
  tasks. Every problem with a file is one `SuiteError` line naming the file and, where there is one, the line:
  a YAML syntax error (line and column), a file that is not a mapping with a `tasks` list, no tasks,
  unknown keys, an entry without a task id, a duplicate task, a bad `instances` / `seeds` value.
  `suite_problem(path)` returns that line instead of raising, for the params loader, so `arpo params`,
  `arpo run`, `arpo stage` and the DVC and Prefect front doors all fail on a broken suite at once.
- **Fixed instances.** Fixed instances (the paper's protocol): in OSWorld a task is ONE instance - one JSON
  config, the same desktop and instruction every time - so the replay buffer holds successes of that very
  instance, selection keeps instances, and the in-domain numbers are measured on the training instances. A
  MiniWoB task name is a family: each env seed draws another instance. A suite entry pins instances
  with `instances: N` (N instances, seeds derived from the suite's name, the domain, the task and the
  index with `seeds.derive_seed`, so they are stable anywhere and disjoint between tasks) or
  `seeds: [...]` (explicit env seeds). Each pinned instance is a task of its own: `click-link@0017`
  (index) or `click-link@s4242` (explicit seed), with its own key, GRPO group, baseline row, selection
  verdict, replay key and per-task metrics; `TaskSpec.seed` is its env seed, which every episode of
  it plays whatever seed the job list proposes (rollout.py `EpisodeJob`), and `family` is the env's
  task name (`click-link`). An entry without either stays a family (every episode a fresh instance),
  as before; OSWorld tasks already are instances and keep working unchanged.
- **Task families.** `families(tasks)`: the task families of a list (pinned instances folded back to their
  family, in first-seen order): what demonstrations and held-out evaluation play, on their own seeds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from arpo_core.infra.seeds import derive_seed

__all__ = [
    "INSTANCE_SEED_BITS",
    "SuiteError",
    "TaskSpec",
    "families",
    "instance_seed",
    "load_suite",
    "pinned_seeds",
    "suite_problem",
]

INSTANCE_SEED_BITS = 40
"""Derived instance seeds stay below 2^40: MiniWoB hands them to JavaScript (exact below 2^53)."""

_SUITE_KEYS = {"name", "domain", "backend", "split", "feasible", "rationale", "config", "tasks", "instances"}
_TASK_KEYS = {
    "task_id",
    "instruction",
    "feasible",
    "split",
    "domain",
    "backend",
    "config",
    "note",
    "instances",
    "seeds",
}
_MAX_INSTANCES = 100_000


class SuiteError(ValueError):
    """A suite file that cannot be used; the message is one line naming the file (and line)."""


@dataclass(frozen=True)
class TaskSpec:
    """One task of a suite; hashable so it can key dicts and sets."""

    domain: str
    """Task family's domain, e.g. "miniwob" or an OSWorld domain such as "chrome"."""
    task_id: str
    """Task name inside the domain, e.g. "click-button"; a pinned instance's is `family@index`."""
    instruction: str = ""
    """Fixed instruction; "" when the env supplies it per episode (MiniWoB's utterance)."""
    split: str = "in_domain"
    """Suite split: "in_domain", "out_of_domain", ..."""
    feasible: bool = True
    """False for tasks whose right answer is to give up (OSWorld `infeasible`)."""
    backend: str = "miniwob"
    """Which env implementation runs the task ("miniwob", "osworld")."""
    config: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    """Backend-specific settings (e.g. MiniWoB data_mode); not part of the identity."""
    seed: int | None = None
    """A pinned instance's env seed (decision "Fixed instances"): every episode of the task plays this
    instance. None: a family, each episode on the seed its job gives."""

    @property
    def key(self) -> tuple[str, str]:
        """(domain, task_id): the replay-buffer / statistics key."""
        return (self.domain, self.task_id)

    @property
    def family(self) -> str:
        """The env's task name: `task_id` without a pinned instance's `@...` suffix."""
        return self.task_id.split("@", 1)[0] if self.seed is not None else self.task_id

    @property
    def pinned(self) -> bool:
        return self.seed is not None


def instance_seed(suite: str, domain: str, task_id: str, index: int) -> int:
    """Env seed of instance `index` of `task_id` in suite `suite` (decision "Fixed instances")."""
    return derive_seed("instance", suite, domain, task_id, index, bits=INSTANCE_SEED_BITS)


def families(tasks: Iterable[TaskSpec]) -> list[TaskSpec]:
    """Decision "Task families": each task's family once, in first-seen order (unpinned tasks as they are)."""
    out: dict[tuple[str, str], TaskSpec] = {}
    for t in tasks:
        fam = replace(t, task_id=t.family, seed=None) if t.pinned else t
        out.setdefault(fam.key, fam)
    return list(out.values())


# --------------------------------------------------------------------------------------------------
# The parser (decision "Suite files"): YAML nodes, so every problem can name its line.


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _construct(node: yaml.Node) -> Any:
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_object(node, deep=True)
    finally:
        loader.dispose()


def _mapping(node: yaml.MappingNode, where: str) -> dict[str, tuple[yaml.Node, yaml.Node]]:
    out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
    for k, v in node.value:
        if not isinstance(k, yaml.ScalarNode):
            raise SuiteError(f"{where}:{_line(k)}: keys must be plain names")
        if k.value in out:
            raise SuiteError(f"{where}:{_line(k)}: key {k.value!r} written twice")
        out[k.value] = (k, v)
    return out


def _count(value: Any, where: str, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX_INSTANCES:
        raise SuiteError(f"{where}: {what} must be an integer in [1, {_MAX_INSTANCES}], got {value!r}")
    return value


def _seeds(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise SuiteError(f"{where}: seeds must be a non-empty list of env seeds, got {value!r}")
    for s in value:
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < 1 << 53:
            raise SuiteError(f"{where}: seeds must be integers in [0, 2^53), got {s!r}")
    if len(set(value)) != len(value):
        raise SuiteError(f"{where}: seeds lists a seed twice")
    return list(value)


def load_suite(path: str | Path) -> list[TaskSpec]:
    """Read a suite YAML into TaskSpecs (pinned instances expanded, decision "Fixed instances").

    The file holds defaults (`domain`, `backend`, `split`, `feasible`, `config`, `instances`), an
    optional `name` (default: the file's stem; part of derived instance seeds), a free-text
    `rationale`, and `tasks`: a list of task ids or mappings that override the defaults per task
    (`instances: N` or `seeds: [...]` pin instances). Raises `SuiteError` (decision "Suite files").
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise SuiteError(f"{path}: cannot read the suite file ({e.strerror or e})") from None
    try:
        root = yaml.compose(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        raise SuiteError(f"{path}{at}: YAML syntax error: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise SuiteError(f"{path}: YAML error: {e}") from None
    if not isinstance(root, yaml.MappingNode):
        raise SuiteError(f"{path}: a suite is a mapping with a 'tasks' list (see data/suites/)")
    top = _mapping(root, str(path))
    unknown = sorted(set(top) - _SUITE_KEYS)
    if unknown:
        raise SuiteError(f"{path}:{_line(top[unknown[0]][0])}: unknown suite key(s) {unknown}")
    if "tasks" not in top:
        raise SuiteError(f"{path}: a suite is a mapping with a 'tasks' list; this one has no 'tasks'")
    tasks_node = top["tasks"][1]
    if not isinstance(tasks_node, yaml.SequenceNode):
        raise SuiteError(f"{path}:{_line(tasks_node)}: 'tasks' must be a list of task ids or mappings")
    if not tasks_node.value:
        raise SuiteError(f"{path}:{_line(tasks_node)}: the suite lists no tasks")
    head = {k: _construct(v) for k, (_, v) in top.items() if k != "tasks"}
    for k in ("domain", "backend", "split", "name"):
        if k in head and not isinstance(head[k], str):
            raise SuiteError(f"{path}:{_line(top[k][1])}: {k} must be a string, got {head[k]!r}")
    if "config" in head and not isinstance(head["config"] or {}, dict):
        raise SuiteError(f"{path}:{_line(top['config'][1])}: config must be a mapping")
    name = head.get("name", path.stem)
    defaults = {
        "domain": head.get("domain", "miniwob"),
        "backend": head.get("backend", "miniwob"),
        "split": head.get("split", "in_domain"),
        "feasible": bool(head.get("feasible", True)),
        "config": dict(head.get("config") or {}),
    }
    default_instances = (
        _count(head["instances"], f"{path}:{_line(top['instances'][1])}", "instances")
        if "instances" in head
        else None
    )
    specs: list[TaskSpec] = []
    seen: dict[tuple[str, str], int] = {}
    for i, node in enumerate(tasks_node.value):
        where = f"{path}:{_line(node)}"
        if isinstance(node, yaml.ScalarNode):
            entry: dict[str, Any] = {"task_id": _construct(node)}
        elif isinstance(node, yaml.MappingNode):
            fields = _mapping(node, str(path))
            unknown = sorted(set(fields) - _TASK_KEYS)
            if unknown:
                raise SuiteError(
                    f"{path}:{_line(fields[unknown[0]][0])}: task #{i}: unknown key(s) {unknown}"
                )
            entry = {k: _construct(v) for k, (_, v) in fields.items()}
        else:
            raise SuiteError(f"{where}: task #{i} must be a task id or a mapping")
        if "task_id" not in entry:
            raise SuiteError(f"{where}: task #{i} has no task_id")
        task_id = entry["task_id"]
        if not isinstance(task_id, str) or not task_id or "@" in task_id:
            raise SuiteError(
                f"{where}: task #{i}: task_id must be a non-empty name without '@', got {task_id!r}"
            )
        if "instances" in entry and "seeds" in entry:
            raise SuiteError(f"{where}: task {task_id}: give instances or seeds, not both")
        entry.pop("note", None)
        instances = entry.pop("instances", default_instances)
        seeds = entry.pop("seeds", None)
        if not isinstance(entry.get("config") or {}, dict):
            raise SuiteError(f"{where}: task {task_id}: config must be a mapping")
        merged = {**defaults, **entry, "config": {**defaults["config"], **(entry.get("config") or {})}}
        merged["feasible"] = bool(merged["feasible"])
        if seeds is not None:
            pinned = [(f"{task_id}@s{s}", s) for s in _seeds(seeds, f"{where}: task {task_id}")]
        elif instances is not None:
            n = _count(instances, f"{where}: task {task_id}", "instances")
            pinned = [
                (f"{task_id}@{k:04d}", instance_seed(name, merged["domain"], task_id, k)) for k in range(n)
            ]
        else:
            pinned = [(task_id, None)]
        if pinned[0][1] is not None and merged["backend"] != "miniwob":
            raise SuiteError(
                f"{where}: task {task_id}: only MiniWoB tasks pin instances ({merged['backend']} tasks already are instances)"
            )
        for tid, seed in pinned:
            spec = TaskSpec(**{**merged, "task_id": tid}, seed=seed)
            if spec.key in seen:
                raise SuiteError(
                    f"{where}: duplicate task {spec.domain}/{tid} (first at line {seen[spec.key]})"
                )
            seen[spec.key] = _line(node)
            specs.append(spec)
    return specs


def suite_problem(path: str | Path) -> str | None:
    """Decision "Suite files": `load_suite`'s error line for `path`, or None when the suite loads (or is
    missing: a missing file is the params path check's error)."""
    if not Path(path).is_file():
        return None
    try:
        load_suite(path)
    except SuiteError as e:
        return str(e)
    return None


def pinned_seeds(tasks: Sequence[TaskSpec]) -> dict[tuple[str, str], set[int]]:
    """{(domain, family): env seeds of its pinned instances} over `tasks`."""
    out: dict[tuple[str, str], set[int]] = {}
    for t in tasks:
        if t.pinned:
            out.setdefault((t.domain, t.family), set()).add(int(t.seed))
    return out
