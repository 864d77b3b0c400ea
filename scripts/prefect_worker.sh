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
# One Ctrl-C (or SIGTERM) stops the worker. Prefect's worker re-raises a first SIGINT through the handler
# it found at start; started where SIGINT is ignored (any background job of a non-interactive shell, e.g.
# a supervisor or a test harness) that handler is "ignore", and it stayed up (measured: alive 30 s after
# one SIGINT; a second one SIGKILLs it). So the worker runs as a job of its own (set -m: its own process
# group, SIGINT reset to its default before exec), a Ctrl-C or SIGTERM here forwards one SIGINT, and the worker is given
# ARPO_WORKER_STOP_S seconds (default 10) while it has no flow run left, then stopped.
set -m
python -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])' \
  prefect worker start --pool "$POOL" --type process --limit 1 "${@:2}" &
worker=$!
stop_worker() {
  trap - INT TERM
  kill -INT "$worker" 2>/dev/null || exit 0
  local idle=0
  while kill -0 "$worker" 2>/dev/null; do
    if pgrep -P "$worker" >/dev/null; then
      idle=0; echo "[prefect_worker] waiting for the running flow run to finish (Ctrl-C again: stop now)"
      trap 'kill -KILL "$worker" 2>/dev/null' INT TERM
      sleep 5
    else
      idle=$((idle + 1))
      if [ "$idle" -gt "${ARPO_WORKER_STOP_S:-10}" ]; then kill -KILL "$worker" 2>/dev/null; break; fi
      sleep 1
    fi
  done
  wait "$worker" 2>/dev/null
  echo "[prefect_worker] worker stopped"
  exit 0
}
trap stop_worker INT TERM
wait "$worker"
