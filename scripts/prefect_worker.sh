#!/usr/bin/env bash
# Start a process worker for the work pool (default arpo-local; created if missing, concurrency 1 since
# all runs share this working tree's outputs). It runs deployment flow runs as subprocesses in the
# project root. Needs the server (scripts/prefect_server.sh). Stop with Ctrl-C.
set -euo pipefail
# A shell cannot trap a signal that was ignored when it started (POSIX), and a background job of a
# non-interactive shell (nohup, a supervisor, a CI harness) starts with SIGINT ignored: start this script
# again with SIGINT at its default, so that the Ctrl-C trap below runs wherever it was started from.
if [ -z "${_ARPO_WORKER_SIGINT_RESET:-}" ]; then
  export _ARPO_WORKER_SIGINT_RESET=1
  exec python3 -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])' \
    bash "$0" "$@"
fi
cd "$(dirname "$0")/.."
source scripts/prefect_env.sh
POOL="${1:-arpo-local}"
if ! prefect work-pool inspect "$POOL" >/dev/null 2>&1; then
  prefect work-pool create "$POOL" --type process
  prefect work-pool set-concurrency-limit "$POOL" 1
fi
# Ctrl-C does what it says (issue 34 item 5). Prefect's own worker, given SIGINT, cancels its task
# group, which terminates the running flow run at once; so while a flow run is in progress the first
# Ctrl-C (or SIGTERM) here does not signal the worker at all: it waits for the flow run to finish and only
# then stops the worker. A second Ctrl-C stops the flow run the way Ctrl-C stops `arpo run`: one SIGINT to
# the flow run's process, which marks its Prefect flow run Crashed and its MLflow runs KILLED, releases the
# working tree's lock and stops its env workers (ARPO_RUN_STOP_S seconds, default 60, then SIGTERM, then
# SIGKILL); a third Ctrl-C kills it outright (the next run's lock takeover closes what it left open). The
# worker runs as a job of its own (set -m: its own process group, SIGINT reset to its default before
# exec): started where SIGINT is ignored (a background job of a non-interactive shell, a supervisor, a
# test harness) Prefect re-raised its first SIGINT through an "ignore" handler and the worker stayed up.
# With no flow run in progress the worker is given ARPO_WORKER_STOP_S seconds (default 10), then stopped.
set -m
python -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])' \
  prefect worker start --pool "$POOL" --type process --limit 1 "${@:2}" &
worker=$!
# (Explicit `return 0`: a bare `return` in a function called from a trap returns the status the trap
# interrupted, 130 for `wait`, and `set -e` then ended the script in the middle of the trap.)
flow_run() {  # pid of the worker's running flow run (its child in a session of its own), or nothing
  local pid
  for pid in $(pgrep -P "$worker" || true); do
    if [ "$(ps -o sid= -p "$pid" | tr -d ' ')" = "$pid" ]; then echo "$pid"; return 0; fi
  done
  return 0
}
stop_worker_now() {
  kill -INT "$worker" 2>/dev/null || return 0
  local idle=0
  while kill -0 "$worker" 2>/dev/null; do
    idle=$((idle + 1))
    if [ "$idle" -gt "${ARPO_WORKER_STOP_S:-10}" ]; then kill -KILL "$worker" 2>/dev/null; break; fi
    sleep 1
  done
  wait "$worker" 2>/dev/null || true
  return 0
}
stop_run() {
  trap 'echo "[prefect_worker] killing the flow run (pid $run)"; kill -KILL "$run" 2>/dev/null' INT TERM
  echo "[prefect_worker] stopping the running flow run (pid $run): it marks its runs (Ctrl-C again: kill it)"
  kill -INT "$run" 2>/dev/null
  local waited=0
  while kill -0 "$run" 2>/dev/null; do
    waited=$((waited + 1))
    if [ "$waited" -eq "${ARPO_RUN_STOP_S:-60}" ]; then kill -TERM "$run" 2>/dev/null; fi
    if [ "$waited" -eq $(( ${ARPO_RUN_STOP_S:-60} + 15 )) ]; then kill -KILL "$run" 2>/dev/null; fi
    sleep 1
  done
  return 0
}
stop_worker() {
  trap '' INT TERM  # while it looks for the flow run; the next Ctrl-C is handled below
  run=$(flow_run)
  if [ -n "$run" ]; then
    echo "[prefect_worker] waiting for the running flow run (pid $run) to finish (Ctrl-C again: stop it)"
    trap stop_run INT TERM
    while kill -0 "$run" 2>/dev/null; do sleep 1; done
    trap - INT TERM
  fi
  # The worker may have taken the next scheduled run in the second it took to notice: stopping the worker
  # then terminates that one, which marks itself on the way out (flows/arpo_train.py, decision "Clean stop").
  stop_worker_now
  echo "[prefect_worker] worker stopped"
  exit 0
}
trap stop_worker INT TERM
wait "$worker"
