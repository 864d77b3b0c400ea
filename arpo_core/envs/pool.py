"""Parallel GUI env workers: each env in its own process (own process group), or hosted by Ray actors.

Design decisions:
- **Worker process groups.** One env = one worker process started with `start_new_session=True`, so the
  worker, its chromedriver and every Chromium process share one process group that `os.killpg` removes in one
  call (killing only the Python process leaves the browser running, docs/method.md §6). Workers are plain
  `python -c` worker subprocesses (entry `worker_main`) speaking pickled messages over a socketpair, not
  multiprocessing children: no fork of a parent holding torch threads, no `__main__` re-import, and
  the same code runs unchanged inside a Ray actor.
- **No orphans.** No orphans, even when the parent is SIGKILLed: a watchdog thread in the worker polls its
  parent pid (every 0.2 s) and kills its own process group once the parent is gone; `close()` asks each
  worker to close its env and then kills the group anyway. A worker that is itself SIGKILLed (OOM
  killer; Ray kills the direct children of a dead actor) cannot clean up, so each worker also starts
  a tiny reaper process that waits for the worker's death, kills the group and removes the
  worker's private TMPDIR (browser profiles; ~2.5 MB each would otherwise pile up in /tmp).
  Chromium's crash handlers leave the group; the browser's own reaper kills them (miniwob_env.py,
  decision "Process hygiene"). PR_SET_PDEATHSIG was not used: it fires when the *thread* that spawned the
  child exits, and the pool restarts workers from its per-env threads, Ray from arbitrary actor threads.
- **Errors are results.** Errors are results, not exceptions: every call returns an `EnvResult` whose `error`
  is set when the worker timed out or crashed, its env raised, or a step reported `info["error"]`. A worker
  that timed out, crashed, raised or reported `info["fatal"]` is marked broken: it is killed (whole
  group) and restarted before its next call, so one dead browser costs one episode (reported as an
  env error), never the batch.
- **Reset retries.** `reset` retries up to `reset_retries` times (reference: 8), restarting the worker between
  tries; then it reports the error and the rollout loop marks that env done.
- **Per-env executors.** Each env has a one-thread executor: calls to one env run in order, calls to different
  envs run in parallel, and the `submit_*` methods return futures so the rollout loop can evaluate a finished
  env while the others keep stepping (docs/method.md §1).
- **Fault counting.** Every fault is counted and reported (issue 18): `FAULT_KINDS` per pool and per task (the
  task the env was playing), one warning line each on the `arpo.envs` logger; `fault_counts()` and
  `task_fault_counts()` are what the rollout loop turns into metrics.
- **Ray backend.** The Ray backend keeps the same class: each env's worker process is owned by a small Ray
  actor (`resources={"env_node": 0.01}`-style custom resources place actors on env machines, as the
  reference does with 128 OSWorld VMs); a hung actor is `ray.kill`ed and the orphaned worker kills
  its group through decision "No orphans".
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from arpo_core.actions import Action
from arpo_core.envs.base import GuiEnv, Observation, StepResult, TaskSpec

EnvFactory = Callable[[], GuiEnv]
FAULT_KINDS = (
    "worker_restarts",
    "worker_crashes",
    "timeouts",
    "browser_crashes",
    "env_errors",
    "reset_retries",
    "reset_failures",
)
"""Decision "Fault counting": worker_restarts (a worker replaced after a fault), worker_crashes (a worker died
or could not start), timeouts (a call past its limit), browser_crashes (a step reported a fatal env fault,
e.g. a dead browser; or the env replaced a dead browser during a reset, or found it dead when closing),
env_errors (the env raised or a step reported an error), reset_retries (a reset tried
again), reset_failures (a reset given up after all its tries)."""
log = logging.getLogger("arpo.envs")
_WORKER_BOOT = (
    "import sys; from arpo_core.envs.pool import worker_main; "
    "worker_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else '')"
)
_WATCHDOG_PERIOD_S = 0.2


class WorkerFailure(RuntimeError):
    """The worker process timed out, died or could not start (it has been killed)."""


@dataclass
class EnvResult:
    """Outcome of one pool call for one env."""

    env_idx: int
    observation: Observation | None = None
    """reset / step: the new observation (None on error or for evaluate)."""
    done: bool = False
    """step: the episode ended; also True whenever `error` is set."""
    info: dict[str, Any] = field(default_factory=dict)
    score: float | None = None
    """evaluate: task success in [0, 1]."""
    value: Any = None
    """call: the return value of a backend-specific method (e.g. oracle_reply)."""
    error: str | None = None
    """Env fault (timeout, crash, browser failure): the episode counts as an env error."""
    elapsed_s: float = 0.0


# ---------------------------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------------------------


def _kill_own_group() -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(os.getpgid(0), signal.SIGKILL)
    os._exit(1)  # only reached when the group could not be signalled


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            _kill_own_group()
        time.sleep(_WATCHDOG_PERIOD_S)


# The reaper: a tiny process that outlives a SIGKILLed worker, then kills the worker's group and removes
# the worker's temp dir (browser profiles). Needed because some supervisors SIGKILL a dying process's
# direct children (Ray does so to an actor's children), so the worker never gets to clean up itself.
# It leaves the worker's group so that killing the group (the pool's normal way) does not kill it
# before it has removed the temp dir; it exits within one period of the worker's death either way.
_REAPER = (
    "import os, shutil, signal, sys, time\n"
    "parent, group, tmp = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]\n"
    "os.setpgid(0, 0)\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "while os.getppid() == parent:\n"
    f"    time.sleep({_WATCHDOG_PERIOD_S!r})\n"
    "try:\n"
    "    os.killpg(group, signal.SIGKILL)\n"
    "except ProcessLookupError:\n"
    "    pass\n"
    "if tmp:\n"
    "    shutil.rmtree(tmp, ignore_errors=True)\n"
)


def worker_main(fd: int, parent_pid: int, tmpdir: str = "") -> None:
    """Serve one env over the socket `fd` until 'close', EOF, or the parent's death.

    tmpdir: the worker's private temp dir (its TMPDIR), removed by the reaper when the worker dies.
    """
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    subprocess.Popen(
        [sys.executable, "-S", "-c", _REAPER, str(os.getpid()), str(os.getpgid(0)), tmpdir],
        stdin=subprocess.DEVNULL,
    )
    conn = Connection(fd)
    env: Any = None
    try:
        kind, factory = conn.recv()
        assert kind == "init"
        env = factory()
        conn.send(("ok", os.getpid()))
        while True:
            try:
                method, args = conn.recv()
            except (EOFError, OSError):
                break
            if method == "close":
                note = env.close()
                env = None
                conn.send(("ok", note if isinstance(note, str) else None))
                break
            try:
                result = getattr(env, method)(*args)
                conn.send(("ok", result))
            except Exception as e:
                conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"))
    finally:
        if env is not None:
            with contextlib.suppress(Exception):
                env.close()
        conn.close()
        _kill_own_group()  # chromedriver/Chromium share the group: nothing survives the worker


class ProcessWorker:
    """Parent-side handle of one worker process (its pid is also its process-group id)."""

    def __init__(self, env_factory: EnvFactory, start_timeout_s: float = 60.0):
        self.env_factory = env_factory
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.tmpdir: str | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> int:
        """Spawn the worker and build its env; returns the worker pid. Raises WorkerFailure."""
        parent_sock, child_sock = socket.socketpair()
        child_fd = child_sock.fileno()
        # A private TMPDIR: browser profiles land there, and one rmtree removes them even after a kill.
        self.tmpdir = tempfile.mkdtemp(prefix="arpo-envworker-")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": self.tmpdir}
        self.proc = subprocess.Popen(
            # `-c` rather than `-m arpo_core.envs.pool`: the package imports pool, and runpy warns when the
            # module it is about to run as __main__ is already in sys.modules.
            [sys.executable, "-c", _WORKER_BOOT, str(child_fd), str(os.getpid()), self.tmpdir],
            pass_fds=[child_fd],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        child_sock.close()
        self.conn = Connection(parent_sock.detach())
        try:
            self.conn.send(("init", self.env_factory))
            return self._recv(self.start_timeout_s, "start")
        except Exception as e:
            self.kill()
            if isinstance(e, WorkerFailure):
                raise
            raise WorkerFailure(f"worker start failed: {e}") from e

    def _recv(self, timeout_s: float, what: str) -> Any:
        assert self.conn is not None
        try:
            ready = self.conn.poll(timeout_s)
        except (EOFError, OSError):
            ready = True
        if not ready:
            self.kill()
            raise WorkerFailure(f"{what} timed out after {timeout_s:.0f} s")
        try:
            status, payload = self.conn.recv()
        except (EOFError, OSError) as e:
            code = self.proc.poll() if self.proc else None
            self.kill()
            raise WorkerFailure(f"worker died during {what} (exit code {code})") from e
        if status == "err":
            raise EnvCallError(payload)
        return payload

    def call(self, method: str, args: tuple = (), timeout_s: float = 60.0) -> Any:
        """Run env.method(*args) in the worker. Raises EnvCallError (env raised; worker alive) or
        WorkerFailure (timeout / death; worker killed)."""
        if self.conn is None or self.proc is None or self.proc.poll() is not None:
            self.kill()
            raise WorkerFailure("worker is not running")
        try:
            self.conn.send((method, args))
        except (OSError, pickle.PicklingError) as e:
            self.kill()
            raise WorkerFailure(f"cannot send {method}: {e}") from e
        return self._recv(timeout_s, method)

    def kill(self) -> None:
        """SIGKILL the worker's whole process group (worker, chromedriver, Chromium) and reap it."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                self.proc.wait(timeout=10)
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.close()
        self.conn = None
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None

    def close(self, timeout_s: float = 10.0) -> tuple[str, str] | None:
        """Ask the env to close (quits the browser cleanly), then kill the group regardless.

        Returns None when the worker answered the close request and its env found nothing wrong, else
        (fault kind, message): the worker had died or did not answer in time, or the env found its
        browser dead. The pool counts that as a fault. Asking is the test rather than `poll()`: a
        SIGKILLed worker whose threads are still exiting is not yet reapable, and polling would miss it.
        """
        fault = None
        if self.proc is not None:
            try:
                if self.conn is None:
                    raise WorkerFailure("worker has no connection")
                self.conn.send(("close", ()))
                note = self._recv(timeout_s, "close")
                if note:
                    fault = ("browser_crashes", str(note))
            except WorkerFailure as e:
                fault = (_failure_kind(e), str(e))
            except Exception as e:  # the send failed: the worker's end of the socket is gone
                fault = ("worker_crashes", f"worker {self.proc.pid} found dead ({type(e).__name__}: {e})")
        self.kill()
        self.proc = None
        return fault


