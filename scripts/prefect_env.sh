# Source me: Prefect settings for this project (server on 127.0.0.1, state in .prefect/, no analytics).
#   source scripts/prefect_env.sh            # then: prefect work-pool create / deploy / deployment run
# PREFECT_PORT picks another port (default 4200). Works from bash and zsh.
_arpo_root="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)"
export PREFECT_HOME="${PREFECT_HOME:-$_arpo_root/.prefect}"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_SERVER_API_HOST=127.0.0.1
export PREFECT_SERVER_API_PORT="${PREFECT_PORT:-4200}"
export PREFECT_API_URL="http://127.0.0.1:${PREFECT_SERVER_API_PORT}/api"
export MLFLOW_DISABLE_TELEMETRY=true
export DVC_NO_ANALYTICS=1
export PATH="$_arpo_root/.venv/bin:$PATH"
unset _arpo_root
