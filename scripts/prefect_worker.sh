#!/usr/bin/env bash
# Start a process worker for the work pool (default arpo-local; created if missing, concurrency 1 since
# all runs share this working tree's outputs). It runs deployment flow runs as subprocesses in the
# project root. Needs the server (scripts/prefect_server.sh). Stop with Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/prefect_env.sh
POOL="${1:-arpo-local}"
if ! prefect work-pool inspect "$POOL" >/dev/null 2>&1; then
  prefect work-pool create "$POOL" --type process
  prefect work-pool set-concurrency-limit "$POOL" 1
fi
exec prefect worker start --pool "$POOL" --type process --limit 1 "${@:2}"
