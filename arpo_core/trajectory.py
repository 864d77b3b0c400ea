"""Step and Trajectory, and their Parquet form: the project's one data contract (docs/design.md).

Decisions:
- **Row per step.** One Parquet row per step; the trajectory's fields are repeated on each of its rows. A file
  is self-describing and can be filtered with any Parquet tool (e.g. `success == true and epoch == 3`).
- **PNG screenshots.** Screenshots are stored as PNG bytes, never as pixel tensors: a 160x210 MiniWoB frame is
  a few KB, and the reference code's fp32 processor tensors cost ~0.75 GB per 1080p trajectory (docs/method.md
  §1). A trajectory is re-tokenised from these rows whenever it is trained on or replayed.
- **Token ids kept.** Generated token ids are kept per step (optional) so a replayed or re-trained reply is
  scored on the exact tokens that were sampled, not on a re-tokenisation of its text.
- **Atomic writes.** Writes are atomic: a temp file in the same directory, fsync, then `os.replace`. A reader
  never sees a half-written file, and a run killed mid-write leaves the previous file intact.
- **Checked schema.** Reading checks the schema and names the missing or mistyped column instead of failing
  later.
- **Defaulted added columns.** Columns added after the first release carry a default (`_ADDED_STEP_COLUMNS`):
  a file written before a column existed reads with that default, so old Parquet files stay readable; a column
  that is present must still have the right type. The first such column is `train_reply` (False: the reply is
  context, never a target, e.g. a demo's deliberate miss, arpo_core/offline/demonstrations.py).
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from arpo_core.infra.errors import InputError
from arpo_core.infra.fileio import atomic_open

__all__ = [
    "SCHEMA",
    "SchemaError",
    "Step",
    "Trajectory",
    "png_bytes",
    "read_trajectories",
    "trajectories_from_table",
    "trajectories_to_table",
    "write_trajectories",
]


class SchemaError(InputError):
    """A Parquet file that does not follow the trajectory schema; the message names the column. A bad
    input: not retried (errors.py, decision "NotRetryable marker")."""


def png_bytes(image: Image.Image) -> bytes:
    """Encode a PIL image as PNG bytes (the only screenshot form stored on disk)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@dataclass
class Step:
    """One turn: the screenshot the agent saw, what it answered, and what happened."""

    step_idx: int
    screenshot_png: bytes
    screen_w: int
    screen_h: int
    response_text: str = ""
    actions_json: str = "[]"
    """The parsed actions (screen coordinates) as JSON; '[]' when the reply did not parse."""
    parse_ok: bool = True
    done: bool = False
    env_error: str = ""
    """Empty when the environment behaved; otherwise what went wrong (not the policy's fault)."""
    gen_logprob_sum: float = 0.0
    """Sum of the behaviour policy's log-probs of the reply tokens (0.0 when not generated, e.g. demos)."""
    response_token_ids: list[int] = field(default_factory=list)
    """Token ids the generator sampled for this reply (empty for demos; then the text is tokenised)."""
    train_reply: bool = True
    """False: the reply is context only and is never a training target (its tokens are outside the
    assistant mask, policy/sequences.py); e.g. a recovery demo's deliberate miss (arpo_core/offline/demonstrations.py)."""

    def image(self) -> Image.Image:
        return Image.open(io.BytesIO(self.screenshot_png)).convert("RGB")

    def actions(self) -> list[dict]:
        return json.loads(self.actions_json)


@dataclass
class Trajectory:
    """One episode of one task. `reward` is the trained reward (success + format term, docs/method.md §1)."""

    run_id: str
    stage: str
    epoch: int
    task_domain: str
    task_id: str
    instruction: str
    steps: list[Step]
    group_id: int = 0
    sample_idx: int = 0
    success: float = 0.0
    """The environment checker's score in [0, 1] (OSWorld can give fractions)."""
    reward: float = 0.0
    replayed: bool = False
    """True when this trajectory came from the replay buffer rather than a fresh rollout."""
    policy_version: int = 0

    @property
    def key(self) -> tuple[str, str]:
        """Replay/selection key: OSWorld ids repeat across domains, so (domain, id)."""
        return (self.task_domain, self.task_id)

    @property
    def format_error(self) -> bool:
        return any(not s.parse_ok for s in self.steps)

    @property
    def env_error(self) -> str:
        return next((s.env_error for s in self.steps if s.env_error), "")

    def with_(self, **changes) -> Trajectory:
        return replace(self, **changes)


