#!/usr/bin/env bash
# Start the project's Prefect server in the foreground: 127.0.0.1:${PREFECT_PORT:-4200}, state in
# .prefect/ (sqlite), analytics off. UI at http://127.0.0.1:4200. Stop with Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/prefect_env.sh
exec prefect server start --host 127.0.0.1 --port "$PREFECT_SERVER_API_PORT" "$@" 2>&1