def _failure_kind(e: WorkerFailure) -> str:
    """Decision "Fault counting": the fault kind of a WorkerFailure: a call past its limit, or a worker that
    died."""
    return "timeouts" if "timed out" in str(e) else "worker_crashes"


class EnvCallError(RuntimeError):
    """The env raised inside a live worker; the message carries its type, text and traceback tail."""


# ---------------------------------------------------------------------------------------------------------
# Ray backend
# ---------------------------------------------------------------------------------------------------------


class _EnvHost:
    """Ray actor body: owns one ProcessWorker on the actor's machine."""

    def __init__(self, env_factory: EnvFactory, start_timeout_s: float):
        self.worker = ProcessWorker(env_factory, start_timeout_s)

    def start(self) -> int:
        return self.worker.start()

    def call(self, method: str, args: tuple, timeout_s: float) -> tuple[str, Any]:
        try:
            return "ok", self.worker.call(method, args, timeout_s)
        except EnvCallError as e:
            return "err", str(e)
        except WorkerFailure as e:
            return "fail", str(e)

    def close(self) -> tuple[str, str] | None:
        return self.worker.close()

    def kill(self) -> None:
        self.worker.kill()

    def worker_pid(self) -> int | None:
        return self.worker.pid


_RAY_LOCK = threading.Lock()


