"""Type and range checks of the config dataclasses' fields, shared by the params loader (config.py) and
the sections that check themselves when built in code (replay.py's `ReplayConfig`, selection.py's
`SelectConfig`, config.py's ground sections). A leaf module: it imports nothing from arpo_core, so those
modules use it without an import cycle through config.py.

Decisions:
- **Declared ranges.** A range is declared on the field it constrains, as annotated_types metadata
  (`lr: Annotated[float, Gt(0)]`, `clip_dual: Annotated[float, Gt(1)] | None`, list items and mapping
  values too: `dict[str, Annotated[float, Gt(0)]]`), and checked after type coercion, so the rule and
  the field stay together. Supported: Gt, Ge, Lt, Le, Interval, MinLen, MaxLen, Len and `ExistingPath`;
  any other metadata is a programming error (TypeError), never silently ignored.
- **Strict types.** Types are strict: bool is not an int, an int is accepted for a float, floats must be
  finite (YAML's .nan / .inf are errors).
- **Cross-field rules.** A rule across fields is the section's `cross_checks()` method, run by `build` after
  the section is made (the loader's path). `check_fields`, which the sections that validate on construction
  call from `__post_init__`, checks fields only: code builds partial configs freely (e.g. a DPOConfig whose
  micro-batch exceeds a tiny test's batch).
- **Located errors.** Every error names the dotted key, the value as written, the rule and, when loading, the
  source that set the key (`Provenance`): `train.loss.clip_low = 1.5 is out of range: must be < 1 (set by
  command-line override -S train.loss.clip_low=1.5)`. A key no source set is a dataclass default.
- **No Pydantic.** Pydantic is not used: its lax coercion ("3" -> 3) and validation on every construction are
  not wanted (decision "Cross-field rules"), and the few annotated_types constraint classes are checked here
  in a few lines.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import operator
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn, TypeVar

import annotated_types as at

__all__ = [
    "ConfigError",
    "Context",
    "CrossChecks",
    "ExistingPath",
    "KeyPath",
    "Provenance",
    "Source",
    "build",
    "check_fields",
    "coerce",
    "dotted",
]

T = TypeVar("T")

CrossChecks = Iterator[tuple[str, str, tuple[str, ...]]]
"""What a section's `cross_checks()` yields: (field it blames, rule, other fields involved); field names
are relative to the section (dotted for `Params`, e.g. 'select.min_successes'). A rule is a bound
("must be <= mini_batch_size": the key "is out of range") or says its own verb ("is not a usable suite:
...")."""


class ConfigError(ValueError):
    """A params file that does not match the config dataclasses; the message names key, value and source."""


@dataclass(frozen=True)
class ExistingPath:
    """Range marker of a path field: the path must exist when params load (`load_params`). Relative paths
    are read from the working directory, as the stages open them. `checkpoint`: a directory holding a
    model's config.json."""

    checkpoint: bool = False
    """A checkpoint directory (config.json inside) rather than a file."""


# --------------------------------------------------------------------------------------------------
# Provenance: which source set each key

KeyPath = tuple[Any, ...]
"""A key as a path: ('train', 'loss', 'clip_low'), ('ground', 'phases', 0, 'steps')."""


def dotted(path: KeyPath) -> str:
    """('ground', 'phases', 0, 'mix', 'box1') -> 'ground.phases[0].mix.box1'."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out


@dataclass(frozen=True)
class Source:
    """Where a value came from: `kind` 'params file', 'preset' or 'command-line override'; `where` the
    file (with the line when known) or the override as given."""

    kind: str
    """What set the value."""
    where: str
    """'params.yaml:87', 'presets/quick.yaml:12', '-S train.optimizer.lr=abc'."""

    def __str__(self) -> str:
        return f"{self.kind} {self.where}"


class Provenance:
    """For every key of a raw params mapping, the source that last set it (params file < preset <
    override). A list accounts for everything below it (a phase's keys that it leaves out come from the
    list's source too); mappings are recorded key by key, so a section key that no source wrote has no
    source: it is the dataclass default."""

    def __init__(self) -> None:
        self._at: dict[KeyPath, Source] = {}
        self._merged: set[KeyPath] = set()  # mapping nodes that sources merge into key by key

    def replace(self, path: KeyPath, value: Any, source_at: Callable[[KeyPath], Source]) -> None:
        """`value` was set at `path` as a whole: it and everything below it come from `source_at`."""
        n = len(path)
        for p in [p for p in self._at if len(p) > n and p[:n] == path]:
            del self._at[p]
            self._merged.discard(p)
        self._record(path, value, source_at)

    def touch(self, path: KeyPath, source: Source) -> None:
        """A mapping at `path` was merged into by `source` (it names the mapping itself in errors)."""
        self._at[path] = source
        self._merged.add(path)

    def _record(self, path: KeyPath, value: Any, source_at: Callable[[KeyPath], Source]) -> None:
        self._at[path] = source_at(path)
        self._merged.discard(path)
        if isinstance(value, Mapping):
            self._merged.add(path)
            for k, v in value.items():
                self._record((*path, k), v, source_at)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                self._record((*path, i), v, source_at)

    def source(self, path: KeyPath) -> Source | None:
        """The source of the key at `path`, or None for a default."""
        if path in self._at:
            return self._at[path]
        for i in range(len(path) - 1, 0, -1):  # inside a value set as a whole (a list item's key)
            if path[:i] in self._at and path[:i] not in self._merged:
                return self._at[path[:i]]
        return None


# --------------------------------------------------------------------------------------------------
# Coercion and range checks


@dataclass(frozen=True)
class Context:
    """How values are checked: where they came from, and whether paths are looked up."""

    provenance: Provenance | None
    """None: values from code (`check_fields`), errors name no source."""
    check_paths: bool = False
    """Check `ExistingPath` fields against the filesystem."""

    def origin(self, path: KeyPath) -> str:
        src = self.provenance.source(path) if self.provenance else None
        return f"set by {src}" if src else "default value"

    def where(self, path: KeyPath) -> str:
        return f" ({self.origin(path)})" if self.provenance else ""


def _fail(ctx: Context, path: KeyPath, value: Any, problem: str) -> NoReturn:
    raise ConfigError(f"{dotted(path)} = {value!r} {problem}{ctx.where(path)}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def _describe(tp: Any) -> str:
    """An annotation in words: 'an integer', 'a number or null', "one of ['k1', 'k2']"."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        return _describe(typing.get_args(tp)[0])
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is Literal:
        return f"one of {list(typing.get_args(tp))}"
    if dataclasses.is_dataclass(tp):
        return "a section (a mapping of keys)"
    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    words |= {type(None): "null", list: "a list", tuple: "a list", Sequence: "a list", dict: "a mapping"}
    return words.get(origin or tp, _type_name(tp))


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


_COMPARISONS: dict[type, tuple[str, str, Callable[[Any, Any], bool]]] = {
    at.Gt: (">", "gt", operator.gt),
    at.Ge: (">=", "ge", operator.ge),
    at.Lt: ("<", "lt", operator.lt),
    at.Le: ("<=", "le", operator.le),
}


def _broken(value: Any, rule: Any, ctx: Context) -> tuple[str, str] | None:
    """(what is wrong, the rule) when `value` breaks one range `rule`, else None."""
    if type(rule) in _COMPARISONS:
        op, attr, holds = _COMPARISONS[type(rule)]
        bound = getattr(rule, attr)
        return None if holds(value, bound) else ("is out of range", f"must be {op} {bound}")
    if isinstance(rule, at.MinLen | at.MaxLen):
        unit = "character" if isinstance(value, str) else "item"
        if isinstance(rule, at.MinLen):
            n, ok, what, most = rule.min_length, len(value) >= rule.min_length, "is too short", "at least"
        else:
            n, ok, what, most = rule.max_length, len(value) <= rule.max_length, "is too long", "at most"
        return None if ok else (what, f"must have {most} {n} {unit}{'s' if n != 1 else ''}")
    if isinstance(rule, ExistingPath):
        if not ctx.check_paths:
            return None
        full = Path(value) if Path(value).is_absolute() else Path.cwd() / value
        relative = (
            "" if Path(value).is_absolute() else " (relative paths are read from the working directory)"
        )
        if rule.checkpoint and not (full / "config.json").is_file():
            return (
                "is not a checkpoint",
                f"must be a directory holding config.json; no {full / 'config.json'}{relative}",
            )
        if not rule.checkpoint and not full.is_file():
            return "does not exist", f"must be an existing file; no {full}{relative}"
        return None
    raise TypeError(f"unsupported range rule {rule!r}")


def _check_rules(
    value: Any, rules: Sequence[Any], path: KeyPath, ctx: Context, or_null: bool, shown: Any
) -> None:
    """Raise for the first of `rules` that `value` breaks; the message shows the value as written."""
    for group in rules:
        for rule in group if isinstance(group, at.GroupedMetadata) else (group,):
            broken = _broken(value, rule, ctx)
            if broken:
                what, text = broken
                numeric = type(rule) in _COMPARISONS
                _fail(ctx, path, shown, f"{what}: {text}{' (or null)' if or_null and numeric else ''}")


def coerce(
    value: Any, tp: Any, path: KeyPath, ctx: Context, check: bool = True, or_null: bool = False
) -> Any:
    """Check `value` against annotation `tp` (types, then the declared ranges when `check`), converting
    nested mappings into dataclasses."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        inner, *rules = typing.get_args(tp)
        coerced = coerce(value, inner, path, ctx, check)
        if check:
            _check_rules(coerced, rules, path, ctx, or_null, shown=value)
        return coerced
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):  # built in code (`check_fields`)
            return value
        if not isinstance(value, Mapping):
            _fail(ctx, path, value, f"is not {_describe(tp)}")
        return build(tp, value, path, ctx)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:  # the first member whose type fits; its range errors are then the ones to report
                coerce(value, arg, path, ctx, check=False)
            except ConfigError:
                continue
            return coerce(value, arg, path, ctx, check, or_null=type(None) in args)
        _fail(ctx, path, value, f"is not {_describe(tp)}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            _fail(ctx, path, value, f"is not {_describe(tp)}")
        return value
    if origin in (list, tuple, Sequence):
        if not isinstance(value, list | tuple):
            _fail(ctx, path, value, "is not a list")
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        items = [coerce(v, item_tp, (*path, i), ctx, check) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, Mapping):
            _fail(ctx, path, value, "is not a mapping")
        key_tp, value_tp = typing.get_args(tp) or (Any, Any)
        return {
            coerce(k, key_tp, (*path, k), ctx, check): coerce(v, value_tp, (*path, k), ctx, check)
            for k, v in value.items()
        }
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            _fail(ctx, path, value, "is not true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            _fail(ctx, path, value, "is not an integer")
        return int(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            _fail(ctx, path, value, "is not a number")
        if not math.isfinite(value):
            _fail(ctx, path, value, "is not a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            _fail(ctx, path, value, "is not a string")
        return value
    raise ConfigError(f"{dotted(path)}: unsupported annotation {tp!r}")


def _subsection_keys(tp: Any) -> frozenset[str]:
    """The keys of a sub-section type (`OptimizerConfig` for `train.optimizer`), else none."""
    return frozenset(f.name for f in dataclasses.fields(tp)) if dataclasses.is_dataclass(tp) else frozenset()


def _over_default(cls: type, name: str, value: Any) -> Any:
    """A sub-section given in part takes its missing keys from the parent's default for it, not from the
    sub-section class: `train: {optimizer: {lr: 1e-5}}` keeps train's weight decay 1e-2 (its default
    factory's), not `OptimizerConfig`'s 0.0. Only the values the parent's default sets differently from
    the class (or that the class leaves without default) are filled in."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if not isinstance(value, Mapping) or f.default_factory is dataclasses.MISSING:
        return value
    default = f.default_factory()
    if not dataclasses.is_dataclass(default):
        return value
    own = {g.name: g for g in dataclasses.fields(default)}
    filled = {}
    for key, g in own.items():
        if key in value:
            continue
        v = getattr(default, key)
        if g.default is not dataclasses.MISSING:
            base = g.default
        elif g.default_factory is not dataclasses.MISSING:
            base = g.default_factory()
        else:
            filled[key] = v
            continue
        if v != base:
            filled[key] = v
    return {**filled, **value} if filled else value


def build(cls: type[T], raw: Mapping[str, Any], path: KeyPath, ctx: Context) -> T:
    """Section `cls` from the raw mapping found at `path`: unknown keys, then each value's type and ranges
    (`coerce`), then the section's `cross_checks()`; every error names key, value and source."""
    hints = _hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in known:
            section = f"section '{dotted(path)}'" if path else "the top level"
            moved = next((s for s in known if key in _subsection_keys(hints[s])), None)
            hint = f"; it now lives in '{dotted((*path, moved, key))}'" if moved else ""
            raise ConfigError(
                f"unknown key '{key}' in {section} ({ctx.origin((*path, key))}){hint}; "
                f"known keys: {', '.join(sorted(known))}"
            )
    kwargs = {k: coerce(_over_default(cls, k, v), hints[k], (*path, k), ctx) for k, v in raw.items()}
    try:
        obj = cls(**kwargs)
    except (ValueError, TypeError) as e:  # a section's own __post_init__ (the loader checked first)
        raise ConfigError(f"section '{dotted(path) or '<top>'}': {e}") from e
    for name, rule, involved in obj.cross_checks() if hasattr(obj, "cross_checks") else ():
        key = (*path, *name.split("."))
        others = "; ".join(
            f"{dotted(k)} = {_lookup(obj, o)!r} {ctx.origin(k)}"
            for o in involved
            for k in [(*path, *o.split("."))]
        )
        where = f"{ctx.origin(key)}; {others}" if others else ctx.origin(key)
        # A rule that says its own verb ("is not a usable suite: ...") stands as it is.
        verb = rule if rule.startswith("is ") else f"is out of range: {rule}"
        raise ConfigError(f"{dotted(key)} = {_lookup(obj, name)!r} {verb} ({where})")
    return obj


# ------------------------------------------------------------------------------------------------
# Suite files: every MiniWoB task a suite names exists (issue 17)


@functools.cache
def miniwob_task_names() -> frozenset[str] | None:
    """The MiniWoB++ task ids the installed `miniwob` package ships (its html/miniwob/*.html pages), or
    None without the package. Found without importing it (importing it pulls in selenium)."""
    import importlib.util

    spec = importlib.util.find_spec("miniwob")
    if spec is None or not spec.submodule_search_locations:
        return None
    pages = Path(next(iter(spec.submodule_search_locations))) / "html" / "miniwob"
    names = frozenset(p.stem for p in pages.glob("*.html"))
    return names or None


def unknown_suite_task(path: str | Path) -> str | None:
    """Why suite file `path` cannot be played, for its first MiniWoB task entry naming no MiniWoB task:
    "names no MiniWoB task: 'click-buton' (data/suites/x.yaml:21); closest known: click-button, ..."
    (difflib's closest names). None when every MiniWoB entry exists, the file is unreadable (its own
    checks report that) or the package is missing."""
    import difflib

    import yaml

    known = miniwob_task_names()
    if known is None:
        return None
    try:
        root = yaml.compose(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(root, yaml.MappingNode):
        return None
    top = {k.value: v for k, v in root.value if isinstance(k, yaml.ScalarNode)}
    default_backend = top["backend"].value if isinstance(top.get("backend"), yaml.ScalarNode) else "miniwob"
    tasks = top.get("tasks")
    for node in tasks.value if isinstance(tasks, yaml.SequenceNode) else ():
        backend, task = default_backend, node
        if isinstance(node, yaml.MappingNode):
            entry = {k.value: v for k, v in node.value if isinstance(k, yaml.ScalarNode)}
            task = entry.get("task_id")
            if isinstance(entry.get("backend"), yaml.ScalarNode):
                backend = entry["backend"].value
        if backend != "miniwob" or not isinstance(task, yaml.ScalarNode) or task.value in known:
            continue
        close = difflib.get_close_matches(task.value, sorted(known), n=3, cutoff=0.6)
        hint = f"; closest known: {', '.join(close)}" if close else "; no known task is close"
        return f"names no MiniWoB task: {task.value!r} ({path}:{task.start_mark.line + 1}){hint}"
    return None


def _lookup(obj: Any, name: str) -> Any:
    for part in name.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)  # a list's item: "phases.1.seed"
    return obj


def check_fields(obj: Any) -> None:
    """Check a config dataclass built in code against its declared types and ranges (what the loader
    checks, without sources, paths and cross-field rules); a ConfigError (a ValueError) names the field.
    Called by the `__post_init__` of the sections that validate on construction
    (decision "Cross-field rules")."""
    cls = type(obj)
    ctx = Context(provenance=None)
    for f in dataclasses.fields(cls):
        coerce(getattr(obj, f.name), _hints(cls)[f.name], (cls.__name__, f.name), ctx)
