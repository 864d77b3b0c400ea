"""The services a local run starts beside its flow (Prefect's temporary API server, Ray), and stopping them.

Decisions:
1. The temporary Prefect server runs in a session of its own. Prefect starts it (when no
   PREFECT_API_URL is set) as a plain child, so it shared the terminal's foreground process group: a
   Ctrl-C killed it together with the run, and the flow engine then retried its crash-state update
   against a dead server for about 4 minutes and ended with `ConnectError` (issue 34 item 1). In its own
   session the server never sees the terminal's SIGINT; the run marks its Prefect and MLflow runs, and
   only then stops the server (`stop_services`, on every way out of `arpo run`). If the run is killed
   outright, the guardian (arpo_core/guardian.py) removes the server's whole group, which it leads.
2. `own_session_server()` registers the server under the key Prefect's clients look up
   (`SubprocessASGIServer()`, port None) before any client asks, so every client of the run (flow
   engine, log and event workers) uses this one. Its command is Prefect 3.9's own
   (`SubprocessASGIServer._run_uvicorn_command`) with `start_new_session=True` added; it is copied,
   not patched in, because that method builds and starts the Popen in one call.
3. The run's last log records still queued for the API are sent before the server stops: stopped before
   them, the server left Prefect's log worker retrying at exit (~2 min, then 'Error logging to API').
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

__all__ = ["own_session_server", "stop_services"]


def own_session_server() -> object | None:
    """Decision 2: make the temporary server Prefect would start one in its own session; returns it, or
    None when a server is configured (PREFECT_API_URL) or temporary servers are off."""
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
                start_new_session=True,  # decision 1: out of the terminal's process group
            )

    existing = SubprocessASGIServer._instances.get(None)
    if existing is not None:  # already made by an earlier run in this process
        return existing
    return OwnSessionServer()


def stop_services() -> None:
    """Stop Prefect's temporary API server and Ray if this run started them (only if imported), after
    sending the run's queued log records (decision 3)."""
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