def _ensure_ray() -> None:
    """Start Ray (if this process has not) from a daemon thread that lives as long as the process.

    Ray ties the head processes it starts (GCS, raylet) to the thread that called `ray.init`: when a
    pool's worker thread started Ray and then ended with the pool, the next stage's pool found Ray
    dead ("Failed to connect to GCS") or hung. Measured with a bare ray EnvPool open/close."""
    import ray

    with _RAY_LOCK:
        if ray.is_initialized():
            return
        done, err = threading.Event(), []

        def owner() -> None:
            try:
                ray.init()
            except BaseException as e:
                err.append(e)
            done.set()
            threading.Event().wait()

        threading.Thread(target=owner, name="ray-owner", daemon=True).start()
        done.wait()
        if err:
            raise err[0]


class RayWorker:
    """Same interface as ProcessWorker, with the worker process owned by a Ray actor."""

    _actor_cls: Any = None

    def __init__(
        self,
        env_factory: EnvFactory,
        start_timeout_s: float = 60.0,
        resources: Mapping[str, float] | None = None,
        grace_s: float = 15.0,
    ):
        import ray

        if RayWorker._actor_cls is None:
            RayWorker._actor_cls = ray.remote(_EnvHost)
        self.env_factory = env_factory
        self.start_timeout_s = start_timeout_s
        self.resources = dict(resources or {})
        self.grace_s = grace_s
        self.actor: Any = None
        self.pid: int | None = None

    def start(self) -> int:
        import ray

        opts: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0, "max_concurrency": 1}
        if self.resources:
            opts["resources"] = self.resources
        self.actor = RayWorker._actor_cls.options(**opts).remote(self.env_factory, self.start_timeout_s)
        try:
            self.pid = ray.get(self.actor.start.remote(), timeout=self.start_timeout_s + self.grace_s)
        except Exception as e:
            self.kill()
            raise WorkerFailure(f"ray worker start failed: {type(e).__name__}: {e}") from e
        return self.pid

    def call(self, method: str, args: tuple = (), timeout_s: float = 60.0) -> Any:
        import ray

        if self.actor is None:
            raise WorkerFailure("ray worker is not running")
        try:
            status, payload = ray.get(
                self.actor.call.remote(method, args, timeout_s), timeout=timeout_s + self.grace_s
            )
        except Exception as e:
            self.kill()
            raise WorkerFailure(f"ray actor failed during {method}: {type(e).__name__}: {e}") from e
        if status == "err":
            raise EnvCallError(payload)
        if status == "fail":
            self.kill()
            raise WorkerFailure(payload)
        return payload

    def kill(self) -> None:
        import ray

        if self.actor is not None:
            # Kill the worker group from inside the actor first (fast, exact); if the actor hangs,
            # ray.kill ends it and the orphaned worker's watchdog kills its own group.
            with contextlib.suppress(Exception):
                ray.get(self.actor.kill.remote(), timeout=5)
            with contextlib.suppress(Exception):
                ray.kill(self.actor, no_restart=True)
        self.actor = None

    def close(self, timeout_s: float = 10.0) -> tuple[str, str] | None:
        """As ProcessWorker.close: None when all was well, else (fault kind, message)."""
        import ray

        fault = None
        if self.actor is not None:
            try:
                fault = ray.get(self.actor.close.remote(), timeout=timeout_s)
            except Exception as e:
                fault = ("worker_crashes", f"actor close failed: {type(e).__name__}: {e}")
        self.kill()
        return fault


