"""The services a local run starts beside its flow (Prefect's temporary API server, Ray), and stopping them.

Decisions:
- **Prefect server session.** The temporary Prefect server runs in a session of its own. Prefect starts it
  (when no PREFECT_API_URL is set) as a plain child, so it shared the terminal's foreground process group: a
  Ctrl-C killed it together with the run, and the flow engine then retried its crash-state update
  against a dead server for about 4 minutes and ended with `ConnectError` (issue 34 item 1). In its own
  session the server never sees the terminal's SIGINT; the run marks its Prefect and MLflow runs, and
  only then stops the server (`stop_services`, on every way out of `arpo run`). If the run is killed
  outright, the guardian (arpo_core/infra/guardian.py) removes the server's whole group, which it leads.
- **One registered server.** `own_session_server()` registers the server under the key Prefect's clients look
  up (`SubprocessASGIServer()`, port None) before any client asks, so every client of the run (flow
  engine, log and event workers) uses this one. Its command is Prefect 3.9's own
  (`SubprocessASGIServer._run_uvicorn_command`) with `start_new_session=True` added; it is copied,
  not patched in, because that method builds and starts the Popen in one call.
- **Logs flushed.** The run's last log records still queued for the API are sent before the server stops:
  stopped before them, the server left Prefect's log worker retrying at exit (~2 min, then 'Error logging to
  API').
- **Dead run cleanup.** What a dead run left open is closed by the next one (issue 34 items 5, 6). Every front
  door takes the working tree's lock through `run_lock` here; when that takes the lock over from a dead holder
  (arpo_core/infra/lock.py, decision "Takeover record"), the dead run's MLflow runs still RUNNING (found by
  its lock token, mlflow_runs.py, decision "Never left running") end KILLED, its temp folder is gone (lock.py,
  decision "Private temp folder"), and the Prefect flow runs of its pipeline runs, with their stage subflows,
  are set Crashed by the next `arpo-train` flow run that has an API to talk to (`crash_dead_flow_runs`; an
  `arpo stage` under DVC has none). A failure here is a warning: it never stops the new run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

from arpo_core.infra.lock import describe
from arpo_core.infra.lock import run_lock as _run_lock

__all__ = [
    "DEAD_FLOW_RUNS",
    "INTERRUPTED",
    "crash_dead_flow_runs",
    "on_interrupt",
    "own_session_server",
    "run_lock",
    "stop_services",
]

INTERRUPTED = threading.Event()
"""Set by `on_interrupt` (flows/arpo_train.py, decision "Ctrl-C never lost"). Here, not in the flow's module,
so `arpo stage` installs it without importing Prefect and MLflow (an up-to-date stage then takes about a
second)."""


def on_interrupt(signum: int, frame: object) -> None:
    """SIGINT handler of `arpo run` and `arpo stage`: remember the interrupt, then raise it as Python's
    own would."""
    INTERRUPTED.set()
    raise KeyboardInterrupt


log = logging.getLogger("arpo.lock")

DEAD_FLOW_RUNS: list[str] = []
"""Prefect flow run ids of the pipeline runs of dead holders, for `crash_dead_flow_runs`
(decision "Dead run cleanup")."""


@contextlib.contextmanager
def run_lock(root: str | os.PathLike = ".", command: str | None = None) -> Iterator[dict[str, Any] | None]:
    """arpo_core.infra.lock.run_lock, closing what a dead previous holder left open
    (decision "Dead run cleanup")."""
    with _run_lock(root, command=command) as holder:
        previous = (holder or {}).get("previous")
        if previous:
            close_dead_run(root, previous)
        yield holder


def close_dead_run(root: str | os.PathLike, previous: dict[str, Any]) -> None:
    """Decision "Dead run cleanup": the dead holder's MLflow runs end KILLED; its pipeline runs' flow run ids
    are kept for `crash_dead_flow_runs`."""
    token = str(previous.get("token") or "")
    if not token:
        return
    try:
        from tracking import mlflow_runs

        reason = f"killed: its process died ({describe(previous)}); closed by pid {os.getpid()}"
        closed = mlflow_runs.close_runs_of(mlflow_runs.client(root), token, reason)
    except Exception as e:  # tracking must never stop a run
        log.warning("could not close the MLflow runs of the dead run %s: %s", describe(previous), e)
        return
    if closed:
        log.warning(
            "closed %d MLflow run(s) of the dead run %s as KILLED: %s",
            len(closed),
            describe(previous),
            ", ".join(sorted(c["stage"] for c in closed)),
        )
    DEAD_FLOW_RUNS.extend(c["pipeline_id"] for c in closed if c["stage"] == "pipeline" and c["pipeline_id"])


def crash_dead_flow_runs() -> int:
    """Decision "Dead run cleanup", inside a flow run: set Crashed the dead runs' flow runs (and their subflow
    runs) that are not in a final state; returns how many."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.states import Crashed

    done = 0
    pending, DEAD_FLOW_RUNS[:] = list(DEAD_FLOW_RUNS), []
    try:
        with get_client(sync_client=True) as client:
            for flow_run_id in pending:
                try:
                    parent = client.read_flow_run(UUID(flow_run_id))
                except Exception:  # not in this server's database (another server, deleted)
                    continue
                children = client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(
                        parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent.id])
                    )
                )
                for fr in [parent, *children]:
                    if fr.state is not None and not fr.state.is_final():
                        message = "its process died; marked by the next run that took over the lock"
                        client.set_flow_run_state(fr.id, Crashed(message=message), force=True)
                        done += 1
    except Exception as e:  # never stops the new run
        log.warning("could not mark the dead run's Prefect flow runs Crashed: %s", e)
    return done


def own_session_server() -> object | None:
    """Decision "One registered server": make the temporary server Prefect would start one in its own session;
    returns it, or None when a server is configured (PREFECT_API_URL) or temporary servers are off."""
    import prefect
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED, get_current_settings

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None

    class OwnSessionServer(SubprocessASGIServer):
        def _run_uvicorn_command(self) -> subprocess.Popen:
            server_env = {
                "PREFECT_UI_ENABLED": "0",
                "PREFECT__SERVER_EPHEMERAL": "1",
                "PREFECT__SERVER_FINAL": "1",
            }
            return subprocess.Popen(
                args=[
                    sys.executable,
                    "-m",
                    "uvicorn",
                    "--app-dir",
                    str(prefect.__module_path__.parent),
                    "--factory",
                    "prefect.server.api.server:create_app",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--log-level",
                    "error",
                    "--lifespan",
                    "on",
                ],
                env={
                    **os.environ,
                    **server_env,
                    **get_current_settings().to_environment_variables(exclude_unset=True),
                },
                # decision "Prefect server session": out of the terminal's process group
                start_new_session=True,
            )

    existing = SubprocessASGIServer._instances.get(None)
    if existing is not None:  # already made by an earlier run in this process
        return existing
    return OwnSessionServer()


def stop_services() -> None:
    """Stop Prefect's temporary API server and Ray if this run started them (only if imported), after
    sending the run's queued log records (decision "Logs flushed")."""
    handlers = sys.modules.get("prefect.logging.handlers")
    if handlers is not None:
        with contextlib.suppress(Exception):
            handlers.APILogWorker.drain_all(timeout=10)
    server = sys.modules.get("prefect.server.api.server")
    if server is not None:
        for instance in list(server.SubprocessASGIServer._instances.values()):
            with contextlib.suppress(Exception):
                instance.stop()
    ray = sys.modules.get("ray")
    if ray is not None:
        with contextlib.suppress(Exception):
            if ray.is_initialized():
                ray.shutdown()