_TRAJ_FIELDS = [
    ("run_id", pa.string()),
    ("stage", pa.string()),
    ("epoch", pa.int32()),
    ("task_domain", pa.string()),
    ("task_id", pa.string()),
    ("group_id", pa.int32()),
    ("sample_idx", pa.int32()),
    ("instruction", pa.string()),
    ("success", pa.float64()),
    ("reward", pa.float64()),
    ("replayed", pa.bool_()),
    ("policy_version", pa.int32()),
]
_STEP_FIELDS = [
    ("step_idx", pa.int32()),
    ("screenshot_png", pa.binary()),
    ("screen_w", pa.int32()),
    ("screen_h", pa.int32()),
    ("response_text", pa.string()),
    ("actions_json", pa.string()),
    ("parse_ok", pa.bool_()),
    ("done", pa.bool_()),
    ("env_error", pa.string()),
    ("gen_logprob_sum", pa.float64()),
    ("response_token_ids", pa.list_(pa.int32())),
    ("train_reply", pa.bool_()),
]
_ADDED_STEP_COLUMNS: dict[str, object] = {"train_reply": True}
"""Step columns newer than the first schema -> the value of rows of files written without them
(decision "Defaulted added columns")."""
SCHEMA = pa.schema(_TRAJ_FIELDS + _STEP_FIELDS)
_TRAJ_NAMES = [n for n, _ in _TRAJ_FIELDS]
_STEP_NAMES = [n for n, _ in _STEP_FIELDS]
assert set(_TRAJ_NAMES) | {"steps"} == {f.name for f in fields(Trajectory)}
assert set(_STEP_NAMES) == {f.name for f in fields(Step)}


def trajectories_to_table(trajs: Iterable[Trajectory]) -> pa.Table:
    cols: dict[str, list] = {name: [] for name in SCHEMA.names}
    for t in trajs:
        if not t.steps:
            raise ValueError(f"trajectory {t.task_domain}/{t.task_id} #{t.sample_idx} has no steps")
        for s in t.steps:
            for name in _TRAJ_NAMES:
                cols[name].append(getattr(t, name))
            for name in _STEP_NAMES:
                cols[name].append(getattr(s, name))
    return pa.table(cols, schema=SCHEMA)


def _check_schema(schema: pa.Schema, where: str) -> None:
    for f in SCHEMA:
        if f.name not in schema.names:
            if f.name in _ADDED_STEP_COLUMNS:
                continue
            raise SchemaError(f"{where}: missing column {f.name!r} (expected {f.type})")
        got = schema.field(f.name).type
        if got != f.type:
            raise SchemaError(f"{where}: column {f.name!r} has type {got}, expected {f.type}")


def trajectories_from_table(table: pa.Table, where: str = "table") -> list[Trajectory]:
    """Rebuild trajectories from rows; rows of one trajectory must be contiguous (as written)."""
    _check_schema(table.schema, where)
    for name, default in _ADDED_STEP_COLUMNS.items():
        # decision "Defaulted added columns": a file older than the column
        if name not in table.schema.names:
            table = table.append_column(
                pa.field(name, SCHEMA.field(name).type),
                pa.array([default] * table.num_rows, SCHEMA.field(name).type),
            )
    rows = table.select(SCHEMA.names).to_pylist()
    out: list[Trajectory] = []
    prev_key = None
    for r in rows:
        key = tuple(r[n] for n in _TRAJ_NAMES)
        step = Step(**{n: r[n] for n in _STEP_NAMES})
        if step.response_token_ids is None:
            step.response_token_ids = []
        if key != prev_key or step.step_idx == 0:
            out.append(Trajectory(steps=[step], **{n: r[n] for n in _TRAJ_NAMES}))
            prev_key = key
        else:
            out[-1].steps.append(step)
    return out


def write_trajectories(path: str | os.PathLike, trajs: Sequence[Trajectory]) -> Path:
    """Write atomically: temp file in the target directory, fsync, rename. Returns the path. On a full
    disk the error says how much the table needs (its Arrow size: the PNG screenshots that dominate it
    do not compress) and how much is free (fileio.py, decision "Clear output errors")."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = trajectories_to_table(trajs)
    with atomic_open(path, needed=table.nbytes) as f:
        pq.write_table(table, f, compression="zstd")
    return path


def read_trajectories(path: str | os.PathLike) -> list[Trajectory]:
    """Read a file (or every *.parquet file of a directory, in name order) written by write_trajectories."""
    path = Path(path)
    if path.is_dir():
        out: list[Trajectory] = []
        for p in sorted(path.glob("*.parquet")):
            out.extend(read_trajectories(p))
        return out
    if not path.exists():
        raise FileNotFoundError(f"no trajectory file at {path}")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:  # truncated, or not Parquet at all: one line naming it
        raise InputError(f"{path} is not a readable trajectory file ({type(e).__name__}: {e})") from e
    return trajectories_from_table(table, where=str(path))