# ---------------------------------------------------------------------------------------------------------
# The pool
# ---------------------------------------------------------------------------------------------------------


@dataclass
class _Slot:
    idx: int
    executor: ThreadPoolExecutor
    worker: Any = None
    broken: bool = True
    restarts: int = -1
    """Worker starts minus one (the first start is not a restart)."""
    task: tuple[str, str] | None = None
    """(domain, task_id) of the episode the env is playing, for per-task fault counts."""


class EnvPool:
    """N GUI envs driven in parallel; see the module docstring for the failure semantics."""

    def __init__(
        self,
        env_factory: EnvFactory,
        n: int,
        backend: str = "process",
        reset_timeout_s: float = 120.0,
        step_timeout_s: float = 60.0,
        eval_timeout_s: float = 60.0,
        reset_retries: int = 8,
        start_timeout_s: float = 60.0,
        ray_resources: Mapping[str, float] | None = None,
    ):
        """
        Args:
            env_factory: picklable zero-argument callable building the env inside the worker, e.g.
                `functools.partial(make_miniwob_env, episode_time_limit_s=60)`.
            n: number of envs (rollout_batch_size x group size in the reference).
            backend: "process" (local worker processes) or "ray" (workers owned by Ray actors; call
                `ray.init` first).
            reset_timeout_s / step_timeout_s / eval_timeout_s: per-call limits; a call past its limit
                kills and later restarts the worker, and reports an env error.
            reset_retries: attempts per reset before the env is reported as failed (reference: 8).
            start_timeout_s: limit for spawning a worker and building its env.
            ray_resources: custom Ray resources per actor, e.g. {"env_node": 0.01}.
        """
        if backend not in ("process", "ray"):
            raise ValueError(f"unknown backend {backend!r} (expected 'process' or 'ray')")
        if n < 1:
            raise ValueError("n must be >= 1")
        self.env_factory = env_factory
        self.n = n
        self.backend = backend
        self.reset_timeout_s = reset_timeout_s
        self.step_timeout_s = step_timeout_s
        self.eval_timeout_s = eval_timeout_s
        self.reset_retries = max(1, reset_retries)
        self.start_timeout_s = start_timeout_s
        self.ray_resources = dict(ray_resources or {})
        self._closed = False
        self._fault_lock = threading.Lock()
        self._faults: dict[str, int] = dict.fromkeys(FAULT_KINDS, 0)
        self._task_faults: dict[tuple[str, str], dict[str, int]] = {}
        self._slots = [
            _Slot(i, ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"env{i}")) for i in range(n)
        ]
        # Start all workers in parallel; a failed start is retried lazily by the first reset.
        for f in [s.executor.submit(self._restart, s) for s in self._slots]:
            f.result()

    # ------------------------------------------------------------------ worker management
    def _new_worker(self) -> Any:
        if self.backend == "ray":
            _ensure_ray()
            return RayWorker(self.env_factory, self.start_timeout_s, self.ray_resources)
        return ProcessWorker(self.env_factory, self.start_timeout_s)

    def _fault(self, slot: _Slot, kind: str, message: str, worker_pid: int | None = None) -> None:
        """Decision "Fault counting": count one fault of `kind` for the pool and the slot's task; one warning
        line, naming the worker process it concerns (`worker_pid`, default the slot's current worker)."""
        if worker_pid is None and slot.worker is not None:
            worker_pid = slot.worker.pid
        with self._fault_lock:
            self._faults[kind] += 1
            if slot.task is not None:
                per = self._task_faults.setdefault(slot.task, dict.fromkeys(FAULT_KINDS, 0))
                per[kind] += 1
        task = "/".join(slot.task) if slot.task else "-"
        first = message.strip().splitlines()[0][:300] if message.strip() else ""
        log.warning("env fault %s: env %d, task %s, worker %s: %s", kind, slot.idx, task, worker_pid, first)

    def fault_counts(self) -> dict[str, int]:
        """Decision "Fault counting": faults of each kind so far (all of `FAULT_KINDS`)."""
        with self._fault_lock:
            return dict(self._faults)

    def task_fault_counts(self) -> dict[tuple[str, str], dict[str, int]]:
        """Decision "Fault counting": {(domain, task_id): {kind: count}} for the tasks that had a fault."""
        with self._fault_lock:
            return {k: dict(v) for k, v in self._task_faults.items()}

    def _restart(self, slot: _Slot) -> str | None:
        """Kill the slot's worker (whole group) and start a fresh one; returns an error or None."""
        old_pid = None
        if slot.worker is not None:
            old_pid = slot.worker.pid
            slot.worker.kill()
        slot.worker = self._new_worker()
        slot.restarts += 1
        if slot.restarts > 0:  # the line names the worker replaced, not its successor (not started yet)
            msg = f"worker replaced (restart {slot.restarts} of env {slot.idx})"
            self._fault(slot, "worker_restarts", msg, worker_pid=old_pid)
        try:
            slot.worker.start()
        except WorkerFailure as e:
            slot.broken = True
            self._fault(slot, "worker_crashes", f"worker start failed: {e}")
            return str(e)
        slot.broken = False
        return None

    def _call(self, slot: _Slot, method: str, args: tuple, timeout_s: float) -> tuple[Any, str | None]:
        if slot.broken:
            err = self._restart(slot)
            if err is not None:
                return None, f"worker restart failed: {err}"
        try:
            return slot.worker.call(method, args, timeout_s), None
        except EnvCallError as e:
            slot.broken = True
            self._fault(slot, "env_errors", f"{method}: {e}")
            return None, f"env error in {method}: {e}"
        except WorkerFailure as e:
            slot.broken = True
            self._fault(slot, _failure_kind(e), f"{method}: {e}")
            return None, f"worker failure in {method}: {e}"

    # ------------------------------------------------------------------ single-env jobs
    def _reset_job(self, slot: _Slot, task: TaskSpec, seed: int | None) -> EnvResult:
        t0 = time.monotonic()
        slot.task = (task.domain, task.task_id)
        errors: list[str] = []
        for attempt in range(self.reset_retries):
            obs, err = self._call(slot, "reset", (task, seed), self.reset_timeout_s)
            if err is None:
                for note in obs.faults:  # faults the env recovered from by itself
                    self._fault(slot, "browser_crashes", f"reset: {note}")
                return EnvResult(slot.idx, observation=obs, elapsed_s=time.monotonic() - t0)
            errors.append(err)
            slot.broken = True
            if attempt + 1 < self.reset_retries:
                self._fault(slot, "reset_retries", f"reset try {attempt + 1} failed, trying again: {err}")
        msg = f"reset failed {len(errors)} times; last: {errors[-1]}"
        self._fault(slot, "reset_failures", msg)
        return EnvResult(slot.idx, done=True, error=msg, elapsed_s=time.monotonic() - t0)

    def _step_job(self, slot: _Slot, actions: list[Action]) -> EnvResult:
        t0 = time.monotonic()
        res, err = self._call(slot, "step", (list(actions),), self.step_timeout_s)
        if err is not None:
            return EnvResult(slot.idx, done=True, error=err, elapsed_s=time.monotonic() - t0)
        assert isinstance(res, StepResult)
        env_err = res.info.get("error")
        if res.info.get("fatal"):
            slot.broken = True  # e.g. the browser died: replace the worker before the next episode
            self._fault(slot, "browser_crashes", f"step: {env_err or 'fatal env fault'}")
        elif env_err:
            self._fault(slot, "env_errors", f"step: {env_err}")
        return EnvResult(
            slot.idx,
            observation=res.observation,
            done=res.done or bool(env_err),
            info=res.info,
            error=env_err,
            elapsed_s=time.monotonic() - t0,
        )

    def _evaluate_job(self, slot: _Slot) -> EnvResult:
        t0 = time.monotonic()
        score, err = self._call(slot, "evaluate", (), self.eval_timeout_s)
        return EnvResult(
            slot.idx,
            done=True,
            score=None if err else float(score),
            error=err,
            elapsed_s=time.monotonic() - t0,
        )

    def _call_job(self, slot: _Slot, method: str, args: tuple) -> EnvResult:
        t0 = time.monotonic()
        value, err = self._call(slot, method, args, self.step_timeout_s)
        return EnvResult(slot.idx, value=value, error=err, elapsed_s=time.monotonic() - t0)

    # ------------------------------------------------------------------ non-blocking API
    def _slot(self, env_idx: int) -> _Slot:
        if self._closed:
            raise RuntimeError("EnvPool is closed")
        return self._slots[env_idx]

    def submit_reset(self, env_idx: int, task: TaskSpec, seed: int | None = None) -> Future[EnvResult]:
        s = self._slot(env_idx)
        return s.executor.submit(self._reset_job, s, task, seed)

    def submit_step(self, env_idx: int, actions: Sequence[Action]) -> Future[EnvResult]:
        s = self._slot(env_idx)
        return s.executor.submit(self._step_job, s, list(actions))

    def submit_evaluate(self, env_idx: int) -> Future[EnvResult]:
        s = self._slot(env_idx)
        return s.executor.submit(self._evaluate_job, s)

    def submit_call(self, env_idx: int, method: str, *args: Any) -> Future[EnvResult]:
        """Any other env method (e.g. `oracle_reply`, `dom_elements`); result in `EnvResult.value`."""
        if method.startswith("_") or method in ("close",):
            raise ValueError(f"method {method!r} cannot be called through the pool")
        s = self._slot(env_idx)
        return s.executor.submit(self._call_job, s, method, args)

    # ------------------------------------------------------------------ batch API
    def reset(self, items: Iterable[tuple[int, TaskSpec, int | None]]) -> dict[int, EnvResult]:
        """Reset many envs in parallel: items of (env_idx, task, seed) -> {env_idx: result}."""
        futs = {i: self.submit_reset(i, task, seed) for i, task, seed in items}
        return {i: f.result() for i, f in futs.items()}

    def step(self, actions: Mapping[int, Sequence[Action]]) -> dict[int, EnvResult]:
        """Step many envs in parallel: {env_idx: actions} -> {env_idx: result}."""
        futs = {i: self.submit_step(i, a) for i, a in actions.items()}
        return {i: f.result() for i, f in futs.items()}

    def evaluate(self, env_idxs: Iterable[int]) -> dict[int, EnvResult]:
        futs = {i: self.submit_evaluate(i) for i in env_idxs}
        return {i: f.result() for i, f in futs.items()}

    # ------------------------------------------------------------------ introspection / teardown
    def worker_pids(self) -> list[int | None]:
        """Pid (= process-group id) of each env's worker process."""
        return [s.worker.pid if s.worker is not None else None for s in self._slots]

    def restarts(self) -> list[int]:
        """How often each env's worker was replaced."""
        return [max(0, s.restarts) for s in self._slots]

    def close(self) -> None:
        """Close every env and kill every worker group; idempotent."""
        if self._closed:
            return
        self._closed = True
        for s in self._slots:
            s.executor.shutdown(wait=True, cancel_futures=True)
        closers = ThreadPoolExecutor(max_workers=max(1, self.n))
        jobs = [
            (s, s.worker.pid, closers.submit(s.worker.close)) for s in self._slots if s.worker is not None
        ]
        for s, pid, f in jobs:
            try:
                fault = f.result()
            except Exception as e:
                fault = ("worker_crashes", f"{type(e).__name__}: {e}")
            # Decision "Fault counting": a worker (or browser) that died or hung since its last call is a
            # fault too; a broken slot's worker was counted when it broke.
            if fault is not None and not s.broken:
                self._fault(s, fault[0], f"found when the pool closed: {fault[1]}", worker_pid=pid)
        closers.shutdown()

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


if __name__ == "__main__":
    worker_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "")
