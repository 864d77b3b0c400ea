#!/usr/bin/env bash
# Lint, then the test suite (default: everything but `gpu`-marked tests). Extra args go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check . || exit 1
.venv/bin/ruff format --check . || exit 1
.venv/bin/python -m pytest -q -rfE "$@"
rc=$?
# pytest exits 5 when no test was collected (e.g. a -k filter that matches nothing): not a failure of
# the code under test, but say so loudly.
if [ $rc -eq 5 ]; then echo "no tests collected"; exit 0; fi
exit $rc
